"""KV caches: keep each layer's keys and values so that a decode step computes only the new token.

Shapes: keys and values are `B x H x L x D` (H = key/value heads). One cache object serves one layer.

- `TinyKvFullCache` holds one request's keys and values for one layer and grows as tokens arrive.
- `BatchingKvCache` holds up to `max_active_requests` requests, one per slot, each at its own length,
  and presents them to attention as one `B x H x S x D` batch with a `B x 1 x L x S` mask.
"""

from __future__ import annotations  # annotations stay text, so the skeleton's signatures read as the reference's

from abc import ABC, abstractmethod

import mlx.core as mx


class TinyKvCache(ABC):
    """The interface every KV cache offers to the model's attention layers."""

    @abstractmethod
    def update_and_fetch(
        self,
        key: mx.array,
        value: mx.array,
        mask_length: int | None = None,
        mask: mx.array | str | None = None,
    ) -> tuple[mx.array, mx.array, int, mx.array | str | None]:
        """Append L new keys/values (`B x H x L x D`); return (all keys, all values, S, the mask to use).

        S is the number of key positions in the returned keys (`B x H x S x D`). `mask_length` is the
        number of new query tokens L (default: `key.shape[2]`); `mask` is the mask the model would use
        without this cache (for example "causal"), which a cache may pass on or replace.
        """


class TinyKvFullCache(TinyKvCache):
    """One request's keys and values for one layer, all of them, growing by concatenation."""

    def __init__(self):
        """An empty cache (provided)."""
        self.key_values: tuple[mx.array, mx.array] | None = None
        self.offset = 0  # how many token positions the cache holds

    def update_and_fetch(
        self,
        key: mx.array,
        value: mx.array,
        mask_length: int | None = None,
        mask: mx.array | str | None = None,
    ) -> tuple[mx.array, mx.array, int, mx.array | str | None]:
        """Append L new keys/values (`B x H x L x D`); return (all keys, all values, S, the mask to use).

        S is the number of key positions in the returned keys (`B x H x S x D`). `mask_length` is the
        number of new query tokens L (default: `key.shape[2]`); `mask` is the mask the model would use
        without this cache (for example "causal"), which a cache may pass on or replace.
        """
        # BEGIN TASK Week 2 Day 1 Task 1: append the new keys and values
        # TODO: concatenate after the held keys/values on axis 2; update offset; pass mask through
        if self.key_values is None:
            keys, values = key, value
        else:
            cached_keys, cached_values = self.key_values
            # Positions are axis 2: the new tokens go after the ones already held.
            keys = mx.concatenate([cached_keys, key], axis=2)
            values = mx.concatenate([cached_values, value], axis=2)
        self.key_values = (keys, values)
        self.offset = keys.shape[2]
        # One request needs no special mask: "causal" with S = offset + L already lets query i
        # (at absolute position offset + i) see keys 0 .. offset + i.
        return keys, values, self.offset, mask
        # END TASK


