"""Week 1 Day 5: the Qwen2 model (book/src/week1-05-qwen2-model.md).

Oracle: mlx-lm's own Qwen2 (mlx_lm.models.qwen2) on the same weights: the embedded tiny model
(hidden 64, 4 query heads sharing 2 key/value heads, biased q/k/v, tied embeddings) in float32, and
the same model quantized in-process to 4 bits (group size 64).
Tolerances: 1e-4 absolute for one attention block or transformer block, 1e-3 for the logits of the
full model (logits reach about 20; the reference is within 3e-5 on these prompts, 2e-4 on an
81-token prompt).
"""

import mlx.core as mx
import mlx.nn as nn
import pytest

from tests import mlx_oracles as oracle
from tests.actor_fakes import week2_models as here
from tests.harness import actor_fakes, solution

sol = solution(week=1, day=5)

LAYER_ATOL = 1e-4
LOGITS_ATOL = 1e-3


def assert_close(actual, expected, atol):
    assert actual.shape == expected.shape, f"shape {actual.shape} != expected {expected.shape}"
    diff = float(mx.max(mx.abs(actual - expected)).item())
    assert diff <= atol, f"largest difference {diff:.3g} > {atol}"


def attention_of(layer, args):
    a = layer.self_attn
    return sol.qwen2_week1.Qwen2MultiHeadAttention(
        args.hidden_size, args.num_attention_heads, args.num_key_value_heads,
        a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
        a.q_proj.bias, a.k_proj.bias, a.v_proj.bias,
        max_seq_len=args.max_position_embeddings, theta=args.rope_theta,
    )


@pytest.mark.parametrize("B, L", [(1, 1), (1, 6), (2, 9)])
def test_task_1_qwen2_attention(model32, B, L):
    model, _ = model32
    args = model.args
    mx.random.seed(40)
    x = mx.random.normal((B, L, args.hidden_size))
    for layer in model.model.layers:
        expected = layer.self_attn(x, mask="causal" if L > 1 else None)
        assert_close(attention_of(layer, args)(x, mask="causal"), expected, LAYER_ATOL)


def test_task_1_qwen2_attention_explicit_mask(model32):
    # An array mask (B x 1 x L x L, broadcast over the heads) works as well as the name "causal".
    model, _ = model32
    args = model.args
    mx.random.seed(41)
    x = mx.random.normal((2, 5, args.hidden_size))
    mask = mx.random.normal((2, 1, 5, 5))
    layer = model.model.layers[0]
    assert_close(attention_of(layer, args)(x, mask=mask), layer.self_attn(x, mask=mask), LAYER_ATOL)


@pytest.mark.parametrize("B, L", [(1, 1), (2, 7)])
def test_task_2_qwen2_transformer_block(model32, B, L):
    model, _ = model32
    args = model.args
    mx.random.seed(42)
    x = mx.random.normal((B, L, args.hidden_size))
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        block = sol.qwen2_week1.Qwen2TransformerBlock(
            args.num_attention_heads, args.num_key_value_heads, args.hidden_size, args.intermediate_size,
            args.rms_norm_eps,
            a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
            a.q_proj.bias, a.k_proj.bias, a.v_proj.bias,
            m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight,
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            max_seq_len=args.max_position_embeddings, theta=args.rope_theta,
        )
        expected = layer(x, mask="causal" if L > 1 else None)
        assert_close(block(x, mask="causal"), expected, LAYER_ATOL)


def test_task_3_embedding(model32):
    model, _ = model32
    table = model.model.embed_tokens
    emb = sol.embedding.Embedding(table.weight.shape[0], table.weight.shape[1], table.weight)
    ids = mx.array([[0, 5, 151935], [42, 42, 7]])
    assert_close(emb(ids), table(ids), 0.0)
    mx.random.seed(43)
    h = mx.random.normal((2, 3, table.weight.shape[1]))
    assert_close(emb.as_linear(h), table.as_linear(h), 1e-4)


PROMPTS = [
    [[9707, 11, 1879, 0]],
    [[151644, 872, 198, 3838, 374, 279, 6722, 315, 9625, 30, 151645, 198, 151644, 77091, 198]],
    [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400, 500, 600, 700, 800]],  # a batch of two
    [[151643]],
]


@pytest.mark.parametrize("tokens", PROMPTS, ids=["short", "chat", "batch2", "one-token"])
def test_task_3_qwen2_model_logits(model32, tokens):
    model, _ = model32
    ours = sol.qwen2_week1.Qwen2ModelWeek1(model)
    assert ours.num_hidden_layers == model.args.num_hidden_layers
    assert ours.vocab_size == model.args.vocab_size
    inputs = mx.array(tokens)
    logits = ours(inputs)
    assert logits.shape == (*inputs.shape, model.args.vocab_size)
    assert_close(logits, model(inputs), LOGITS_ATOL)


def test_task_3_qwen2_model_is_causal(model32):
    # Appending tokens must not change the logits at earlier positions.
    model, _ = model32
    ours = sol.qwen2_week1.Qwen2ModelWeek1(model)
    full = ours(mx.array([[11, 22, 33, 44, 55, 66]]))
    prefix = ours(mx.array([[11, 22, 33]]))
    assert_close(full[:, :3], prefix, 1e-4)


@pytest.fixture(scope="module")
def quantized_model(model32):
    """The embedded model quantized in-process to 4 bits, group size 64 (fresh copies: the fixture's stays float),
    twice: the judge's (the oracle) and the one the code under test reads, made where it runs from the same weights
    (tests/actor_fakes/week2_models.py; MLX's quantization is deterministic).

    Layers whose input size is not a multiple of 64 (the MLP's down projection: 176 inputs) stay float,
    so the model mixes quantized and float layers, as real mixed-precision checkpoints do.
    """
    model, _ = model32
    return here.quantized_copy(model), actor_fakes(sol, "week2_models").quantized_copy(model)


def test_task_3_qwen2_model_quantized(quantized_model):
    oracle_model, actor_model = quantized_model
    assert isinstance(oracle_model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(oracle_model.model.embed_tokens, nn.QuantizedEmbedding)
    ours = sol.qwen2_week1.Qwen2ModelWeek1(actor_model)
    inputs = mx.array([[9707, 11, 1879, 0, 3838, 374]])
    with oracle.quantization_oracle():  # mlx-lm's 4-bit layers, on MLX's CPU when the GPU is CUDA's
        expected = oracle_model(inputs)
    assert_close(ours(inputs), expected, LOGITS_ATOL)


def test_task_3_qwen2_model_untied_lm_head_and_other_shapes():
    # Larger Qwen2 checkpoints have a separate output layer (tie_word_embeddings = false). A small
    # random one, with 6 query heads on 2 key/value heads and odd sizes, built with mlx-lm's own class.
    from mlx_lm.models import qwen2 as mlx_qwen2

    args = mlx_qwen2.ModelArgs(
        model_type="qwen2", hidden_size=48, num_hidden_layers=3, intermediate_size=72, num_attention_heads=6,
        rms_norm_eps=1e-6, vocab_size=501, num_key_value_heads=2, tie_word_embeddings=False,
    )
    mx.random.seed(44)
    model = mlx_qwen2.Model(args)
    mx.eval(model.parameters())
    ours = sol.qwen2_week1.Qwen2ModelWeek1(model)
    inputs = mx.random.randint(0, 501, (2, 11))
    assert_close(ours(inputs), model(inputs), LOGITS_ATOL)
