"""The Qwen2 model, week 2 edition: a KV cache per layer, a start position per call, batches of requests.

`model(inputs, offset, cache)` runs only the new tokens: `inputs` is `B x L` token ids that come
after `offset` tokens whose keys and values are already in `cache` (one cache per layer).

- Prefill: `offset=0`, the whole prompt, a fresh `make_cache()`.
- A prefill chunk: L prompt tokens after `offset` cached ones; query i is at position offset + i.
- Decode: one token (`L=1`) at `offset` = the tokens held so far.
- A batch (day 2.5): `offset` is a list, one start position per row, and the cache is
  `make_batch_cache(...)`, which also supplies the `B x 1 x L x S` mask.

Two switches of `Qwen2ModelWeek2`: `keep_quantized=True` keeps a quantized checkpoint's weights packed
and runs every projection through day 2.3's `quantized_linear`; `flash_attention=True` runs the
attention of every call with more than one new token (prefill, prefill chunks) through day 2.4's
tiled `flash_attention`.
"""

from __future__ import annotations  # annotations stay text, so the skeleton's signatures read as the reference's

import mlx.core as mx

from . import basics, flash_attention, quantize
from .attention import scaled_dot_product_attention_grouped
from .embedding import Embedding
from .kv_cache import BatchingKvCache, TinyKvCache, TinyKvFullCache
from .layer_norm import RMSNorm
from .mlp import Qwen2MLP
from .positional_encoding import RoPE
from .weights import bias_of, dequantize_linear


def linear(x: mx.array, w: mx.array | quantize.QuantizedWeight, bias: mx.array | None = None) -> mx.array:
    """x @ w.T + bias for a float weight; day 2.3's quantized_linear for a weight kept quantized (provided)."""
    if isinstance(w, quantize.QuantizedWeight):
        return quantize.quantized_linear(x, w, bias)
    return basics.linear(x, w, bias)


class Qwen2MLPWeek2(Qwen2MLP):
    """Day 1.4's MLP with its projections through `linear` above, so its weights may stay quantized (provided)."""

    def __call__(self, x: mx.array) -> mx.array:
        """`... x dim` -> `... x dim`."""
        gated = basics.silu(linear(x, self.w_gate)) * linear(x, self.w_up)
        return linear(gated, self.w_down)


