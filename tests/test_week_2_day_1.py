"""Week 2 Day 1: the KV cache (book/src/week2-01-kv-cache.md).

Oracles: plain concatenation for the cache; mlx-lm's own Qwen2 on the embedded model's weights for
the logits (prefill, each decode step, and prefill split into chunks); mlx-lm's greedy generation and
week 1's cacheless loop for the generated tokens. The loops (Tasks 3 and 4) run on mlx-lm's model behind
the week-2 interface, with fakes built where the code under test runs (tests/actor_fakes/week2_models.py): a spy
model records what each call fed, and a tokenizer notes how many model calls had been made when each token reached
its detokenizer (the pipelined loop queues step n + 1 before reading token n). Their records are checked against
the reference loops' run on the judge's own copies of the same fakes and model; where they say more than the outputs
(what each call fed, when it ran), they are taken on trust: no output shows it (see `run`).
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from tests.actor_fakes import week2_models as here
from tests.harness import actor_fakes, class_of, fetch, reference, solution

sol = solution(week=2, day=1, reads_text=True)
ref = reference()


def fakes():
    """tests/actor_fakes/week2_models where the code under test runs (asked each time: a worker stopped at a time
    limit is replaced); `here` is the judge's own copy."""
    return actor_fakes(sol, "week2_models")

ATOL = RTOL = 1e-3  # float32 logits of size ~20; different summation orders differ by ~1e-5
PROMPT = "The quick brown fox jumps over the lazy dog. A KV cache keeps what attention already computed."


def assert_close(actual, expected, what):
    np.testing.assert_allclose(np.array(actual), np.array(expected), rtol=RTOL, atol=ATOL, err_msg=what)


def random_kv(shape, seed):
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    return mx.random.normal(shape, key=k1), mx.random.normal(shape, key=k2)


# ---------------------------------------------------------------- Task 1: the full cache

def test_task_1_full_cache_appends():
    cache = sol.kv_cache.TinyKvFullCache()
    assert cache.offset == 0
    k1, v1 = random_kv((1, 2, 3, 4), seed=1)  # B x H x L x D: a 3-token prefill
    keys, values, seq_len, mask = cache.update_and_fetch(k1, v1)
    assert seq_len == 3 and cache.offset == 3
    assert mask is None
    assert_close(keys, k1, "keys after the first update")
    assert_close(values, v1, "values after the first update")

    k2, v2 = random_kv((1, 2, 2, 4), seed=2)  # a 2-token chunk
    keys, values, seq_len, mask = cache.update_and_fetch(k2, v2, mask_length=2, mask="causal")
    assert seq_len == 5 and cache.offset == 5
    assert mask == "causal", "a one-request cache passes the model's mask on unchanged"
    assert keys.shape == (1, 2, 5, 4) and values.shape == (1, 2, 5, 4)
    assert_close(keys, mx.concatenate([k1, k2], axis=2), "keys: old then new, along the sequence axis")
    assert_close(values, mx.concatenate([v1, v2], axis=2), "values: old then new, along the sequence axis")

    k3, v3 = random_kv((1, 2, 1, 4), seed=3)  # one decode step
    keys, values, seq_len, _ = cache.update_and_fetch(k3, v3)
    assert seq_len == 6 and cache.offset == 6
    assert_close(keys, mx.concatenate([k1, k2, k3], axis=2), "keys after a decode step")
    assert_close(values, mx.concatenate([v1, v2, v3], axis=2), "values after a decode step")


def test_task_1_full_caches_are_independent():
    first, second = sol.kv_cache.TinyKvFullCache(), sol.kv_cache.TinyKvFullCache()
    k1, v1 = random_kv((1, 2, 4, 8), seed=4)
    k2, v2 = random_kv((1, 2, 2, 8), seed=5)
    first.update_and_fetch(k1, v1)
    second.update_and_fetch(k2, v2)
    assert first.offset == 4 and second.offset == 2
    keys, _, _, _ = second.update_and_fetch(k1[:, :, :1], v1[:, :, :1])
    assert_close(keys, mx.concatenate([k2, k1[:, :, :1]], axis=2), "a cache holds only its own tokens")


# ---------------------------------------------------------------- Task 2: the model with a cache

@pytest.fixture(scope="module")
def our_model(model32):
    return sol.qwen2_week2.Qwen2ModelWeek2(model32[0])


