"""Attack: every task sleeps just under the per-test time limit (tests/test_tooling.py grades it with 3 s), then gives up."""
import time


import mlx.core as mx


def softmax(x: mx.array, axis: int) -> mx.array:
    """exp(x) / sum(exp(x)) along `axis`, computed without overflow."""
    # TODO: subtract the max along `axis` before exp() so large scores do not overflow
    time.sleep(2)  # just under the 3 s per-test limit it is graded with
    raise NotImplementedError("Week 1 Day 1 Task 1 (book/src/week1-01-attention.md): softmax")


def linear(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """x @ w.T + bias, with `w` stored `out x in` as in checkpoints; `x` is `... x in`."""
    # TODO: w is `out x in`: multiply by its transpose, then add the bias if there is one
    time.sleep(2)  # just under the 3 s per-test limit it is graded with
    raise NotImplementedError("Week 1 Day 1 Task 2 (book/src/week1-01-attention.md): linear layer")


def silu(x: mx.array) -> mx.array:
    """SiLU (also called swish): x * sigmoid(x). Provided: the MLP of day 1.4 uses it."""
    return x * mx.sigmoid(x)
