"""Week 2 Day 7: chunked prefill (book/src/week2-07-chunked-prefill.md).

Oracles: a recording fake model (tests/actor_fakes/schedulers.py) for the order, offsets and lengths of the
model calls; numpy and MLX built-ins (mx.fast.rope, mx.fast.scaled_dot_product_attention) for the
chunk's mask and positions; one-shot prefill for chunked prefill (same logits, same KV cache);
one-request-at-a-time greedy generation by mlx-lm's own Qwen2 for the scheduler's outputs; MLX's
memory counters for materialization and peak memory; an injected clock for times, policies and logs.

The fakes, the model the scheduler runs, the logits recorder and the memory counters are where the scheduler
runs (`actor_fakes(sol, "schedulers")`); what they recorded comes back as data, and the fake model's record is
replayed by the judge's own copy of the fake (`replay`, `check_replay`) before any check reads it.

Day 2.6's parts of batch.py (a request's output, the decode slots) come from the reference here
(tests/harness.py: each day's tests run that day's tasks only).
"""

import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tests.harness import actor_fakes, reference, solution
from tests.scheduler_fakes import (
    EOS, FakeTokenizer, check_replay, expected_tokens, next_token_of, prompt_of, replay, replay_steps,
)

sol = solution(week=2, day=7, reads_text=True)
ref = reference()


PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. Chunked prefill keeps decodes flowing.",
    "a",
    "Once upon a time there was a scheduler",
    "1 2 3 4 5 6 7 8 9 10 11 12",
]
MAX_SEQ_LEN = 40


@pytest.fixture
def batch():
    """The batch module under test."""
    return sol.batch


@pytest.fixture
def fakes():
    """tests/actor_fakes/schedulers.py where the scheduler runs: its fakes are built there."""
    return actor_fakes(sol, "schedulers")


@pytest.fixture
def real(model32):
    """(Qwen2ModelWeek2 where the scheduler runs, mlx-lm model, tokenizer) on the embedded weights, float32.

    The scheduler's model is built from the package under test, where every task but this day's is the
    reference's: day 2.1's model and day 2.5's batching cache."""
    mlx_model, tokenizer = model32
    return sol.qwen2_week2.Qwen2ModelWeek2(mlx_model), mlx_model, tokenizer


@pytest.fixture(scope="module")
def oracle_model(model32):
    """The reference's Qwen2ModelWeek2 here, in the judge: the one-shot prefill the chunked one is checked against."""
    return ref.qwen2_week2.Qwen2ModelWeek2(model32[0])


def mlx_lm_greedy(mlx_model, tokenizer, prompt: str, max_seq_len: int) -> list[int]:
    """One request at a time, with mlx-lm's model and cache: the oracle for the embedded model."""
    tokens = tokenizer.encode(prompt, add_special_tokens=False)
    cache = make_prompt_cache(mlx_model)
    logits = mlx_model(mx.array([tokens]), cache=cache)
    output = []
    while True:
        token = int(mx.argmax(logits[0, -1]).item())
        if token in tokenizer.eos_token_ids:
            return output
        output.append(token)
        if len(tokens) + len(output) >= max_seq_len:
            return output
        logits = mlx_model(mx.array([[token]]), cache=cache)


@pytest.fixture(scope="module")
def oracle_tokens(model32):
    mlx_model, tokenizer = model32
    return [mlx_lm_greedy(mlx_model, tokenizer, p, MAX_SEQ_LEN) for p in PROMPTS]


def run_scheduler(fakes, batch, model, tokenizer, prompts, watch=False, texts=False, **settings):
    """Drive a SlotScheduler to the end, as batch_generate does, where it runs (`drive`): its finished requests,
    with `watch` its slots after every step, and the fake model's record (None for a real model)."""
    scheduler = batch.SlotScheduler(model, tokenizer, **settings)
    return fakes.drive(scheduler, prompts, model, watch=watch, texts=texts)


def run_fake(fakes, batch, model, prompts, eos=True, **settings):
    """run_scheduler on the fake `model` (made with `eos`); its record, replayed by the judge and checked against
    the outputs, comes back as that replay."""
    run = run_scheduler(fakes, batch, model, fakes.FakeTokenizer(), prompts, **settings)
    tape = replay(run["events"], eos=eos)
    check_replay(tape, run["finished"], prompts)
    return run, tape


def prefill_calls(model, eos=True):
    """The prefill calls of a fake model's record, replayed by the judge."""
    return [c for c in replay(model.record(), eos=eos).calls if c.kind == "prefill"]


