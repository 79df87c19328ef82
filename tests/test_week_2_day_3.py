"""Week 2 Day 3: quantized weights (book/src/week2-03-quantized-weights.md).

Oracles: mx.quantize and mx.dequantize, bit for bit; mx.quantized_matmul (MLX's fused kernel) for the
quantized linear layer (each on MLX's CPU when the GPU is CUDA's: tests/mlx_oracles.py); mlx-lm's own Qwen2 quantized in-process to 4 bits for the logits, and the same
checkpoint dequantized on load (mx.dequantize) for the greedy tokens.
"""

import mlx.core as mx
import numpy as np
import pytest

from tests import mlx_oracles as oracle
from tests.actor_fakes import week2_models as here
from tests.harness import actor_fakes, class_of, solution

sol = solution(week=2, day=3)

FORMATS = [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)]  # (bits, group_size)


def random_weight(shape, seed, dtype=mx.float32):
    return (mx.random.normal(shape, key=mx.random.key(seed)) * 0.05).astype(dtype)


def assert_equal_bits(actual, expected, what):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    a, e = np.array(actual.astype(mx.float32) if actual.dtype == mx.bfloat16 else actual), np.array(
        expected.astype(mx.float32) if expected.dtype == mx.bfloat16 else expected)
    mismatches = int((a != e).sum())
    assert mismatches == 0, f"{what}: {mismatches} of {a.size} values differ from MLX's"


# ---------------------------------------------------------------- Task 1: quantize

@pytest.mark.parametrize("bits,group_size", FORMATS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_task_1_quantize_matches_mlx_bit_for_bit(bits, group_size, dtype):
    w = random_weight((40, 384), seed=bits * group_size, dtype=dtype)
    packed, scales, biases = sol.quantize.quantize(w, group_size=group_size, bits=bits)
    e_packed, e_scales, e_biases = oracle.quantize(w, group_size=group_size, bits=bits)
    assert_equal_bits(packed, e_packed, "packed weights (uint32, in*bits/32 per row)")
    assert_equal_bits(scales, e_scales, "scales")
    assert_equal_bits(biases, e_biases, "biases")


def test_task_1_quantize_awkward_groups():
    # Groups that are constant, all zero, all negative, or hold one large outlier: the edge cases of
    # the scale (never 0) and of which end of the range is pinned.
    rows = [
        np.full(64, 0.25), np.zeros(64), -np.linspace(0.1, 2.0, 64), np.r_[np.full(63, 0.01), 30.0],
        np.r_[-30.0, np.full(63, 0.01)], np.linspace(-1.0, 1.0, 64),
    ]
    w = mx.array(np.stack(rows).astype(np.float32))
    for bits in (4, 8):
        got = sol.quantize.quantize(w, group_size=64, bits=bits)
        expected = oracle.quantize(w, group_size=64, bits=bits)
        for name, a, e in zip(("packed", "scales", "biases"), got, expected, strict=True):
            assert_equal_bits(a, e, f"{bits}-bit {name}")


def test_task_1_quantize_error_is_within_a_step():
    # Rounding costs at most half a step; pinning the edge can stretch the far end by up to another half.
    w = random_weight((16, 256), seed=7)
    packed, scales, biases = sol.quantize.quantize(w, group_size=64, bits=4)
    restored = oracle.dequantize(packed, scales, biases, group_size=64, bits=4)  # MLX's, not yours
    step = mx.repeat(mx.abs(scales), 64, axis=1)
    assert bool(mx.all(mx.abs(restored - w) <= step + 1e-6)), "a value landed more than one step away"


def test_task_1_quantize_rejects_bad_arguments():
    w = random_weight((4, 96), seed=1)
    with pytest.raises(ValueError, match="bits"):
        sol.quantize.quantize(random_weight((4, 64), seed=1), group_size=64, bits=3)
    with pytest.raises(ValueError, match="group_size"):
        sol.quantize.quantize(w, group_size=64, bits=4)  # 96 inputs are not whole groups of 64


# ---------------------------------------------------------------- Task 2: dequantize

@pytest.mark.parametrize("bits,group_size", FORMATS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_task_2_dequantize_matches_mlx_bit_for_bit(bits, group_size, dtype):
    packed, scales, biases = oracle.quantize(random_weight((24, 256), seed=bits + group_size, dtype=dtype),
                                         group_size=group_size, bits=bits)
    got = sol.quantize.dequantize(packed, scales, biases, group_size=group_size, bits=bits)
    assert_equal_bits(got, oracle.dequantize(packed, scales, biases, group_size=group_size, bits=bits), "weights")


def test_task_2_dequantize_unpacks_low_bits_first():
    # One 4-bit word 0x76543210 holds q = 0, 1, ..., 7 (first value in the lowest bits); 8-bit words
    # 0x03020100 and 0x07060504 hold 0 .. 7 too. With scale 1 and bias 0, dequantize returns q itself.
    one = mx.ones((1, 1))
    zero = mx.zeros((1, 1))
    four = sol.quantize.dequantize(mx.array([[0x76543210]], dtype=mx.uint32), one, zero, group_size=8, bits=4)
    eight = sol.quantize.dequantize(mx.array([[0x03020100, 0x07060504]], dtype=mx.uint32), one, zero,
                                    group_size=8, bits=8)
    assert four.tolist() == [list(map(float, range(8)))]
    assert eight.tolist() == [list(map(float, range(8)))]


def test_task_2_dequantize_leading_axes():
    # An embedding lookup dequantizes gathered rows: batch x tokens x words.
    packed, scales, biases = oracle.quantize(random_weight((10, 128), seed=3), group_size=64, bits=4)
    ids = mx.array([[1, 7, 7], [0, 9, 2]])
    got = sol.quantize.dequantize(packed[ids], scales[ids], biases[ids], group_size=64, bits=4)
    assert_equal_bits(got, oracle.dequantize(packed, scales, biases, group_size=64, bits=4)[ids], "gathered rows")


# ---------------------------------------------------------------- Task 3: the quantized linear layer

def quantized_weight(shape, seed, bits, group_size):
    packed, scales, biases = oracle.quantize(random_weight(shape, seed), group_size=group_size, bits=bits)
    return sol.quantize.QuantizedWeight(packed, scales, biases, group_size, bits)


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32), (4, 128)])
@pytest.mark.parametrize("x_shape", [(1, 256), (3, 5, 256)])
def test_task_3_quantized_linear_matches_quantized_matmul(bits, group_size, x_shape):
    w = quantized_weight((72, 256), seed=11, bits=bits, group_size=group_size)
    x = mx.random.normal(x_shape, key=mx.random.key(12))
    bias = mx.random.normal((72,), key=mx.random.key(13))
    fused = oracle.quantized_matmul(x, w.weight, w.scales, w.biases, transpose=True, group_size=group_size,
                                    bits=bits)
    np.testing.assert_allclose(np.array(sol.quantize.quantized_linear(x, w)), np.array(fused), atol=1e-4)
    np.testing.assert_allclose(np.array(sol.quantize.quantized_linear(x, w, bias)), np.array(fused + bias),
                               atol=1e-4)


