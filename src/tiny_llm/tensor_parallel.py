"""Tensor parallelism: week 3's model split across N processes ("ranks"), Megatron-style.

Every rank runs the whole program on the same tokens; what differs is which slice of each layer it
holds. A layer's two halves are split so that only one all-reduce is needed after each:

- The first matmuls (q, k, v; gate and up) are *column-parallel*: each rank keeps 1/N of their
  output features. For attention that is 1/N of the query heads and 1/N of the KV heads, so the rank
  computes attention for its own heads, over its own share of the KV cache, without talking to anyone.
- The second matmuls (o_proj; down_proj) are *row-parallel*: each rank keeps the 1/N of their input
  features that match the outputs it computed, so its product is a partial sum of the full output.
- One `mx.distributed.all_sum` adds the N partial sums: every rank then holds the full `T x E` output.

The embedding, the norms and the output head are replicated (each rank holds all of them).
MLX stores a linear weight as `out x in`, so "columns" of the math (`y = x W^T`: output features)
are rows of the stored array.
"""

from __future__ import annotations

import mlx.core as mx

from .mlp import Qwen2MLP
from .qwen2_week3 import Qwen2ModelWeek3, Qwen2RaggedAttention


def check_divisible(count: int, world_size: int, what: str) -> None:
    """Refuse a split that would leave ranks with unequal shares (provided)."""
    if count % world_size:
        raise ValueError(f"{what} ({count}) do not divide among {world_size} ranks")


def split_outputs(weight: mx.array, rank: int, world_size: int) -> mx.array:
    """Rank `rank`'s 1/N of the output features of an `out x in` weight (or of an `out` bias).

    Column-parallel in Megatron's terms: the rank computes 1/N of the layer's outputs, in full.
    """
    # TODO: check that the outputs divide among the ranks; keep the rank's contiguous block of rows
    raise NotImplementedError(
        "Week 4 Day 3 Task 1 (book/src/week4-03-tensor-parallelism.md): the rows of a column-parallel weight that this rank keeps"
    )


def split_inputs(weight: mx.array, rank: int, world_size: int) -> mx.array:
    """Rank `rank`'s 1/N of the input features of an `out x in` weight.

    Row-parallel in Megatron's terms: the rank's product is a partial sum of every output.
    """
    # TODO: check that the inputs divide among the ranks; keep the rank's contiguous block of columns
    raise NotImplementedError(
        "Week 4 Day 3 Task 1 (book/src/week4-03-tensor-parallelism.md): the columns of a row-parallel weight that this rank keeps"
    )


def own_copy(weight: mx.array | None) -> mx.array | None:
    """The shard in a buffer of its own, evaluated now (provided).

    A slice of an MLX array is a view that keeps the whole matrix alive; a copy lets it go, so the
    rank holds only its share once the full model is dropped.
    """
    if weight is None:
        return None
    copy = mx.contiguous(weight)
    mx.eval(copy)
    return copy


class ShardedMLP:
    """This rank's share of an MLP: 1/N of the intermediate features; the outputs all-reduced."""

    def __init__(self, mlp: Qwen2MLP, group):
        """Keep rank `group.rank()`'s slices of `mlp`'s weights as a smaller `Qwen2MLP`, `self.local`."""
        self.group = group
        # TODO: gate and up keep the rank's intermediate features (outputs), down the same features (inputs)
        raise NotImplementedError(
            "Week 4 Day 3 Task 2 (book/src/week4-03-tensor-parallelism.md): split the MLP: gate and up by outputs, down by inputs"
        )

    def __call__(self, x: mx.array) -> mx.array:
        """`T x E` -> `T x E`, the full MLP output on every rank."""
        # TODO: run the local MLP (a partial sum of the output), then all_sum it over the group
        raise NotImplementedError(
            "Week 4 Day 3 Task 2 (book/src/week4-03-tensor-parallelism.md): the rank's partial output, summed over the ranks"
        )


class ShardedAttention:
    """This rank's share of a layer's attention: 1/N of the query heads and of the KV heads."""

    def __init__(self, attention: Qwen2RaggedAttention, group):
        """Keep rank `group.rank()`'s heads of `attention` as a smaller `Qwen2RaggedAttention`, `self.local`."""
        self.group = group
        # TODO: divide the query heads and the KV heads; q/k/v (and biases) by outputs, o by inputs
        raise NotImplementedError(
            "Week 4 Day 3 Task 3 (book/src/week4-03-tensor-parallelism.md): split the attention by heads: q, k, v by outputs, o by inputs"
        )

    def __call__(self, x, batch, cos, sin, pool, layer) -> mx.array:
        """`T x E` -> `T x E`: the rank's heads over its share of the pool, then summed over the ranks."""
        # TODO: run the local attention (its keys and values go to this rank's pool), then all_sum
        raise NotImplementedError(
            "Week 4 Day 3 Task 3 (book/src/week4-03-tensor-parallelism.md): the rank's heads' share of o_proj, summed over the ranks"
        )


class Qwen2TensorParallel(Qwen2ModelWeek3):
    """Week 3's model with every layer sharded over `group`: same calls, same KV pool interface.

    Build it on every rank from the same checkpoint; run the same batches on every rank.
    """

    def __init__(self, mlx_model, group):
        """Build the whole week-3 model, then keep only this rank's shard of every layer."""
        super().__init__(mlx_model)
        self.group = group
        # TODO: replace each block's attention and MLP with their sharded versions; divide num_kv_heads
        raise NotImplementedError(
            "Week 4 Day 3 Task 4 (book/src/week4-03-tensor-parallelism.md): shard every layer; the KV pool holds this rank's KV heads only"
        )

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of the weights this rank holds: `sharded` (its share of the layers) and `replicated` (provided)."""
        sharded = replicated = 0
        for block in self.layers:
            attention, mlp = block.self_attn.local, block.mlp.local
            arrays = [attention.wq, attention.wk, attention.wv, attention.wo, attention.bq, attention.bk,
                      attention.bv, mlp.w_gate, mlp.w_up, mlp.w_down]
            sharded += sum(a.nbytes for a in arrays if a is not None)
            replicated += block.input_layernorm.weight.nbytes + block.post_attention_layernorm.weight.nbytes
        replicated += self.embedding.weight.nbytes + self.norm.weight.nbytes
        if self.w_lm_head is not None:
            replicated += self.w_lm_head.nbytes
        return {"sharded": sharded, "replicated": replicated}