def prefill_all(request) -> list[int]:
    """Call try_prefill until the prefill is done; the tokens each call reported."""
    sizes = []
    while not request.is_prefill_done:
        sizes.append(request.try_prefill())
    return sizes


def eos_free_prompt(length: int, tokens_needed: int, seed: int = 0) -> str:
    """A fake prompt of `length` tokens whose greedy continuation has no EOS for `tokens_needed` tokens."""
    tokenizer = FakeTokenizer()
    for s in range(seed, seed + 500):
        prompt = prompt_of(length, s)
        output, _ = expected_tokens(tokenizer.encode(prompt), length + tokens_needed)
        if len(output) == tokens_needed:
            return prompt
    raise AssertionError("no such prompt")


# ---------------------------------------------------------------- Task 1: the chunk's mask and positions


def numpy_chunk_mask(offset: int, length: int) -> np.ndarray:
    mask = np.full((length, offset + length), -np.inf, dtype=np.float32)
    for i in range(length):
        mask[i, : offset + i + 1] = 0.0
    return mask


@pytest.mark.parametrize("offset, length", [(0, 1), (0, 6), (5, 3), (7, 1), (3, 9), (20, 4)])
def test_task_1_chunk_causal_mask(batch, offset, length):
    mask = batch.chunk_causal_mask(offset, length, mx.float32)
    assert mask.shape == (length, offset + length) and mask.dtype == mx.float32
    np.testing.assert_array_equal(np.array(mask), numpy_chunk_mask(offset, length))
    np.testing.assert_array_equal(np.array(batch.chunk_positions(offset, length)), np.arange(offset, offset + length))


def test_task_1_contract_example(batch):
    """With 5 tokens cached and 3 new, row 0 sees 6 keys (and rows 1, 2 see 7, 8)."""
    mask = np.array(batch.chunk_causal_mask(5, 3, mx.float32))
    assert [(row == 0).sum() for row in mask] == [6, 7, 8]
    assert np.array(batch.chunk_causal_mask(9, 1, mx.float32)).tolist() == [[0.0] * 10], "a decode row sees all"