@pytest.fixture(scope="module")
def prompt_ids(model32):
    ids = model32[1].encode(PROMPT, add_special_tokens=False)
    assert len(ids) >= 16
    return ids


@pytest.fixture(scope="module")
def mlx_lm_logits(model32, prompt_ids):
    """mlx-lm's logits for the whole prompt, no cache: position i predicts token i + 1."""
    return model32[0](mx.array([prompt_ids]))


def test_task_2_make_cache(our_model, model32):
    cache = our_model.make_cache()
    assert len(cache) == our_model.num_hidden_layers == model32[0].args.num_hidden_layers
    assert all(class_of(c) is sol.kv_cache.TinyKvFullCache for c in cache)
    assert all(c.offset == 0 for c in cache)
    assert cache[0] is not cache[1], "one cache object per layer"


def test_task_2_prefill_matches_mlx_lm(our_model, prompt_ids, mlx_lm_logits):
    cache = our_model.make_cache()
    logits = our_model(mx.array([prompt_ids]), 0, cache)
    assert logits.shape == (1, len(prompt_ids), our_model.vocab_size)
    assert_close(logits, mlx_lm_logits, "prefill logits vs mlx-lm")
    assert all(c.offset == len(prompt_ids) for c in cache), "every layer's cache holds the whole prompt"


def test_task_2_decode_steps_match_mlx_lm(our_model, prompt_ids, mlx_lm_logits):
    # Prefill the first 6 tokens, then feed the rest one at a time at offset = tokens cached so far.
    # Step by step, the logits must equal mlx-lm's for the whole sequence at that position.
    start = 6
    cache = our_model.make_cache()
    logits = our_model(mx.array([prompt_ids[:start]]), 0, cache)
    assert_close(logits[0, -1], mlx_lm_logits[0, start - 1], "last prefill position")
    for position in range(start, len(prompt_ids)):
        logits = our_model(mx.array([[prompt_ids[position]]]), position, cache)
        assert logits.shape == (1, 1, our_model.vocab_size)
        assert_close(logits[0, 0], mlx_lm_logits[0, position], f"decode step at position {position}")
        assert cache[0].offset == position + 1


@pytest.mark.parametrize("chunk", [1, 3, 5, 8])
def test_task_2_chunked_prefill_equals_one_shot(our_model, prompt_ids, mlx_lm_logits, chunk):
    # L new tokens after `offset` cached ones: query i sits at offset + i and sees keys 0 .. offset + i,
    # which is causal_mask(L, offset + L). Prefilling in chunks gives the one-shot logits.
    cache = our_model.make_cache()
    parts = []
    for offset in range(0, len(prompt_ids), chunk):
        part = prompt_ids[offset : offset + chunk]
        parts.append(our_model(mx.array([part]), offset, cache))
    assert_close(mx.concatenate(parts, axis=1), mlx_lm_logits, f"prefill in chunks of {chunk} vs one shot")


def test_task_2_two_part_prefill(our_model, prompt_ids, mlx_lm_logits):
    # The smallest case of the above, the one day 2.7 builds on: two parts of unequal length.
    cache = our_model.make_cache()
    first = our_model(mx.array([prompt_ids[:5]]), 0, cache)
    second = our_model(mx.array([prompt_ids[5:]]), 5, cache)
    assert_close(first, mlx_lm_logits[:, :5], "first part")
    assert_close(second, mlx_lm_logits[:, 5:], "second part, 5 tokens already cached")


# ---------------------------------------------------------------- Task 3: generating with the cache

MAX_TOKENS = 10
PROMPTS = [
    "Hello, my name is",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "数学很有趣",
]


@pytest.fixture(scope="module")
def ref_model(model32):
    # Task 3 tests the loop, so it runs on a correct model that is none of the student's tasks: mlx-lm's, behind
    # the week-2 interface, built where the code under test runs.
    return fakes().Week2Model(model32[0])


@pytest.fixture(scope="module")
def judge_model(model32):
    """The judge's own copy of `ref_model`: the oracles' runs of the reference loops."""
    return here.Week2Model(model32[0])


