"""Flash attention: attention computed tile by tile with an online softmax, in bounded memory.

Plain attention writes the whole `L x S` score matrix for every head: a 8,192-token prefill with 14
heads is 14 x 8192 x 8192 float32 scores, 3.7 GB, several times over while the softmax runs. Here the
queries are cut into tiles of `tile_q` rows and the keys into tiles of `tile_kv`; a query tile meets
one key tile at a time, and only a `tile_q x tile_kv` block of scores ever exists. The softmax is
built up as the key tiles go by: a running maximum, a running sum, and an output that is rescaled
whenever the maximum grows. The result equals plain attention up to float rounding.

Shapes as in `attention.scaled_dot_product_attention_grouped`: query `B.. x H_q x L x D`, key and
value `B.. x H x S x D`, H_q a multiple of H (grouped-query heads).
"""

from __future__ import annotations  # annotations stay text, so the skeleton's signatures read as the reference's

import math

import mlx.core as mx


def tile_causal_mask(q_start: int, q_len: int, k_start: int, k_len: int, L: int, S: int) -> mx.array:
    """The `q_len x k_len` block of `causal_mask(L, S)` at rows q_start.. and columns k_start.., as float32.

    Query i sits at absolute position S - L + i (the L queries are the last L of S positions, which is
    also a prefill chunk after S - L cached tokens) and sees keys 0 .. S - L + i: 0 there, -inf elsewhere.
    """
    # TODO: query positions q_start.. shifted by S - L, key positions k_start..;
    # TODO: 0 where key <= query, -inf elsewhere
    raise NotImplementedError("Week 2 Day 4 Task 1 (book/src/week2-04-flash-attention.md): a tile of the causal mask")


def flash_attention(
    query: mx.array,
    key: mx.array,
    value: mx.array,
    scale: float | None = None,
    mask: mx.array | str | None = None,
    tile_q: int = 128,
    tile_kv: int = 128,
) -> mx.array:
    """Grouped-query attention, tile by tile: the same result as plain attention, never an `L x S` matrix.

    `mask` is None, "causal" (causal_mask(L, S), made tile by tile; key tiles wholly in a query tile's
    future are skipped), or an additive array that broadcasts to `B.. x H_q x L x S`, read a tile at a
    time. Returns `B.. x H_q x L x D` in query's dtype.
    """
    # TODO: the grouped layout of q, k, v (and an array mask); for each query tile: attend_query_tile, then
    # TODO: mx.eval its output; concatenate the tiles
    raise NotImplementedError(
        "Week 2 Day 4 Task 2 (book/src/week2-04-flash-attention.md): tiled attention with an online softmax"
    )


def attend_query_tile(q_tile: mx.array, k: mx.array, v: mx.array, q_start: int, l: int, factor: float,
                      mask: mx.array | str | None, tile_kv: int) -> mx.array:
    """Query rows `q_start ..` (of `l`) against the key tiles they can see: `... x rows x D`, float32.

    `q_tile`, `k`, `v` and an array `mask` are in `flash_attention`'s grouped layout (S keys in `k`).
    """
    # TODO: running max, running sum and output over the key tiles, rescaled when the max grows; skip causal-future tiles
    raise NotImplementedError(
        "Week 2 Day 4 Task 2 (book/src/week2-04-flash-attention.md): tiled attention with an online softmax"
    )