def numpy_rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Non-traditional RoPE of `... x L x D` at the given absolute positions."""
    half = x.shape[-1] // 2
    freqs = base ** (-np.arange(half, dtype=np.float64) * 2 / x.shape[-1])
    angles = positions[:, None] * freqs[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(np.float32)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 11, 20])
def test_task_1_chunked_attention_equals_one_shot(batch, chunk):
    """RoPE at the chunk's positions and attention under its mask, chunk by chunk, give one-shot attention."""
    total, heads, dim, base = 11, 2, 8, 10000.0
    q, k, v = (mx.random.normal((1, heads, total, dim), key=mx.random.key(s)) for s in (1, 2, 3))
    rope = lambda x: mx.fast.rope(x, dim, traditional=False, base=base, scale=1.0, offset=0)  # noqa: E731
    one_shot = mx.fast.scaled_dot_product_attention(rope(q), rope(k), v, scale=dim**-0.5, mask="causal")
    keys = []
    outputs = []
    for start in range(0, total, chunk):
        length = min(chunk, total - start)
        positions = np.array(batch.chunk_positions(start, length)).astype(np.float64)
        q_chunk = mx.array(numpy_rope(np.array(q[:, :, start : start + length]), positions, base))
        keys.append(mx.array(numpy_rope(np.array(k[:, :, start : start + length]), positions, base)))
        mask = batch.chunk_causal_mask(start, length, mx.float32)
        outputs.append(mx.fast.scaled_dot_product_attention(
            q_chunk, mx.concatenate(keys, axis=2), v[:, :, : start + length], scale=dim**-0.5, mask=mask))
    np.testing.assert_allclose(np.array(mx.concatenate(outputs, axis=2)), np.array(one_shot), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- Task 2: materialize the KV cache


def kv_bytes(model, tokens: int) -> int:
    args = model.args
    head_dim = args.hidden_size // args.num_attention_heads
    return tokens * args.num_hidden_layers * 2 * args.num_key_value_heads * head_dim * 4  # float32


def test_task_2_materialize_cache_computes_keys_and_values(batch, fakes, real):
    model, mlx_model, tokenizer = real
    ids = tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    cache = model.make_cache()
    fakes.call_lazily(model, ids, 0, cache)  # lazy: nothing computed yet
    before = fakes.active_memory()  # measured where the cache is
    batch.materialize_cache(cache)
    grown = fakes.active_memory() - before
    # Allocator accounting is not byte-exact; left lazy, the cache would have grown by ~0 bytes.
    assert grown >= kv_bytes(mlx_model, len(ids)) / 2, f"the cache's arrays must be computed (grew {grown} bytes)"


# ---------------------------------------------------------------- Task 3: Request.try_prefill


def test_task_3_seven_tokens_in_chunks_of_three(batch, fakes):
    model, tokenizer = fakes.FakeModel(), FakeTokenizer()
    prompt = "abcdefg"
    ids = tokenizer.encode(prompt)
    request = batch.Request(model, fakes.FakeTokenizer(), prompt, prefill_max_step=3, prompt_idx=2)
    progress = []
    for _ in range(3):
        assert not request.is_prefill_done and request.next_token is None
        ran = request.try_prefill()
        progress.append((ran, request.offset, request.is_prefill_done))
    assert progress == [(3, 3, False), (3, 6, False), (1, 7, True)]
    tape = replay(model.record())
    calls = [(c.tokens, c.offset) for c in tape.calls if c.kind == "prefill"]
    assert calls == [(ids[0:3], 0), (ids[3:6], 3), (ids[6:7], 6)], "chunks of at most 3 at their absolute offsets"
    first = next_token_of(ids)
    assert request.next_token == first, "the last chunk picks the first output token (greedy)"
    assert tape.generations() == [(tuple(ids), (first,))], "the replayed chunks predict that token"
    assert request.output_tokens == ([] if first == EOS else [first])
    with pytest.raises(ValueError):
        request.try_prefill()
    assert model.num_calls == 3, "a try_prefill after the prefill is done must not call the model"


@pytest.mark.parametrize("length, calls", [(4, 1), (5, 1), (6, 2), (1, 1), (11, 3)])
def test_task_3_prompt_shorter_equal_longer_than_a_chunk(batch, fakes, length, calls):
    model, tokenizer = fakes.FakeModel(), FakeTokenizer()
    prompt = prompt_of(length, seed=length)
    request = batch.Request(model, fakes.FakeTokenizer(), prompt, prefill_max_step=5)
    sizes = prefill_all(request)
    tape = replay(model.record())
    chunks = [c for c in tape.calls if c.kind == "prefill"]
    assert len(chunks) == calls and sum(sizes) == length and all(1 <= s <= 5 for s in sizes)
    assert [c.offset for c in chunks] == [5 * i for i in range(calls)]
    assert request.offset == length
    first = next_token_of(tokenizer.encode(prompt))
    assert request.next_token == first
    assert tape.generations() == [(tuple(tokenizer.encode(prompt)), (first,))], "the replayed chunks predict it"


def test_task_3_bad_input_fails_before_any_model_call(batch, fakes):
    model, tokenizer = fakes.FakeModel(), fakes.FakeTokenizer()
    request = batch.Request(model, tokenizer, "xy", prefill_max_step=1)
    assert prefill_all(request) == [1, 1]
    for kwargs in (dict(prompt="abc", prefill_max_step=0), dict(prompt=""), dict(prompt="abcdef", max_seq_len=6)):
        model = fakes.FakeModel()
        with pytest.raises(ValueError):
            batch.Request(model, tokenizer, **kwargs)
        # Taken on trust: no sound check exists. A call whose result is thrown away before the error shows in no
        # output (a fake that failed on a call instead could be switched off as easily as this record rewritten).
        assert replay(model.record()).calls == []


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, None])
def test_task_3_chunked_prefill_equals_one_shot(batch, fakes, real, oracle_model, chunk):
    """Same logits at every prompt position and the same KV cache (the next decode step agrees)."""
    model, _, tokenizer = real
    prompt = PROMPTS[1]
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    chunk = chunk or len(ids) + 5  # None: one chunk longer than the prompt

    one_shot_cache = oracle_model.make_cache()
    one_shot = oracle_model(mx.array([ids]), 0, one_shot_cache)

    recorder = fakes.LogitsRecorder(model)
    request = batch.Request(recorder, tokenizer, prompt, prefill_max_step=chunk)
    sizes = prefill_all(request)
    assert sizes == [min(chunk, len(ids) - s) for s in range(0, len(ids), chunk)]
    chunked = mx.concatenate(recorder.outputs, axis=1)
    np.testing.assert_allclose(np.array(chunked), np.array(one_shot), rtol=1e-3, atol=1e-3)
    assert request.next_token == int(mx.argmax(one_shot[0, -1]).item())
    assert request.offset == len(ids) == one_shot_cache[0].offset

    # The caches agree if the next decode step on each gives the same logits.
    probe = mx.array([[request.next_token]])
    after_chunked = model(probe, len(ids), request.kv_cache)
    after_one_shot = oracle_model(probe, len(ids), one_shot_cache)
    np.testing.assert_allclose(np.array(after_chunked), np.array(after_one_shot), rtol=1e-3, atol=1e-3)


