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
    # TODO: per group: scale and bias (pin the larger-magnitude end), q = round((w - bias) / scale) clipped to
    # TODO: 0 .. 2**bits - 1; pack 32 // bits values per uint32, the first in the lowest bits
    raise NotImplementedError(
        "Week 2 Day 3 Task 1 (book/src/week2-03-quantized-weights.md): group-wise affine quantization, packed"
    )


def dequantize(
    w_q: mx.array, scales: mx.array, biases: mx.array, group_size: int = 64, bits: int = 4
) -> mx.array:
    """Packed `... x in*bits/32` uint32 and `... x in/group_size` scales and biases -> `... x in`.

    Every value is `scale * q + bias` of its group, in the dtype of `scales`; bit for bit what
    `mx.dequantize` returns.
    """
    # TODO: unpack the words with shifts and a mask, then scale * q + bias per group (dtype of scales)
    raise NotImplementedError("Week 2 Day 3 Task 2 (book/src/week2-03-quantized-weights.md): unpack and dequantize")


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
    # TODO: dequantize the weight, then x @ W.T + bias
    raise NotImplementedError("Week 2 Day 3 Task 3 (book/src/week2-03-quantized-weights.md): quantized linear layer")


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
