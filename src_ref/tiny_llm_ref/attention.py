"""Attention: scaled dot-product attention, multi-head attention, the causal mask and grouped-query attention.

Shapes: queries are `B.. x H x L x D`, keys and values `B.. x H x S x D` (L queries attend over S keys).
"""

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
    # BEGIN TASK Week 1 Day 1 Task 1: scaled dot-product attention
    # TODO: scores = query @ key^T * scale (+ mask); softmax over the keys; weights @ value
    factor = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = (query @ key.swapaxes(-2, -1)) * factor  # B.. x L x S: how well query i matches key j
    if mask is not None:
        scores = scores + mask.astype(scores.dtype)
    weights = softmax(scores, axis=-1)  # each query's weights over the keys sum to 1
    return weights @ value
    # END TASK


class SimpleMultiHeadAttention:
    """Multi-head attention with separate query/key/value projections and an output projection.

    wq, wk, wv, wo are `hidden_size x hidden_size` (`out x in`); heads split the hidden size evenly.
    """

    def __init__(self, hidden_size: int, num_heads: int, wq: mx.array, wk: mx.array, wv: mx.array,
                 wo: mx.array):
        """Keep the four projection weights; `hidden_size` must be a multiple of `num_heads`."""
        # BEGIN TASK Week 1 Day 1 Task 2: multi-head attention
        # TODO: keep the weights; head_dim = hidden_size // num_heads
        assert hidden_size % num_heads == 0, "hidden_size must split evenly into heads"
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        # END TASK

    def __call__(self, query: mx.array, key: mx.array, value: mx.array, mask: mx.array | None = None) -> mx.array:
        """query `N x L x E`, key and value `N x S x E` -> `N x L x E`; `mask` broadcasts to `N x H x L x S`."""
        # BEGIN TASK Week 1 Day 1 Task 2: multi-head attention
        # TODO: project, reshape N x L x E -> N x L x H x D, transpose to N x H x L x D,
        # TODO: attend, transpose back, reshape to N x L x E, project with wo
        n, l, _ = query.shape
        s = key.shape[1]
        # Project, then split E into H heads of D and move the head axis in front of the sequence:
        # N x L x E -> N x L x H x D -> N x H x L x D, so each head attends on its own.
        q = linear(query, self.wq).reshape(n, l, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = linear(key, self.wk).reshape(n, s, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = linear(value, self.wv).reshape(n, s, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        out = scaled_dot_product_attention_simple(q, k, v, mask=mask)
        # Put the heads back side by side (N x L x H*D) and mix them with the output projection.
        out = out.transpose(0, 2, 1, 3).reshape(n, l, self.hidden_size)
        return linear(out, self.wo)
        # END TASK


def causal_mask(L: int, S: int, dtype: mx.Dtype) -> mx.array:
    """The `L x S` additive causal mask: 0 where query i may see key j, -inf where it may not.

    The L queries are the last L of the S positions: query i sits at absolute position S - L + i and
    sees keys 0 .. S - L + i. With 5 tokens cached and 3 new (L=3, S=8), row 0 sees 6 keys.
    """
    # BEGIN TASK Week 1 Day 3 Task 2: causal mask
    # TODO: query i sits at position S - L + i and sees keys 0 .. S - L + i
    query_positions = mx.arange(L)[:, None] + (S - L)
    key_positions = mx.arange(S)[None, :]
    allowed = key_positions <= query_positions
    return mx.where(allowed, mx.array(0.0, dtype=dtype), mx.array(-mx.inf, dtype=dtype))
    # END TASK


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
    # BEGIN TASK Week 1 Day 3 Task 1: grouped-query attention
    # TODO: reshape query to B.. x H x n x L x D and key/value to B.. x H x 1 x S x D; broadcast does the sharing;
    # TODO: Task 2 adds mask == "causal"
    *batch, h_q, l, d = query.shape
    h, s = key.shape[-3], key.shape[-2]
    assert h_q % h == 0, "the number of query heads must be a multiple of the key/value heads"
    n_rep = h_q // h
    factor = scale if scale is not None else 1.0 / math.sqrt(d)

    # Give every key/value head a group axis of size 1 and every group of query heads its own axis:
    # query B.. x H x n x L x D against key B.. x H x 1 x S x D. Broadcasting shares each key/value
    # head with its n query heads without copying it n times.
    query = query.reshape(*batch, h, n_rep, l, d)
    key = mx.expand_dims(key, -3)
    value = mx.expand_dims(value, -3)

    scores = (query @ key.swapaxes(-2, -1)) * factor  # B.. x H x n x L x S
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"the only mask name is 'causal', not {mask!r}")
        scores = scores + causal_mask(l, s, scores.dtype)
    elif mask is not None:
        # The mask is written for B.. x H_q x L x S; give it the same head split as the scores.
        mask = mx.broadcast_to(mask, (*batch, h_q, l, s)).reshape(*batch, h, n_rep, l, s)
        scores = scores + mask.astype(scores.dtype)  # a float32 mask must not promote half-precision scores
    out = softmax(scores, axis=-1) @ value  # B.. x H x n x L x D
    return out.reshape(*batch, h_q, l, d)
    # END TASK
