"""RMSNorm: scale each token's hidden vector to unit root-mean-square, then by a learned weight."""

import mlx.core as mx


class RMSNorm:
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last axis (size `dim`)."""

    def __init__(self, dim: int, weight: mx.array, eps: float = 1e-5):
        """`weight` has shape `dim`; `eps` keeps the division finite for an all-zero vector."""
        # BEGIN TASK Week 1 Day 4 Task 1: RMSNorm
        # TODO: keep dim, weight and eps
        self.dim = dim
        self.weight = weight
        self.eps = eps
        # END TASK

    def __call__(self, x: mx.array) -> mx.array:
        """Normalize `... x dim` -> `... x dim`, computing the mean square in float32."""
        # BEGIN TASK Week 1 Day 4 Task 1: RMSNorm
        # TODO: x / sqrt(mean(x^2) + eps) * weight, computed in float32
        # Squares of half-precision values overflow or lose precision quickly: work in float32.
        x32 = x.astype(mx.float32)
        mean_square = mx.mean(x32 * x32, axis=-1, keepdims=True)
        normalized = x32 * mx.rsqrt(mean_square + self.eps)
        return (normalized * self.weight.astype(mx.float32)).astype(x.dtype)
        # END TASK
