"""Token embedding: a lookup table from token ids to vectors, and (tied) back to vocabulary logits."""

import mlx.core as mx

from .basics import linear


class Embedding:
    """A `vocab_size x embedding_dim` table; row t is the vector of token t."""

    def __init__(self, vocab_size: int, embedding_dim: int, weight: mx.array):
        """`weight` is the `vocab_size x embedding_dim` table."""
        # BEGIN TASK Week 1 Day 5 Task 3: embedding
        # TODO: keep the table
        self.vocab_size = vocab_size
        self.embedding_dim = embedding_dim
        self.weight = weight
        # END TASK

    def __call__(self, x: mx.array) -> mx.array:
        """Token ids of any shape `...` -> vectors `... x embedding_dim`."""
        # BEGIN TASK Week 1 Day 5 Task 3: embedding lookup
        # TODO: index the table's rows with the token ids
        return self.weight[x]
        # END TASK

    def as_linear(self, x: mx.array) -> mx.array:
        """Hidden states `... x embedding_dim` -> logits `... x vocab_size` (tied input/output embedding).

        Each logit is the dot product of the hidden state with that token's embedding row.
        """
        # BEGIN TASK Week 1 Day 5 Task 3: tied output layer
        # TODO: linear() with the table as the weight
        return linear(x, self.weight)
        # END TASK
