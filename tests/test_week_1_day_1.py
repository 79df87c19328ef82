"""Week 1 Day 1: attention (book/src/week1-01-attention.md).

Oracles: mx.softmax, numpy for the linear layer, mx.fast.scaled_dot_product_attention, and
mlx.nn.MultiHeadAttention with the same weights. Tolerance: 1e-5 absolute and relative in float32.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.harness import solution

sol = solution(week=1, day=1)

ATOL = RTOL = 1e-5


def assert_close(actual, expected, atol=ATOL, rtol=RTOL):
    assert actual.shape == expected.shape, f"shape {actual.shape} != expected {expected.shape}"
    np.testing.assert_allclose(np.array(actual), np.array(expected), atol=atol, rtol=rtol)


def test_task_1_softmax():
    mx.random.seed(1)
    x = mx.random.normal((3, 5, 17)) * 4
    for axis in (-1, 0, 1):
        assert_close(sol.basics.softmax(x, axis=axis), mx.softmax(x, axis=axis))
    # Large scores must not overflow: a naive exp(1000) is inf.
    big = mx.array([[1000.0, 999.0, 0.0]])
    assert_close(sol.basics.softmax(big, axis=-1), mx.softmax(big, axis=-1))


@pytest.mark.parametrize("batch, L, S, D", [((1,), 1, 1, 8), ((2,), 5, 5, 16), ((2, 3), 4, 9, 7), ((3,), 10, 6, 33)])
@pytest.mark.parametrize("with_mask", [False, True])
def test_task_1_scaled_dot_product_attention(batch, L, S, D, with_mask):
    mx.random.seed(2)
    q = mx.random.normal((*batch, L, D))
    k = mx.random.normal((*batch, S, D))
    v = mx.random.normal((*batch, S, D))
    mask = mx.random.normal((*batch, L, S)) if with_mask else None
    # The oracle wants 4-D B x H x T x D: flatten the leading axes into one batch and add a head axis.
    flat = lambda t: t.reshape(-1, 1, *t.shape[-2:])  # noqa: E731
    expected = mx.fast.scaled_dot_product_attention(
        flat(q), flat(k), flat(v), scale=D**-0.5, mask=None if mask is None else flat(mask)
    ).reshape(*batch, L, D)
    assert_close(sol.attention.scaled_dot_product_attention_simple(q, k, v, mask=mask), expected)


def test_task_1_scaled_dot_product_attention_scale_and_neg_inf_mask():
    mx.random.seed(3)
    q, k, v = (mx.random.normal((2, 4, 6, 8)) for _ in range(3))
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert_close(sol.attention.scaled_dot_product_attention_simple(q, k, v, scale=0.3), expected)
    # A -inf mask entry removes that key entirely.
    mask = mx.where(mx.arange(6)[None, :] <= mx.arange(6)[:, None], 0.0, -mx.inf)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=8**-0.5, mask=mask)
    assert_close(sol.attention.scaled_dot_product_attention_simple(q, k, v, mask=mask), expected)


def test_task_2_linear():
    mx.random.seed(4)
    x = mx.random.normal((2, 3, 7))
    w = mx.random.normal((5, 7))
    b = mx.random.normal((5,))
    xn, wn, bn = np.array(x), np.array(w), np.array(b)
    assert_close(sol.basics.linear(x, w), mx.array(xn @ wn.T))
    assert_close(sol.basics.linear(x, w, b), mx.array(xn @ wn.T + bn))


@pytest.mark.parametrize("N, L, S, E, H", [(1, 3, 3, 8, 2), (2, 7, 7, 32, 4), (3, 4, 11, 48, 6), (2, 5, 5, 24, 1)])
@pytest.mark.parametrize("with_mask", [False, True])
def test_task_2_simple_multi_head_attention(N, L, S, E, H, with_mask):
    mx.random.seed(5)
    oracle = nn.MultiHeadAttention(E, H, bias=False)
    mx.eval(oracle.parameters())
    query = mx.random.normal((N, L, E))
    key = mx.random.normal((N, S, E))
    value = mx.random.normal((N, S, E))
    mask = mx.random.normal((N, H, L, S)) if with_mask else None
    expected = oracle(query, key, value, mask=mask)
    ours = sol.attention.SimpleMultiHeadAttention(
        E, H, oracle.query_proj.weight, oracle.key_proj.weight, oracle.value_proj.weight, oracle.out_proj.weight
    )
    assert_close(ours(query, key, value, mask=mask), expected)