def test_task_3_chunks_go_to_the_model_with_their_chunk_mask(batch, fakes):
    """The model gets `chunk_causal_mask(offset, chunk length)` with every chunk: the mask the chunk needs.

    The fake model marks in its cache every row a chunk computed under another mask (schedulers.FakeModel), as a
    real model's keys and values would be wrong there, so a wrong mask (or mask=None) changes the first output
    token, which the judge's replay of the recorded masks must predict: a record that hid the wrong mask predicts
    the right token, and the request holds another."""
    model, tokenizer = fakes.FakeModel(), FakeTokenizer()
    prompt = prompt_of(11, 3)
    request = batch.Request(model, fakes.FakeTokenizer(), prompt, prefill_max_step=4)
    prefill_all(request)
    ids, first = tokenizer.encode(prompt), next_token_of(tokenizer.encode(prompt))
    assert request.next_token == first, (
        "the chunks' rows saw other keys than their own and the cached ones: pass mask=chunk_causal_mask(...)")
    assert replay(model.record()).generations() == [(tuple(ids), (first,))], "the replayed chunks predict that token"
    # Day 2.7's array or the model's default "causal": the same keys in effect, so no output tells them apart. That
    # check alone reads the record (a submission that rewrote it gains nothing it could not get from "causal").
    for call in prefill_calls(model):
        assert not isinstance(call.mask, str), "try_prefill must pass mask=chunk_causal_mask(...) to the model"
        np.testing.assert_array_equal(np.array(call.mask), numpy_chunk_mask(call.offset, len(call.tokens)))


def test_task_3_try_prefill_materializes_between_chunks(batch, fakes, real):
    model, mlx_model, tokenizer = real
    ids = list(range(1000, 1064))
    request = batch.Request(model, tokenizer, ids, prefill_max_step=32)
    before = fakes.active_memory()  # measured where the request's cache is
    request.try_prefill()  # the first of two chunks: nobody reads its logits
    grown = fakes.active_memory() - before
    assert grown >= kv_bytes(mlx_model, 32) / 2, (
        f"after a chunk that is not the last, its keys and values must be computed (memory grew {grown} bytes)")


def test_task_3_chunked_prefill_needs_less_peak_memory(batch, real):
    model, _, tokenizer = real
    ids = [1000 + (i * 37) % 5000 for i in range(384)]
    one_shot = batch.prefill_peak_memory(model, tokenizer, ids, len(ids))
    chunked = batch.prefill_peak_memory(model, tokenizer, ids, 32)
    assert 0 < chunked < one_shot / 4, f"chunked {chunked} bytes, one-shot {one_shot} bytes"


# ---------------------------------------------------------------- Task 4: stats and logs


def test_task_4_stats_before_anything_ran(batch):
    stats = batch.SchedulerStats()
    assert stats.avg_chunk_time is None and stats.interleave_ratio is None
    stats.record_chunk(10, 2.0)
    stats.record_decode_step(4, 0.5, interleaved=False)
    assert (stats.avg_chunk_time, stats.interleave_ratio, stats.decode_tokens, stats.interleaved_steps) == (2.0, 1.0, 4, 0)


STATS_LINE = re.compile(
    r"prompt (?P<prompt>[\d.]+) tokens/s, generation (?P<gen>[\d.]+) tokens/s, running (?P<running>\d+), "
    r"waiting (?P<waiting>\d+), KV cache (?P<kv>[\d.]+)%")


def scheduler_at(fakes, batch, clock, log, **settings):
    """A SlotScheduler on the fake model whose log goes to `log` (a Lines); nothing runs until the test says so."""
    settings = {"max_seq_len": 32, "batch_size": 2, "prefill_step": 4, "log_interval": 1.0, **settings}
    return batch.SlotScheduler(fakes.FakeModel(), fakes.FakeTokenizer(), clock=clock, log=log, **settings)