def mlx_lm_greedy(model, tokenizer, prompt, max_tokens):
    """mlx-lm's greedy token ids and streamed text for `prompt`, encoded as our loop encodes it."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    tokens, text = [], ""
    for response in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=make_sampler(temp=0.0)):
        if response.finish_reason != "stop":  # the "stop" response carries EOS, which is not output
            tokens.append(response.token)
        text += response.text
    return tokens, text


@dataclass
class Run:
    """What one generation did, read back as plain data from the fakes it ran with (week2_models)."""

    text: str
    calls: list  # (tokens fed, offset) per model call
    trace: list  # (token ids fed, offset) per model call
    tokens: list  # each token handed to the detokenizer
    calls_at_token: list  # model calls made when each of them was handed over
    sampled: list | None  # the Recorder's picks, EOS included, when the sampler was one
    pieces: list  # what on_text received


def run(module, loop, model, tokenizer, prompt, eos=None, eos_from=None, record=False, **kwargs) -> Run:
    """`loop(model, tokenizer, prompt, ...)` with `module`'s fakes around `model` and `tokenizer`: a Spy (making EOS
    win from `eos_from` on), a CallCountingTokenizer, a Recorder as the sampler if `record`, Pieces as on_text.

    The student's loop runs with the actor's fakes (`fakes()`); the oracle is the reference's loop with the judge's
    own (`here`) on the judge's own model, and a test compares the two. The text and the tokens are outputs; the
    records of how the loop got them (what each call fed, when each call happened) are the actor's, and follow from
    the outputs: a submission could write them itself, so what they add to the outputs is taken on trust (it
    catches an honest mistake, not a forged record).
    """
    spy = module.Spy(model, eos, eos_from)
    counting = module.CallCountingTokenizer(tokenizer, spy)
    pieces = module.Pieces()
    recorder = module.Recorder() if record else None
    if record:
        kwargs["sampler"] = recorder
    text = loop(spy, counting, prompt, on_text=pieces, **kwargs)
    [[calls, trace]] = fetch([spy], "calls", "trace")
    [[tokens, calls_at_token]] = fetch([counting], "tokens", "calls_at_token")
    sampled = recorder.tokens if record else None
    return Run(text, calls, trace, tokens, calls_at_token, sampled, pieces.pieces)


def assert_same_record(got: Run, oracle: Run):
    """The student's run recorded what the reference's run on the judge's own fakes recorded."""
    assert got.text == oracle.text, f"text {got.text!r}, expected {oracle.text!r}"
    assert got.trace == oracle.trace, (
        f"model calls (token ids fed, offset): {got.trace}, expected {oracle.trace}")
    assert got.tokens == oracle.tokens, f"tokens detokenized: {got.tokens}, expected {oracle.tokens}"


@pytest.mark.parametrize("prompt", PROMPTS, ids=["hello", "chat", "chinese"])
def test_task_3_greedy_matches_mlx_lm(model32, ref_model, prompt):
    model, tokenizer = model32
    expected_tokens, expected_text = mlx_lm_greedy(model, tokenizer, prompt, MAX_TOKENS)
    got = run(fakes(), sol.generate.simple_generate_with_kv_cache, ref_model, tokenizer, prompt, record=True,
              max_tokens=MAX_TOKENS)
    # The Recorder's picks are written in the actor; they must be mlx-lm's own greedy tokens, computed here.
    assert got.sampled[: len(expected_tokens)] == expected_tokens
    # The same text as mlx-lm's streaming detokenizer spells (it drops a leading space).
    assert got.text == expected_text
    default = sol.generate.simple_generate_with_kv_cache(ref_model, tokenizer, prompt, max_tokens=MAX_TOKENS)
    assert default == got.text, "sampler=None means greedy"


def test_task_3_same_text_as_week_1_loop(model32, ref_model):
    mlx_model, tokenizer = model32
    week1 = ref.qwen2_week1.Qwen2ModelWeek1(mlx_model)
    prompt = PROMPTS[0]
    without_cache = ref.generate.simple_generate(week1, tokenizer, prompt, max_tokens=MAX_TOKENS)
    with_cache = sol.generate.simple_generate_with_kv_cache(ref_model, tokenizer, prompt, max_tokens=MAX_TOKENS)
    assert with_cache == without_cache


def test_task_3_feeds_one_token_per_step(model32, ref_model, judge_model):
    _, tokenizer = model32
    prompt = PROMPTS[0]
    prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
    got = run(fakes(), sol.generate.simple_generate_with_kv_cache, ref_model, tokenizer, prompt, max_tokens=6)
    # The prompt once, at offset 0; then one token per step at offset = tokens already cached.
    assert got.calls[0] == (prompt_len, 0), "the first call prefills the whole prompt at offset 0"
    assert got.calls[1:] == [(1, prompt_len + i) for i in range(5)], (
        f"after the prompt, each step feeds one token at the next offset; calls were {got.calls}")
    # The Spy's record is the actor's: it must be, token for token, the calls the reference's loop makes on the
    # judge's own model. No sound check exists for it: a loop without the cache (the whole sequence at offset 0
    # into a fresh cache, every step) returns the same text, and the record follows from that text, so a submission
    # could write it. What each call fed is taken on trust: only time would show it, and tests never time.
    oracle = run(here, ref.generate.simple_generate_with_kv_cache, judge_model, tokenizer, prompt, max_tokens=6)
    assert_same_record(got, oracle)


