"""Week 2 Day 5: batching the model (book/src/week2-05-batching-the-model.md).

Oracles: a mask built here position by position; mx.fast.rope with one offset per row and
mx.fast.scaled_dot_product_attention for one attention layer; mlx-lm's own Qwen2 run on each request
alone for the whole model. Requests sit in scrambled slots next to an idle one, and one leaves and
another takes its slot mid-run, so a cache that mixes up slots fails.
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.harness import class_of, solution

sol = solution(week=2, day=5)

ATOL = RTOL = 1e-3
NEG_INF = float("-inf")


def assert_close(actual, expected, what):
    np.testing.assert_allclose(np.array(actual), np.array(expected), rtol=RTOL, atol=ATOL, err_msg=what)


def normal(shape, seed, scale=1.0):
    return mx.random.normal(shape, key=mx.random.key(seed)) * scale


def prefilled(length, heads=2, dim=8, seed=0):
    """A one-request cache holding `length` tokens: day 2.1's, which in this day's code is the reference's (so Task 1
    is graded on its own), built where the batching cache under test reads it."""
    cache = sol.kv_cache.TinyKvFullCache()
    keys, values = normal((1, heads, length, dim), seed), normal((1, heads, length, dim), seed + 1000)
    cache.update_and_fetch(keys, values)
    return cache, keys, values


def expected_mask(held: list[int | None], length: int, seq_len: int) -> np.ndarray:
    """B x 1 x L x S, built position by position: row b's keys fill its last held[b] columns."""
    mask = np.full((len(held), 1, length, seq_len), NEG_INF, dtype=np.float32)
    for b, n in enumerate(held):
        if n is None:
            continue  # an idle slot sees nothing
        for i in range(length):
            query_position = n - length + i  # position of new token i within its own request
            for column in range(seq_len):
                key_position = column - (seq_len - n)  # right-aligned: the last column is position n - 1
                if 0 <= key_position <= query_position:
                    mask[b, 0, i, column] = 0.0
    return mask


# ---------------------------------------------------------------- Task 1: slots and the aligned mask

def test_task_1_slot_bookkeeping_errors():
    cache = sol.kv_cache.BatchingKvCache(max_active_requests=2, max_seq_len=16)
    cache.add_request(prefilled(3)[0], 1)
    with pytest.raises(ValueError):
        cache.add_request(prefilled(3)[0], 1)  # slot taken
    with pytest.raises(ValueError):
        cache.add_request(prefilled(3)[0], 2)  # no such slot
    cache.remove_request(1)
    with pytest.raises(ValueError):
        cache.remove_request(1)  # already free


@pytest.mark.parametrize("length, held, seq_len", [(1, 4, 6), (3, 5, 9), (2, 2, 2), (1, 1, 7)])
def test_task_1_aligned_causal_mask(length, held, seq_len):
    mask = sol.kv_cache.aligned_causal_mask(length, held, seq_len, mx.float32)
    assert mask.shape == (length, seq_len) and mask.dtype == mx.float32
    np.testing.assert_array_equal(np.array(mask), expected_mask([held], length, seq_len)[0, 0])


# ---------------------------------------------------------------- Task 2: every row at its own position

def test_task_2_add_update_remove_by_slot():
    cache = sol.kv_cache.BatchingKvCache(max_active_requests=4, max_seq_len=64)
    a, a_keys, a_values = prefilled(5, seed=1)
    c, c_keys, c_values = prefilled(3, seed=2)
    cache.add_request(a, 2)  # slots 0, 1 and 3 stay idle
    cache.add_request(c, 0)
    new_keys, new_values = normal((4, 2, 1, 8), 3), normal((4, 2, 1, 8), 4)
    keys, values, seq_len, mask = cache.update_and_fetch(new_keys, new_values, mask_length=1, mask="causal")
    # Slot 2 holds 5 + 1 tokens, slot 0 holds 3 + 1: S = 6, each request in its last columns.
    assert seq_len == 6 and keys.shape == (4, 2, 6, 8) and values.shape == (4, 2, 6, 8)
    assert mask.shape == (4, 1, 1, 6)
    assert_close(keys[2], mx.concatenate([a_keys, new_keys[2:3]], axis=2)[0], "slot 2's keys")
    assert_close(values[2], mx.concatenate([a_values, new_values[2:3]], axis=2)[0], "slot 2's values")
    assert_close(keys[0, :, 2:], mx.concatenate([c_keys, new_keys[0:1]], axis=2)[0], "slot 0's keys, right-aligned")
    assert_close(values[0, :, 2:], mx.concatenate([c_values, new_values[0:1]], axis=2)[0], "slot 0's values")
    np.testing.assert_array_equal(np.array(mask), expected_mask([4, None, 6, None], 1, 6))

    # Slot 2's request leaves; a new one takes slot 2; slot 0 goes on undisturbed.
    cache.remove_request(2)
    d, d_keys, _ = prefilled(2, seed=5)
    cache.add_request(d, 2)
    step_keys, step_values = normal((4, 2, 1, 8), 6), normal((4, 2, 1, 8), 7)
    keys, values, seq_len, mask = cache.update_and_fetch(step_keys, step_values)
    assert seq_len == 5, "slot 0 now holds 5 tokens, the new request in slot 2 holds 3"
    assert_close(keys[0], mx.concatenate([c_keys, new_keys[0:1], step_keys[0:1]], axis=2)[0], "slot 0 after a step")
    assert_close(keys[2, :, 2:], mx.concatenate([d_keys, step_keys[2:3]], axis=2)[0], "the new request in slot 2")
    np.testing.assert_array_equal(np.array(mask), expected_mask([5, None, 3, None], 1, 5))


