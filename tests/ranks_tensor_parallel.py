"""What each rank runs for day 4.3's tests: `python -m tests.ranks_tensor_parallel --checks NAMES [--die-rank R]`
under mlx.launch (tests/harness.py's `RankLaunches`).

Every rank builds the code its launch names the way the tests do (`launched()`: the student's Task N
alone for Task N's checks, their stack so far for the stack's), makes the checks named (`CHECKS`) on
the embedded model, and writes what it saw to `rank<r>.json` (course/ranks.py). The oracle is mlx-lm's
own Qwen2 on the same weights, run whole in each rank. A check that raises is recorded, not fatal, so
one unwritten task does not hide another. "stack", your stack so far (the student's week-3 engine and
model with their day-4.3 shards), runs week 3's workloads (tests/week3_stack.py) on the sharded tiny
model, every rank running the same engine in step; its record is written after the others', so a stack
that breaks the ranks cannot take other checks of the same launch with it.
With `--die-rank R`, rank R exits just before the tensor-parallel model's first forward pass: the
others must then fail, not wait forever.
"""

from course import fast_mlx

fast_mlx.setup(quiet=True)

import argparse  # noqa: E402
import os  # noqa: E402
import traceback  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402

from course import ranks  # noqa: E402
from course.models import load_model  # noqa: E402
from tests import week3_stack  # noqa: E402
from tests.harness import launched  # noqa: E402

TOKENS = 12  # rows of the prefill the checks run
GREEDY_PROMPTS = [[1, 2, 3, 4, 5], [42, 7, 7, 300, 9001, 17, 5], [151000, 12]]
GREEDY_TOKENS = 8
DIED = 3  # the exit status of a rank told to die


def prefill(sol, tokens: list[int], dtype) -> object:
    """A RaggedBatch of one sequence's whole prompt from position 0, every row sampled."""
    t = len(tokens)
    chunk = sol.qwen2_week3.PrefillChunk(t, mx.arange(t), sol.attention.causal_mask(t, t, dtype))
    return sol.qwen2_week3.RaggedBatch(
        token_ids=mx.array(tokens), positions=mx.arange(t), write_slots=mx.arange(t), num_decodes=0,
        decode_key_slots=None, decode_mask=None, chunks=[chunk], sample_rows=mx.arange(t),
    )


def rope_angles(model, positions: mx.array) -> tuple[mx.array, mx.array]:
    """cos and sin of the week-3 model's RoPE at `positions` (`T x 1 x D/2`), as its forward pass makes them."""
    angles = positions.astype(mx.float32)[:, None] * model.inv_freq
    return mx.cos(angles)[:, None, :], mx.sin(angles)[:, None, :]


def difference(got: mx.array, expected: mx.array) -> dict:
    return {"shape": list(got.shape), "expected_shape": list(expected.shape),
            "max_abs_diff": mx.abs(got - expected).max().item() if got.shape == expected.shape else None,
            "scale": mx.abs(expected).max().item()}


def check_mlp(sol, group, full, mlx_model) -> dict:
    x = mx.random.normal((TOKENS, full.args.hidden_size), key=mx.random.key(1))
    sharded = sol.tensor_parallel.ShardedMLP(full.layers[0].mlp, group)
    return difference(sharded(x), mlx_model.model.layers[0].mlp(x))


def check_attention(sol, group, full, mlx_model) -> dict:
    x = mx.random.normal((TOKENS, full.args.hidden_size), key=mx.random.key(2))
    sharded = sol.tensor_parallel.ShardedAttention(full.layers[0].self_attn, group)
    pool = sol.block_manager.KvPool(1, 4, 16, sharded.local.num_kv_heads, full.head_dim, full.dtype)
    cos, sin = rope_angles(full, mx.arange(TOKENS))
    got = sharded(x, prefill(sol, list(range(TOKENS)), full.dtype), cos, sin, pool, 0)
    expected = mlx_model.model.layers[0].self_attn(x[None], mask="causal")[0]
    return {**difference(got, expected), "heads": sharded.local.num_heads, "kv_heads": sharded.local.num_kv_heads}


def check_model(sol, group, full, mlx_model, tokenizer, die_rank: int | None) -> dict:
    tp = sol.tensor_parallel.Qwen2TensorParallel(mlx_model, group)
    if group.rank() == die_rank:
        os._exit(DIED)
    pool = tp.make_kv_pool(4, 16)
    tokens = GREEDY_PROMPTS[1] + GREEDY_PROMPTS[0]
    logits = tp(prefill(sol, tokens, tp.dtype), pool)
    expected = mlx_model(mx.array([tokens]))[0]
    layer_bytes = sum(a.nbytes for block in full.layers
                      for a in (block.self_attn.wq, block.self_attn.wk, block.self_attn.wv, block.self_attn.wo,
                                block.self_attn.bq, block.self_attn.bk, block.self_attn.bv,
                                block.mlp.w_gate, block.mlp.w_up, block.mlp.w_down) if a is not None)
    return {**difference(logits, expected), "logits_checksum": [mx.sum(logits).item(), mx.sum(logits[:, ::97] ** 2).item()],
            "weight_bytes": tp.weight_bytes(), "full_layer_bytes": layer_bytes,
            "pool_kv_heads": pool.keys[0].shape[1], "model_kv_heads": full.num_kv_heads,
            "greedy": greedy_outputs(sol, tp, mlx_model, tokenizer)}


