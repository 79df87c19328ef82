"""Week 2 Day 4: flash attention (book/src/week2-04-flash-attention.md).

Oracles: a causal mask written with numpy; mx.fast.scaled_dot_product_attention (MLX's fused
attention, grouped-query heads included) on random inputs whose sizes are not multiples of the tiles;
MLX's peak-memory counter for "never the whole score matrix"; the reference's week-2 model, run here through
the same marked flash attention as the model under test (tests/actor_fakes/week2_models.py), for the prefill
with tiles, one-shot and in chunks after cached tokens, and the plain decode step after them.
"""

import contextlib

import mlx.core as mx
import numpy as np
import pytest

from tests.actor_fakes import week2_models as here
from tests.harness import actor_fakes, reference, solution

sol = solution(week=2, day=4)
ref = reference()

ATOL = 1e-5  # float32 attention outputs of size ~1; summation order differs by ~1e-7


def numpy_causal_mask(L, S):
    query_positions = np.arange(L)[:, None] + (S - L)
    return np.where(np.arange(S)[None, :] <= query_positions, 0.0, -np.inf).astype(np.float32)


def random_qkv(b, h_q, h, l, s, d, seed):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((b, h_q, l, d), key=k1), mx.random.normal((b, h, s, d), key=k2),
            mx.random.normal((b, h, s, d), key=k3))


def fused_attention(q, k, v, mask):
    """MLX's own attention; "causal" as an explicit L x S mask, so that L < S means a chunk after the cache."""
    if isinstance(mask, str):
        mask = mx.array(numpy_causal_mask(q.shape[-2], k.shape[-2]))
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask)


def assert_close(actual, expected, what, atol=ATOL):
    np.testing.assert_allclose(np.array(actual), np.array(expected), atol=atol, rtol=1e-4, err_msg=what)


# ---------------------------------------------------------------- Task 1: a tile of the causal mask

@pytest.mark.parametrize("L,S", [(7, 7), (3, 8), (13, 40), (1, 9)])
@pytest.mark.parametrize("tile_q,tile_kv", [(4, 4), (5, 3), (64, 64)])
def test_task_1_tiles_make_the_causal_mask(L, S, tile_q, tile_kv):
    expected = numpy_causal_mask(L, S)
    for q_start in range(0, L, tile_q):
        q_len = min(tile_q, L - q_start)
        for k_start in range(0, S, tile_kv):
            k_len = min(tile_kv, S - k_start)
            tile = sol.flash_attention.tile_causal_mask(q_start, q_len, k_start, k_len, L, S)
            assert tile.shape == (q_len, k_len)
            np.testing.assert_array_equal(np.array(tile), expected[q_start:q_start + q_len, k_start:k_start + k_len],
                                          err_msg=f"tile at rows {q_start}.., columns {k_start}..")


def test_task_1_chunk_after_cached_tokens():
    # 5 tokens cached, 3 new: the new row 0 sits at position 5 and sees 6 keys.
    mask = np.array(sol.flash_attention.tile_causal_mask(0, 3, 0, 8, 3, 8))
    assert (mask == 0).sum(axis=1).tolist() == [6, 7, 8]


# ---------------------------------------------------------------- Task 2: tiled attention

