"""The paged KV cache: a pool of fixed-size blocks per layer, and block tables that map positions to blocks.

Day 2.6 gave every request a slot of `max_seq_len` positions whether it used them or not. Here
the memory is a pool of `num_blocks` blocks of `block_size` positions (one pool per layer, all
layers share the same block ids). A sequence owns a list of block ids, its *block table*: position
p of the sequence lives in block `block_table[p // block_size]`, at offset `p % block_size`. Blocks
are taken from the free list as a sequence grows and returned when it finishes or is preempted, so
memory follows the tokens actually held.

- `BlockManager` does the bookkeeping (which block belongs to whom): plain Python, no arrays.
- `KvPool` holds the arrays: per layer, keys and values of shape `num_blocks * block_size x H x D`,
  addressed by *slot* = block id * block_size + offset.
"""

from __future__ import annotations

from collections import deque

import mlx.core as mx

from .sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold `num_tokens` positions (provided)."""
    return -(-num_tokens // block_size)


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The pool slots of positions `start .. end-1` of a sequence with this block table.

    Position p sits in block `block_table[p // block_size]` at offset `p % block_size`, so its slot
    is `block_table[p // block_size] * block_size + p % block_size`.
    """
    # TODO: block_table[p // block_size] * block_size + p % block_size for each p
    raise NotImplementedError(
        "Week 3 Day 2 Task 2 (book/src/week3-02-paged-kv-cache.md): the pool slots of a range of positions"
    )


class BlockManager:
    """Hands out blocks of the KV pool: a free list, and one block table per sequence (`seq.block_table`)."""

    def __init__(self, num_blocks: int, block_size: int):
        """A pool of `num_blocks` free blocks of `block_size` positions each."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds."""
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """The fraction of blocks in use, 0..1."""
        return 1 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """How many more blocks `seq` needs so that its table covers positions 0 .. num_tokens-1."""
        # TODO: blocks_for(num_tokens) - blocks it has, at least 0
        raise NotImplementedError(
            "Week 3 Day 2 Task 1 (book/src/week3-02-paged-kv-cache.md): how many more blocks a sequence needs"
        )

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """True if the free blocks suffice for `seq` to hold `num_tokens` positions."""
        # TODO: blocks_needed <= num_free_blocks
        raise NotImplementedError(
            "Week 3 Day 2 Task 1 (book/src/week3-02-paged-kv-cache.md): whether the free blocks suffice"
        )

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_tokens` positions; RuntimeError if the pool cannot."""
        # TODO: RuntimeError if too few free blocks (take nothing); else pop free blocks onto seq.block_table
        raise NotImplementedError(
            "Week 3 Day 2 Task 1 (book/src/week3-02-paged-kv-cache.md): grow a sequence's block table"
        )

    def free(self, seq: Sequence) -> None:
        """Give every block of `seq` back to the pool and empty its table."""
        # TODO: extend the free list with seq.block_table; empty the table
        raise NotImplementedError(
            "Week 3 Day 2 Task 1 (book/src/week3-02-paged-kv-cache.md): give a sequence's blocks back"
        )

    # The block manager alone writes block tables: the prefix cache (day 3.3) grows them with `append`, day 4.1's
    # rejected guesses shrink them with `truncate`; everybody else only reads `seq.block_table`.

    def append(self, seq: Sequence, blocks: list[int]) -> None:
        """Add `blocks` (already taken from the pool) to the end of `seq`'s table (provided)."""
        seq.block_table.extend(blocks)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks of `seq` that hold positions 0 .. num_tokens-1; give the rest back with `release` (provided)."""
        keep = blocks_for(num_tokens, self.block_size)
        tail = seq.block_table[keep:]
        del seq.block_table[keep:]
        self.release(tail)

    def detach(self, seq: Sequence) -> list[int]:
        """Empty `seq`'s table; return the blocks it held, for the caller to `release` (provided)."""
        blocks, seq.block_table = seq.block_table, []
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Put blocks nobody holds any more back on the free list (provided; day 3.3 counts references instead)."""
        self.free_blocks.extend(blocks)

    # Day 3.3's prefix cache (prefix_cache.py) overrides these three hooks; without it they do nothing.

    def reuse_cached_prefix(self, seq: Sequence) -> int:
        """Hand a sequence being admitted the cached blocks of its leading tokens; no cache here: 0 tokens (provided)."""
        return 0

    def record_lookup(self, seq: Sequence, cached_tokens: int) -> None:
        """Count an admission's cache lookup; no cache here (provided)."""

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Make the newly computed full blocks of `seq` findable; no cache here (provided)."""


class KvPool:
    """Keys and values of every layer, `num_blocks * block_size x num_kv_heads x head_dim` each.

    `write` stores new keys/values at their slots; `gather` reads any list of slots back, which is
    how attention sees one sequence's cache through its block table.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: mx.Dtype = mx.float32):
        """Zero-filled pools, allocated once; they never grow or move."""
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.keys = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        mx.eval(self.keys, self.values)

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store `T x H x D` keys and values at the T given slots of `layer`."""
        # TODO: keys[layer][slots] = keys; values likewise
        raise NotImplementedError(
            "Week 3 Day 2 Task 2 (book/src/week3-02-paged-kv-cache.md): store keys and values at their slots"
        )

    def gather(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """The keys and values at `slots` (any shape `...`), as `... x H x D`."""
        # TODO: index keys[layer] and values[layer] with slots
        raise NotImplementedError(
            "Week 3 Day 2 Task 2 (book/src/week3-02-paged-kv-cache.md): read keys and values at slots"
        )

    def arrays(self) -> list[mx.array]:
        """Every pool array: what a step must evaluate so the writes happen."""
        return self.keys + self.values
