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
    # BEGIN TASK Week 4 Day 3 Task 1: the rows of a column-parallel weight that this rank keeps
    # TODO: check that the outputs divide among the ranks; keep the rank's contiguous block of rows
    check_divisible(weight.shape[0], world_size, "output features")
    share = weight.shape[0] // world_size
    return weight[rank * share : (rank + 1) * share]
    # END TASK


def split_inputs(weight: mx.array, rank: int, world_size: int) -> mx.array:
    """Rank `rank`'s 1/N of the input features of an `out x in` weight.

    Row-parallel in Megatron's terms: the rank's product is a partial sum of every output.
    """
    # BEGIN TASK Week 4 Day 3 Task 1: the columns of a row-parallel weight that this rank keeps
    # TODO: check that the inputs divide among the ranks; keep the rank's contiguous block of columns
    check_divisible(weight.shape[1], world_size, "input features")
    share = weight.shape[1] // world_size
    return weight[:, rank * share : (rank + 1) * share]
    # END TASK


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
        # BEGIN TASK Week 4 Day 3 Task 2: split the MLP: gate and up by outputs, down by inputs
        # TODO: gate and up keep the rank's intermediate features (outputs), down the same features (inputs)
        rank, world_size = group.rank(), group.size()
        self.local = Qwen2MLP(
            mlp.dim,
            mlp.hidden_dim // world_size,
            own_copy(split_outputs(mlp.w_gate, rank, world_size)),
            own_copy(split_outputs(mlp.w_up, rank, world_size)),
            own_copy(split_inputs(mlp.w_down, rank, world_size)),
        )
        # END TASK

    def __call__(self, x: mx.array) -> mx.array:
        """`T x E` -> `T x E`, the full MLP output on every rank."""
        # BEGIN TASK Week 4 Day 3 Task 2: the rank's partial output, summed over the ranks
        # TODO: run the local MLP (a partial sum of the output), then all_sum it over the group
        return mx.distributed.all_sum(self.local(x), group=self.group)
        # END TASK


class ShardedAttention:
    """This rank's share of a layer's attention: 1/N of the query heads and of the KV heads."""

    def __init__(self, attention: Qwen2RaggedAttention, group):
        """Keep rank `group.rank()`'s heads of `attention` as a smaller `Qwen2RaggedAttention`, `self.local`."""
        self.group = group
        # BEGIN TASK Week 4 Day 3 Task 3: split the attention by heads: q, k, v by outputs, o by inputs
        # TODO: divide the query heads and the KV heads; q/k/v (and biases) by outputs, o by inputs
        rank, world_size = group.rank(), group.size()
        check_divisible(attention.num_kv_heads, world_size, "KV heads")
        heads, kv_heads = attention.num_heads // world_size, attention.num_kv_heads // world_size
        # Heads are contiguous blocks of head_dim rows, so a block of rows is a block of heads; and
        # with both counts divided, the rank's query heads are exactly those that read its KV heads.
        def outputs(weight):
            return None if weight is None else own_copy(split_outputs(weight, rank, world_size))

        self.local = Qwen2RaggedAttention(
            heads * attention.head_dim,  # this rank's width: the local attention derives head_dim from it
            heads,
            kv_heads,
            outputs(attention.wq), outputs(attention.wk), outputs(attention.wv),
            own_copy(split_inputs(attention.wo, rank, world_size)),
            outputs(attention.bq), outputs(attention.bk), outputs(attention.bv),
        )
        # END TASK

    def __call__(self, x, batch, cos, sin, pool, layer) -> mx.array:
        """`T x E` -> `T x E`: the rank's heads over its share of the pool, then summed over the ranks."""
        # BEGIN TASK Week 4 Day 3 Task 3: the rank's heads' share of o_proj, summed over the ranks
        # TODO: run the local attention (its keys and values go to this rank's pool), then all_sum
        return mx.distributed.all_sum(self.local(x, batch, cos, sin, pool, layer), group=self.group)
        # END TASK


class Qwen2TensorParallel(Qwen2ModelWeek3):
    """Week 3's model with every layer sharded over `group`: same calls, same KV pool interface.

    Build it on every rank from the same checkpoint; run the same batches on every rank.
    """

    def __init__(self, mlx_model, group):
        """Build the whole week-3 model, then keep only this rank's shard of every layer."""
        super().__init__(mlx_model)
        self.group = group
        # BEGIN TASK Week 4 Day 3 Task 4: shard every layer; the KV pool holds this rank's KV heads only
        # TODO: replace each block's attention and MLP with their sharded versions; divide num_kv_heads
        for block in self.layers:
            block.self_attn = ShardedAttention(block.self_attn, group)
            block.mlp = ShardedMLP(block.mlp, group)
        self.num_kv_heads //= group.size()
        # END TASK

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
