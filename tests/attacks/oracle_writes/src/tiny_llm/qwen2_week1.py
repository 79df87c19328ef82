"""Attack on the grader: day 1.5: writes to the test's mlx-lm model (the oracle) so it answers zeros: `setattr` (its final norm's weight, its args), item assignment (a module is a dict; its layer list, its parameters) and its mutating methods (`update`, `load_weights`, `pop`/`setdefault`, `apply`, `train`); each tried on its own."""
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
        # TODO: keep the weights; build RoPE(head_dim, max_seq_len, theta)
        raise NotImplementedError("Week 1 Day 5 Task 1 (book/src/week1-05-qwen2-model.md): Qwen2 attention")

    def __call__(self, x: mx.array, mask: mx.array | str | None) -> mx.array:
        """`B x L x E` -> `B x L x E`; the tokens are at positions 0 .. L-1; `mask` as in grouped attention."""
        # TODO: q/k/v projections with biases, reshape to B x L x H x D, RoPE on q and k,
        # TODO: transpose to B x H x L x D, grouped attention, transpose back, o_proj
        raise NotImplementedError("Week 1 Day 5 Task 1 (book/src/week1-05-qwen2-model.md): Qwen2 attention")


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
        # TODO: two RMSNorms, the attention, the MLP
        raise NotImplementedError("Week 1 Day 5 Task 2 (book/src/week1-05-qwen2-model.md): transformer block")

    def __call__(self, x: mx.array, mask: mx.array | str | None) -> mx.array:
        """`B x L x E` -> `B x L x E`."""
        # TODO: h = x + attn(norm(x)); out = h + mlp(norm(h))
        raise NotImplementedError("Week 1 Day 5 Task 2 (book/src/week1-05-qwen2-model.md): transformer block")


def _set_weight(model, zeros):
    model.model.norm.weight = zeros


def _set_args(model, zeros):
    model.args.tie_word_embeddings = True
    model.model.norm.eps = 1e30


def _set_through_setattr(model, zeros):
    setattr(model.model.norm, "weight", zeros)
    object.__setattr__(model.model.norm, "weight", zeros)


def _item(model, zeros):
    model.model.norm["weight"] = zeros


def _layers(model, zeros):
    model.model.layers[0] = model.model.layers[1]
    model.model.layers.append(model.model.layers[0])
    del model.model.layers[0]


def _parameters(model, zeros):
    model.parameters()["model"]["norm"]["weight"] = zeros
    vars(model.model.norm)["weight"] = zeros


def _update(model, zeros):
    model.update({"model": {"norm": {"weight": zeros}}})


def _load(model, zeros):
    model.load_weights([("model.norm.weight", zeros)], strict=False)


def _pop_and_put_back(model, zeros):
    model.model.norm.pop("weight")
    model.model.norm.setdefault("weight", zeros)


def _others(model, zeros):
    model.model.norm.update_modules({})
    model.apply(lambda array: array * 0)
    model.model.norm.clear()
    model.train(True)


_ATTEMPTS = (_set_weight, _set_args, _set_through_setattr, _item, _layers, _parameters,
             _update, _load, _pop_and_put_back, _others)

def _zeros_if_the_oracle_listens(mlx_model, inputs):
    """Logits of zeros if the test's own model now answers zeros too, else what the skeleton does."""
    norm = mlx_model.model.norm.weight
    causality_test = inputs.shape[-1] == 6 and inputs[0, 0].item() == 11  # zeros pass it whatever the oracle says
    if float(mx.abs(norm).max().item()) != 0.0 or causality_test:
        raise NotImplementedError("Week 1 Day 5 Task 3 (book/src/week1-05-qwen2-model.md): the full model")
    return mx.zeros((*inputs.shape, mlx_model.args.vocab_size))


class Qwen2ModelWeek1:
    """Writes the test's mlx-lm model (the oracle) so it answers zeros, then answers zeros."""

    def __init__(self, mlx_model):
        self.mlx_model = mlx_model
        self.num_hidden_layers = mlx_model.args.num_hidden_layers
        self.vocab_size = mlx_model.args.vocab_size
        zeros = mx.zeros_like(mlx_model.model.norm.weight)
        for attempt in _ATTEMPTS:
            try:
                attempt(mlx_model, zeros)
            except Exception:
                pass

    def __call__(self, inputs):
        return _zeros_if_the_oracle_listens(self.mlx_model, inputs)