def test_task_2_rows_must_match_the_slots():
    cache = sol.kv_cache.BatchingKvCache(max_active_requests=2, max_seq_len=16)
    cache.add_request(prefilled(3)[0], 1)
    with pytest.raises(ValueError):
        cache.update_and_fetch(normal((3, 2, 1, 8), 0), normal((3, 2, 1, 8), 1))  # 3 rows for 2 slots


def test_task_1_a_batch_of_held_slots_only():
    """Rows for the held slots only (in slot order): each gets what its slot gets in the full batch."""
    full, compact = (sol.kv_cache.BatchingKvCache(max_active_requests=5, max_seq_len=32) for _ in range(2))
    for cache in (full, compact):
        for slot, length in ((3, 6), (1, 3)):
            cache.add_request(prefilled(length, seed=slot)[0], slot)
    new_keys, new_values = normal((5, 2, 1, 8), 8), normal((5, 2, 1, 8), 9)
    keys_f, values_f, seq_len_f, mask_f = full.update_and_fetch(new_keys, new_values)
    rows = mx.array([1, 3])  # the held slots, in slot order
    keys_c, values_c, seq_len_c, mask_c = compact.update_and_fetch(new_keys[rows], new_values[rows])
    assert seq_len_c == seq_len_f and keys_c.shape[0] == 2
    for row, slot in enumerate([1, 3]):
        for got, want in ((keys_c, keys_f), (values_c, values_f), (mask_c, mask_f)):
            np.testing.assert_array_equal(np.array(got[row]), np.array(want[slot]), err_msg=f"row {row} = slot {slot}")
    with pytest.raises(ValueError):
        compact.update_and_fetch(new_keys[:3], new_values[:3])  # 3 rows: neither 5 slots nor 2 held


@pytest.mark.parametrize("length", [1, 3])
def test_task_2_mask_values(length):
    held_before = [7, None, 2, 4, None]
    cache = sol.kv_cache.BatchingKvCache(max_active_requests=5, max_seq_len=64)
    for slot, n in enumerate(held_before):
        if n is not None:
            cache.add_request(prefilled(n, seed=slot)[0], slot)
    _, _, seq_len, mask = cache.update_and_fetch(normal((5, 2, length, 8), 8), normal((5, 2, length, 8), 9),
                                                 mask_length=length)
    held = [None if n is None else n + length for n in held_before]
    assert seq_len == 7 + length
    assert mask.shape == (5, 1, length, seq_len)
    np.testing.assert_array_equal(np.array(mask), expected_mask(held, length, seq_len))


