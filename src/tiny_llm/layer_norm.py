"""RMSNorm: scale each token's hidden vector to unit root-mean-square, then by a learned weight."""

import mlx.core as mx


class RMSNorm:
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last axis (size `dim`)."""

    def __init__(self, dim: int, weight: mx.array, eps: float = 1e-5):
        """`weight` has shape `dim`; `eps` keeps the division finite for an all-zero vector."""
        # TODO: keep dim, weight and eps
        raise NotImplementedError("Week 1 Day 4 Task 1 (book/src/week1-04-rmsnorm-and-mlp.md): RMSNorm")

    def __call__(self, x: mx.array) -> mx.array:
        """Normalize `... x dim` -> `... x dim`, computing the mean square in float32."""
        # TODO: x / sqrt(mean(x^2) + eps) * weight, computed in float32
        raise NotImplementedError("Week 1 Day 4 Task 1 (book/src/week1-04-rmsnorm-and-mlp.md): RMSNorm")
