"""Qwen2's feed-forward block: the SwiGLU MLP."""

import mlx.core as mx

from .basics import linear, silu


class Qwen2MLP:
    """down( silu(gate(x)) * up(x) ): a gated MLP that widens `dim` to `hidden_dim` and back.

    w_gate and w_up are `hidden_dim x dim`, w_down is `dim x hidden_dim` (`out x in`, no biases).
    """

    def __init__(self, dim: int, hidden_dim: int, w_gate: mx.array, w_up: mx.array, w_down: mx.array):
        """Keep the three projection weights."""
        # BEGIN TASK Week 1 Day 4 Task 2: SwiGLU MLP
        # TODO: keep the three weights
        self.dim = dim
        self.hidden_dim = hidden_dim
        self.w_gate, self.w_up, self.w_down = w_gate, w_up, w_down
        # END TASK

    def __call__(self, x: mx.array) -> mx.array:
        """`... x dim` -> `... x dim`."""
        # BEGIN TASK Week 1 Day 4 Task 2: SwiGLU MLP
        # TODO: down( silu(gate(x)) * up(x) ), with linear() and silu() from basics
        # The gate decides, feature by feature, how much of the "up" projection passes through.
        gated = silu(linear(x, self.w_gate)) * linear(x, self.w_up)
        return linear(gated, self.w_down)
        # END TASK