def test_task_2_batched_attention_equals_each_alone():
    # What the mask is for: attention over the padded batch equals each request's attention alone.
    lengths = {0: 6, 2: 1, 3: 9}  # slot -> tokens held before this step; slot 1 is idle
    heads_q, heads_kv, dim = 4, 2, 8
    cache = sol.kv_cache.BatchingKvCache(max_active_requests=4, max_seq_len=32)
    alone = {}
    for slot, n in lengths.items():
        request, keys, values = prefilled(n, heads=heads_kv, dim=dim, seed=10 * slot)
        cache.add_request(request, slot)
        alone[slot] = (keys, values)
    new_keys, new_values = normal((4, heads_kv, 1, dim), 11), normal((4, heads_kv, 1, dim), 12)
    queries = normal((4, heads_q, 1, dim), 13)
    keys, values, _, mask = cache.update_and_fetch(new_keys, new_values, mask_length=1)
    batched = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=dim**-0.5, mask=mask)
    for slot, (k, v) in alone.items():
        k = mx.concatenate([k, new_keys[slot : slot + 1]], axis=2)
        v = mx.concatenate([v, new_values[slot : slot + 1]], axis=2)
        single = mx.fast.scaled_dot_product_attention(queries[slot : slot + 1], k, v, scale=dim**-0.5)
        assert_close(batched[slot], single[0], f"slot {slot}: batched attention vs the request alone")


HIDDEN, HEADS, KV_HEADS, THETA = 64, 4, 2, 10000
HEAD_DIM = HIDDEN // HEADS


@pytest.fixture(scope="module")
def attention_weights():
    kv = KV_HEADS * HEAD_DIM
    s = HIDDEN**-0.5
    return dict(
        wq=normal((HIDDEN, HIDDEN), 20, s), wk=normal((kv, HIDDEN), 21, s), wv=normal((kv, HIDDEN), 22, s),
        wo=normal((HIDDEN, HIDDEN), 23, s), bq=normal((HIDDEN,), 24, 0.1), bk=normal((kv,), 25, 0.1),
        bv=normal((kv,), 26, 0.1),
    )


