"""Token embedding: a lookup table from token ids to vectors, and (tied) back to vocabulary logits."""

import mlx.core as mx

from .basics import linear


class Embedding:
    """A `vocab_size x embedding_dim` table; row t is the vector of token t."""

    def __init__(self, vocab_size: int, embedding_dim: int, weight: mx.array):
        """`weight` is the `vocab_size x embedding_dim` table."""
        # TODO: keep the table
        raise NotImplementedError("Week 1 Day 5 Task 3 (book/src/week1-05-qwen2-model.md): embedding")

    def __call__(self, x: mx.array) -> mx.array:
        """Token ids of any shape `...` -> vectors `... x embedding_dim`."""
        # TODO: index the table's rows with the token ids
        raise NotImplementedError("Week 1 Day 5 Task 3 (book/src/week1-05-qwen2-model.md): embedding lookup")

    def as_linear(self, x: mx.array) -> mx.array:
        """Hidden states `... x embedding_dim` -> logits `... x vocab_size` (tied input/output embedding).

        Each logit is the dot product of the hidden state with that token's embedding row.
        """
        # TODO: linear() with the table as the weight
        raise NotImplementedError("Week 1 Day 5 Task 3 (book/src/week1-05-qwen2-model.md): tied output layer")
