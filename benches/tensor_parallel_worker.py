"""One rank of bench-tensor-parallel: greedy decoding of one request (day 4.3) or a batch (day 4.4), timed.

    python -m benches.tensor_parallel_worker --engine ours|mlx-lm --model M --prompt-tokens P --decode-tokens D
    python -m benches.tensor_parallel_worker --requests N ...   # day 4.4: N requests at once, the engines' way

Started by `course.ranks.launch` (mlx.launch, one or more ranks). With one rank there is no backend and
`mx.distributed.init()` gives a group of one: the same code runs, every all_sum a no-op.
- ours: day 4.3's `Qwen2TensorParallel` driven by week 3's engine (one request, one step per token);
- mlx-lm: its own model, `model.shard(group)` when there are several ranks, with its KV cache.
With `--requests N` (day 4.4), N requests arrive at once and run to the end through benches/runner.py:
- ours: day 4.4's `TensorParallelEngine` on rank 0 (it plans and samples), `follow_engine` on the others;
- mlx-lm: its `BatchGenerator` on its sharded model, the same on every rank (its ranks stay in step
  because every rank makes the same greedy choices; only the collectives inside the model cross).
With several ranks, rank 0 also times `all_sum` of one hidden-size vector: the latency of one all-reduce.
Rank 0 writes the figures (course/ranks.py).
"""

from course import fast_mlx

fast_mlx.setup(quiet=True)

import argparse  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402

from benches import engines, runner  # noqa: E402
from benches.workloads import Arrival, random_prompt  # noqa: E402
from course import ranks, selector  # noqa: E402
from course.engines import PLAIN_ENGINE  # noqa: E402
from course.models import load_model  # noqa: E402

ALL_SUM_REPEATS = 200


def make_engine(selection, model, tokenizer, prompt_tokens: int, decode_tokens: int):
    """Week 3's engine sized for one request (the one place this file builds one)."""
    config = selection.engine.EngineConfig(**PLAIN_ENGINE, token_budget=max(prompt_tokens, 16), max_num_seqs=1,
                                           block_size=16, num_blocks=(prompt_tokens + decode_tokens) // 16 + 2)
    return selection.engine.LLMEngine(model, tokenizer, config)


def ours(selection, group, mlx_model, tokenizer, prompt: list[int], decode_tokens: int) -> tuple[list[int], list[float]]:
    model = selection.tensor_parallel.Qwen2TensorParallel(mlx_model, group)
    engine = make_engine(selection, model, tokenizer, len(prompt), decode_tokens)
    seq = engine.add_request(prompt, selection.sequence.SamplingParams(max_tokens=decode_tokens))
    times = []
    for _ in range(decode_tokens + len(prompt)):  # a step limit: one prefill step, then one token per step
        if not engine.has_work():
            break
        engine.step()
        times.append(time.perf_counter())
    return seq.output_token_ids, times


def mlx_lm(group, mlx_model, prompt: list[int], decode_tokens: int) -> tuple[list[int], list[float]]:
    from mlx_lm.models.cache import make_prompt_cache

    if group.size() > 1:
        mlx_model.shard(group)
    cache = make_prompt_cache(mlx_model)
    tokens, times = [], []
    inputs = mx.array([prompt])
    for _ in range(decode_tokens):
        tokens.append(mx.argmax(mlx_model(inputs, cache=cache)[0, -1]).item())
        times.append(time.perf_counter())
        inputs = mx.array([[tokens[-1]]])
    return tokens, times


def batch_config(requests: int, prompt_tokens: int, decode_tokens: int) -> dict:
    """Day 4.4's engine sized for the whole batch at once: EngineConfig fields (the same on every rank)."""
    return dict(PLAIN_ENGINE, token_budget=max(256, requests), max_num_seqs=requests, block_size=16,
                num_blocks=requests * ((prompt_tokens + decode_tokens) // 16 + 2))


def batch(engine: str, selection, group, mlx_model, tokenizer, args) -> dict | None:
    """Day 4.4: `args.requests` requests at once to the end; rank 0's summary (benches/runner.py), None elsewhere."""
    arrivals = [Arrival("batch", random_prompt(args.prompt_tokens, seed=i), args.decode_tokens)
                for i in range(args.requests)]
    config = batch_config(args.requests, args.prompt_tokens, args.decode_tokens)
    if engine == "mlx-lm":
        if group.size() > 1:
            mlx_model.shard(group)
        adapter = engines.MlxLm(mlx_model, tokenizer, prefill_step=config["token_budget"], batch_size=args.requests)
    else:
        model = selection.tensor_parallel.Qwen2TensorParallel(mlx_model, group)
        if group.rank() != 0:
            selection.distributed_engine.follow_engine(model, selection.engine.EngineConfig(**config)).follow()
            return None
        adapter = engines.TensorParallel(selection, model, tokenizer, **config)
    done = runner.run(adapter, arrivals, engine)
    return {**runner.summarize(done), "outputs": [done.outputs[i] for i in range(len(arrivals))]}


def all_sum_latency(group, width: int) -> float:
    """Seconds per all_sum of one float32 hidden-size vector, averaged over ALL_SUM_REPEATS after a warm-up."""
    x = mx.ones((1, width))
    mx.eval(mx.distributed.all_sum(x, group=group))
    start = time.perf_counter()
    for _ in range(ALL_SUM_REPEATS):
        x = mx.distributed.all_sum(x, group=group) * 0.5  # each depends on the last: no overlap
        mx.eval(x)
    return (time.perf_counter() - start) / ALL_SUM_REPEATS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("ours", "mlx-lm"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-tokens", type=int, required=True)
    parser.add_argument("--decode-tokens", type=int, required=True)
    parser.add_argument("--requests", type=int, default=None, help="day 4.4: this many requests at once")
    parser.add_argument("--solution", choices=("ref", "student"), default="ref")
    args = parser.parse_args()
    group = mx.distributed.init()
    mlx_model, tokenizer = load_model(args.model)
    selection = selector.for_command(args.solution)
    if args.requests:
        result = batch(args.engine, selection, group, mlx_model, tokenizer, args)
        if result is not None:
            ranks.write_result(0, {**result, "world_size": group.size()})
        return
    prompt = random_prompt(args.prompt_tokens, seed=0)
    if args.engine == "ours":
        tokens, times = ours(selection, group, mlx_model, tokenizer, prompt, args.decode_tokens)
    else:
        tokens, times = mlx_lm(group, mlx_model, prompt, args.decode_tokens)
    itls = [b - a for a, b in zip(times, times[1:])]
    result = {"tokens": tokens, "itl_s": itls, "world_size": group.size()}
    if group.size() > 1:
        result["all_sum_s"] = all_sum_latency(group, mlx_model.args.hidden_size)
    if group.rank() == 0:
        ranks.write_result(0, result)


if __name__ == "__main__":
    main()