def test_task_4_start_up_line_says_whether_chunking_is_on(batch, fakes):
    for prefill_step, max_seq_len, word in [(4, 32, "enabled"), (31, 32, "enabled"), (32, 32, "disabled"),
                                            (100, 32, "disabled")]:
        log = fakes.Lines()
        scheduler = scheduler_at(fakes, batch, fakes.FakeClock(), log, prefill_step=prefill_step,
                                 max_seq_len=max_seq_len)
        scheduler.log_stats()
        lines = log.lines
        assert len(lines) == 1 and f"chunked prefill {word}" in lines[0] and "token budget" in lines[0], lines
        if word == "enabled":
            assert scheduler.policy.describe() in lines[0], "the line names the policy"
        scheduler.log_stats()
        assert len(log.lines) == 1, "no stats line before log_interval has passed"


def test_task_4_stats_line_rates_since_the_previous_line_and_kv_use_from_offsets(batch, fakes):
    """Rates cover the time since the last line, not since the start; KV use counts what the slots hold."""
    clock, log = fakes.FakeClock(), fakes.Lines()
    scheduler = scheduler_at(fakes, batch, clock, log, max_seq_len=50, batch_size=4, log_interval=2.0)
    scheduler.log_stats()  # the start-up line at t = 0
    scheduler.stats.prefill_tokens, scheduler.stats.decode_tokens = 40, 10
    clock.advance(2.0)
    scheduler.log_stats()
    # The second interval: 4 s, far fewer tokens, so cumulative rates would differ from the true ones.
    scheduler.stats.prefill_tokens, scheduler.stats.decode_tokens = 44, 30
    long_prompt = batch.Request(scheduler.model, scheduler.tokenizer, prompt_of(20, 1))
    long_prompt.offset = 23  # 20 prompt tokens + 3 decoded
    short_prompt = batch.Request(scheduler.model, scheduler.tokenizer, prompt_of(2, 2))
    short_prompt.offset = 9
    scheduler.slots = [None, long_prompt, None, short_prompt]  # whole: while grading, a read is a copy of its list
    scheduler.add_request("abc")
    clock.advance(4.0)
    scheduler.log_stats()
    lines = log.lines
    first, second = (STATS_LINE.search(line) for line in lines[1:])
    assert (float(first["prompt"]), float(first["gen"])) == (20.0, 5.0), lines[1]
    assert (float(second["prompt"]), float(second["gen"])) == (1.0, 5.0), "rates since the previous line"
    assert (int(second["running"]), int(second["waiting"])) == (2, 1)
    assert float(second["kv"]) == pytest.approx(100 * 32 / 200, abs=0.05), "held = sum of offsets, of 4 x 50"
    assert "32/200 tokens" in lines[2]


def test_task_4_no_stats_line_inside_the_interval(batch, fakes):
    clock, log = fakes.FakeClock(), fakes.Lines()
    scheduler = scheduler_at(fakes, batch, clock, log)
    for _ in range(5):
        scheduler.log_stats()
        clock.advance(0.3)
    assert len(log.lines) == 2, "the start-up line at 0 s, a stats line at 1.2 s"


# ---------------------------------------------------------------- Task 5: the scheduler interleaves


def test_task_5_each_iteration_runs_one_chunk_then_one_decode_step(batch, fakes):
    model = fakes.FakeModel(eos=False)
    short, long = prompt_of(3, 1), prompt_of(10, 2)
    scheduler = batch.SlotScheduler(model, fakes.FakeTokenizer(), max_seq_len=40, batch_size=2, prefill_step=3)
    scheduler.add_request(short)
    scheduler.add_request(long)
    ends = []  # how many calls the model had made after each iteration
    for _ in range(6):
        scheduler.step()
        ends.append(model.num_calls)
    calls = replay(model.record(), eos=False).calls
    kinds = [[c.kind for c in calls[start:end]] for start, end in zip([0] + ends, ends)]
    # Iteration 1: the short prompt in one chunk, then its first decode step. Iterations 2-5: one chunk
    # of the long prompt (offsets 0, 3, 6, 9) and one decode step of the short request. Then decode only.
    assert kinds == [["prefill", "decode"]] * 5 + [["decode"]]
    long_chunks = [(len(c.tokens), c.offset) for c in calls if c.kind == "prefill"][1:]
    assert long_chunks == [(3, 0), (3, 3), (3, 6), (1, 9)]
    decode_rows = [c.active for c in calls if c.kind == "decode"]
    assert decode_rows[:4] == [[0]] * 4, "the short request decodes while the long prompt prefills"
    assert decode_rows[4:] == [[0, 1], [0, 1]], "the long request takes a slot when its last chunk ran"


