"""Week 4 Day 2: a quantized paged KV cache (book/src/week4-02-quantized-kv-cache.md).

Oracles: MLX's own `mx.quantize`/`mx.dequantize` (the layout bit for bit, and `RoundTripPool`, a
float pool that stores `mx.dequantize(mx.quantize(k))`: what a quantized pool must give back, to
float rounding); the error bound of affine quantization, computed per group from the data; the float
pool, for the stated logit tolerance on the embedded model; plain arithmetic for bytes and blocks;
day 3.2's block accounting after every step.

The oracle needs group sizes MLX supports (32, 64, 128), so most model-level tests run `wide_model`,
a random Qwen2 built here with SmolLM2's head_dim of 64; the embedded model (head_dim 16, one group
per head) gives the tolerance against the float pool. The engine, the runner and the model come
from the reference (the selector): what runs the student's code is the pool and its sizing. Each
task's tests take the student's code for that task alone (`solution(week=4, day=2, task=N)`): the pool
of Task 2 is tested over the reference's quantize_kv, the engine of Task 3 over the reference's pool,
so a bug in one task never costs another task's points; Task 4 runs the student's whole day.
"""

import random
from types import SimpleNamespace

import mlx.core as mx
import pytest

from tests.harness import actor_fakes, fetch, reference, solution, stack
from tests.week3_fakes import PLAIN_ENGINE
from tests.week4_stack import check_quantized_stack

TASKS = {n: solution(week=4, day=2, task=n) for n in range(1, 4)}  # Task N's tests: the student's Task N alone
STACK = stack(week=4, day=2)  # "your stack so far": started now, beside the collection
ref = reference()

BLOCK_SIZE = 4
WIDE_EOS = 0  # the wide model's end token: a random model may emit it, which just ends a request early


# ---------------------------------------------------------------- oracles and set-up


def round_trip(x: mx.array, bits: int, group_size: int) -> mx.array:
    """`T x H x D` through MLX's own quantize and dequantize, scales and biases rounded to float16 on the way."""
    tokens, heads, head_dim = x.shape
    packed, scales, biases = mx.quantize(x.reshape(-1, head_dim), group_size, bits)
    scales, biases = scales.astype(mx.float16).astype(x.dtype), biases.astype(mx.float16).astype(x.dtype)
    return mx.dequantize(packed, scales, biases, group_size, bits).reshape(tokens, heads, head_dim)


class RoundTripPool(ref.block_manager.KvPool):
    """A float pool that stores what quantizing and dequantizing with MLX gives: the quantized pool's oracle."""

    def __init__(self, *shape, bits: int, group_size: int = 64):
        super().__init__(*shape)
        self.bits, self.group_size = bits, group_size

    def write(self, layer, slots, keys, values):
        super().write(layer, slots, round_trip(keys, self.bits, self.group_size),
                      round_trip(values, self.bits, self.group_size))


@pytest.fixture(scope="module")
def wide_model():
    """A random two-layer Qwen2 with head_dim 64 (SmolLM2's), 512 tokens, float32: (week-3 model, mlx-lm model,
    tokenizer); the week-3 model and the tokenizer are this process's (the oracles'), the engine under test builds
    its own from the mlx-lm model (`make_engine`)."""
    from mlx.utils import tree_map
    from mlx_lm.models import qwen2 as mlx_qwen2

    args = mlx_qwen2.ModelArgs(model_type="qwen2", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                               num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6, vocab_size=512,
                               rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=True)
    mx.random.seed(42)
    mlx_model = mlx_qwen2.Model(args)
    # Wider than the default initialisation, so attention is peaked and quantization error shows.
    mlx_model.update(tree_map(lambda p: (p * 3).astype(mx.float32), mlx_model.parameters()))
    mx.eval(mlx_model.parameters())
    return ref.qwen2_week3.Qwen2ModelWeek3(mlx_model), mlx_model, SimpleNamespace(eos_token_ids={WIDE_EOS})


def pool_shape(model, num_blocks, block_size):
    return model.num_hidden_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim


def prompt_of(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(length)]


