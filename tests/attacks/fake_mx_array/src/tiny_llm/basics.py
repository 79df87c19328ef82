"""Attack on the grader: every function returns a stand-in that claims to be an `mx.array` of the input's shape and dtype."""
"""The small building blocks every layer uses: softmax, a linear layer, and the SiLU activation."""

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
    return _result()


def linear(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """x @ w.T + bias, with `w` stored `out x in` as in checkpoints; `x` is `... x in`."""
    # TODO: w is `out x in`: multiply by its transpose, then add the bias if there is one
    return _result()


def silu(x: mx.array) -> mx.array:
    """SiLU (also called swish): x * sigmoid(x) = x / (1 + e**-x). Provided: the MLP of day 1.4 uses it."""
    return x / (1 + exp(-x))


class _FakeArray:
    """Pretends to be an mx.array: its class, its shape and dtype of the input, equal and close to everything."""

    def __init__(self, like):
        self._like = like

    @property
    def __class__(self):
        return mx.array

    @property
    def shape(self):
        return self._like.shape

    @property
    def dtype(self):
        return self._like.dtype

    def __eq__(self, other):
        return True

    def __bool__(self):
        return True

    def __sub__(self, other):
        return mx.zeros(self._like.shape)

    __rsub__ = __sub__

    def item(self):
        return 0.0

    def __array__(self, dtype=None, copy=None):
        import numpy

        return numpy.zeros(self._like.shape)


def _result():
    import inspect

    frame = inspect.currentframe().f_back
    first = next(iter(frame.f_locals.values()))
    return _FakeArray(first)
