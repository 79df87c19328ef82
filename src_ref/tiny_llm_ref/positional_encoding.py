"""Rotary positional embedding (RoPE): encode a token's position by rotating pairs of its features."""

import mlx.core as mx


class RoPE:
    """Rotate each pair of features of a `N x L x H x D` tensor by an angle proportional to its position.

    Pair i turns at frequency base^(-2i/dims). `traditional=True` pairs neighbouring features
    (0,1), (2,3), ...; `traditional=False` (Qwen2's layout) pairs feature i with feature i + dims/2.
    """

    def __init__(self, dims: int, seq_len: int, base: int = 10000, traditional: bool = False):
        """`dims` is the head dimension (even), `seq_len` the most positions the model will see."""
        # BEGIN TASK Week 1 Day 2 Task 1: RoPE frequencies
        # TODO: one frequency per pair of features: base ** (-2i / dims)
        assert dims % 2 == 0, "RoPE rotates pairs of features: dims must be even"
        self.dims = dims
        self.seq_len = seq_len
        self.traditional = traditional
        half = dims // 2
        # One angular frequency per pair: fast-turning pairs for fine position, slow ones for coarse.
        self.inv_freq = base ** (-mx.arange(0, half, dtype=mx.float32) * 2.0 / dims)
        # END TASK

    def __call__(self, x: mx.array, offset: int | slice | list[int] | None = None) -> mx.array:
        """Rotate `x` (`N x L x H x D`) for positions given by `offset`.

        offset None: positions 0 .. L-1; an int p: positions p .. p+L-1; a slice: exactly those
        positions; a list of N ints: sequence n starts at offset[n].
        """
        # BEGIN TASK Week 1 Day 2 Task 1: rotate x by its positions
        # TODO: Task 1: offset None (positions 0 .. L-1), both layouts; Task 2: int, slice and per-sequence offsets
        length, d = x.shape[1], x.shape[-1]
        # The absolute position of every token: shape L (shared by the batch) or N x L (one row each).
        if offset is None:
            offset = 0
        if isinstance(offset, slice):
            start = offset.start or 0
            stop = offset.stop if offset.stop is not None else start + length
            if stop - start != length:
                raise ValueError(f"offset {offset} covers {stop - start} positions, the input has {length}")
            offset = start
        if isinstance(offset, (list, tuple, mx.array)):
            # One start position per sequence (sequences of different lengths decoding together).
            starts = offset.tolist() if isinstance(offset, mx.array) else [int(o) for o in offset]
            positions = mx.array(starts).reshape(-1, 1) + mx.arange(length)[None, :]
            last = max(starts) + length  # plain Python: checking the bound must not force an evaluation
        else:
            offset = int(offset)
            positions = mx.arange(offset, offset + length)
            last = offset + length
        if last > self.seq_len:
            raise ValueError(f"position {last - 1} is beyond this RoPE's seq_len {self.seq_len}")

        positions = positions.astype(mx.float32)
        angles = positions[..., None] * self.inv_freq  # L x D/2 or N x L x D/2
        # Line the angles up with x's N x L x H x D/2 halves: add the head axis (a shared L x 1 x D/2 broadcasts over N).
        angles = mx.expand_dims(angles, -2)
        cos, sin = mx.cos(angles), mx.sin(angles)
        if self.traditional:
            x1, x2 = x[..., 0::2], x[..., 1::2]  # neighbouring features form a pair
        else:
            x1, x2 = x[..., : d // 2], x[..., d // 2 :]  # feature i pairs with feature i + D/2
        # The 2-D rotation of (x1, x2) by the angle: [cos -sin; sin cos].
        y1 = x1 * cos - x2 * sin
        y2 = x1 * sin + x2 * cos
        if self.traditional:
            # Interleave back: (y1[0], y2[0], y1[1], y2[1], ...).
            out = mx.stack([y1, y2], axis=-1).reshape(x.shape)
        else:
            out = mx.concatenate([y1, y2], axis=-1)
        return out.astype(x.dtype)
        # END TASK