@pytest.mark.parametrize("prefill_step", [1, 2, 3, 5, 1000])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_task_5_fake_outputs_equal_for_every_chunk_size(batch, fakes, prefill_step, batch_size):
    tokenizer = FakeTokenizer()
    prompts = [prompt_of(2 + (i * 7) % 13, seed=i) for i in range(7)]
    run, _ = run_fake(fakes, batch, fakes.FakeModel(), prompts, max_seq_len=24, batch_size=batch_size,
                      prefill_step=prefill_step)
    got = {r["idx"]: (r["tokens"], r["reason"]) for r in run["finished"]}
    assert got == {i: expected_tokens(tokenizer.encode(p), 24) for i, p in enumerate(prompts)}


@pytest.mark.parametrize("prefill_step", [1, 2, 3, 7, 64])
def test_task_5_real_model_outputs_equal_one_at_a_time(batch, fakes, real, oracle_tokens, prefill_step):
    model, _, tokenizer = real
    run = run_scheduler(fakes, batch, model, tokenizer, PROMPTS, max_seq_len=MAX_SEQ_LEN, batch_size=3,
                        prefill_step=prefill_step)
    got = {r["idx"]: r["tokens"] for r in run["finished"]}
    assert got == dict(enumerate(oracle_tokens))


def test_task_5_first_token_eos_finishes_without_a_decode_step(batch, fakes):
    tokenizer = FakeTokenizer()
    eos_prompt = next(p for p in (prompt_of(n, s) for s in range(500) for n in (4, 9))
                      if next_token_of(tokenizer.encode(p)) == EOS)
    other = eos_free_prompt(5, 10)
    run, tape = run_fake(fakes, batch, fakes.FakeModel(), [other, eos_prompt], max_seq_len=15, batch_size=2,
                         prefill_step=3, texts=True)
    finished = {r["idx"]: r for r in run["finished"]}
    assert finished[1]["reason"] == "stop" and finished[1]["tokens"] == [] and finished[1]["text"] == ""
    assert tape.adds[0] == 1, "only the other request ever takes a slot"
    assert all(c.active == [0] for c in tape.calls if c.kind == "decode")


@pytest.mark.parametrize("fail_on_call", [3, 5, 7])  # calls: short prefill, decode, long chunk, decode, ...
def test_task_5_error_in_a_chunk_leaves_the_scheduler_releasable(batch, fakes, fail_on_call):
    """A chunk that raises propagates out of step(); release_all then frees every slot and cache."""
    model = fakes.FakeModel(eos=False, fail_on_call=fail_on_call)
    scheduler = batch.SlotScheduler(model, fakes.FakeTokenizer(), max_seq_len=40, batch_size=2, prefill_step=3)
    requests = [scheduler.add_request(prompt_of(3, 1)), scheduler.add_request(prompt_of(12, 2))]
    with pytest.raises(fakes.ModelFailure):
        for _ in range(10):
            scheduler.step()
    calls = replay(model.record(), eos=False).calls
    assert calls[-1].kind == "failed" and len(calls[-1].tokens) == 1, "the failure hit a prefill chunk"
    assert scheduler.prefilling is requests[1], "the failing request is still the one being prefilled"
    scheduler.release_all()
    tape = replay(model.record(), eos=False)
    assert all(tape.held(0, layer) == [] for layer in range(tape.num_layers)) and not scheduler.has_work()
    assert all(r.kv_cache is None for r in requests)


def test_task_5_stats_count_chunks_decode_steps_and_interleaving(batch, fakes):
    clock = fakes.FakeClock()
    model = fakes.FakeModel(eos=False, clock=clock, prefill_cost=(0.5, 0.25), decode_cost=0.125)
    scheduler = batch.SlotScheduler(model, fakes.FakeTokenizer(), max_seq_len=40, batch_size=2, prefill_step=3,
                                    clock=clock)
    prompts = [prompt_of(3, 1), prompt_of(10, 2)]
    scheduler.add_request(prompts[0], max_tokens=8)
    scheduler.add_request(prompts[1], max_tokens=2)
    while scheduler.has_work():
        scheduler.step()
    stats = scheduler.stats
    tape = replay(model.record(), eos=False)
    check_replay(tape, [fakes.finished(r) for r in scheduler.finished], prompts)
    calls = tape.calls
    decodes = [c for c in calls if c.kind == "decode"]
    assert stats.chunks == 5 and stats.prefill_tokens == 13
    assert stats.chunk_seconds == pytest.approx(5 * 0.5 + 13 * 0.25)
    assert stats.avg_chunk_time == pytest.approx(stats.chunk_seconds / 5)
    assert stats.decode_steps == len(decodes)
    assert stats.decode_tokens == sum(len(c.active) for c in decodes) == 7 + 1
    assert stats.decode_seconds == pytest.approx(0.125 * stats.decode_steps)
    # A decode step is interleaved when the same iteration ran a chunk: the call just before it.
    interleaved = sum(1 for before, c in zip(calls, calls[1:]) if c.kind == "decode" and before.kind == "prefill")
    assert stats.interleaved_steps == interleaved == 5
    assert stats.interleave_ratio == pytest.approx(5 / stats.decode_steps)


