"""Rotary positional embedding (RoPE): encode a token's position by rotating pairs of its features."""

import mlx.core as mx


class RoPE:
    """Rotate each pair of features of a `N x L x H x D` tensor by an angle proportional to its position.

    Pair i turns at frequency base^(-2i/dims). `traditional=True` pairs neighbouring features
    (0,1), (2,3), ...; `traditional=False` (Qwen2's layout) pairs feature i with feature i + dims/2.
    """

    def __init__(self, dims: int, seq_len: int, base: int = 10000, traditional: bool = False):
        """`dims` is the head dimension (even), `seq_len` the most positions the model will see."""
        # TODO: one frequency per pair of features: base ** (-2i / dims)
        raise NotImplementedError("Week 1 Day 2 Task 1 (book/src/week1-02-rope.md): RoPE frequencies")

    def __call__(self, x: mx.array, offset: int | slice | list[int] | None = None) -> mx.array:
        """Rotate `x` (`N x L x H x D`) for positions given by `offset`.

        offset None: positions 0 .. L-1; an int p: positions p .. p+L-1; a slice: exactly those
        positions; a list of N ints: sequence n starts at offset[n].
        """
        # TODO: Task 1: offset None (positions 0 .. L-1), both layouts; Task 2: int, slice and per-sequence offsets
        raise NotImplementedError("Week 1 Day 2 Task 1 (book/src/week1-02-rope.md): rotate x by its positions")
