"""Week 1 Day 7: sampling (book/src/week1-07-sampling.md).

The sampler draws at random, so the tests draw many times under a fixed seed (`mx.random.seed`) and
check what each strategy claims: temperature 0 is greedy; a temperature T samples from softmax(logits/T);
top-k draws only from the k most likely tokens, in proportion to their renormalized probabilities;
top-p draws only from the smallest set of most likely tokens whose mass reaches p. Frequencies are
compared with the expected probabilities to within 0.02 over 20,000 draws (6 standard errors or more).
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.harness import solution

sol = solution(week=1, day=7)

DRAWS = 20000
FREQ_TOL = 0.02

# Ten tokens with distinct, well-separated probabilities, in a scrambled order (so "most likely" is
# not "smallest index").
PROBS = np.array([0.02, 0.30, 0.05, 0.12, 0.01, 0.20, 0.08, 0.03, 0.15, 0.04])
LOGPROBS = np.log(PROBS)


def draws(sampler, logprobs=LOGPROBS, n=DRAWS, seed=0):
    """`n` draws for the same row, in one batched call (the sampler handles B x V)."""
    mx.random.seed(seed)
    batch = mx.broadcast_to(mx.array(logprobs, dtype=mx.float32), (n, len(logprobs)))
    out = sampler(batch)
    assert out.shape == (n,), f"one token per row expected, got shape {out.shape}"
    return np.array(out)


def frequencies(samples, vocab=len(PROBS)):
    return np.bincount(samples, minlength=vocab) / len(samples)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_task_1_temperature_zero_is_greedy():
    sample = sol.sampler.make_sampler(0.0)
    mx.random.seed(50)
    logprobs = mx.random.normal((6, 1000))
    np.testing.assert_array_equal(np.array(sample(logprobs)), np.argmax(np.array(logprobs), axis=-1))
    # Greedy ignores top-k / top-p: there is nothing left to choose.
    np.testing.assert_array_equal(np.array(sol.sampler.make_sampler(0, top_p=0.5, top_k=3)(logprobs)),
                                  np.argmax(np.array(logprobs), axis=-1))


@pytest.mark.parametrize("temp", [1.0, 0.5, 2.0])
def test_task_1_temperature_distribution(temp):
    samples = draws(sol.sampler.make_sampler(temp))
    expected = softmax(LOGPROBS / temp)
    np.testing.assert_allclose(frequencies(samples), expected, atol=FREQ_TOL)


def test_task_1_temperature_is_deterministic_under_a_seed_and_rows_are_independent():
    sample = sol.sampler.make_sampler(1.0)
    first, again = draws(sample, seed=7), draws(sample, seed=7)
    np.testing.assert_array_equal(first, again)
    assert len(set(first[:50].tolist())) > 1, "rows of a batch must be drawn independently"
    # A small temperature concentrates on the most likely token, a large one spreads out.
    cold = frequencies(draws(sol.sampler.make_sampler(0.05)))
    hot = frequencies(draws(sol.sampler.make_sampler(10.0)))
    assert cold[np.argmax(PROBS)] > 0.99
    assert hot.max() < 0.2


@pytest.mark.parametrize("k", [1, 3, 5])
def test_task_2_top_k(k):
    samples = draws(sol.sampler.make_sampler(1.0, top_k=k))
    top = np.argsort(-PROBS)[:k]
    assert set(samples.tolist()) == set(top.tolist()), f"top-{k} must draw exactly the {k} most likely tokens"
    expected = np.zeros_like(PROBS)
    expected[top] = PROBS[top] / PROBS[top].sum()
    np.testing.assert_allclose(frequencies(samples), expected, atol=FREQ_TOL)


def test_task_2_top_k_per_row_and_with_temperature():
    # Each row keeps its own top k.
    mx.random.seed(51)
    logprobs = mx.random.normal((3, 50)) * 3
    rows = np.array(logprobs)
    sample = sol.sampler.make_sampler(1.0, top_k=2)
    for r in range(3):
        samples = draws(sample, logprobs=rows[r], n=2000, seed=r)
        assert set(samples.tolist()) == set(np.argsort(-rows[r])[:2].tolist())
    # Temperature reshapes the kept tokens' probabilities: softmax(logprobs / T) over the top k.
    samples = draws(sol.sampler.make_sampler(2.0, top_k=3))
    top = np.argsort(-PROBS)[:3]
    expected = np.zeros_like(PROBS)
    expected[top] = softmax(LOGPROBS[top] / 2.0)
    np.testing.assert_allclose(frequencies(samples), expected, atol=FREQ_TOL)


@pytest.mark.parametrize("p, nucleus_size", [(0.25, 1), (0.45, 2), (0.55, 3), (0.7, 4), (0.88, 6)])
def test_task_3_top_p(p, nucleus_size):
    # Sorted probabilities: 0.30, 0.20, 0.15, 0.12, 0.08, 0.05, ... -> cumulative 0.30, 0.50, 0.65, 0.77, 0.85, 0.90
    # The nucleus is the smallest prefix whose mass reaches p.
    samples = draws(sol.sampler.make_sampler(1.0, top_p=p))
    nucleus = np.argsort(-PROBS)[:nucleus_size]
    assert set(samples.tolist()) == set(nucleus.tolist()), f"top-p {p} must draw exactly the {nucleus_size} most likely"
    expected = np.zeros_like(PROBS)
    expected[nucleus] = PROBS[nucleus] / PROBS[nucleus].sum()
    np.testing.assert_allclose(frequencies(samples), expected, atol=FREQ_TOL)


def test_task_3_top_p_one_keeps_everything_and_combines_with_top_k():
    samples = draws(sol.sampler.make_sampler(1.0, top_p=1.0))
    np.testing.assert_allclose(frequencies(samples), PROBS, atol=FREQ_TOL)
    # top-k 2 then top-p 0.9: the top two are 0.30 and 0.20, renormalized 0.6 and 0.4; both are needed.
    samples = draws(sol.sampler.make_sampler(1.0, top_k=2, top_p=0.9))
    assert set(samples.tolist()) == set(np.argsort(-PROBS)[:2].tolist())
    # top-k 4 then top-p 0.5: renormalized 0.3/0.77, 0.2/0.77, ... -> 0.39, 0.26 (0.65 >= 0.5): two tokens.
    samples = draws(sol.sampler.make_sampler(1.0, top_k=4, top_p=0.5))
    assert set(samples.tolist()) == set(np.argsort(-PROBS)[:2].tolist())