def test_task_5_logs_the_set_up_then_periodic_stats(batch, fakes):
    clock, log = fakes.FakeClock(), fakes.Lines()
    model = fakes.FakeModel(eos=False, clock=clock, prefill_cost=(0.0, 0.1), decode_cost=0.25)
    scheduler = batch.SlotScheduler(model, fakes.FakeTokenizer(), max_seq_len=32, batch_size=2, prefill_step=4,
                                    clock=clock, log=log, log_interval=1.0)
    for i in range(3):
        scheduler.add_request(prompt_of(8, i), max_tokens=6)
    while scheduler.has_work():
        scheduler.step()
    lines = log.lines
    assert "chunked prefill enabled" in lines[0] and "4 prompt tokens" in lines[0], lines[0]
    assert "token budget" in lines[0]
    periodic = [STATS_LINE.search(line) for line in lines[1:]]
    assert len(periodic) >= 3 and all(periodic), lines
    # The first periodic line covers [0, t]: 4 prompt tokens per chunk at 0.1 s/token and 0.25 s decode steps.
    first = periodic[0]
    assert float(first["prompt"]) > 0 and float(first["gen"]) > 0
    assert int(first["running"]) <= 2 and int(first["waiting"]) <= 3 and 0 < float(first["kv"]) <= 100
    assert clock() / 1.0 - 1 <= len(periodic) <= clock() / 1.0 + 1, "about one line per log_interval"


def test_task_5_every_output_token_is_timed_and_eos_is_not(batch, fakes):
    """metrics.token once per output token: the first one (TTFT ends there) included, an EOS never."""
    tokenizer = FakeTokenizer()
    eos_first = next(p for p in (prompt_of(n, s) for s in range(500) for n in (4, 9))
                     if next_token_of(tokenizer.encode(p)) == EOS)
    prompts = [eos_free_prompt(5, 6), eos_first, prompt_of(7, 3), prompt_of(3, 4)]
    clock = fakes.FakeClock()
    model = fakes.FakeModel(clock=clock, prefill_cost=(0.01, 0.001), decode_cost=0.02)
    scheduler = batch.SlotScheduler(model, fakes.FakeTokenizer(), max_seq_len=14, batch_size=2, prefill_step=3,
                                    clock=clock)
    run = fakes.drive(scheduler, prompts, model)
    check_replay(replay(run["events"]), run["finished"], prompts)
    timed = scheduler.metrics.requests
    for request in run["finished"]:
        times = timed[request["idx"]].token_times
        assert len(times) == len(request["tokens"]), (
            f"request {request['idx']}: {len(request['tokens'])} output tokens, {len(times)} timed")
    assert timed[0].ttft is not None and timed[0].ttft > 0, "the first token ends time-to-first-token"
    assert timed[1].token_times == [], "an EOS first token is not an output token"


def test_task_5_a_freed_slot_goes_to_the_waiting_request_in_the_same_iteration(batch, fakes):
    """After every step: never a free slot while a prefilled request waits for one."""
    prompts = [eos_free_prompt(3, 4, seed=s) for s in (0, 40, 80)] + [prompt_of(2, 9)]
    run, _ = run_fake(fakes, batch, fakes.FakeModel(eos=False), prompts, eos=False, watch=True, max_seq_len=7,
                      batch_size=1, prefill_step=8)
    # The slots as the scheduler reports them, checked against the replay's batch cache after every step.
    for step, (tape, view) in enumerate(replay_steps(run["events"], run["views"], eos=False)):
        busy = [b for b, layers in enumerate(view["slots"]) if layers is not None]
        assert tape.held(0, 0) == busy, f"step {step}: the batch cache's occupied rows must be the occupied slots"
        waiting = view["waiting"]
        if waiting is not None and waiting[0] and not waiting[1]:
            assert view["free"] is None, (
                f"step {step}: a request is prefilled and slot {view['free']} is free: "
                "admit again after the decode step")