def test_task_3_quantized_linear_rejects_wrong_width():
    w = quantized_weight((8, 128), seed=1, bits=4, group_size=64)
    with pytest.raises(ValueError, match="features"):
        sol.quantize.quantized_linear(mx.zeros((2, 64)), w)


@pytest.fixture(scope="module")
def quantized_checkpoint(model32):
    """The embedded model quantized in-process to 4 bits, group size 64, embedding included, twice: the judge's copy
    (the oracle) and the copy the code under test reads, made where it runs from the same weights
    (tests/actor_fakes/week2_models.py; MLX's quantization is deterministic).

    Layers whose input size is not a multiple of 64 (the MLP's down projection: 176 inputs) stay
    float, as in real mixed-precision checkpoints.
    """
    model, tokenizer = model32
    return here.quantized_copy(model), actor_fakes(sol, "week2_models").quantized_copy(model), tokenizer


def greedy_tokens(model, prompt_ids, max_tokens):
    """Prefill, then one token at a time with the KV cache, always the most likely token."""
    cache = model.make_cache()
    logits = model(mx.array([prompt_ids]), 0, cache)
    offset, tokens = len(prompt_ids), []
    for _ in range(max_tokens):
        token = int(mx.argmax(logits[0, -1]).item())
        tokens.append(token)
        logits = model(mx.array([[token]]), offset, cache)
        offset += 1
    return tokens


@pytest.fixture
def model_uses_solution(monkeypatch):
    # The week-2 model reaches day 2.3 through its module `quantize`; point it at the code under test
    # (a no-op against the reference), so the model runs your quantized_linear and dequantize.
    monkeypatch.setattr(sol.qwen2_week2, "quantize", sol.quantize)


def test_task_3_model_runs_quantized_checkpoint(quantized_checkpoint, model_uses_solution):
    oracle_model, mlx_model, tokenizer = quantized_checkpoint
    ours = sol.qwen2_week2.Qwen2ModelWeek2(mlx_model, keep_quantized=True)
    attn = ours.layers[0].self_attn
    assert class_of(attn.wq) is sol.quantize.QuantizedWeight, "keep_quantized keeps the weights packed"
    assert class_of(ours.embedding) is sol.quantize.QuantizedEmbedding
    prompt = tokenizer.encode("A quantized model reads a quarter of the bytes per token.")
    logits = ours(mx.array([prompt]), 0, ours.make_cache())
    with oracle.quantization_oracle():
        expected = oracle_model(mx.array([prompt]))
    np.testing.assert_allclose(np.array(logits), np.array(expected), atol=1e-3,
                               err_msg="logits against mlx-lm's own model on the same 4-bit weights")

    dequantized_on_load = sol.qwen2_week2.Qwen2ModelWeek2(mlx_model)  # mx.dequantize, then float weights
    assert greedy_tokens(ours, prompt, 12) == greedy_tokens(dequantized_on_load, prompt, 12)
