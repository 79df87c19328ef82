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
    # BEGIN TASK Week 2 Day 4 Task 1: a tile of the causal mask
    # TODO: query positions q_start.. shifted by S - L, key positions k_start..;
    # TODO: 0 where key <= query, -inf elsewhere
    query_positions = mx.arange(q_start, q_start + q_len)[:, None] + (S - L)
    key_positions = mx.arange(k_start, k_start + k_len)[None, :]
    return mx.where(key_positions <= query_positions, mx.array(0.0), mx.array(-mx.inf))
    # END TASK


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
    # BEGIN TASK Week 2 Day 4 Task 2: tiled attention with an online softmax
    # TODO: the grouped layout of q, k, v (and an array mask); for each query tile: attend_query_tile, then
    # TODO: mx.eval its output; concatenate the tiles
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"the only mask name is 'causal', not {mask!r}")
    if tile_q < 1 or tile_kv < 1:
        raise ValueError(f"tile_q and tile_kv must be positive, not {tile_q} and {tile_kv}")
    *batch, h_q, l, d = query.shape
    h, s = key.shape[-3], key.shape[-2]
    if h_q % h != 0:
        raise ValueError(f"query heads ({h_q}) must be a multiple of key/value heads ({h})")
    n_rep = h_q // h
    factor = scale if scale is not None else 1.0 / math.sqrt(d)

    # The grouped layout of day 1.3: n query heads per key/value head, which broadcasts over them.
    q = query.reshape(*batch, h, n_rep, l, d)
    k = mx.expand_dims(key, -3)
    v = mx.expand_dims(value, -3)
    if isinstance(mask, mx.array):
        mask = mx.broadcast_to(mask, (*batch, h_q, l, s)).reshape(*batch, h, n_rep, l, s)

    out_tiles = []
    for q_start in range(0, l, tile_q):
        q_tile = q[..., q_start : min(q_start + tile_q, l), :]
        out_tiles.append(attend_query_tile(q_tile, k, v, q_start, l, factor, mask, tile_kv))
        # MLX is lazy: left alone, it would schedule every tile of every query tile as one graph and
        # could hold most of their score blocks at once. Computing each query tile here frees its
        # blocks before the next tile's are made, which is what bounds the memory.
        mx.eval(out_tiles[-1])
    out = mx.concatenate(out_tiles, axis=-2).astype(query.dtype)
    return out.reshape(*batch, h_q, l, d)
    # END TASK


def attend_query_tile(q_tile: mx.array, k: mx.array, v: mx.array, q_start: int, l: int, factor: float,
                      mask: mx.array | str | None, tile_kv: int) -> mx.array:
    """Query rows `q_start ..` (of `l`) against the key tiles they can see: `... x rows x D`, float32.

    `q_tile`, `k`, `v` and an array `mask` are in `flash_attention`'s grouped layout (S keys in `k`).
    """
    # BEGIN TASK Week 2 Day 4 Task 2: tiled attention with an online softmax
    # TODO: running max, running sum and output over the key tiles, rescaled when the max grows; skip causal-future tiles
    rows, s = q_tile.shape[-2], k.shape[-2]
    q_end = q_start + rows
    causal = isinstance(mask, str)
    running_max = mx.full((*q_tile.shape[:-1], 1), -mx.inf, dtype=mx.float32)
    running_sum = mx.zeros((*q_tile.shape[:-1], 1), dtype=mx.float32)
    acc = mx.zeros(q_tile.shape, dtype=mx.float32)
    # With the causal mask, this tile's last query (absolute position S - L + q_end - 1) sees no
    # key beyond it: the key tiles after that are all -inf, so they are not computed at all.
    k_stop = min(s, s - l + q_end) if causal else s
    for k_start in range(0, k_stop, tile_kv):
        k_end = min(k_start + tile_kv, k_stop)
        scores = (q_tile @ k[..., k_start:k_end, :].swapaxes(-2, -1)).astype(mx.float32) * factor
        if causal:
            scores = scores + tile_causal_mask(q_start, rows, k_start, k_end - k_start, l, s)
        elif mask is not None:
            scores = scores + mask[..., q_start:q_end, k_start:k_end].astype(mx.float32)
        new_max = mx.maximum(running_max, scores.max(axis=-1, keepdims=True))
        # A row that has met only masked keys so far has a maximum of -inf: subtract 0 instead,
        # so exp() gives 0 for those keys rather than exp(-inf - -inf) = nan.
        shift = mx.where(new_max == -mx.inf, 0.0, new_max)
        weights = mx.exp(scores - shift)  # unnormalized softmax of this tile
        # Everything summed so far was scaled by exp(-old max); rescale it to exp(-new max).
        rescale = mx.exp(running_max - shift)
        running_sum = running_sum * rescale + weights.sum(axis=-1, keepdims=True)
        acc = acc * rescale + weights @ v[..., k_start:k_end, :].astype(mx.float32)
        running_max = new_max
    return acc / running_sum
    # END TASK
