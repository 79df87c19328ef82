"""The provided logits processing (logits_processors.py) and the SamplingParams ranges: on constructed rows
against hand-computed numbers, and log-probabilities against mlx-lm's model (book/src/week3-05-serving.md)."""

import pytest

from tests.harness import reference
from tests.week3_fakes import PLAIN_ENGINE
from tests.sampling_oracles import penalized, raw_logprobs

ref = reference()


def test_processing_on_constructed_rows():
    import mlx.core as mx
    import numpy as np

    lp = ref.logits_processors
    row = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]
    prompt, output = [0, 1], [1, 3, 3]
    # By hand: first the bias, +10 on token 2, +1 on token 3 and -100 on token 4: [2, -1, 10.5, 4, -102, 0];
    # then repetition 2 on {0, 1, 3}: 2 -> 1, -1 -> -2, 4 -> 2; then frequency 0.25 x count + presence 0.5
    # on the output {1: 1, 3: 2}: -2 -> -2.75, 2 -> 1.
    bias = {2: 10.0, 3: 1.0, 4: -100.0}
    expected = [1.0, -2.75, 10.5, 1.0, -102.0, 0.0]
    params = ref.sequence.SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                                         logit_bias=bias)
    got = lp.process_row(mx.array(row), params, prompt, output)
    np.testing.assert_allclose(np.array(got), expected, atol=1e-6)
    np.testing.assert_allclose(expected, penalized(row, prompt, output, 0.5, 0.25, 2.0, bias))
    # Presence and frequency count the output only: a token only in the prompt is not penalized by them.
    only_prompt = lp.process_row(mx.array(row), ref.sequence.SamplingParams(presence_penalty=1.0), [5], [])
    np.testing.assert_allclose(np.array(only_prompt), row)
    # min_p after temperature: probabilities 1, .5, .1, .25 (relative); min_p 0.4 keeps 1 and .5 at T=1,
    # and at T=2 (relative 1, .71, .32, .5) keeps three.
    logits = mx.array(np.log([1.0, 0.5, 0.1, 0.25]))
    keep = lambda t: np.isfinite(np.array(lp.apply_min_p(logits, 0.4, t))).tolist()  # noqa: E731
    assert keep(1.0) == [True, True, False, False]
    assert keep(2.0) == [True, True, False, True]
    # Rows of sequences that ask for nothing are untouched, and a step where nobody asks costs nothing.
    plain = ref.sequence.Sequence("plain", [0], ref.sequence.SamplingParams())
    asks = ref.sequence.Sequence("asks", prompt, params)
    asks.output_token_ids = list(output)
    batch = mx.array([row, row])
    assert lp.process_logits(batch, [plain, plain]) is batch
    processed = np.array(lp.process_logits(batch, [plain, asks]))
    np.testing.assert_allclose(processed, [row, expected], atol=1e-6)
    np.testing.assert_allclose(np.array(batch), [row, row])  # the raw logits stay raw (for logprobs)


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", float("nan")), ("repetition_penalty", 0.0),
    ("repetition_penalty", 2.5), ("min_p", -0.1), ("min_p", 1.5), ("logprobs", 21), ("logprobs", -1),
    ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0}), ("ignore_eos", 1)])
def test_sampling_params_refuse_out_of_range(field, value):
    with pytest.raises((ValueError, TypeError), match=field.split("_")[0]):
        ref.sequence.SamplingParams(**{field: value})


def test_sampled_logprobs_are_the_raw_distribution(model32):
    """A sampled request's log-probabilities are the model's own (before temperature, top-k and penalties)."""
    week3_model = ref.qwen2_week3.Qwen2ModelWeek3(model32[0])
    engine = ref.engine.LLMEngine(week3_model, model32[1], ref.engine.EngineConfig(**PLAIN_ENGINE, token_budget=64,
                                                                                      block_size=8))
    prompt = model32[1].encode("Once upon a time", add_special_tokens=False)
    sampling = ref.sequence.SamplingParams(temperature=1.8, top_k=20, seed=5, max_tokens=6, logprobs=2,
                                           presence_penalty=1.0)
    seq = engine.add_request(prompt, sampling)
    reported = []
    for _ in range(50):
        reported += [o.logprobs for o in engine.step() if o.token is not None]
        if not engine.has_work():
            break
    oracle = raw_logprobs(model32, prompt + seq.output_token_ids)
    assert [r.token for r in reported] == seq.output_token_ids
    for i, r in enumerate(reported):
        row = oracle[len(prompt) - 1 + i]
        assert r.logprob == pytest.approx(row[r.token], abs=2e-3)
        assert [t for t, _ in r.top] == row.argsort()[::-1][:2].tolist()
