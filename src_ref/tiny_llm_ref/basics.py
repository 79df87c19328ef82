"""The small building blocks every layer uses: softmax, a linear layer, and the SiLU activation."""

import mlx.core as mx


def softmax(x: mx.array, axis: int) -> mx.array:
    """exp(x) / sum(exp(x)) along `axis`, computed without overflow."""
    # BEGIN TASK Week 1 Day 1 Task 1: softmax
    # TODO: subtract the max along `axis` before exp() so large scores do not overflow
    # Subtracting the maximum changes nothing mathematically (it cancels in the ratio) but keeps
    # exp() from overflowing for large scores.
    x_max = mx.max(x, axis=axis, keepdims=True)
    e = mx.exp(x - x_max)
    return e / mx.sum(e, axis=axis, keepdims=True)
    # END TASK


def linear(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """x @ w.T + bias, with `w` stored `out x in` as in checkpoints; `x` is `... x in`."""
    # BEGIN TASK Week 1 Day 1 Task 2: linear layer
    # TODO: w is `out x in`: multiply by its transpose, then add the bias if there is one
    y = x @ w.T
    if bias is not None:
        y = y + bias
    return y
    # END TASK


def silu(x: mx.array) -> mx.array:
    """SiLU (also called swish): x * sigmoid(x). Provided: the MLP of day 1.4 uses it."""
    return x * mx.sigmoid(x)