def prefill_logits(model, pool, tokens: list[int], block_table: list[int], block_size: int, chunk: int) -> mx.array:
    """Every position's logits, running `tokens` in chunks over `pool` through `block_table` (reference runner)."""
    runner = ref.model_runner.ModelRunner(model, 1, block_size)
    runner.pool = pool
    seq = ref.sequence.Sequence("prefill", tokens)
    seq.block_table = block_table
    rows = []
    for start in range(0, len(tokens), chunk):
        length = min(chunk, len(tokens) - start)
        batch = runner.prepare(ref.scheduler.StepPlan(prefills=[ref.scheduler.ScheduledChunk(seq, start, length)]))
        batch.sample_rows = mx.arange(length)
        rows.append(model(batch, pool))
    return mx.concatenate(rows)


def engine_config(package=ref, **knobs):
    """`package`'s EngineConfig of the tests' engine knobs: blocks of 4 tokens, 4 sequences, 16 tokens a step, and
    `knobs`."""
    return package.engine.EngineConfig(**{**PLAIN_ENGINE, "block_size": BLOCK_SIZE, "max_num_seqs": 4,
                                          "token_budget": 16, **knobs})


def make_engine(sol, mlx_model, kv_cache_bytes: int, kv_bits: int | None = None):
    """The reference engine on `sol`'s pool, sized by memory with `sol`'s sizing, all of it (the week-3 model of
    `mlx_model` too) built where `sol` runs.

    The engine module is the reference's (the selector keeps modules without the day's tasks as they
    are), so the pool and its size are put in here: the one place the tests build an engine.
    """
    model = sol.qwen2_week3.Qwen2ModelWeek3(mlx_model)
    qkv = sol.quantized_kv
    num_blocks = qkv.num_blocks_for_memory(kv_cache_bytes, BLOCK_SIZE, qkv.model_bytes_per_token(model, kv_bits))
    tokenizer = actor_fakes(sol, "speculative").EndToken(WIDE_EOS)
    engine = sol.engine.LLMEngine(model, tokenizer, engine_config(sol, num_blocks=num_blocks, kv_bits=kv_bits))
    engine.runner.pool = qkv.make_kv_pool(model, num_blocks, BLOCK_SIZE, kv_bits)
    return engine


def oracle_engine(model, tokenizer, bits, num_blocks):
    """The reference engine over `RoundTripPool`: what the quantized engine must generate, token for token."""
    engine = ref.engine.LLMEngine(model, tokenizer, engine_config(ref, num_blocks=num_blocks))
    engine.runner.pool = RoundTripPool(*pool_shape(model, num_blocks, BLOCK_SIZE), bits=bits)
    return engine


def run_to_end(engine, prompts, max_tokens, package=ref, max_steps=3000):
    """Add the prompts, step to the end checking the block accounting after every step; the outputs. `package`: the
    code `engine` is made of (its state is read where it runs, in one round trip a step while grading)."""
    seqs = [engine.add_request(p, ref.sequence.SamplingParams(max_tokens=max_tokens)) for p in prompts]
    state_of, step = actor_fakes(package, "speculative").state, engine.step  # read once (while grading, a round trip)
    for _ in range(max_steps):
        state = state_of(engine)
        if not state["has_work"]:
            return [output for (output,) in fetch(seqs, "output_token_ids")]
        step()
        check_pool(state_of(engine))
    raise AssertionError(f"no end after {max_steps} steps: every step must make progress (a prefill chunk, a token "
                         "or a preemption), so the engine stopped moving")


def check_pool(state: dict):
    """Day 3.2's accounting on an engine's state (tests/actor_fakes/speculative.py's `state`): every block free or
    held by exactly one running sequence, and enough of them."""
    held = [b for _, table, _, _ in state["running"] for b in table]
    assert len(held) == len(set(held)), "a block is held twice"
    assert len(held) + state["num_free"] == state["num_blocks"], "blocks leaked"
    for _, table, _, computed in state["running"]:
        assert len(table) * state["block_size"] >= computed


def group_max(x: mx.array, group_size: int) -> mx.array:
    """The largest value of each group of `group_size` along the last axis."""
    return x.reshape(*x.shape[:-1], -1, group_size).max(axis=-1)