SHAPES = [  # (B, H_q, H, L, S, D): lengths that are not multiples of the tiles, GQA, a chunk (L < S)
    (1, 4, 4, 37, 37, 16),
    (2, 6, 2, 50, 50, 8),
    (1, 14, 2, 45, 130, 64),
    (3, 4, 1, 1, 23, 8),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", [None, "causal"])
def test_task_2_flash_attention_matches_mlx(shape, mask):
    b, h_q, h, l, s, d = shape
    q, k, v = random_qkv(*shape, seed=sum(shape))
    expected = fused_attention(q, k, v, mask)
    for tile_q, tile_kv in [(16, 24), (7, 5), (128, 128)]:
        out = sol.flash_attention.flash_attention(q, k, v, mask=mask, tile_q=tile_q, tile_kv=tile_kv)
        assert out.shape == (b, h_q, l, d)
        assert_close(out, expected, f"mask={mask}, tiles {tile_q} x {tile_kv}")


def test_task_2_flash_attention_array_mask_and_scale():
    # A batching cache's B x 1 x L x S mask: row 1 is left-padded, so its first key tile is all -inf.
    q, k, v = random_qkv(2, 6, 3, 20, 33, 16, seed=5)
    allowed = numpy_causal_mask(20, 33)[None].repeat(2, axis=0)
    allowed[1, :, :12] = -np.inf
    mask = mx.array(allowed)[:, None]
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    out = sol.flash_attention.flash_attention(q, k, v, scale=0.3, mask=mask, tile_q=8, tile_kv=8)
    assert_close(out, expected, "B x 1 x L x S array mask, scale 0.3")


def test_task_2_flash_attention_keeps_dtype_and_rejects_bad_mask():
    q, k, v = (t.astype(mx.bfloat16) for t in random_qkv(1, 2, 1, 9, 9, 8, seed=2))
    assert sol.flash_attention.flash_attention(q, k, v, mask="causal", tile_q=4, tile_kv=4).dtype == mx.bfloat16
    with pytest.raises(ValueError, match="causal"):
        sol.flash_attention.flash_attention(q, k, v, mask="upper")


def test_task_2_flash_attention_never_holds_the_score_matrix():
    # One head, 2,048 queries and keys: the float32 score matrix alone is 16 MiB, and plain attention
    # holds several of them (about 68 MiB at its peak). Tiles of 128 x 128, with each query tile
    # evaluated before the next, peak near 1 MiB; without those evaluations MLX schedules all the
    # tiles as one graph and peaks near 9 MiB.
    q, k, v = random_qkv(1, 1, 1, 2048, 2048, 32, seed=9)
    mx.eval(q, k, v)
    score_bytes = 2048 * 2048 * 4
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(sol.flash_attention.flash_attention(q, k, v, mask="causal"))
    peak = mx.get_peak_memory() - base
    assert peak < score_bytes / 4, f"peak {peak / 2**20:.1f} MiB: the whole L x S scores were built"


@contextlib.contextmanager
def routed_through(qwen2_week2, flash):
    """While the block runs, `qwen2_week2`'s model reaches day 2.4 through `flash` (a week2_models.MarkedFlash)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(qwen2_week2, "flash_attention", flash)
        yield


def test_task_2_model_prefill_with_flash_attention(model32):
    mlx_model, _ = model32
    prompt = mx.array([[(t * 7919) % 150000 for t in range(1, 151)]])  # 150 tokens: several tiles
    decode = mx.array([[42]])

    # The week-2 model reaches flash attention through its module `flash_attention`: pointed at a MarkedFlash, built
    # where the model under test runs, around the code under test. It counts the calls and scales what it returns,
    # so the route shows in the logits: the oracle is the reference's model run here through the judge's own
    # MarkedFlash. Counts a submission rewrote would not change its logits.
    with routed_through(ref.qwen2_week2, here.MarkedFlash(ref.flash_attention)):
        oracle = ref.qwen2_week2.Qwen2ModelWeek2(mlx_model, flash_attention=True)
        oracle_cache = oracle.make_cache()
        expected = oracle(prompt, 0, oracle_cache)
        expected_decode = oracle(decode, 150, oracle_cache)
    flash = actor_fakes(sol, "week2_models").MarkedFlash(sol.flash_attention)
    with routed_through(sol.qwen2_week2, flash):
        tiled = sol.qwen2_week2.Qwen2ModelWeek2(mlx_model, flash_attention=True)
        assert_close(tiled(prompt, 0, tiled.make_cache()), expected, "one-shot prefill", atol=1e-4)
        assert flash.calls == [150] * tiled.num_hidden_layers, "every layer's prefill went through flash attention"

        # Chunked prefill: chunks after cached tokens use the chunk mask; decode (one token) stays plain.
        cache = tiled.make_cache()
        chunks = [tiled(prompt[:, start:start + 64], start, cache) for start in range(0, 150, 64)]
        assert_close(mx.concatenate(chunks, axis=1), expected, "prefill in chunks of 64", atol=1e-4)
        flash.calls = []
        assert_close(tiled(decode, 150, cache), expected_decode, "a decode step after the chunks", atol=1e-4)
        assert flash.calls == [], "a decode step (one new token) uses plain attention"
