"""Week 1 Day 2: RoPE (book/src/week1-02-rope.md).

Oracle: mx.fast.rope, in both layouts, with the same offsets. mx.fast.rope wants the sequence on
axis -2 (`B x H x L x D`) while our RoPE takes `N x L x H x D`, so the tests transpose around it.
Tolerance: 1e-5 (1e-4 for positions in the thousands, where float32 angles lose digits).
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.harness import solution

sol = solution(week=1, day=2)


def oracle_rope(x, dims, traditional, base, offset):
    """mx.fast.rope on our N x L x H x D layout; `offset` an int or an array of N start positions."""
    y = mx.fast.rope(x.transpose(0, 2, 1, 3), dims, traditional=traditional, base=base, scale=1.0, offset=offset)
    return y.transpose(0, 2, 1, 3)


def assert_close(actual, expected, atol=1e-5):
    assert actual.shape == expected.shape, f"shape {actual.shape} != expected {expected.shape}"
    np.testing.assert_allclose(np.array(actual), np.array(expected), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("N, L, H, D", [(1, 1, 1, 2), (1, 8, 2, 16), (2, 13, 3, 32), (3, 5, 4, 64)])
@pytest.mark.parametrize("base", [10000, 1000000])
def test_task_1_rope_no_offset(traditional, N, L, H, D, base):
    mx.random.seed(10)
    x = mx.random.normal((N, L, H, D))
    rope = sol.positional_encoding.RoPE(D, 64, base=base, traditional=traditional)
    assert_close(rope(x), oracle_rope(x, D, traditional, base, 0))


@pytest.mark.parametrize("traditional", [False, True])
def test_task_1_rope_layouts_differ_and_keep_norms(traditional):
    mx.random.seed(11)
    x = mx.random.normal((2, 6, 2, 8))
    y = sol.positional_encoding.RoPE(8, 16, traditional=traditional)(x)
    # A rotation keeps the length of every rotated pair, hence of every head vector.
    assert_close(mx.linalg.norm(y, axis=-1), mx.linalg.norm(x, axis=-1))
    # Position 0 is not rotated at all; later positions are.
    assert_close(y[:, 0], x[:, 0])
    assert not np.allclose(np.array(y[:, 1:]), np.array(x[:, 1:]), atol=1e-3)
    # The other layout pairs different features, so it gives a different answer.
    other = oracle_rope(x, 8, not traditional, 10000, 0)
    assert not np.allclose(np.array(y), np.array(other), atol=1e-3)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("offset", [0, 1, 7, 100, 3000])
def test_task_2_rope_int_offset(traditional, offset):
    mx.random.seed(12)
    x = mx.random.normal((2, 5, 3, 16))
    rope = sol.positional_encoding.RoPE(16, 4096, base=10000, traditional=traditional)
    atol = 1e-4 if offset >= 1000 else 1e-5
    assert_close(rope(x, offset=offset), oracle_rope(x, 16, traditional, 10000, offset), atol=atol)


@pytest.mark.parametrize("traditional", [False, True])
def test_task_2_rope_slice_offset(traditional):
    mx.random.seed(13)
    x = mx.random.normal((2, 4, 2, 32))
    rope = sol.positional_encoding.RoPE(32, 64, base=1000000, traditional=traditional)
    for start in (0, 3, 20):
        expected = oracle_rope(x, 32, traditional, 1000000, start)
        assert_close(rope(x, offset=slice(start, start + 4)), expected)


@pytest.mark.parametrize("traditional", [False, True])
def test_task_2_rope_offset_per_sequence(traditional):
    mx.random.seed(14)
    offsets = [0, 5, 17, 2]
    x = mx.random.normal((4, 3, 2, 16))
    rope = sol.positional_encoding.RoPE(16, 64, base=1000000, traditional=traditional)
    expected = oracle_rope(x, 16, traditional, 1000000, mx.array(offsets))
    assert_close(rope(x, offset=offsets), expected)
    # Row by row, the same as rotating each sequence alone with an int offset.
    for n, start in enumerate(offsets):
        assert_close(rope(x, offset=offsets)[n], oracle_rope(x[n : n + 1], 16, traditional, 1000000, start)[0])


def test_task_2_rope_offset_shifts_positions():
    # Rotating positions 4..6 equals rotating 0..6 and keeping the last three: an offset is a shift.
    mx.random.seed(15)
    x = mx.random.normal((1, 7, 2, 8))
    rope = sol.positional_encoding.RoPE(8, 32)
    assert_close(rope(x[:, 4:], offset=4), rope(x)[:, 4:])
