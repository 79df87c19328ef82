"""Quantized weights: group-wise affine quantization to 4 or 8 bits, in MLX's layout.

A weight `w` (`out x in`) is cut, row by row, into groups of `group_size` consecutive input features.
Each group gets its own `scale` and `bias`, and each value becomes an integer `q` in 0 .. 2**bits - 1
with `w ~ scale * q + bias`. The integers are packed 32 // bits to a uint32 word, the first value in
the lowest bits. So a 4-bit weight is `out x in/8` words plus `out x in/group_size` scales and biases,
the layout of `mx.quantize` and of every quantized MLX checkpoint.
"""

from __future__ import annotations  # annotations stay text, so the skeleton's signatures read as the reference's

from dataclasses import dataclass

import mlx.core as mx

from .basics import linear


def quantize(w: mx.array, group_size: int = 64, bits: int = 4) -> tuple[mx.array, mx.array, mx.array]:
    """`w` (`out x in`) -> (packed `out x in*bits/32` uint32, scales and biases `out x in/group_size`).

    Bit for bit what `mx.quantize(w, group_size, bits)` returns; scales and biases keep `w`'s dtype.
    """
    # BEGIN TASK Week 2 Day 3 Task 1: group-wise affine quantization, packed
    # TODO: per group: scale and bias (pin the larger-magnitude end), q = round((w - bias) / scale) clipped to
    # TODO: 0 .. 2**bits - 1; pack 32 // bits values per uint32, the first in the lowest bits
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits!r}")
    if w.ndim != 2 or w.shape[-1] % group_size != 0:
        raise ValueError(f"w must be 2-D with a last axis that is a multiple of group_size={group_size}, "
                         f"not {w.shape}")
    out_features, in_features = w.shape
    groups = w.astype(mx.float32).reshape(out_features, in_features // group_size, group_size)
    w_max = groups.max(axis=-1, keepdims=True)
    w_min = groups.min(axis=-1, keepdims=True)
    levels = 2**bits - 1
    # The step between two levels spans the group's range; never 0, so a constant group stays finite.
    scales = mx.maximum((w_max - w_min) / levels, 1e-7)
    # Pin the group's larger-magnitude end (its "edge") exactly on a level: the scale takes the sign
    # that makes q=0 land on the edge, then shrinks a little so the edge is a whole number of steps
    # from zero. That is what MLX does, and it keeps the largest weights exact.
    min_is_edge = mx.abs(w_min) > mx.abs(w_max)
    scales = mx.where(min_is_edge, scales, -scales)
    edge = mx.where(min_is_edge, w_min, w_max)
    edge_steps = mx.round(edge / scales)
    scales = mx.where(edge_steps != 0, edge / edge_steps, scales)
    biases = mx.where(edge_steps == 0, 0, edge)

    q = mx.clip(mx.round((groups - biases) / scales), 0, levels).astype(mx.uint32)
    # Pack: value j of each run of 32 // bits shifts left by j * bits; the shifted values never
    # overlap, so their sum is their bitwise or.
    per_word = 32 // bits
    q = q.reshape(out_features, in_features // per_word, per_word)
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    packed = (q << shifts).sum(axis=-1).astype(mx.uint32)
    return packed, scales.squeeze(-1).astype(w.dtype), biases.squeeze(-1).astype(w.dtype)
    # END TASK


def dequantize(
    w_q: mx.array, scales: mx.array, biases: mx.array, group_size: int = 64, bits: int = 4
) -> mx.array:
    """Packed `... x in*bits/32` uint32 and `... x in/group_size` scales and biases -> `... x in`.

    Every value is `scale * q + bias` of its group, in the dtype of `scales`; bit for bit what
    `mx.dequantize` returns.
    """
    # BEGIN TASK Week 2 Day 3 Task 2: unpack and dequantize
    # TODO: unpack the words with shifts and a mask, then scale * q + bias per group (dtype of scales)
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits!r}")
    *rest, words = w_q.shape
    per_word = 32 // bits
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    # Unpack: shift each word right by 0, bits, 2*bits, ... and keep the low `bits` bits.
    q = (w_q[..., None] >> shifts) & (2**bits - 1)  # ... x words x per_word
    in_features = words * per_word
    q = q.reshape(*rest, in_features // group_size, group_size).astype(scales.dtype)
    w = scales[..., None] * q + biases[..., None]
    return w.reshape(*rest, in_features)
    # END TASK


@dataclass
class QuantizedWeight:
    """A weight kept quantized: the packed integers, the per-group scales and biases, and the format."""

    weight: mx.array  # out x in*bits/32, uint32
    scales: mx.array  # out x in/group_size
    biases: mx.array  # out x in/group_size
    group_size: int
    bits: int

    @classmethod
    def from_mlx_layer(cls, mlx_layer) -> QuantizedWeight:
        """The quantized weight of an mlx-lm QuantizedLinear or QuantizedEmbedding (affine mode)."""
        mode = getattr(mlx_layer, "mode", "affine")
        if mode != "affine":
            raise ValueError(f"only affine quantization is supported, not mode={mode!r}")
        return cls(mlx_layer.weight, mlx_layer.scales, mlx_layer.biases, mlx_layer.group_size, mlx_layer.bits)

    @property
    def shape(self) -> tuple[int, int]:
        """`out x in` of the float weight it stands for."""
        out_features, words = self.weight.shape
        return out_features, words * 32 // self.bits

    def nbytes(self) -> int:
        """Bytes it occupies: the packed integers plus the scales and biases."""
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes


def quantized_linear(x: mx.array, w: QuantizedWeight, bias: mx.array | None = None) -> mx.array:
    """x @ W.T + bias, where W is the float weight that `w` stands for; `x` is `... x in`.

    Dequantize, then multiply: readable, but it writes a float copy of the weight on every call,
    which the fused `mx.quantized_matmul` never does.
    """
    # BEGIN TASK Week 2 Day 3 Task 3: quantized linear layer
    # TODO: dequantize the weight, then x @ W.T + bias
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but the weight takes {w.shape[1]}")
    w_float = dequantize(w.weight, w.scales, w.biases, w.group_size, w.bits)
    return linear(x, w_float, bias)
    # END TASK


class QuantizedEmbedding:
    """The token embedding, kept quantized: a lookup dequantizes only the rows it reads (provided)."""

    def __init__(self, weight: QuantizedWeight):
        """`weight` stands for the `vocab_size x embedding_dim` table."""
        self.weight = weight
        self.vocab_size, self.embedding_dim = weight.shape

    def __call__(self, x: mx.array) -> mx.array:
        """Token ids of any shape `...` -> vectors `... x embedding_dim`."""
        w = self.weight
        return dequantize(w.weight[x], w.scales[x], w.biases[x], w.group_size, w.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        """Hidden states `... x embedding_dim` -> logits `... x vocab_size` (tied output layer)."""
        return quantized_linear(x, self.weight)
