"""Prefix caching: requests that start with the same tokens share the KV blocks of that start.

Many requests begin alike: the same system prompt, the same few-shot examples, the previous turns
of a conversation. Their keys and values for those tokens are identical (a token's K and V depend
only on the tokens before it and on its position), so there is no need to compute them twice.

Day 3.2's pool already cuts a sequence's cache into blocks of `block_size` positions. Here a *full*
block gets a name: the hash of its parent block's hash and its own tokens. The chain makes the name
stand for the whole prefix up to the block's end, so equal names mean equal keys and values.

- `reuse_cached_prefix(seq)`: when a sequence is admitted, its leading full blocks are looked up by
  name; every hit is shared (its reference count goes up) and counts as computed. At least the
  last token is always left to compute: its logits give the first output token.
- `cache_computed_blocks(seq)`: after each step, the blocks the step filled get their names.
- `free(seq)`: a block is returned only when its reference count drops to 0; a named block then
  stays in the cache, on the free list, until a new allocation evicts it (least recently used first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from .block_manager import BlockManager
from .sequence import Sequence

ROOT_HASH = b""  # the parent of a sequence's first block


def hash_block(parent_hash: bytes, tokens: list[int]) -> bytes:
    """The name of a full block: SHA-256 of its parent's name and its token ids (4 bytes each).

    A cryptographic hash, because two different prefixes with the same name would silently share
    the wrong keys and values.
    """
    raise NotImplementedError(
        "Week 3 Day 3 Task 1 (book/src/week3-03-prefix-caching.md): name a full block by SHA-256 of its parent name and its token ids"
    )


def prefix_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The names of every full block of `token_ids`, in order: each one chains its parent's."""
    raise NotImplementedError(
        "Week 3 Day 3 Task 1 (book/src/week3-03-prefix-caching.md): the chained names of every full block"
    )


class PrefixCachingBlockManager(BlockManager):
    """Day 3.2's block manager plus a cache of named full blocks, shared by reference count."""

    def __init__(self, num_blocks: int, block_size: int):
        """Every block free and unnamed; counters at zero (provided).

        `free_blocks` is ordered: unnamed blocks at the front (taken first), named ones behind them,
        least recently used first, so an allocation evicts the coldest cached block.
        """
        super().__init__(num_blocks, block_size)
        self.free_blocks: OrderedDict[int, None] = OrderedDict((block, None) for block in range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.cached_blocks: dict[bytes, int] = {}  # name -> block id
        self.block_names: dict[int, bytes] = {}  # block id -> name, for the named blocks
        self.seq_names: dict[Sequence, list[bytes]] = {}  # the names of each sequence's named blocks
        self.queried_tokens = 0  # tokens of admitted sequences that were looked up
        self.hit_tokens = 0  # of those, tokens served from the cache

    def reuse_cached_prefix(self, seq: Sequence) -> int:
        """Give a sequence being admitted the cached blocks of its leading tokens; return how many tokens they hold.

        Walk the names of its full blocks while they are cached, leaving at least the last token to
        compute; take each hit (off the free list if nobody holds it) and count one more reference.
        """
        # TODO: nothing if it holds blocks; walk names[:usable] while cached: take each hit off the free list if
        # TODO: nobody holds it, count a reference; self.append(seq, hits); remember its names; return the tokens
        raise NotImplementedError(
            "Week 3 Day 3 Task 3 (book/src/week3-03-prefix-caching.md): share the cached blocks of the leading full blocks"
        )

    def record_lookup(self, seq: Sequence, cached_tokens: int) -> None:
        """Count an admission: all its tokens were looked up, `cached_tokens` of them were hits."""
        raise NotImplementedError(
            "Week 3 Day 3 Task 4 (book/src/week3-03-prefix-caching.md): count looked-up and hit tokens"
        )

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` with fresh blocks from the front of the free list, evicting their names."""
        # TODO: RuntimeError if too few free blocks; else pop each from the front, evict its name, 1 reference;
        # TODO: self.append(seq, blocks) (the block manager writes the table)
        raise NotImplementedError(
            "Week 3 Day 3 Task 2 (book/src/week3-03-prefix-caching.md): take fresh blocks from the front of the free list, evicting their names"
        )

    def evict(self, block: int) -> None:
        """Forget a free block's name, if it has one: its contents are about to be overwritten."""
        raise NotImplementedError(
            "Week 3 Day 3 Task 2 (book/src/week3-03-prefix-caching.md): forget a reused block name"
        )

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Name the blocks of `seq` that are now full and computed, so later requests can find them.

        A name already cached for another block (two requests computed the same prefix at the same
        time) keeps its first block; this one stays unnamed and is freed like any other.
        """
        raise NotImplementedError(
            "Week 3 Day 3 Task 3 (book/src/week3-03-prefix-caching.md): name the newly computed full blocks"
        )

    def free(self, seq: Sequence) -> None:
        """Drop one reference to each block of `seq` (`release`), empty its table and forget its names."""
        # TODO: self.release(self.detach(seq)); drop seq's names
        raise NotImplementedError(
            "Week 3 Day 3 Task 2 (book/src/week3-03-prefix-caching.md): give a sequence's blocks back and forget its names"
        )

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each of `blocks`; a block nobody holds goes back on the free list.

        Named blocks go to the back (most recently used; a sequence's first blocks last, as they are the
        most shared), unnamed ones to the front, to be taken first. `free` and day 4.1's `truncate` call it.
        """
        # TODO: last block first: one reference less; at 0 it goes on the free list, to the front if it has no name
        raise NotImplementedError(
            "Week 3 Day 3 Task 2 (book/src/week3-03-prefix-caching.md): drop one reference per block; free unreferenced blocks, named ones at the back"
        )

    @property
    def hit_rate(self) -> float:
        """Tokens served from the cache / tokens looked up, 0..1 (0 before any lookup)."""
        raise NotImplementedError(
            "Week 3 Day 3 Task 4 (book/src/week3-03-prefix-caching.md): hit tokens / looked-up tokens"
        )

    def reset(self) -> None:
        """Forget every cached name and zero the counters (benchmarks start each run cold)."""
        raise NotImplementedError(
            "Week 3 Day 3 Task 4 (book/src/week3-03-prefix-caching.md): forget every name and zero the counters"
        )
