"""Week 1 Day 3: grouped-query attention and the causal mask (book/src/week1-03-gqa.md).

Oracles: mx.fast.scaled_dot_product_attention (which supports grouped heads and a "causal" mask with
lower-right alignment, the same convention as ours) and a causal mask written out in numpy.
Tolerance: 1e-5 in float32.
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.harness import solution

sol = solution(week=1, day=3)


def assert_close(actual, expected, atol=1e-5):
    assert actual.shape == expected.shape, f"shape {actual.shape} != expected {expected.shape}"
    np.testing.assert_allclose(np.array(actual), np.array(expected), atol=atol, rtol=1e-5)


def random_qkv(B, H_q, H, L, S, D, seed):
    mx.random.seed(seed)
    return mx.random.normal((B, H_q, L, D)), mx.random.normal((B, H, S, D)), mx.random.normal((B, H, S, D))


@pytest.mark.parametrize(
    "B, H_q, H, L, S, D",
    [(1, 2, 2, 3, 3, 8), (2, 4, 2, 5, 5, 16), (2, 6, 2, 3, 7, 8), (3, 8, 1, 4, 4, 12), (1, 14, 2, 9, 9, 64),
     (2, 6, 3, 1, 10, 5)],
)
def test_task_1_grouped_attention(B, H_q, H, L, S, D):
    q, k, v = random_qkv(B, H_q, H, L, S, D, seed=20)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5)
    assert_close(sol.attention.scaled_dot_product_attention_grouped(q, k, v), expected)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.7)
    assert_close(sol.attention.scaled_dot_product_attention_grouped(q, k, v, scale=0.7), expected)


@pytest.mark.parametrize("mask_shape", ["L S", "B 1 L S", "B H_q L S", "1 H_q L S"])
def test_task_1_grouped_attention_mask_broadcast(mask_shape):
    B, H_q, H, L, S, D = 2, 6, 2, 4, 7, 8
    q, k, v = random_qkv(B, H_q, H, L, S, D, seed=21)
    sizes = {"B": B, "H_q": H_q, "L": L, "S": S, "1": 1}
    mask = mx.random.normal(tuple(sizes[n] for n in mask_shape.split()))
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)
    assert_close(sol.attention.scaled_dot_product_attention_grouped(q, k, v, mask=mask), expected)


def test_task_1_grouped_attention_extra_batch_axes():
    # B.. may be more than one axis: 2 x 3 x H x L x D.
    mx.random.seed(22)
    q = mx.random.normal((2, 3, 4, 5, 8))
    k = mx.random.normal((2, 3, 2, 6, 8))
    v = mx.random.normal((2, 3, 2, 6, 8))
    flat = lambda t: t.reshape(6, *t.shape[2:])  # noqa: E731
    expected = mx.fast.scaled_dot_product_attention(flat(q), flat(k), flat(v), scale=8**-0.5).reshape(2, 3, 4, 5, 8)
    assert_close(sol.attention.scaled_dot_product_attention_grouped(q, k, v), expected)


def test_task_1_grouped_attention_shares_kv_heads_in_order():
    # Query heads 0..n-1 read key/value head 0, heads n..2n-1 head 1 (not round-robin).
    mx.random.seed(23)
    B, H_q, H, L, S, D = 1, 4, 2, 3, 3, 8
    q, k, v = random_qkv(B, H_q, H, L, S, D, seed=23)
    repeated_k, repeated_v = mx.repeat(k, 2, axis=1), mx.repeat(v, 2, axis=1)
    expected = mx.fast.scaled_dot_product_attention(q, repeated_k, repeated_v, scale=D**-0.5)
    assert_close(sol.attention.scaled_dot_product_attention_grouped(q, k, v), expected)


def test_task_1_grouped_attention_keeps_half_precision():
    # Real checkpoints run in float16/bfloat16 on a GPU: a float32 mask must not turn the output float32.
    q, k, v = (t.astype(mx.float16) for t in random_qkv(2, 4, 2, 3, 5, 8, seed=25))
    mask = mx.random.normal((3, 5))
    out = sol.attention.scaled_dot_product_attention_grouped(q, k, v, mask=mask)
    assert out.dtype == mx.float16
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=8**-0.5, mask=mask.astype(mx.float16))
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(expected.astype(mx.float32)), atol=1e-2)


def numpy_causal_mask(L, S):
    mask = np.full((L, S), -np.inf, dtype=np.float32)
    for i in range(L):
        mask[i, : S - L + i + 1] = 0.0
    return mask


@pytest.mark.parametrize("L, S", [(1, 1), (4, 4), (3, 8), (1, 9), (7, 10)])
def test_task_2_causal_mask(L, S):
    mask = sol.attention.causal_mask(L, S, mx.float32)
    assert mask.shape == (L, S)
    assert mask.dtype == mx.float32
    np.testing.assert_array_equal(np.array(mask), numpy_causal_mask(L, S))


def test_task_2_causal_mask_cached_example_and_dtype():
    # The course's example: 5 tokens cached, 3 new -> row 0 sees 6 keys, row 2 sees all 8.
    mask = np.array(sol.attention.causal_mask(3, 8, mx.float32))
    assert [(row == 0).sum() for row in mask] == [6, 7, 8]
    assert sol.attention.causal_mask(2, 3, mx.float16).dtype == mx.float16


@pytest.mark.parametrize("B, H_q, H, L, S, D", [(2, 4, 2, 6, 6, 8), (1, 6, 3, 3, 9, 16), (2, 8, 2, 1, 5, 8)])
def test_task_2_grouped_attention_causal(B, H_q, H, L, S, D):
    q, k, v = random_qkv(B, H_q, H, L, S, D, seed=24)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal")
    assert_close(sol.attention.scaled_dot_product_attention_grouped(q, k, v, mask="causal"), expected)
    # The named mask and the explicit array are the same thing.
    explicit = sol.attention.causal_mask(L, S, mx.float32)
    assert_close(sol.attention.scaled_dot_product_attention_grouped(q, k, v, mask=explicit), expected)
