"""The small building blocks every layer uses: softmax, a linear layer, and the SiLU activation."""

import mlx.core as mx


def softmax(x: mx.array, axis: int) -> mx.array:
    """exp(x) / sum(exp(x)) along `axis`, computed without overflow."""
    # Subtracting the maximum changes nothing mathematically (it cancels in the ratio) but keeps
    # exp() from overflowing for large scores.
    x_max = mx.max(x, axis=axis, keepdims=True)
    e = mx.exp(x - x_max)
    return e / mx.sum(e, axis=axis, keepdims=True)


def linear(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """x @ w.T + bias, with `w` stored `out x in` as in checkpoints; `x` is `... x in`."""
    y = x @ w.T
    if bias is not None:
        y = y + bias
    return y


def silu(x: mx.array) -> mx.array:
    """SiLU (also called swish): x * sigmoid(x). Provided: the MLP of day 1.4 uses it."""
    return x * mx.sigmoid(x)
