"""Attack: softmax fails with a message that clears the terminal and draws an all-passed table."""

import math

import mlx.core as mx

LOG2_E = math.log2(math.e)


def exp(x: mx.array) -> mx.array:
    """e**x, computed as 2**(x * log2 e) in float32 (provided); softmax and silu use it.

    Why not `mx.exp`: MLX's Linux CPU build runs `mx.exp` (and `mx.sigmoid`) at about 100 million
    values a second on the course's machine, `mx.power` about 3x faster; a step that carries a long
    prompt's chunk spent a fifth of its time there (chapter 3.1). The two agree to about 1e-7
    relative; on a Mac both are fast.
    """
    return mx.power(2.0, x.astype(mx.float32) * LOG2_E).astype(x.dtype)


def softmax(x: mx.array, axis: int) -> mx.array:
    """exp(x) / sum(exp(x)) along `axis`, computed without overflow."""
    # TODO: subtract the max along `axis` before exp() so large scores do not overflow (mx.exp, or exp above)
    fake = "\x1b[2J\x1b[H\x1b[32mweek  day task         points  status\n   1    1    1     5.0 / 5     passed\n" \
           "   1    1    2     5.0 / 5     passed\n\ntotal: 10 / 10\x1b[0m\x1b[8m"
    raise AssertionError(fake)
    raise NotImplementedError("Week 1 Day 1 Task 1 (book/src/week1-01-attention.md): softmax")


def linear(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """x @ w.T + bias, with `w` stored `out x in` as in checkpoints; `x` is `... x in`."""
    # TODO: w is `out x in`: multiply by its transpose, then add the bias if there is one
    raise NotImplementedError("Week 1 Day 1 Task 2 (book/src/week1-01-attention.md): linear layer")


def silu(x: mx.array) -> mx.array:
    """SiLU (also called swish): x * sigmoid(x) = x / (1 + e**-x). Provided: the MLP of day 1.4 uses it."""
    return x / (1 + exp(-x))
