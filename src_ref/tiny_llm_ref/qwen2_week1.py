"""The Qwen2 model, week 1 edition: every token recomputed on every call (no KV cache yet)."""

import mlx.core as mx

from .attention import scaled_dot_product_attention_grouped
from .basics import linear
from .embedding import Embedding
from .layer_norm import RMSNorm
from .mlp import Qwen2MLP
from .positional_encoding import RoPE
from .weights import bias_of, dequantize_linear


class Qwen2MultiHeadAttention:
    """Qwen2's self-attention: biased q/k/v projections, RoPE on queries and keys, grouped-query attention.

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
        """Keep the weights and build the RoPE (Qwen2 uses the non-traditional layout)."""
        # BEGIN TASK Week 1 Day 5 Task 1: Qwen2 attention
        # TODO: keep the weights; build RoPE(head_dim, max_seq_len, theta)
        assert hidden_size % num_heads == 0 and num_heads % num_kv_heads == 0
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.scale = self.head_dim**-0.5
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.bq, self.bk, self.bv = bq, bk, bv
        self.rope = RoPE(self.head_dim, max_seq_len, theta, traditional=False)
        # END TASK

    def __call__(self, x: mx.array, mask: mx.array | str | None) -> mx.array:
        """`B x L x E` -> `B x L x E`; the tokens are at positions 0 .. L-1; `mask` as in grouped attention."""
        # BEGIN TASK Week 1 Day 5 Task 1: Qwen2 attention
        # TODO: q/k/v projections with biases, reshape to B x L x H x D, RoPE on q and k,
        # TODO: transpose to B x H x L x D, grouped attention, transpose back, o_proj
        b, l, _ = x.shape
        # Project and split into heads, keeping the B x L x H x D layout that RoPE expects.
        q = linear(x, self.wq, self.bq).reshape(b, l, self.num_heads, self.head_dim)
        k = linear(x, self.wk, self.bk).reshape(b, l, self.num_kv_heads, self.head_dim)
        v = linear(x, self.wv, self.bv).reshape(b, l, self.num_kv_heads, self.head_dim)
        # Positions enter only through queries and keys: their dot product then depends on the distance.
        q = self.rope(q, offset=0)
        k = self.rope(k, offset=0)
        # Attention wants heads before the sequence: B x H x L x D.
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        out = scaled_dot_product_attention_grouped(q, k, v, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(b, l, self.hidden_size)
        return linear(out, self.wo)
        # END TASK


class Qwen2TransformerBlock:
    """One decoder layer: x + attention(norm(x)), then h + mlp(norm(h)) (pre-norm residual blocks)."""

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
        """Build the two norms, the attention and the MLP from their weights."""
        # BEGIN TASK Week 1 Day 5 Task 2: transformer block
        # TODO: two RMSNorms, the attention, the MLP
        self.input_layernorm = RMSNorm(hidden_size, w_input_layernorm, eps=rms_norm_eps)
        self.self_attn = Qwen2MultiHeadAttention(
            hidden_size, num_attention_heads, num_kv_heads, wq, wk, wv, wo, bq, bk, bv, max_seq_len, theta
        )
        self.post_attention_layernorm = RMSNorm(hidden_size, w_post_attention_layernorm, eps=rms_norm_eps)
        self.mlp = Qwen2MLP(hidden_size, intermediate_size, w_gate, w_up, w_down)
        # END TASK

    def __call__(self, x: mx.array, mask: mx.array | str | None) -> mx.array:
        """`B x L x E` -> `B x L x E`."""
        # BEGIN TASK Week 1 Day 5 Task 2: transformer block
        # TODO: h = x + attn(norm(x)); out = h + mlp(norm(h))
        # Each sub-block reads a normalized copy of the residual stream and adds its result back.
        h = x + self.self_attn(self.input_layernorm(x), mask)
        return h + self.mlp(self.post_attention_layernorm(h))
        # END TASK


class Qwen2ModelWeek1:
    """Qwen2 from an mlx-lm model object (`mlx_lm.load`), quantized checkpoints dequantized on load."""

    def __init__(self, mlx_model):
        """Copy every weight out of `mlx_model` (an mlx-lm Qwen2 `Model`) into our own layers."""
        # BEGIN TASK Week 1 Day 5 Task 3: load the model
        # TODO: read mlx_model.args and mlx_model.model.{embed_tokens, layers, norm};
        # TODO: use dequantize_linear() for every weight matrix, bias_of() for the q/k/v biases
        args = mlx_model.args
        self.args = args
        self.num_hidden_layers = args.num_hidden_layers
        self.vocab_size = args.vocab_size
        inner = mlx_model.model  # mlx-lm keeps the decoder in .model and the optional lm_head beside it
        self.embedding = Embedding(args.vocab_size, args.hidden_size, dequantize_linear(inner.embed_tokens))
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
                    wq=dequantize_linear(attn.q_proj),
                    wk=dequantize_linear(attn.k_proj),
                    wv=dequantize_linear(attn.v_proj),
                    wo=dequantize_linear(attn.o_proj),
                    bq=bias_of(attn.q_proj),
                    bk=bias_of(attn.k_proj),
                    bv=bias_of(attn.v_proj),
                    w_gate=dequantize_linear(mlp.gate_proj),
                    w_up=dequantize_linear(mlp.up_proj),
                    w_down=dequantize_linear(mlp.down_proj),
                    w_input_layernorm=layer.input_layernorm.weight,
                    w_post_attention_layernorm=layer.post_attention_layernorm.weight,
                    max_seq_len=args.max_position_embeddings,
                    theta=args.rope_theta,
                )
            )
        self.norm = RMSNorm(args.hidden_size, inner.norm.weight, eps=args.rms_norm_eps)
        # Small Qwen2 models reuse the embedding table as the output layer ("tied" embeddings).
        self.w_lm_head = None if args.tie_word_embeddings else dequantize_linear(mlx_model.lm_head)
        # END TASK

    def __call__(self, inputs: mx.array) -> mx.array:
        """Token ids `B x L` -> logits `B x L x vocab_size`; position i sees tokens 0 .. i."""
        # BEGIN TASK Week 1 Day 5 Task 3: the full model
        # TODO: embed, every block with mask="causal", norm, output layer
        h = self.embedding(inputs)
        for layer in self.layers:
            h = layer(h, mask="causal")
        h = self.norm(h)
        if self.w_lm_head is None:
            return self.embedding.as_linear(h)
        return linear(h, self.w_lm_head)
        # END TASK
