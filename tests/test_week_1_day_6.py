"""Week 1 Day 6: generating a response (book/src/week1-06-generate-response.md).

Oracle: mlx_lm.stream_generate with greedy sampling, on the embedded model, for several prompts: our
greedy tokens must be identical, token for token. Then the loop's contract: stop at EOS, stop at
max_tokens, stream text through on_text while generating, and use the sampler it is given.
"""

import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from tests.actor_fakes import week2_models as here
from tests.harness import actor_fakes, fetch, reference, solution

sol = solution(week=1, day=6, reads_text=True)
ref = reference()


def fakes():
    """tests/actor_fakes/week2_models where the code under test runs (asked each time: a worker stopped at a time
    limit is replaced); `here` is the judge's own copy."""
    return actor_fakes(sol, "week2_models")


MAX_TOKENS = 12
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "数学很有趣",
]


@pytest.fixture(scope="module")
def our_model(model32):
    # Day 6 tests the loop, so the model is day 5's, which in this day's code is the reference's: built where the
    # loop runs.
    return sol.qwen2_week1.Qwen2ModelWeek1(model32[0])


@pytest.fixture(scope="module")
def judge_model(model32):
    """The reference's model, run here: the oracle's runs of the reference loop."""
    return ref.qwen2_week1.Qwen2ModelWeek1(model32[0])


def mlx_lm_greedy(model, tokenizer, prompt, max_tokens):
    """mlx-lm's greedy token ids and streamed text for `prompt` (encoded as simple_generate encodes it)."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    tokens, text = [], ""
    for response in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=make_sampler(temp=0.0)):
        if response.finish_reason != "stop":  # the "stop" response carries the EOS token, which is not output
            tokens.append(response.token)
        text += response.text
    return tokens, text


@pytest.mark.parametrize("prompt", PROMPTS, ids=["hello", "france", "code", "chat", "chinese"])
def test_task_1_greedy_matches_mlx_lm(model32, our_model, prompt):
    model, tokenizer = model32
    expected_tokens, expected_text = mlx_lm_greedy(model, tokenizer, prompt, MAX_TOKENS)
    # Token ids, through a recording greedy sampler...
    recorder = fakes().Recorder()
    text = sol.generate.simple_generate(our_model, tokenizer, prompt, sampler=recorder, max_tokens=MAX_TOKENS)
    assert recorder.tokens[: len(expected_tokens)] == expected_tokens
    # ...the same text as mlx-lm's streaming detokenizer spells (it drops a leading space)...
    assert text == expected_text
    # ...and the same again with the default sampler (None = greedy).
    assert sol.generate.simple_generate(our_model, tokenizer, prompt, max_tokens=MAX_TOKENS) == expected_text


def test_task_1_stops_at_eos(model32, our_model, judge_model):
    _, tokenizer = model32
    prompt = PROMPTS[0]
    prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
    eos = next(iter(tokenizer.eos_token_ids))
    # A model wrapped so that from the 3rd generated token on, EOS is the most likely token (week2_models.EosAfter).
    wrapped = fakes().EosAfter(our_model, prompt_len, 3, eos)
    recorder = fakes().Recorder()
    text = sol.generate.simple_generate(wrapped, tokenizer, prompt, sampler=recorder, max_tokens=20)
    picked, calls = recorder.tokens, wrapped.calls
    # Three tokens, then EOS: the loop stops there and EOS is not part of the text.
    assert picked[-1] == eos and len(picked) == 4
    assert calls == 4
    assert text.strip() == tokenizer.decode(picked[:3]).strip()
    assert "<|im_end|>" not in text
    # The records are the actor's: they must be what the reference's loop records on the judge's own model and fakes().
    oracle_recorder, oracle_wrapped = here.Recorder(), here.EosAfter(judge_model, prompt_len, 3, eos)
    oracle = ref.generate.simple_generate(oracle_wrapped, tokenizer, prompt, sampler=oracle_recorder, max_tokens=20)
    assert (text, picked, calls) == (oracle, oracle_recorder.tokens, oracle_wrapped.calls)


def test_task_1_max_tokens(model32, our_model):
    model, tokenizer = model32
    expected, _ = mlx_lm_greedy(model, tokenizer, PROMPTS[1], 5)
    recorder = fakes().Recorder()
    sol.generate.simple_generate(our_model, tokenizer, PROMPTS[1], sampler=recorder, max_tokens=5)
    assert len(recorder.tokens) == 5, "max_tokens=5: five tokens, then stop"
    assert recorder.tokens == expected, "the five tokens must be mlx-lm's greedy ones (the last position's logits)"


def test_task_1_streams_text_as_tokens_arrive(model32, our_model):
    model, tokenizer = model32
    prompt_len = len(tokenizer.encode(PROMPTS[2], add_special_tokens=False))
    # The model says EOS from its 6th generated token on (week2_models.EosAfter): the stream ends there.
    _, expected_text = mlx_lm_greedy(model, tokenizer, PROMPTS[2], 5)
    eos = next(iter(tokenizer.eos_token_ids))
    # The model and on_text log each call and each piece in one list, where the loop runs (week2_models.Events).
    log = fakes().Events(fakes().EosAfter(our_model, prompt_len, 5, eos))
    text = sol.generate.simple_generate(log, tokenizer, PROMPTS[2], max_tokens=MAX_TOKENS, on_text=log.on_text)
    [[events, pieces]] = fetch([log], "events", "pieces")
    assert "".join(pieces) == text == expected_text, "the pieces streamed must spell mlx-lm's greedy text"
    assert len(pieces) > 1, "on_text should be called once per new piece of text, not once at the end"
    # Streaming: text comes out between model calls, not all after the last one.
    assert events.index("text") < len(events) - 1 - events[::-1].index("model")
    assert all(piece for piece in pieces), "on_text should not be called with empty pieces"


def test_task_1_uses_the_sampler(model32, our_model, judge_model):
    _, tokenizer = model32
    eos = next(iter(tokenizer.eos_token_ids))
    # A sampler that picks the 2nd most likely token, then the most likely, then the 3rd, then EOS must be obeyed, its
    # EOS included (week2_models.RankedSampler). Its picks show in the text: a loop that asked it twice for a token,
    # handed it another position's log-probabilities or went on after its EOS spells another text than the
    # reference's loop does here with this process's own copy of the sampler.
    ranks = [1, 0, 2]
    text = sol.generate.simple_generate(our_model, tokenizer, PROMPTS[0], sampler=fakes().RankedSampler(ranks, eos),
                                        max_tokens=10)
    oracle = here.RankedSampler(ranks, eos)
    expected = ref.generate.simple_generate(judge_model, tokenizer, PROMPTS[0], sampler=oracle, max_tokens=10)
    assert oracle.calls == 4 and expected, "the oracle: three tokens, then the EOS the sampler picked"
    assert text == expected, (
        "the loop must ask the sampler once per token, with the last position's log-probabilities (1 x vocab), and "
        "stop at the EOS it picks")
    # The shape itself (1 x vocab, not vocab) shows in no output: the sampler refuses another, a check of the fake's
    # own, which a submission that rewrote the fake could pass by (nothing the judge sees can tell the two apart).
