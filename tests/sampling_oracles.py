"""Oracles for the sampling extensions (logits_processors.py): the penalties by their definitions, in numpy,
and mlx-lm's own log-probabilities."""


import mlx.core as mx
import numpy as np


def penalized(row, prompt, output, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """The penalties by their definitions, in numpy: the test's own oracle for a logits row."""
    row = np.array(row, dtype=np.float64)
    for token, value in (bias or {}).items():
        row[token] += value
    for token in set(prompt) | set(output):
        row[token] = row[token] / repetition if row[token] > 0 else row[token] * repetition
    for token in set(output):
        row[token] -= frequency * output.count(token) + presence
    return row


def raw_logprobs(model32, tokens: list[int]):
    """Log-softmax of mlx-lm's logits at every position of `tokens` (row i predicts token i + 1)."""
    logits = model32[0](mx.array([tokens])).astype(mx.float32)[0]
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