def test_task_3_stops_at_eos_and_max_tokens(model32, ref_model, judge_model):
    _, tokenizer = model32
    prompt = PROMPTS[0]
    prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
    eos = next(iter(tokenizer.eos_token_ids))
    # From the 4th generated token on, EOS is the most likely token.
    ends = dict(eos=eos, eos_from=prompt_len + 3, record=True, max_tokens=20)
    got = run(fakes(), sol.generate.simple_generate_with_kv_cache, ref_model, tokenizer, prompt, **ends)
    assert len(got.sampled) == 4 and got.sampled[-1] == eos
    assert got.text.strip() == tokenizer.decode(got.sampled[:3]).strip(), "EOS ends the text, not part of it"
    assert "<|im_end|>" not in got.text
    assert len(got.calls) == 4
    oracle = run(here, ref.generate.simple_generate_with_kv_cache, judge_model, tokenizer, prompt, **ends)
    assert_same_record(got, oracle)

    got = run(fakes(), sol.generate.simple_generate_with_kv_cache, ref_model, tokenizer, prompt, record=True,
              max_tokens=3)
    assert len(got.sampled) == 3


def test_task_3_streams_text(model32, ref_model):
    _, tokenizer = model32
    got = run(fakes(), sol.generate.simple_generate_with_kv_cache, ref_model, tokenizer, PROMPTS[2],
              max_tokens=MAX_TOKENS)
    assert len(got.pieces) >= 2, "text arrives piece by piece as tokens are generated"
    assert "".join(got.pieces) == got.text


# ---------------------------------------------------------------- Task 4: pipelined generation
# The CallCountingTokenizer (week2_models) notes how many model calls the Spy had seen when each token reached the
# detokenizer: a plain loop has made n + 1 by token n, a pipelined loop, which queued step n + 1 first, n + 2.

def assert_queued_ahead(got: Run, max_tokens):
    """Each token reached the detokenizer after the step that reads it had been queued (but never past max_tokens).

    No sound check exists: a pipelined loop and a plain one return the same text, token for token, and these counts
    are the actor's, which a plain loop could write itself (only time would show the difference, and tests never
    time). So the order is taken on trust: it catches a loop that reads a token before queuing the next step, not a
    forged record. The same holds for the number of calls (a step queued past max_tokens and thrown away changes no
    output); the tokens and the text are checked against the oracles.
    """
    read = len(got.calls_at_token)
    expected = [min(n + 2, max_tokens) for n in range(read)]
    assert got.calls_at_token == expected, (
        f"model calls made when each of the {read} tokens reached the detokenizer: {got.calls_at_token}, "
        f"expected {expected}: queue step n + 1 on token n before reading token n with .item(), and stop "
        f"calling the model after max_tokens={max_tokens} calls")


@pytest.mark.parametrize("prompt", PROMPTS, ids=["hello", "chat", "chinese"])
def test_task_4_greedy_matches_mlx_lm_and_the_plain_loop(model32, ref_model, judge_model, prompt):
    model, tokenizer = model32
    expected_tokens, expected_text = mlx_lm_greedy(model, tokenizer, prompt, MAX_TOKENS)
    got = run(fakes(), sol.generate.pipelined_generate_with_kv_cache, ref_model, tokenizer, prompt, record=True,
              max_tokens=MAX_TOKENS)
    assert got.sampled[: len(expected_tokens)] == expected_tokens
    assert got.text == expected_text
    assert_queued_ahead(got, MAX_TOKENS)
    plain = ref.generate.simple_generate_with_kv_cache(judge_model, tokenizer, prompt, max_tokens=MAX_TOKENS)
    assert got.text == plain, "the same text as Task 3's loop"
    default = sol.generate.pipelined_generate_with_kv_cache(ref_model, tokenizer, prompt, max_tokens=MAX_TOKENS)
    assert default == got.text, "sampler=None means greedy"
    # The same prompt where EOS becomes the most likely token at the 4th generated one: the text ends there.
    eos = next(iter(tokenizer.eos_token_ids))
    eos_from = len(tokenizer.encode(prompt, add_special_tokens=False)) + 3
    ended = run(fakes(), sol.generate.pipelined_generate_with_kv_cache, ref_model, tokenizer, prompt, eos=eos,
                eos_from=eos_from, max_tokens=MAX_TOKENS)
    plain = run(here, ref.generate.simple_generate_with_kv_cache, judge_model, tokenizer, prompt, eos=eos,
                eos_from=eos_from, max_tokens=MAX_TOKENS)
    assert ended.text == plain.text, "EOS ends the text as in Task 3's loop, and is not part of it"