def grouped_ranges(x: mx.array, group_size: int) -> mx.array:
    """max - min of each group of `group_size` along the last axis."""
    return group_max(x, group_size) + group_max(-x, group_size)


def head_major(x: mx.array, group_size: int, bits: int) -> mx.array:
    """The packed words of `x` (T x H x D) quantized head by head instead of token by token: a swapped layout."""
    return mx.quantize(x.swapaxes(0, 1).reshape(-1, x.shape[-1]), group_size, bits)[0]


def stored_difference(pool, layer: int, slots: list[int], x: mx.array, bits: int, group_size: int, name: str) -> str:
    """What differs between the pool's stored `name` ("keys" or "values") at `slots` and mx.quantize's of `x`
    (T x H x D): the dtype, the scales, the biases (or both swapped), the packing order, the packed words; "" if
    nothing does."""
    tokens, heads, head_dim = x.shape
    stored = pool.keys[layer] if name == "keys" else pool.values[layer]
    packed, scales, biases = (part[mx.array(slots)].reshape(tokens * heads, -1) for part in stored)
    want_packed, want_scales, want_biases = mx.quantize(x.reshape(-1, head_dim), group_size, bits)
    want_scales, want_biases = want_scales.astype(mx.float16), want_biases.astype(mx.float16)
    if packed.dtype != mx.uint32 or scales.dtype != mx.float16 or biases.dtype != mx.float16:
        return f"{name}: stored as {packed.dtype}, {scales.dtype}, {biases.dtype}; want uint32 words and float16 " \
               "scales and biases"
    if scales.shape != want_scales.shape:
        return f"{name}: {scales.shape[-1]} scales a head, want {head_dim // group_size} (groups of {group_size})"
    if mx.array_equal(scales, want_biases).item() and mx.array_equal(biases, want_scales).item():
        return f"{name}: scales and biases swapped"
    if tokens > 1 and heads > 1 and mx.array_equal(packed, head_major(x, group_size, bits)).item():
        return f"{name}: quantized head-major (heads and tokens swapped: rows must be token by token, then head)"
    if not mx.array_equal(scales, want_scales).item():
        return f"{name}: the scales differ from mx.quantize's (one per group of {group_size} features, per token " \
               "and head)"
    if not mx.array_equal(biases, want_biases).item():
        return f"{name}: the biases differ from mx.quantize's"
    if not mx.array_equal(packed, want_packed).item():
        return f"{name}: the packed words differ from mx.quantize's (the packing order or the bits)"
    return ""


def gathered_difference(got: mx.array, x: mx.array, other: mx.array, bits: int, group_size: int, dtype: mx.Dtype,
                        name: str) -> str:
    """What differs between what gather returned for `name` ("keys" or "values") and the dequantization of `x`, what
    was written there (`other`: what was written as the other one): the dtype, the shape, the other one's data, the
    scales and biases swapped, the packed words; "" if nothing does (to float rounding)."""
    if got.dtype != dtype:
        return f"gather returns {name} as {got.dtype}, not the pool's dtype ({dtype})"
    if got.shape != x.shape:
        return f"gather's {name} have shape {got.shape}, want {x.shape} (slots first, then heads and head_dim)"
    shape, head_dim = x.shape, x.shape[-1]
    got = got.astype(mx.float32)

    def matches(expected: mx.array) -> bool:
        return mx.allclose(got, expected.reshape(shape), rtol=1e-5, atol=1e-4).item()

    if matches(round_trip(x.reshape(-1, *shape[-2:]), bits, group_size)):
        return ""
    if matches(round_trip(other.reshape(-1, *shape[-2:]), bits, group_size)):
        return f"gather's {name} are the {'values' if name == 'keys' else 'keys'}"
    packed, scales, biases = mx.quantize(x.reshape(-1, head_dim), group_size, bits)
    scales, biases = scales.astype(mx.float16).astype(mx.float32), biases.astype(mx.float16).astype(mx.float32)
    if matches(mx.dequantize(packed, biases, scales, group_size, bits)):
        return f"gather's {name}: scales and biases swapped when dequantizing"
    return f"gather's {name} are not the dequantization of what the pool stores at those slots (the slots read, " \
           f"the bits ({bits}) or the group size ({group_size}) given to dequantize_kv)"


