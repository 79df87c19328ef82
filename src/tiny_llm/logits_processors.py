"""What a request asks of its logits besides the sampler's knobs (provided: not a task).

Two things, both only for the sequences that ask, so a step where nobody does costs nothing:

- `process_logits`: OpenAI's and vLLM's per-request processing of the next token's logits, in vLLM's
  order: `logit_bias` (added), then the penalties, then `min_p`. The penalties follow their owners'
  definitions: OpenAI's presence and frequency penalties count the *output* so far
  (`logit -= frequency * count + presence * (count > 0)`), and vLLM's (from HF's CTRL paper)
  multiplicative repetition penalty looks at prompt and output (a positive logit is divided by it, a
  negative one multiplied, so either way the token gets less likely). `min_p` keeps the tokens whose
  probability after temperature is at least `min_p` times the most likely one's: with temperature T
  that is `logit >= max_logit + T * log(min_p)`, so it can run here, before the sampler divides by T.
- `token_logprobs`: the log-probability of each chosen token and of the most likely alternatives,
  from the model's raw distribution (log-softmax of the logits before any processing or
  temperature), as vLLM reports by default.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx

from .sequence import SamplingParams, Sequence


def apply_logit_bias(row: mx.array, logit_bias: dict[int, float]) -> mx.array:
    """`row` (V,) with each biased token's logit raised (or lowered) by its bias."""
    tokens = mx.array(list(logit_bias), dtype=mx.int32)
    return row.at[tokens].add(mx.array(list(logit_bias.values()), dtype=row.dtype))


def apply_repetition_penalty(row: mx.array, seen: list[int], penalty: float) -> mx.array:
    """`row` with every token in `seen` made less likely: a positive logit / penalty, a negative one x penalty."""
    tokens = mx.array(sorted(set(seen)), dtype=mx.int32)
    factors = mx.where(row[tokens] > 0, 1 / penalty, penalty).astype(row.dtype)
    return row.at[tokens].multiply(factors)


def apply_presence_frequency(row: mx.array, output: list[int], presence: float, frequency: float) -> mx.array:
    """`row` minus, for every token of `output`, `frequency` per occurrence plus `presence` once."""
    counts = Counter(output)
    tokens = mx.array(list(counts), dtype=mx.int32)
    penalties = mx.array([frequency * n + presence for n in counts.values()], dtype=row.dtype)
    return row.at[tokens].subtract(penalties)


def apply_min_p(row: mx.array, min_p: float, temperature: float) -> mx.array:
    """`row` with -inf for every token less likely than `min_p` x the most likely one at `temperature`."""
    threshold = mx.max(row) + temperature * math.log(min_p)
    return mx.where(row >= threshold, row, mx.array(-mx.inf, dtype=row.dtype))


def ban_tokens(row: mx.array, tokens: tuple[int, ...]) -> mx.array:
    """`row` with -inf for each of `tokens`: none of them can be picked."""
    return row.at[mx.array(list(tokens), dtype=mx.int32)].minimum(mx.array(-mx.inf, dtype=row.dtype))


def process_row(row: mx.array, params: SamplingParams, prompt: list[int], output: list[int]) -> mx.array:
    """One sequence's logits row (V,) after min_tokens' ban on stopping, its logit_bias, penalties and min_p."""
    if len(output) < params.min_tokens and params.stop_token_ids:
        row = ban_tokens(row, params.stop_token_ids)
    if params.logit_bias:
        row = apply_logit_bias(row, params.logit_bias)
    if params.repetition_penalty != 1:
        row = apply_repetition_penalty(row, prompt + output, params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output:
        row = apply_presence_frequency(row, output, params.presence_penalty, params.frequency_penalty)
    if params.min_p:
        row = apply_min_p(row, params.min_p, params.temperature)
    return row


def process_logits(logits: mx.array, seqs: list[Sequence]) -> mx.array:
    """`logits` (one row per sequence) with each asking sequence's row processed; `logits` itself when none asks."""
    rows = [row for row, seq in enumerate(seqs) if seq.sampling.processes_logits]
    if not rows:
        return logits
    processed = mx.array(logits)  # a copy: the raw rows stay as they are, for the log-probabilities
    for row in rows:
        seq = seqs[row]
        processed[row] = process_row(logits[row], seq.sampling, seq.prompt_token_ids, seq.output_token_ids)
    return processed


@dataclass
class TokenLogprobs:
    """A chosen token's log-probability and the `len(top)` most likely tokens' (id, log-probability), best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: mx.array, seqs: list[Sequence], tokens: list[int]) -> dict[object, TokenLogprobs]:
    """For each sequence that asks (`sampling.logprobs` set), its chosen token's log-probabilities, by request id.

    From the raw logits: the model's own distribution, before penalties, min_p, temperature, top-k or top-p.
    """
    rows = [row for row, seq in enumerate(seqs) if seq.sampling.logprobs is not None]
    if not rows:
        return {}
    raw = logits[mx.array(rows, dtype=mx.int32)].astype(mx.float32)
    logprobs = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array([[tokens[row]] for row in rows], dtype=mx.int32), axis=-1)
    most = max(seqs[row].sampling.logprobs for row in rows)
    top_ids = mx.argsort(-logprobs, axis=-1)[:, :most]
    top_logprobs = mx.take_along_axis(logprobs, top_ids, axis=-1)
    chosen, top_ids, top_logprobs = chosen.tolist(), top_ids.tolist(), top_logprobs.tolist()
    answers = {}
    for i, row in enumerate(rows):
        k = seqs[row].sampling.logprobs
        answers[seqs[row].request_id] = TokenLogprobs(tokens[row], chosen[i][0],
                                                      list(zip(top_ids[i][:k], top_logprobs[i][:k])))
    return answers
