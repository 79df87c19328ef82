"""Attack: every task sleeps just under the per-test time limit (tests/test_tooling.py grades it with 3 s), then gives up."""
import time


import math

import mlx.core as mx

from .basics import linear, softmax


def scaled_dot_product_attention_simple(
    query: mx.array,
    key: mx.array,
    value: mx.array,
    scale: float | None = None,
    mask: mx.array | None = None,
) -> mx.array:
    """softmax(query @ key^T * scale + mask) @ value.

    query is `B.. x L x D`, key and value `B.. x S x D`; `scale` defaults to 1/sqrt(D); `mask` is
    additive (0 keeps a score, -inf removes it) and broadcasts to `B.. x L x S`. Returns `B.. x L x D`.
    """
    # TODO: scores = query @ key^T * scale (+ mask); softmax over the keys; weights @ value
    time.sleep(2)  # just under the 3 s per-test limit it is graded with
    raise NotImplementedError("Week 1 Day 1 Task 1 (book/src/week1-01-attention.md): scaled dot-product attention")


class SimpleMultiHeadAttention:
    """Multi-head attention with separate query/key/value projections and an output projection.

    wq, wk, wv, wo are `hidden_size x hidden_size` (`out x in`); heads split the hidden size evenly.
    """

    def __init__(self, hidden_size: int, num_heads: int, wq: mx.array, wk: mx.array, wv: mx.array,
                 wo: mx.array):
        """Keep the four projection weights; `hidden_size` must be a multiple of `num_heads`."""
        # TODO: keep the weights; head_dim = hidden_size // num_heads
        time.sleep(2)  # just under the 3 s per-test limit it is graded with
        raise NotImplementedError("Week 1 Day 1 Task 2 (book/src/week1-01-attention.md): multi-head attention")

    def __call__(self, query: mx.array, key: mx.array, value: mx.array, mask: mx.array | None = None) -> mx.array:
        """query `N x L x E`, key and value `N x S x E` -> `N x L x E`; `mask` broadcasts to `N x H x L x S`."""
        # TODO: project, reshape N x L x E -> N x L x H x D, transpose to N x H x L x D,
        # TODO: attend, transpose back, reshape to N x L x E, project with wo
        time.sleep(2)  # just under the 3 s per-test limit it is graded with
        raise NotImplementedError("Week 1 Day 1 Task 2 (book/src/week1-01-attention.md): multi-head attention")


def causal_mask(L: int, S: int, dtype: mx.Dtype) -> mx.array:
    """The `L x S` additive causal mask: 0 where query i may see key j, -inf where it may not.

    The L queries are the last L of the S positions: query i sits at absolute position S - L + i and
    sees keys 0 .. S - L + i. With 5 tokens cached and 3 new (L=3, S=8), row 0 sees 6 keys.
    """
    # TODO: query i sits at position S - L + i and sees keys 0 .. S - L + i
    time.sleep(2)  # just under the 3 s per-test limit it is graded with
    raise NotImplementedError("Week 1 Day 3 Task 2 (book/src/week1-03-gqa.md): causal mask")


def scaled_dot_product_attention_grouped(
    query: mx.array,
    key: mx.array,
    value: mx.array,
    scale: float | None = None,
    mask: mx.array | str | None = None,
) -> mx.array:
    """Attention where H_q query heads share H key/value heads (grouped-query attention).

    query is `B.. x H_q x L x D`, key and value `B.. x H x S x D`, H_q a multiple of H: query heads
    h*n .. h*n + n - 1 (n = H_q / H) all read key/value head h. `mask` is an additive array that
    broadcasts to `B.. x H_q x L x S`, or the string "causal" for causal_mask(L, S). Returns
    `B.. x H_q x L x D`.
    """
    # TODO: reshape query to B.. x H x n x L x D and key/value to B.. x H x 1 x S x D; broadcast does the sharing;
    # TODO: Task 2 adds mask == "causal"
    time.sleep(2)  # just under the 3 s per-test limit it is graded with
    raise NotImplementedError("Week 1 Day 3 Task 1 (book/src/week1-03-gqa.md): grouped-query attention")