def test_task_5_try_prefill_after_done_is_never_called(batch, fakes):
    _, tape = run_fake(fakes, batch, fakes.FakeModel(), [prompt_of(5, 1), prompt_of(9, 2)], max_seq_len=20,
                       batch_size=1, prefill_step=4)
    assert [len(c.tokens) for c in tape.calls if c.kind == "prefill"] == [4, 1, 4, 4, 1]


# ---------------------------------------------------------------- Task 6: the chunk-size policy


def test_task_6_adaptive_policy_from_measurements(batch):
    policy = sol.chunk_policy.AdaptiveChunkPolicy(target_itl=0.5, min_chunk=8, max_chunk=512, initial_chunk=32,
                                                  smoothing=0.5)
    assert policy.next_chunk_size(0) == 512, "nobody decoding: the largest chunk"
    assert policy.next_chunk_size(3) == 32, "nothing measured yet: the initial chunk"
    policy.observe_chunk(64, 1.0)  # 1/64 s per token
    assert policy.next_chunk_size(3) == 32, "no decode step measured yet: it counts as 0 s, 0.5 s / (1/64 s per token)"
    policy.observe_decode(3, 0.25)
    assert policy.next_chunk_size(3) == 16, "(0.5 - 0.25) s / (1/64 s per token)"
    policy.observe_chunk(16, 0.5)  # 1/32 s per token: the average moves halfway, to 3/128
    assert policy.next_chunk_size(3) == int(0.25 / (3 / 128))
    policy.observe_chunk(0, 5.0)  # an empty chunk tells nothing
    assert policy.next_chunk_size(3) == int(0.25 / (3 / 128))
    policy.observe_decode(3, 1.75)  # decode alone now takes (0.25 + 1.75) / 2 = 1 s: over the target
    assert policy.next_chunk_size(3) == 8, "never below min_chunk"
    fast = sol.chunk_policy.AdaptiveChunkPolicy(target_itl=0.5, min_chunk=8, max_chunk=512)
    fast.observe_chunk(1000, 0.001)
    assert fast.next_chunk_size(1) == 512, "never above max_chunk"


def test_task_6_adaptive_policy_holds_the_latency_target(batch, fakes):
    """With an injected clock: a chunk costs 10 ms + 1 ms/token, a decode step 20 ms; target 100 ms."""
    clock = fakes.FakeClock()
    model = fakes.FakeModel(eos=False, clock=clock, prefill_cost=(0.010, 0.001), decode_cost=0.020)
    policy = sol.chunk_policy.AdaptiveChunkPolicy(target_itl=0.1, min_chunk=4, max_chunk=1024, initial_chunk=16)
    scheduler = batch.SlotScheduler(model, fakes.FakeTokenizer(), max_seq_len=2000, batch_size=2, prefill_step=16,
                                    policy=policy, clock=clock)
    scheduler.add_request(eos_free_prompt(4, 60), max_tokens=60)
    scheduler.step()  # the short request prefills (nobody decoding: full size) and starts decoding
    assert len(prefill_calls(model, eos=False)[0].tokens) == 4
    scheduler.add_request(prompt_of(1200, 3), max_tokens=2)
    times = []
    while scheduler.prefilling is not None or scheduler.queue:
        start = clock()
        scheduler.step()
        times.append(clock() - start)
    sizes = [len(c.tokens) for c in prefill_calls(model, eos=False)[1:]]
    # Measured on the short prompt: (10 + 4) ms / 4 tokens = 3.5 ms per token, so (100 - 20) / 3.5 = 22.
    assert sizes[0] == 22, "the first chunk under load is sized from what was measured so far"
    # The fixed point is 10 ms + 1 ms * n + 20 ms = 100 ms: n = 70. The sizes climb towards it.
    assert sizes[:6] == sorted(sizes[:6]) and all(62 <= s <= 70 for s in sizes[6:-1]), sizes
    assert all(t <= 0.1 + 1e-9 for t in times), "no iteration goes over the target"


def test_task_6_without_decoders_the_whole_prompt_goes_at_once(batch, fakes):
    clock = fakes.FakeClock()
    model = fakes.FakeModel(clock=clock, prefill_cost=(0.01, 0.001))
    policy = sol.chunk_policy.AdaptiveChunkPolicy(target_itl=0.05, min_chunk=4, max_chunk=256)
    _, tape = run_fake(fakes, batch, model, [prompt_of(200, 1)], max_seq_len=203, batch_size=1, prefill_step=16,
                       policy=policy, clock=clock)
    assert [len(c.tokens) for c in tape.calls if c.kind == "prefill"] == [200]