def test_task_4_stops_at_max_tokens_and_eos(model32, ref_model, judge_model):
    _, tokenizer = model32
    prompt = PROMPTS[0]
    prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
    for max_tokens in (1, 2, 6):
        got = run(fakes(), sol.generate.pipelined_generate_with_kv_cache, ref_model, tokenizer, prompt,
                  max_tokens=max_tokens)
        # The prompt once at offset 0, then one token per step at the next offset, and no call after the
        # last token's: max_tokens calls in all.
        assert got.calls == [(prompt_len, 0)] + [(1, prompt_len + i) for i in range(max_tokens - 1)], (
            f"max_tokens={max_tokens}: expected the prompt, then {max_tokens - 1} one-token steps; calls were "
            f"{got.calls}")
        assert len(got.calls_at_token) == max_tokens, f"max_tokens={max_tokens} tokens generated"
        assert_queued_ahead(got, max_tokens)
        assert "".join(got.pieces) == got.text, "on_text receives the text piece by piece"
        # The records are the actor's: they must be the reference pipelined loop's on the judge's own model.
        assert_same_record(got, run(here, ref.generate.pipelined_generate_with_kv_cache, judge_model, tokenizer,
                                    prompt, max_tokens=max_tokens))

    # From the 4th generated token on, EOS is the most likely token.
    ends = dict(eos=next(iter(tokenizer.eos_token_ids)), eos_from=prompt_len + 3, max_tokens=20)
    got = run(fakes(), sol.generate.pipelined_generate_with_kv_cache, ref_model, tokenizer, prompt, **ends)
    plain = run(here, ref.generate.simple_generate_with_kv_cache, judge_model, tokenizer, prompt, **ends)
    assert got.text == plain.text and "<|im_end|>" not in got.text, "EOS ends the text, not part of it"
    assert len(got.calls_at_token) == 3, (
        f"3 tokens before EOS reach the detokenizer, not {len(got.calls_at_token)}: EOS is not output")
    assert_queued_ahead(got, 20)
    assert "".join(got.pieces) == got.text
    # 4 steps gave the 3 tokens and EOS; the one queued on EOS is the only step wasted.
    assert len(got.calls) == 5, f"the prompt, 3 steps and the one queued on EOS: 5 calls, not {len(got.calls)}"
    assert_same_record(got, run(here, ref.generate.pipelined_generate_with_kv_cache, judge_model, tokenizer, prompt,
                                **ends))


def test_task_4_samples_with_the_sampler(model32, ref_model, judge_model):
    _, tokenizer = model32
    prompt = PROMPTS[1]
    # The sampler is built where it runs (sampling is week 1's, the reference's in this day's code); a seed here
    # seeds both processes, and the reference's sampler draws the same from the same seed.
    mx.random.seed(7)
    got = run(fakes(), sol.generate.pipelined_generate_with_kv_cache, ref_model, tokenizer, prompt,
              sampler=sol.sampler.make_sampler(1.0), max_tokens=MAX_TOKENS)
    assert_queued_ahead(got, MAX_TOKENS)
    mx.random.seed(7)
    plain = ref.generate.simple_generate_with_kv_cache(judge_model, tokenizer, prompt,
                                                       sampler=ref.sampler.make_sampler(1.0), max_tokens=MAX_TOKENS)
    # The sampler draws once per step, in the same order in both loops: one seed, one text.
    assert got.text == plain, "with the same seed, the sampled text of Task 3's loop"
    greedy = ref.generate.simple_generate_with_kv_cache(judge_model, tokenizer, prompt, max_tokens=MAX_TOKENS)
    assert got.text != greedy, "the sampler picked the tokens, not argmax"