class BatchingKvCache(TinyKvCache):
    """Up to `max_active_requests` requests for one layer, one per slot, each with its own length.

    A slot holds a request's own per-layer cache (a `TinyKvFullCache` filled by its prefill) or
    nothing (an idle slot). The batch the model runs has either one row per slot (row b is slot b) or
    one row per held slot, in slot order: a decode step that leaves idle slots out computes nothing for
    them. `update_and_fetch` appends each held row's new keys to its request, then lines the requests
    up on the right: every row's newest key lands in the last column, shorter requests are padded with
    zeros on the left, and the mask hides padding and idle slots.
    """

    def __init__(self, max_active_requests: int, max_seq_len: int):
        """`max_active_requests` slots, all idle; a request may hold at most `max_seq_len` positions."""
        self.max_active_requests = max_active_requests
        self.max_seq_len = max_seq_len
        self.kv_caches: list[TinyKvCache | None] = [None] * max_active_requests

    def add_request(self, prefilled: TinyKvCache, id: int) -> None:
        """Put a request's (prefilled) cache for this layer into slot `id`, which must be free."""
        # BEGIN TASK Week 2 Day 5 Task 1: put a request's cache into a slot
        # TODO: check the slot is in range and free, then keep `prefilled` in it
        if not 0 <= id < self.max_active_requests:
            raise ValueError(f"slot {id} out of range: this cache has {self.max_active_requests} slots")
        if self.kv_caches[id] is not None:
            raise ValueError(f"slot {id} is already taken")
        self.kv_caches[id] = prefilled
        # END TASK

    def remove_request(self, id: int) -> None:
        """Free slot `id` (the request finished); the other slots are untouched."""
        # BEGIN TASK Week 2 Day 5 Task 1: free a slot
        # TODO: check the slot holds a request, then empty it
        if not 0 <= id < self.max_active_requests or self.kv_caches[id] is None:
            raise ValueError(f"slot {id} holds no request")
        self.kv_caches[id] = None
        # END TASK

    def update_and_fetch(
        self,
        key: mx.array,
        value: mx.array,
        mask_length: int | None = None,
        mask: mx.array | str | None = None,
    ) -> tuple[mx.array, mx.array, int, mx.array | str | None]:
        """Append L new keys/values (`B x H x L x D`); return (all keys, all values, S, the mask to use).

        S is the number of key positions in the returned keys (`B x H x S x D`). `mask_length` is the
        number of new query tokens L (default: `key.shape[2]`); `mask` is the mask the model would use
        without this cache (for example "causal"), which a cache may pass on or replace.
        """
        # BEGIN TASK Week 2 Day 5 Task 2: append each slot's keys, align the rows, build the B x 1 x L x S mask
        # TODO: which slot each row is (all slots, or the held ones only); each held slot appends its row;
        # TODO: pad every request on the left to the longest; stack rows and masks
        batch, heads, length, dim = key.shape
        held = [slot for slot, cache in enumerate(self.kv_caches) if cache is not None]
        # Row r of the batch is slot r, or, in a batch of the held slots only, the r-th held slot.
        row_slots = range(self.max_active_requests) if batch == self.max_active_requests else held
        if batch != len(row_slots):
            raise ValueError(f"expected a batch of {self.max_active_requests} rows (one per slot) or "
                             f"{len(held)} (one per held slot), got {batch}")
        length = mask_length or length
        # 1. Each held slot appends its own row to its own request's cache.
        fetched: list[tuple[mx.array, mx.array] | None] = []
        for row, slot in enumerate(row_slots):
            cache = self.kv_caches[slot]
            if cache is None:
                fetched.append(None)
                continue
            keys, values, _, _ = cache.update_and_fetch(key[row : row + 1], value[row : row + 1])
            if keys.shape[2] > self.max_seq_len:
                raise ValueError(f"slot {slot} holds {keys.shape[2]} tokens, more than max_seq_len={self.max_seq_len}")
            fetched.append((keys, values))
        # 2. Line the rows up on the right, so the L new tokens of every row are the last L columns:
        #    pad each request on the left (with zeros, which the mask hides) up to the longest one.
        seq_len = max([kv[0].shape[2] for kv in fetched if kv is not None], default=length)
        rows_keys, rows_values, masks = [], [], []
        for kv in fetched:
            if kv is None:
                # An idle slot attends to nothing: its output is garbage that nobody reads.
                empty = mx.zeros((1, heads, seq_len, dim), dtype=key.dtype)
                rows_keys.append(empty)
                rows_values.append(empty)
                masks.append(mx.full((length, seq_len), -mx.inf, dtype=key.dtype))
                continue
            keys, values = kv
            held = keys.shape[2]
            padding = [(0, 0), (0, 0), (seq_len - held, 0), (0, 0)]
            rows_keys.append(mx.pad(keys, padding))
            rows_values.append(mx.pad(values, padding))
            masks.append(aligned_causal_mask(length, held, seq_len, key.dtype))
        all_keys = mx.concatenate(rows_keys, axis=0)
        all_values = mx.concatenate(rows_values, axis=0)
        # 3. One mask per row, shared by all heads: B x 1 x L x S.
        return all_keys, all_values, seq_len, mx.stack(masks)[:, None, :, :]
        # END TASK


def aligned_causal_mask(length: int, held: int, seq_len: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    """The `L x S` mask of one request holding `held` keys, placed in the last `held` of `seq_len` columns.

    Query i (of the L new tokens) is at position held - L + i of its request, so it sees that request's
    keys 0 .. held - L + i, which sit in columns seq_len - held .. seq_len - L + i. The columns before
    seq_len - held are padding. Allowed entries are 0, the others -inf.
    """
    # BEGIN TASK Week 2 Day 5 Task 1: the causal mask of one right-aligned request
    # TODO: 0 where seq_len - held <= column <= seq_len - length + row, -inf elsewhere
    columns = mx.arange(seq_len)[None, :]
    rows = mx.arange(length)[:, None]
    allowed = (columns >= seq_len - held) & (columns <= seq_len - length + rows)
    return mx.where(allowed, mx.array(0, dtype=dtype), mx.array(-mx.inf, dtype=dtype))
    # END TASK
