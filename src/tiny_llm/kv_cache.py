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
        # TODO: concatenate after the held keys/values on axis 2; update offset; pass mask through
        raise NotImplementedError("Week 2 Day 1 Task 1 (book/src/week2-01-kv-cache.md): append the new keys and values")


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
        # TODO: check the slot is in range and free, then keep `prefilled` in it
        raise NotImplementedError(
            "Week 2 Day 5 Task 1 (book/src/week2-05-batching-the-model.md): put a request's cache into a slot"
        )

    def remove_request(self, id: int) -> None:
        """Free slot `id` (the request finished); the other slots are untouched."""
        # TODO: check the slot holds a request, then empty it
        raise NotImplementedError("Week 2 Day 5 Task 1 (book/src/week2-05-batching-the-model.md): free a slot")

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
        # TODO: which slot each row is (all slots, or the held ones only); each held slot appends its row;
        # TODO: pad every request on the left to the longest; stack rows and masks
        raise NotImplementedError(
            "Week 2 Day 5 Task 2 (book/src/week2-05-batching-the-model.md): append each slot's keys, align the rows, build the B x 1 x L x S mask"
        )


def aligned_causal_mask(length: int, held: int, seq_len: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    """The `L x S` mask of one request holding `held` keys, placed in the last `held` of `seq_len` columns.

    Query i (of the L new tokens) is at position held - L + i of its request, so it sees that request's
    keys 0 .. held - L + i, which sit in columns seq_len - held .. seq_len - L + i. The columns before
    seq_len - held are padding. Allowed entries are 0, the others -inf.
    """
    # TODO: 0 where seq_len - held <= column <= seq_len - length + row, -inf elsewhere
    raise NotImplementedError(
        "Week 2 Day 5 Task 1 (book/src/week2-05-batching-the-model.md): the causal mask of one right-aligned request"
    )