def make_engine(sol, model, tokenizer):
    """The week-3 engine on `model` (the one place this file builds one)."""
    config = sol.engine.EngineConfig(**week3_stack.PLAIN_ENGINE, token_budget=16, max_num_seqs=4, block_size=4,
                                     num_blocks=32)
    return sol.engine.LLMEngine(model, tokenizer, config)


def greedy_outputs(sol, tp, mlx_model, tokenizer) -> dict:
    """Greedy tokens of GREEDY_PROMPTS through week 3's engine on the sharded model, and mlx-lm's."""
    engine = make_engine(sol, tp, tokenizer)
    seqs = [engine.add_request(prompt, sol.sequence.SamplingParams(max_tokens=GREEDY_TOKENS)) for prompt in GREEDY_PROMPTS]
    for _ in range(10 * GREEDY_TOKENS * len(GREEDY_PROMPTS)):
        if not engine.has_work():
            break
        engine.step()
    return {"got": [seq.output_token_ids for seq in seqs], "expected": [mlx_lm_greedy(mlx_model, p) for p in GREEDY_PROMPTS],
            "unfinished": engine.has_work()}


def mlx_lm_greedy(mlx_model, prompt: list[int]) -> list[int]:
    """mlx-lm's model, whole, every token recomputed: the single-process oracle."""
    tokens = list(prompt)
    for _ in range(GREEDY_TOKENS):
        tokens.append(mx.argmax(mlx_model(mx.array([tokens]))[0, -1]).item())
    return tokens[len(prompt):]


class ShardedStack:
    """A stack whose week-3 model is built sharded: week3_stack's workloads build theirs as
    `package.qwen2_week3.Qwen2ModelWeek3(mlx_model)`, which here is `Qwen2TensorParallel(mlx_model, group)`."""

    def __init__(self, package, group):
        self.wrapped = package  # the name tests/harness.py's `actor_fakes` looks for
        sharded = lambda mlx_model: package.tensor_parallel.Qwen2TensorParallel(mlx_model, group)  # noqa: E731
        self.qwen2_week3 = SimpleNamespace(Qwen2ModelWeek3=sharded)

    def __getattr__(self, name):
        return getattr(self.wrapped, name)


def check_stack(package, group) -> dict:
    """Days 3.1-3.4's workloads through the stack's engine on its sharded model, on every rank in step: each
    stream mlx-lm's for the request alone, every rank's pool back to full (tests/week3_stack.py); and the
    pool the engine allocates holds this rank's share of the KV heads only (else each rank holds the whole cache)."""
    stack = ShardedStack(package, group)
    model = stack.qwen2_week3.Qwen2ModelWeek3(week3_stack.tiny_mlx_model())
    kv_heads, share = model.make_kv_pool(1, 4).keys[0].shape[1], model.args.num_key_value_heads // group.size()
    pool = None if kv_heads == share else (f"the engine's KV pool holds {kv_heads} KV heads per slot on each rank, "
                                           f"not the rank's {share}: every rank keeps the whole cache")
    try:
        week3_stack.check_stack(stack, day=4)
    except pytest.fail.Exception as failure:
        return {"failures": "\n".join(filter(None, [str(failure), pool]))}
    return {"failures": pool}


def attempt(check, *args) -> dict:
    """Run one check; a failure is recorded with its message (a skeleton's NotImplementedError apart)."""
    try:
        return check(*args)
    except NotImplementedError as error:
        return {"not_implemented": str(error)}
    except RuntimeError as error:
        if "[ring]" in str(error):  # a peer died mid-collective: nothing after this can work
            raise
        return {"error": "".join(traceback.format_exception_only(error)).strip()}
    except Exception as error:  # noqa: BLE001 - the student's code may raise anything; the test reports it
        return {"error": "".join(traceback.format_exception_only(error)).strip()}


TASK_CHECKS = ("mlp", "attention", "model")  # Tasks 2, 3 and 4's, in the order they run
CHECKS = (*TASK_CHECKS, "stack")  # what --checks may name


def task_checks(sol, group, names: list[str], die_rank: int | None) -> dict:
    """The checks of TASK_CHECKS among `names`, on the embedded model: name -> what the rank saw."""
    mlx_model, tokenizer = load_model("embedded")
    full = sol.qwen2_week3.Qwen2ModelWeek3(mlx_model)
    arguments = {"mlp": (check_mlp, sol, group, full, mlx_model),
                 "attention": (check_attention, sol, group, full, mlx_model),
                 "model": (check_model, sol, group, full, mlx_model, tokenizer, die_rank)}
    return {name: attempt(*arguments[name]) for name in TASK_CHECKS if name in names}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checks", required=True, type=lambda text: text.split(","),
                        help=f"comma-separated, of {', '.join(CHECKS)}")
    parser.add_argument("--die-rank", type=int, default=None)
    args = parser.parse_args()
    if set(args.checks) - set(CHECKS):
        parser.error(f"unknown checks {sorted(set(args.checks) - set(CHECKS))}; known: {', '.join(CHECKS)}")
    group = ranks.join()
    sol = launched()
    result = {}
    try:
        if set(args.checks) & set(TASK_CHECKS):
            result = task_checks(sol, group, args.checks, args.die_rank)
            ranks.write_result(group.rank(), result)
        if "stack" in args.checks and args.die_rank is None:
            ranks.write_result(group.rank(), {**result, "stack": attempt(check_stack, sol, group)})
    except RuntimeError as error:
        raise SystemExit(f"rank {group.rank()}: lost a peer in a collective: {error}") from None


if __name__ == "__main__":
    main()