def uneven(shape, seed: int) -> mx.array:
    """Keys-like data whose heads and tokens differ in scale by 10^4 and in offset: per-group scales matter."""
    mx.random.seed(seed)
    tokens, heads, _ = shape
    spread = mx.power(10.0, mx.random.uniform(-2, 2, (tokens, heads, 1)))
    offset = mx.random.normal((tokens, heads, 1)) * spread
    return mx.random.normal(shape) * spread + offset


# ---------------------------------------------------------------- Task 1: quantize and dequantize keys and values


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [64, 32])
def test_task_1_layout_is_mlx_quantize_per_token_and_head(bits, group_size):
    sol = TASKS[1]
    x = uneven((5, 3, 64), seed=1)
    packed, scales, biases = sol.quantized_kv.quantize_kv(x, group_size, bits)
    assert packed.shape == (5, 3, 64 * bits // 32) and packed.dtype == mx.uint32, \
        f"packed: {packed.shape} {packed.dtype}, want (5, 3, {64 * bits // 32}) uint32 (bits/32 words a feature)"
    assert scales.shape == biases.shape == (5, 3, 64 // group_size), \
        f"scales {scales.shape}, biases {biases.shape}: want one per group of {group_size}, (5, 3, {64 // group_size})"
    assert scales.dtype == biases.dtype == mx.float16, "scales and biases are stored as float16"
    mlx_packed, mlx_scales, mlx_biases = mx.quantize(x.reshape(15, 64), group_size, bits)
    if mx.array_equal(scales.reshape(15, -1), mlx_biases.astype(mx.float16)).item():
        pytest.fail("scales and biases swapped", pytrace=False)
    if mx.array_equal(packed.reshape(15, -1), head_major(x, group_size, bits)).item():
        pytest.fail("quantized head-major (heads and tokens swapped: rows must be token by token, then head)",
                    pytrace=False)
    assert mx.array_equal(scales.reshape(15, -1), mlx_scales.astype(mx.float16)).item(), \
        "the scales differ from mx.quantize's (one per group, per token and head)"
    assert mx.array_equal(biases.reshape(15, -1), mlx_biases.astype(mx.float16)).item(), \
        "the biases differ from mx.quantize's"
    assert mx.array_equal(packed.reshape(15, -1), mlx_packed).item(), \
        "the packed words differ from mx.quantize's (the order of tokens, heads and features, or the bits)"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [64, 32, 16])
def test_task_1_round_trip_error_within_a_level_of_each_group(bits, group_size):
    """Affine quantization misses a value by at most a level of its own group, plus float16 rounding.

    Half a level from rounding; MLX's scale, stretched so the group's larger end sits exactly on a
    level, can push the other end up to half a level past the last one (clipped).
    """
    sol = TASKS[1]
    x = uneven((40, 4, 64), seed=2)
    q = sol.quantized_kv.quantize_kv(x, group_size, bits)
    back = sol.quantized_kv.dequantize_kv(*q, group_size, bits, mx.float32)
    assert back.shape == x.shape and back.dtype == mx.float32
    level = grouped_ranges(x, group_size) / (2**bits - 1)
    error = group_max(mx.abs(back - x), group_size)
    # A level, plus float16's rounding of the bias (2^-11 of the group's largest |value|) and of the
    # scale (2^-11 of a level, times up to 2^bits levels); twice that for slack.
    bound = level + 2**-10 * (group_max(mx.abs(x), group_size) + level * 2**bits)
    worst = (error / bound).max().item()
    assert worst <= 1.0, f"a group's error is {worst:.1f}x its own bound: are scales per group, with their bias?"
    assert sol.quantized_kv.dequantize_kv(*q, group_size, bits, mx.float16).dtype == mx.float16


@pytest.mark.parametrize("bits", [8, 4])
def test_task_1_dequantize_matches_mlx(bits):
    sol = TASKS[1]
    x = uneven((6, 2, 64), seed=3)
    mlx_packed, mlx_scales, mlx_biases = mx.quantize(x.reshape(12, 64), 32, bits)
    scales, biases = mlx_scales.astype(mx.float16), mlx_biases.astype(mx.float16)
    got = sol.quantized_kv.dequantize_kv(mlx_packed.reshape(6, 2, -1), scales.reshape(6, 2, -1),
                                         biases.reshape(6, 2, -1), 32, bits, mx.float32)
    expected = mx.dequantize(mlx_packed, scales.astype(mx.float32), biases.astype(mx.float32), 32, bits)
    assert got.dtype == mx.float32, f"dequantize_kv returned {got.dtype}, not the dtype asked for (float32)"
    swapped = mx.dequantize(mlx_packed, biases.astype(mx.float32), scales.astype(mx.float32), 32, bits)
    assert not mx.allclose(got.reshape(12, 64), swapped, rtol=1e-5, atol=1e-5).item(), "scales and biases swapped"
    assert mx.allclose(got.reshape(12, 64), expected, rtol=1e-5, atol=1e-5).item(), \
        "dequantize_kv differs from mx.dequantize on the same words, scales and biases (the group size or the bits)"


# ---------------------------------------------------------------- Task 2: the quantized pool


@pytest.mark.parametrize("bits", [8, 4])
def test_task_2_pool_stores_keys_and_values_quantized(bits):
    sol = TASKS[2]
    pool = sol.quantized_kv.QuantizedKvPool(num_layers=2, num_blocks=4, block_size=2, num_kv_heads=2, head_dim=64,
                                           bits=bits)
    keys, values = uneven((4, 2, 64), seed=4), uneven((4, 2, 64), seed=5)
    slots = mx.array([6, 7, 0, 3])
    pool.write(1, slots, keys, values)
    mx.eval(pool.arrays())
    for x, name in ((keys, "keys"), (values, "values")):
        differs = stored_difference(pool, 1, [6, 7, 0, 3], x, bits, 64, name)
        assert not differs, differs
    got_keys, got_values = pool.gather(1, mx.array([[0, 6], [3, 7]]))
    written = mx.array([[2, 0], [3, 1]])  # which row of `keys` and `values` each of those slots holds
    for got, x, other, name in ((got_keys, keys, values, "keys"), (got_values, values, keys, "values")):
        differs = gathered_difference(got, x[written], other[written], bits, 64, mx.float32, name)
        assert not differs, f"the stored {name} are right (mx.quantize's) but {differs}"
    assert all(mx.array_equal(part, mx.zeros_like(part)).item() for part in pool.keys[0] + pool.values[0]), \
        "other layers untouched"


@pytest.mark.parametrize("bits", [8, 4])
def test_task_2_rewriting_a_slot_requantizes_it(bits):
    """A freed block handed to another sequence is overwritten: new values, new scales, new biases."""
    sol = TASKS[2]
    pool = sol.quantized_kv.QuantizedKvPool(1, num_blocks=3, block_size=2, num_kv_heads=1, head_dim=64, bits=bits)
    first, second = uneven((4, 1, 64), seed=6), 100 * uneven((2, 1, 64), seed=7) + 50
    pool.write(0, mx.array([0, 1, 2, 3]), first, -first)
    mx.eval(pool.arrays())
    pool.write(0, mx.array([2, 3]), second, -second)
    mx.eval(pool.arrays())
    for slots, x in (([0, 1], first[:2]), ([2, 3], second)):
        for name, sign in (("keys", 1), ("values", -1)):
            differs = stored_difference(pool, 0, slots, sign * x, bits, 64, name)
            assert not differs, f"slots {slots} after {'a rewrite' if slots[0] else 'their neighbours rewrite'}: " \
                                f"{differs}"
    keys, values = pool.gather(0, mx.array([0, 1, 2, 3]))
    written = mx.concatenate([first[:2], second])
    for got, sign, name in ((keys, 1, "keys"), (values, -1, "values")):
        differs = gathered_difference(got, sign * written, -sign * written, bits, 64, mx.float32, name)
        assert not differs, f"the stored parts are right but {differs}"


@pytest.mark.parametrize("bits", [8, 4])
def test_task_2_model_over_quantized_pool_matches_mlx_round_trip(wide_model, bits):
    """Two sequences, the second on the first one's blocks, prefilled in chunks: logits as the MLX oracle's."""
    sol = TASKS[2]
    model, _, _ = wide_model
    shape = pool_shape(model, 8, 4)
    pool, oracle = sol.quantized_kv.QuantizedKvPool(*shape, bits=bits), RoundTripPool(*shape, bits=bits)
    for seed, table in ((0, [3, 1, 4, 0, 6, 2, 5]), (1, [2, 5, 0, 7, 1, 3])):
        tokens = prompt_of(4 * len(table) - 1, seed, 512)
        got = prefill_logits(model, pool, tokens, table, 4, chunk=7)
        expected = prefill_logits(model, oracle, tokens, table, 4, chunk=7)
        assert mx.allclose(got, expected, rtol=1e-3, atol=1e-3).item(), \
            f"logits differ from MLX's round trip by up to {mx.abs(got - expected).max().item():.3g}"


def test_task_2_embedded_logits_within_tolerance_of_float_pool(model32):
    """The stated tolerance, 8-bit, on the embedded model (logits span about +-22; measured: 2.5 and 93.5%).

    200 positions prefilled in chunks of 32, so most queries read keys that earlier chunks stored,
    into blocks another sequence used before.
    """
    sol = TASKS[2]
    mlx_model, _ = model32
    model = ref.qwen2_week3.Qwen2ModelWeek3(mlx_model)
    tokens, table = prompt_of(200, 3, 5000), list(range(13))
    base = prefill_logits(model, model.make_kv_pool(13, 16), tokens, table, 16, chunk=32)
    # The pool is made where the code under test runs, for that process's week-3 model of the same weights.
    pool = sol.quantized_kv.make_kv_pool(sol.qwen2_week3.Qwen2ModelWeek3(mlx_model), 13, 16, kv_bits=8)
    prefill_logits(model, pool, prompt_of(200, 4, 5000), table, 16, chunk=200)  # an earlier sequence's blocks
    logits = prefill_logits(model, pool, tokens, table, 16, chunk=32)
    error = mx.abs(logits - base).max().item()
    agreement = (logits.argmax(axis=-1) == base.argmax(axis=-1)).mean().item()
    assert error <= 4.0, f"logits differ from the float pool's by up to {error:.2f}"
    assert agreement >= 0.85, f"argmax agrees with the float pool at {agreement:.1%} of positions"
    assert error > 0, "the pool stored the keys and values exactly: nothing was quantized"


# ---------------------------------------------------------------- Task 3: memory, the engine, your stack


def test_task_3_bytes_per_token_and_blocks_for_a_budget():
    sol = TASKS[3]
    qkv = sol.quantized_kv
    smollm2 = (30, 3, 64)  # layers, KV heads, head_dim
    assert qkv.kv_bytes_per_token(*smollm2, None, mx.float32) == 2 * 30 * 3 * 64 * 4
    assert qkv.kv_bytes_per_token(*smollm2, None, mx.float16) == 2 * 30 * 3 * 64 * 2
    assert qkv.kv_bytes_per_token(*smollm2, 16, mx.float32) == 2 * 30 * 3 * 64 * 2
    assert qkv.kv_bytes_per_token(*smollm2, 8, mx.float32) == 2 * 30 * 3 * (64 + 2 * 2)
    assert qkv.kv_bytes_per_token(*smollm2, 4, mx.float32) == 2 * 30 * 3 * (32 + 2 * 2)
    assert qkv.kv_bytes_per_token(*smollm2, 8, mx.float32, group_size=32) == 2 * 30 * 3 * (64 + 2 * 2 * 2)
    assert qkv.kv_bytes_per_token(2, 2, 16, 4, mx.float32) == 2 * 2 * 2 * (8 + 2 * 2), "a group is a whole small head"
    # The pool's arrays take what the formula says.
    for bits in (8, 4):
        pool = qkv.QuantizedKvPool(3, 5, 4, 2, 64, bits=bits)
        assert qkv.pool_nbytes(pool) == 5 * 4 * qkv.kv_bytes_per_token(3, 2, 64, bits)
    assert qkv.num_blocks_for_memory(10_000, 4, 100) == 25
    assert qkv.num_blocks_for_memory(10_399, 4, 100) == 25
    assert qkv.num_blocks_for_memory(400, 4, 100) == 1
    with pytest.raises(ValueError):
        qkv.num_blocks_for_memory(399, 4, 100)


def test_task_3_equal_memory_holds_more_and_preempts_less(wide_model):
    """The same bytes as 10 float32 blocks: the 8-bit engine holds 3.5x the blocks and never preempts here.

    Eight requests, four at a time: the later ones reuse the blocks of the finished ones.
    """
    sol = TASKS[3]
    model, mlx_model, tokenizer = wide_model
    memory = 10 * 4 * ref.quantized_kv.model_bytes_per_token(model, None)
    prompts, max_tokens = [prompt_of(12, 10 + i, 512) for i in range(8)], 12
    float_engine = make_engine(sol, mlx_model, kv_cache_bytes=memory)
    quantized = make_engine(sol, mlx_model, kv_cache_bytes=memory, kv_bits=8)
    assert float_engine.block_manager.num_blocks == 10
    assert quantized.block_manager.num_blocks >= 3.5 * 10
    knob = ref.engine.LLMEngine(model, tokenizer, engine_config(ref, kv_cache_bytes=memory, kv_bits=8))
    assert knob.block_manager.num_blocks == quantized.block_manager.num_blocks, "the engine's kv_cache_bytes knob"
    for bad in ({"kv_bits": 3}, {"kv_cache_bytes": 0}, {"kv_cache_bytes": memory, "num_blocks": 10}):
        with pytest.raises(ValueError):
            engine_config(ref, **bad)
    assert ref.quantized_kv.pool_nbytes(quantized.runner.pool) <= memory
    run_to_end(float_engine, prompts, max_tokens, sol)
    outputs = run_to_end(quantized, prompts, max_tokens, sol)
    assert float_engine.num_preemptions > 0 and quantized.num_preemptions == 0
    assert quantized.block_manager.num_free_blocks == quantized.block_manager.num_blocks
    oracle = oracle_engine(model, tokenizer, 8, quantized.block_manager.num_blocks)
    assert outputs == run_to_end(oracle, prompts, max_tokens)


@pytest.mark.parametrize("bits", [8, 4])
def test_task_3_engine_end_to_end_with_preemption(wide_model, bits):
    """Your pool in the engine, memory tight enough to preempt and reuse blocks: MLX's tokens, every block back."""
    sol = TASKS[3]
    model, mlx_model, tokenizer = wide_model
    memory = 12 * 4 * ref.quantized_kv.model_bytes_per_token(model, bits)
    prompts, max_tokens = [prompt_of(n, 20 + n, 512) for n in (9, 14, 5, 11, 7)], 10
    engine = make_engine(sol, mlx_model, kv_cache_bytes=memory, kv_bits=bits)
    assert engine.block_manager.num_blocks == 12
    outputs = run_to_end(engine, prompts, max_tokens, sol)
    assert engine.num_preemptions > 0, "the workload was meant to preempt"
    assert engine.block_manager.num_free_blocks == 12 and not engine.has_work()
    oracle = oracle_engine(model, tokenizer, bits, 12)
    assert outputs == run_to_end(oracle, prompts, max_tokens)
    assert oracle.num_preemptions == engine.num_preemptions
    with pytest.raises(ValueError):
        make_engine(sol, mlx_model, kv_cache_bytes=100, kv_bits=bits)


# ---------------------------------------------------------------- Task 4: your stack so far


def test_task_4_your_stack_so_far():
    """Your week-3 engine over your 8-bit and 4-bit pools on server workloads (tests/week4_stack.py): sized by
    memory, preemptions, EOS, aborts, a failing model, seeded sampling; every token MLX's round trip's."""
    check_quantized_stack(STACK)
