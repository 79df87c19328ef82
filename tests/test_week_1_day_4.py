"""Week 1 Day 4: RMSNorm and the SwiGLU MLP (book/src/week1-04-rmsnorm-and-mlp.md).

Oracles: mx.fast.rms_norm, and mlx-lm's Qwen2 MLP module holding the same weights.
Tolerance: 1e-5 in float32 (1e-2 for a float16 input).
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import qwen2 as mlx_qwen2

from tests.harness import solution

sol = solution(week=1, day=4)


def assert_close(actual, expected, atol=1e-5, rtol=1e-5):
    assert actual.shape == expected.shape, f"shape {actual.shape} != expected {expected.shape}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != expected {expected.dtype}"
    np.testing.assert_allclose(np.array(actual.astype(mx.float32)), np.array(expected.astype(mx.float32)),
                               atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", [(1, 8), (2, 5, 64), (3, 7), (2, 3, 4, 33)])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_task_1_rms_norm(shape, eps):
    mx.random.seed(30)
    x = mx.random.normal(shape) * 3
    weight = mx.random.normal((shape[-1],))
    ours = sol.layer_norm.RMSNorm(shape[-1], weight, eps=eps)
    assert_close(ours(x), mx.fast.rms_norm(x, weight, eps))


def test_task_1_rms_norm_eps_and_half_precision():
    # eps matters for tiny inputs: an all-zero row stays zero instead of becoming nan.
    zeros = mx.zeros((2, 16))
    out = sol.layer_norm.RMSNorm(16, mx.ones((16,)), eps=1e-5)(zeros)
    assert not np.isnan(np.array(out)).any()
    small = mx.full((1, 4), 1e-3)
    assert_close(sol.layer_norm.RMSNorm(4, mx.ones((4,)), eps=1e-5)(small), mx.fast.rms_norm(small, mx.ones((4,)), 1e-5))
    # A float16 input comes back as float16, computed without overflow (300^2 overflows float16).
    x = (mx.random.normal((3, 32)) * 300).astype(mx.float16)
    w = mx.random.normal((32,)).astype(mx.float16)
    assert_close(sol.layer_norm.RMSNorm(32, w, eps=1e-6)(x), mx.fast.rms_norm(x, w, 1e-6), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dim, hidden_dim, shape", [(8, 16, (1, 1)), (32, 88, (2, 5)), (64, 176, (3, 4)), (24, 7, (2, 1))])
def test_task_2_qwen2_mlp(dim, hidden_dim, shape):
    mx.random.seed(31)
    oracle = mlx_qwen2.MLP(dim, hidden_dim)
    mx.eval(oracle.parameters())
    x = mx.random.normal((*shape, dim))
    ours = sol.mlp.Qwen2MLP(dim, hidden_dim, oracle.gate_proj.weight, oracle.up_proj.weight, oracle.down_proj.weight)
    assert_close(ours(x), oracle(x))


def test_task_2_qwen2_mlp_gate_and_up_are_not_interchangeable():
    # silu(gate) * up is not symmetric: swapping the two weights must change the answer.
    mx.random.seed(32)
    oracle = mlx_qwen2.MLP(16, 24)
    mx.eval(oracle.parameters())
    x = mx.random.normal((2, 3, 16))
    swapped = sol.mlp.Qwen2MLP(16, 24, oracle.up_proj.weight, oracle.gate_proj.weight, oracle.down_proj.weight)
    assert not np.allclose(np.array(swapped(x)), np.array(oracle(x)), atol=1e-3)
