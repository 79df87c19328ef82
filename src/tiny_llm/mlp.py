"""Qwen2's feed-forward block: the SwiGLU MLP."""

import mlx.core as mx

from .basics import linear, silu


class Qwen2MLP:
    """down( silu(gate(x)) * up(x) ): a gated MLP that widens `dim` to `hidden_dim` and back.

    w_gate and w_up are `hidden_dim x dim`, w_down is `dim x hidden_dim` (`out x in`, no biases).
    """

    def __init__(self, dim: int, hidden_dim: int, w_gate: mx.array, w_up: mx.array, w_down: mx.array):
        """Keep the three projection weights."""
        # TODO: keep the three weights
        raise NotImplementedError("Week 1 Day 4 Task 2 (book/src/week1-04-rmsnorm-and-mlp.md): SwiGLU MLP")

    def __call__(self, x: mx.array) -> mx.array:
        """`... x dim` -> `... x dim`."""
        # TODO: down( silu(gate(x)) * up(x) ), with linear() and silu() from basics
        raise NotImplementedError("Week 1 Day 4 Task 2 (book/src/week1-04-rmsnorm-and-mlp.md): SwiGLU MLP")