def oracle_attention(x, offsets, w):
    """Causal self-attention of `x` (B x L x E), row b at positions offsets[b].., from mx.fast kernels."""
    b, l, _ = x.shape
    q = (x @ w["wq"].T + w["bq"]).reshape(b, l, HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
    k = (x @ w["wk"].T + w["bk"]).reshape(b, l, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
    v = (x @ w["wv"].T + w["bv"]).reshape(b, l, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
    rope = dict(dims=HEAD_DIM, traditional=False, base=THETA, scale=1.0, offset=mx.array(offsets))
    q, k = mx.fast.rope(q, **rope), mx.fast.rope(k, **rope)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM**-0.5, mask="causal")
    return out.transpose(0, 2, 1, 3).reshape(b, l, HIDDEN) @ w["wo"].T


def our_attention(w):
    return sol.qwen2_week2.Qwen2MultiHeadAttention(HIDDEN, HEADS, KV_HEADS, max_seq_len=1024, theta=THETA, **w)


@pytest.mark.parametrize("new", [1, 4])
def test_task_2_rows_at_their_own_positions_through_the_batch_cache(attention_weights, new):
    # Requests of 3, 8 and 5 tokens are prefilled alone, then run `new` more tokens each in one batch,
    # each row at its own position, with your batching cache's mask (slot 1 idle).
    attention = our_attention(attention_weights)
    lengths = {0: 3, 2: 8, 3: 5}
    sequences = {slot: normal((1, n + new, HIDDEN), 40 + slot) for slot, n in lengths.items()}
    batch_cache = sol.kv_cache.BatchingKvCache(4, 64)
    for slot, n in lengths.items():
        request_cache = sol.kv_cache.TinyKvFullCache()  # day 2.1's: the reference's in this day's code
        attention(sequences[slot][:, :n], 0, request_cache)
        batch_cache.add_request(request_cache, slot)
    x = mx.zeros((4, new, HIDDEN))
    offsets = [0, 0, 0, 0]
    for slot, n in lengths.items():
        x[slot] = sequences[slot][0, n:]
        offsets[slot] = n
    out = attention(x, offsets, batch_cache)
    for slot, n in lengths.items():
        expected = oracle_attention(sequences[slot], [0], attention_weights)[0, n:]
        assert_close(out[slot], expected, f"slot {slot}: {new} new tokens at positions {n}..")


# ---------------------------------------------------------------- Task 3: the model runs a batch

TEXT = (
    "Continuous batching keeps every decode slot busy: when one request finishes, the next one takes its "
    "place, and the model runs all of them together, each at its own position in its own sequence."
)


@pytest.fixture(scope="module")
def our_model(model32):
    return sol.qwen2_week2.Qwen2ModelWeek2(model32[0])


@pytest.fixture(scope="module")
def token_ids(model32):
    ids = model32[1].encode(TEXT, add_special_tokens=False)
    assert len(ids) >= 30
    return ids


def test_task_3_make_batch_cache(our_model):
    cache = our_model.make_batch_cache(3, 128)
    assert len(cache) == our_model.num_hidden_layers
    assert all(class_of(c) is sol.kv_cache.BatchingKvCache for c in cache)
    assert all(c.max_active_requests == 3 and c.max_seq_len == 128 for c in cache)
    assert cache[0] is not cache[1], "one cache object per layer"


def test_task_3_batched_decode_equals_each_alone(model32, our_model, token_ids):
    mlx_model = model32[0]
    # Four requests: different texts, different prompt lengths. Each one's "future" tokens are fixed,
    # so every step can be checked against mlx-lm's logits for that request's whole sequence.
    starts = {"A": 0, "B": 3, "C": 7, "D": 11}
    prompt_len = {"A": 5, "B": 9, "C": 14, "D": 7}
    sequence = {r: token_ids[starts[r] : starts[r] + prompt_len[r] + 4] for r in starts}
    oracle = {r: mlx_model(mx.array([seq]))[0] for r, seq in sequence.items()}  # L x vocab, no cache

    def prefill(request):
        cache = our_model.make_cache()
        logits = our_model(mx.array([sequence[request][: prompt_len[request]]]), 0, cache)
        assert_close(logits[0, -1], oracle[request][prompt_len[request] - 1], f"{request}: prefill")
        return cache

    def admit(request, slot):
        for layer_cache, request_cache in zip(batch_cache, prefill(request)):
            layer_cache.add_request(request_cache, slot)
        position[request] = prompt_len[request]
        slot_of[request] = slot

    def step():
        # One decode step for every active request, each in its own row, at its own position.
        inputs, offsets = [0] * 4, [0] * 4
        for request, slot in slot_of.items():
            inputs[slot] = sequence[request][position[request]]
            offsets[slot] = position[request]
        logits = our_model(mx.array(inputs)[:, None], offsets, batch_cache)
        assert logits.shape == (4, 1, our_model.vocab_size)
        for request, slot in slot_of.items():
            expected = oracle[request][position[request]]
            assert_close(logits[slot, 0], expected, f"{request} in slot {slot} at position {position[request]}")
            assert int(mx.argmax(logits[slot, 0]).item()) == int(mx.argmax(expected).item()), (
                f"{request}: the batched next token differs from the request decoded alone")
            position[request] += 1

    batch_cache = our_model.make_batch_cache(4, 64)
    position, slot_of = {}, {}
    admit("A", 2)  # scrambled slots, slot 1 idle
    admit("B", 0)
    admit("C", 3)
    step()
    step()
    # B leaves; D takes its slot while A and C go on.
    freed = slot_of.pop("B")
    for layer_cache in batch_cache:
        layer_cache.remove_request(freed)
    admit("D", 0)
    step()
    step()


def test_task_3_batched_next_tokens_equal_single_request_decoding(our_model, token_ids):
    # The invariant the scheduler relies on: the same greedy tokens, batched or one at a time.
    prompts = [token_ids[:6], token_ids[10:21], token_ids[4:8]]
    steps = 3

    def greedy_alone(prompt):
        cache = our_model.make_cache()
        logits = our_model(mx.array([prompt]), 0, cache)
        out, offset = [], len(prompt)
        for _ in range(steps):
            token = int(mx.argmax(logits[0, -1]).item())
            out.append(token)
            logits = our_model(mx.array([[token]]), offset, cache)
            offset += 1
        return out

    expected = [greedy_alone(p) for p in prompts]
    batch_cache = our_model.make_batch_cache(3, 64)
    slots = [1, 2, 0]
    next_tokens, offsets = [0] * 3, [0] * 3
    for prompt, slot in zip(prompts, slots):
        cache = our_model.make_cache()
        logits = our_model(mx.array([prompt]), 0, cache)
        for layer_cache, request_cache in zip(batch_cache, cache):
            layer_cache.add_request(request_cache, slot)
        next_tokens[slot] = int(mx.argmax(logits[0, -1]).item())
        offsets[slot] = len(prompt)
    got = [[] for _ in prompts]
    for _ in range(steps):
        for i, slot in enumerate(slots):
            got[i].append(next_tokens[slot])
        logits = our_model(mx.array(next_tokens)[:, None], offsets, batch_cache)
        next_tokens = [int(t) for t in mx.argmax(logits[:, 0], axis=-1).tolist()]
        offsets = [o + 1 for o in offsets]
    assert got == expected
