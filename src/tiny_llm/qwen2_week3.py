"""The Qwen2 model, week 3 edition: every token of a step in one call, a ragged batch over a paged KV cache.

Week 2 ran a batch as `B x L` rows padded to the same length, one model call for a prefill chunk and
another for the decode step. Here a step's tokens are laid end to end, `T` of them, whichever
sequence they belong to: the decode tokens of the running sequences first, then prefill chunks.

- Everything that treats tokens independently (embedding, norms, projections, MLP) runs on all T
  rows at once: one matmul per weight per step, so the weights are read from memory once per step,
  not once per sequence or once per chunk.
- Attention is the only place where sequences differ. Each sequence reads its own keys and values
  from the paged pool (gathered through its block table). A prefill chunk uses day 2.7's chunk mask;
  the decode tokens, chunks of one, are grouped into one padded batch (their padding masked off).
- Logits are computed only for the rows that sample: the last token of each sequence whose chunk
  reaches its end. A prompt's other positions never touch the 151,936-row output matrix.

`RaggedBatch` (built by the model runner from the scheduler's plan) says where every token goes.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .attention import scaled_dot_product_attention_grouped
from .basics import linear
from .block_manager import KvPool
from .embedding import Embedding
from .layer_norm import RMSNorm
from .mlp import Qwen2MLP
from .weights import dequantize_linear


@dataclass
class PrefillChunk:
    """One sequence's chunk of L > 1 tokens: the rows it occupies and the keys it attends to."""

    length: int  # L, its rows in the batch
    key_slots: mx.array  # S: pool slots of the sequence's positions 0 .. offset + L - 1
    mask: mx.array  # L x S: day 2.7's chunk mask


@dataclass
class RaggedBatch:
    """One step's tokens laid end to end (T rows) and where attention finds each sequence's keys.

    The first `num_decodes` rows are decode tokens (one per sequence); then come the prefill chunks,
    in order. `write_slots[i]` is where row i's key and value go in the pool; `positions[i]` its
    absolute position (what RoPE rotates by). `sample_rows` are the rows whose logits are wanted.
    """

    token_ids: mx.array  # T
    positions: mx.array  # T
    write_slots: mx.array  # T
    num_decodes: int
    decode_key_slots: mx.array | None  # num_decodes x S_max, padded with slot 0
    decode_mask: mx.array | None  # num_decodes x 1 x 1 x S_max: 0 on real keys, -inf on padding
    chunks: list[PrefillChunk]
    sample_rows: mx.array  # one row per sampling sequence


def rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """RoPE in Qwen2's layout (feature i pairs with i + D/2) on `T x H x D`, with `T x 1 x D/2` angles (provided).

    Feature pairs (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin). Seen as `T x H x 2 x D/2`, the
    swapped pairs (x2, x1) are a view (a reversed axis, nothing copied), so the rotation is
    x * cos + swapped * (-sin, sin): three element-wise operations on x, where slicing both halves,
    four products, a sum, a difference and a concatenation were eight. On a CPU each operation costs
    a few microseconds beyond its arithmetic, and a decode step runs this 24 times on a handful of
    rows; the result is the same to the bit.
    """
    t, h, d = x.shape
    pairs = x.reshape(t, h, 2, d // 2)
    swapped = pairs[:, :, ::-1, :]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # T x 1 x 1 x D/2
    signed_sin = mx.concatenate([-sin, sin], axis=2)  # T x 1 x 2 x D/2: -sin for the first half
    return (pairs * cos + swapped * signed_sin).reshape(t, h, d)


class Qwen2RaggedAttention:
    """Qwen2's self-attention over a ragged batch; new keys and values go into the paged pool."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, wq: mx.array, wk: mx.array,
                 wv: mx.array, wo: mx.array, bq: mx.array | None, bk: mx.array | None, bv: mx.array | None):
        """Keep the weights (provided), q/k/v stacked into one; a missing bias (Llama-family checkpoints) means zero.

        `w_qkv` is wq, wk and wv one under the other (`(H_q + 2 H) D x E`), concatenated once here, so a
        step projects q, k and v with one matmul (one bias add) instead of three: the three small
        products of a decode step each pay a call's fixed cost on a CPU. `wq`, `wk`, `wv` stay, as
        views of it (tensor parallelism splits them by heads, day 4.3).
        """
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.scale = self.head_dim**-0.5
        self.w_qkv = mx.concatenate([wq, wk, wv])
        q_rows, kv_rows = wq.shape[0], wk.shape[0]
        self.wq, self.wk, self.wv = mx.split(self.w_qkv, [q_rows, q_rows + kv_rows])
        self.wo = wo
        self.bq, self.bk, self.bv = bq, bk, bv
        self.b_qkv = None
        if any(b is not None for b in (bq, bk, bv)):
            self.b_qkv = mx.concatenate([mx.zeros(w.shape[0], w.dtype) if b is None else b
                                         for w, b in ((wq, bq), (wk, bk), (wv, bv))])
        mx.eval(self.w_qkv, self.wq, self.wk, self.wv, self.b_qkv)  # now: no step pays for the concatenation

    def __call__(self, x: mx.array, batch: RaggedBatch, cos: mx.array, sin: mx.array, pool: KvPool,
                 layer: int) -> mx.array:
        """`T x E` -> `T x E`: project all rows at once, store the new keys, attend per sequence."""
        # TODO: project q/k/v for all rows with w_qkv (split the heads), rotate q and k, write k/v to the pool,
        # TODO: decode group then each chunk, concatenate, wo
        raise NotImplementedError(
            "Week 3 Day 1 Task 3 (book/src/week3-01-token-budget.md): ragged attention over all T rows"
        )

    def decode_attention(self, q: mx.array, batch: RaggedBatch, pool: KvPool, layer: int) -> mx.array:
        """The decode rows (`n x H_q x D`), one per sequence, as one padded batch -> `n x H_q x D`."""
        # TODO: gather decode_key_slots, transpose to n x H x S x D and mx.contiguous it (MLX's CPU matmul
        # TODO: is many times slower on a transposed view); grouped attention with decode_mask
        raise NotImplementedError(
            "Week 3 Day 1 Task 3 (book/src/week3-01-token-budget.md): the decode rows' attention as one padded batch"
        )

    def chunk_attention(self, q: mx.array, chunk: PrefillChunk, pool: KvPool, layer: int) -> mx.array:
        """One sequence's prefill chunk (`L x H_q x D`) over its cached keys and its own -> `L x H_q x D`."""
        # TODO: gather the chunk's key slots, H x S x D (mx.contiguous); fold the n = H_q / H query heads of
        # TODO: each key/value head into n * L rows (mask tiled n times); grouped attention; unfold
        raise NotImplementedError(
            "Week 3 Day 1 Task 3 (book/src/week3-01-token-budget.md): one prefill chunk's attention"
        )


class Qwen2RaggedBlock:
    """One decoder layer over a ragged batch: x + attention(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, attention: Qwen2RaggedAttention, mlp: Qwen2MLP, input_layernorm: RMSNorm,
                 post_attention_layernorm: RMSNorm):
        """Keep the parts (provided)."""
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def __call__(self, x: mx.array, batch: RaggedBatch, cos: mx.array, sin: mx.array, pool: KvPool,
                 layer: int) -> mx.array:
        """`T x E` -> `T x E`."""
        h = x + self.self_attn(self.input_layernorm(x), batch, cos, sin, pool, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2ModelWeek3:
    """Qwen2 (or a Llama-family checkpoint) running ragged batches over a paged KV pool."""

    def __init__(self, mlx_model):
        """Copy every weight out of an mlx-lm model (provided); quantized weights are dequantized.

        q, k and v are stacked into one weight here, once (`Qwen2RaggedAttention`): one matmul per step
        where there were three. Gate and up stay two: stacked, they measured no faster (chapter 3.1).
        """
        args = mlx_model.args
        self.args = args
        self.num_hidden_layers = args.num_hidden_layers
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.hidden_size // args.num_attention_heads
        self.max_position = args.max_position_embeddings
        inner = mlx_model.model
        self.embedding = Embedding(args.vocab_size, args.hidden_size, dequantize_linear(inner.embed_tokens))
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attention = Qwen2RaggedAttention(
                args.hidden_size, args.num_attention_heads, args.num_key_value_heads,
                dequantize_linear(attn.q_proj), dequantize_linear(attn.k_proj), dequantize_linear(attn.v_proj),
                dequantize_linear(attn.o_proj),
                getattr(attn.q_proj, "bias", None), getattr(attn.k_proj, "bias", None), getattr(attn.v_proj, "bias", None),
            )
            feed_forward = Qwen2MLP(args.hidden_size, args.intermediate_size, dequantize_linear(mlp.gate_proj),
                                    dequantize_linear(mlp.up_proj), dequantize_linear(mlp.down_proj))
            self.layers.append(Qwen2RaggedBlock(
                attention, feed_forward,
                RMSNorm(args.hidden_size, layer.input_layernorm.weight, eps=args.rms_norm_eps),
                RMSNorm(args.hidden_size, layer.post_attention_layernorm.weight, eps=args.rms_norm_eps),
            ))
        self.norm = RMSNorm(args.hidden_size, inner.norm.weight, eps=args.rms_norm_eps)
        self.w_lm_head = None if args.tie_word_embeddings else dequantize_linear(mlx_model.lm_head)
        half = self.head_dim // 2
        self.inv_freq = args.rope_theta ** (-mx.arange(0, half, dtype=mx.float32) * 2.0 / self.head_dim)
        # Computed now, on this thread: MLX streams are per thread, and a server steps the engine on another.
        mx.eval(self.inv_freq)
        self.dtype = self.embedding.weight.dtype

    def make_kv_pool(self, num_blocks: int, block_size: int) -> KvPool:
        """An empty paged KV pool for this model: `num_blocks` blocks of `block_size` positions per layer (provided)."""
        return KvPool(self.num_hidden_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim, self.dtype)

    def __call__(self, batch: RaggedBatch, pool: KvPool) -> mx.array:
        """Run one step's T tokens; return the logits of `batch.sample_rows` only (`len(sample_rows) x vocab`).

        The keys and values of all T tokens are written into `pool` on the way.
        """
        # TODO: RoPE angles once, embedding, layers, then norm + lm_head on batch.sample_rows only
        raise NotImplementedError(
            "Week 3 Day 1 Task 3 (book/src/week3-01-token-budget.md): the ragged forward pass, logits at sampling rows only"
        )