class Qwen2MultiHeadAttention:
    """Qwen2's self-attention over the new tokens and everything the layer's KV cache holds.

    wq is `hidden_size x hidden_size`, wk and wv `num_kv_heads*head_dim x hidden_size`, wo
    `hidden_size x hidden_size`; bq, bk, bv are the projection biases (wo has none).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        wq: mx.array,
        wk: mx.array,
        wv: mx.array,
        wo: mx.array,
        bq: mx.array,
        bk: mx.array,
        bv: mx.array,
        max_seq_len: int = 32768,
        theta: int = 1000000,
    ):
        """Keep the weights and build the RoPE (provided: the same as week 1)."""
        assert hidden_size % num_heads == 0 and num_heads % num_kv_heads == 0
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.scale = self.head_dim**-0.5
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.bq, self.bk, self.bv = bq, bk, bv
        self.rope = RoPE(self.head_dim, max_seq_len, theta, traditional=False)
        self.use_flash_attention = False  # Qwen2ModelWeek2(..., flash_attention=True) turns it on

    def __call__(
        self,
        x: mx.array,
        offset: int | list[int],
        cache: TinyKvCache,
        mask: mx.array | str | None = "causal",
    ) -> mx.array:
        """`B x L x E` new tokens -> `B x L x E`; row b's tokens sit at positions offset[b] .. offset[b]+L-1.

        `offset` is an int (every row starts there) or a list of ints (one per row). The new keys and
        values go into `cache`, which returns all of them and the mask to use (`mask` is the default,
        "causal", which a batching cache replaces with its own `B x 1 x L x S` mask).
        """
        # TODO: project, RoPE at `offset`, heads first, cache.update_and_fetch, grouped attention
        # TODO: flash_attention.flash_attention instead when self.use_flash_attention and L > 1 (day 2.4)
        raise NotImplementedError(
            "Week 2 Day 1 Task 2 (book/src/week2-01-kv-cache.md): attention over the new tokens and the cache"
        )


class Qwen2TransformerBlock:
    """One decoder layer with its KV cache: x + attention(norm(x)), then h + mlp(norm(h))."""

    def __init__(
        self,
        num_attention_heads: int,
        num_kv_heads: int,
        hidden_size: int,
        intermediate_size: int,
        rms_norm_eps: float,
        wq: mx.array,
        wk: mx.array,
        wv: mx.array,
        wo: mx.array,
        bq: mx.array,
        bk: mx.array,
        bv: mx.array,
        w_gate: mx.array,
        w_up: mx.array,
        w_down: mx.array,
        w_input_layernorm: mx.array,
        w_post_attention_layernorm: mx.array,
        max_seq_len: int = 32768,
        theta: int = 1000000,
    ):
        """Build the two norms, the attention and the MLP from their weights (provided: as in week 1)."""
        self.input_layernorm = RMSNorm(hidden_size, w_input_layernorm, eps=rms_norm_eps)
        self.self_attn = Qwen2MultiHeadAttention(
            hidden_size, num_attention_heads, num_kv_heads, wq, wk, wv, wo, bq, bk, bv, max_seq_len, theta
        )
        self.post_attention_layernorm = RMSNorm(hidden_size, w_post_attention_layernorm, eps=rms_norm_eps)
        self.mlp = Qwen2MLPWeek2(hidden_size, intermediate_size, w_gate, w_up, w_down)

    def __call__(
        self,
        x: mx.array,
        offset: int | list[int],
        cache: TinyKvCache,
        mask: mx.array | str | None = "causal",
    ) -> mx.array:
        """`B x L x E` -> `B x L x E`, with `offset`, `cache` and `mask` passed on to the attention."""
        # TODO: week 1's block, passing offset, cache and mask to the attention
        raise NotImplementedError(
            "Week 2 Day 1 Task 2 (book/src/week2-01-kv-cache.md): the transformer block with a cache"
        )


class Qwen2ModelWeek2:
    """Qwen2 with a KV cache, from an mlx-lm model object (`mlx_lm.load`); quantized weights dequantized
    on load unless `keep_quantized`."""

    def __init__(self, mlx_model, keep_quantized: bool = False, flash_attention: bool = False):
        """Copy every weight out of `mlx_model` into our own layers (provided: as in week 1).

        keep_quantized: a quantized layer's weight stays packed (a `quantize.QuantizedWeight`) instead
        of being dequantized on load (day 2.3). flash_attention: prefill attention is tiled (day 2.4).
        """
        args = mlx_model.args
        self.args = args
        self.num_hidden_layers = args.num_hidden_layers
        self.vocab_size = args.vocab_size
        inner = mlx_model.model

        def weight(mlx_layer):
            if keep_quantized and hasattr(mlx_layer, "scales"):
                return quantize.QuantizedWeight.from_mlx_layer(mlx_layer)
            return dequantize_linear(mlx_layer)

        embed = weight(inner.embed_tokens)
        if isinstance(embed, quantize.QuantizedWeight):
            self.embedding = quantize.QuantizedEmbedding(embed)
        else:
            self.embedding = Embedding(args.vocab_size, args.hidden_size, embed)
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                Qwen2TransformerBlock(
                    num_attention_heads=args.num_attention_heads,
                    num_kv_heads=args.num_key_value_heads,
                    hidden_size=args.hidden_size,
                    intermediate_size=args.intermediate_size,
                    rms_norm_eps=args.rms_norm_eps,
                    wq=weight(attn.q_proj),
                    wk=weight(attn.k_proj),
                    wv=weight(attn.v_proj),
                    wo=weight(attn.o_proj),
                    bq=bias_of(attn.q_proj),
                    bk=bias_of(attn.k_proj),
                    bv=bias_of(attn.v_proj),
                    w_gate=weight(mlp.gate_proj),
                    w_up=weight(mlp.up_proj),
                    w_down=weight(mlp.down_proj),
                    w_input_layernorm=layer.input_layernorm.weight,
                    w_post_attention_layernorm=layer.post_attention_layernorm.weight,
                    max_seq_len=args.max_position_embeddings,
                    theta=args.rope_theta,
                )
            )
            self.layers[-1].self_attn.use_flash_attention = flash_attention
        self.norm = RMSNorm(args.hidden_size, inner.norm.weight, eps=args.rms_norm_eps)
        self.w_lm_head = None if args.tie_word_embeddings else weight(mlx_model.lm_head)

    def __call__(
        self,
        inputs: mx.array,
        offset: int | list[int],
        cache: list[TinyKvCache],
        mask: mx.array | str = "causal",
    ) -> mx.array:
        """New token ids `B x L` after `offset` cached ones -> logits `B x L x vocab_size`.

        `offset` is an int, or a list with one start position per row (a batch); `cache` has one
        cache per layer (from `make_cache()` or `make_batch_cache(...)`) and is updated in place.
        `mask` goes to every layer's attention: "causal", or an `L x S` array such as day 2.7's
        chunk mask (a batching cache supplies its own).
        """
        # TODO: embedding; layer i with cache[i] and mask; norm; output layer
        raise NotImplementedError(
            "Week 2 Day 1 Task 2 (book/src/week2-01-kv-cache.md): run the new tokens through the layers and caches"
        )

    def make_cache(self) -> list[TinyKvFullCache]:
        """A fresh, empty cache for one request: one `TinyKvFullCache` per layer."""
        # TODO: a fresh TinyKvFullCache for each of the num_hidden_layers layers
        raise NotImplementedError("Week 2 Day 1 Task 2 (book/src/week2-01-kv-cache.md): one TinyKvFullCache per layer")

    def make_batch_cache(self, batch_size: int, max_seq_len: int) -> list[BatchingKvCache]:
        """A cache for a batch of up to `batch_size` requests of at most `max_seq_len` tokens, one per layer."""
        # TODO: a BatchingKvCache(batch_size, max_seq_len) for each layer
        raise NotImplementedError(
            "Week 2 Day 5 Task 3 (book/src/week2-05-batching-the-model.md): one BatchingKvCache per layer"
        )
