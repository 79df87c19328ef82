"""Token embedding: a lookup table from token ids to vectors, and (tied) back to vocabulary logits."""

import mlx.core as mx

from .basics import linear


class Embedding:
    """A `vocab_size x embedding_dim` table; row t is the vector of token t."""

    def __init__(self, vocab_size: int, embedding_dim: int, weight: mx.array):
        """`weight` is the `vocab_size x embedding_dim` table."""
        self.vocab_size = vocab_size
        self.embedding_dim = embedding_dim
        self.weight = weight

    def __call__(self, x: mx.array) -> mx.array:
        """Token ids of any shape `...` -> vectors `... x embedding_dim`."""
        return self.weight[x]

    def as_linear(self, x: mx.array) -> mx.array:
        """Hidden states `... x embedding_dim` -> logits `... x vocab_size` (tied input/output embedding).

        Each logit is the dot product of the hidden state with that token's embedding row.
        """
        return linear(x, self.weight)
