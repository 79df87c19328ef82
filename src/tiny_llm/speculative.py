"""Speculative decoding, verified as a prefill chunk: several tokens per sequence per step, same output.

A decode step reads every weight to produce one token per sequence. If something cheap could guess
the next k tokens, the target model could check all of them in *one* pass: the newest token and the
k guesses form a chunk of k + 1 tokens at the sequence's offset, run under day 2.7's chunk mask,
exactly like a prefill chunk, riding in the same token-budget step as everybody else's decodes and
prefills. Row i of the chunk gives the target's next token after guess i, so

- greedy: the longest prefix of guesses the target agrees with is accepted, plus the target's own
  token after it (a correction, or a bonus when every guess was right): 1 to k + 1 tokens a step;
- temperature > 0: rejection sampling accepts guess x with probability min(1, p(x) / q(x)) and, at
  the first rejection, draws from the residual max(p - q, 0), normalized: the output has exactly the
  target's distribution, whatever the guesses were.

The KV cache then holds keys of rejected guesses: the sequence's computed length goes back to what
was accepted, and blocks wholly past it go back to the pool.

- `NgramProposer`: prompt lookup; the last n tokens seen earlier in the context propose what
  followed them there. No second model: it shines when the output copies from the prompt.
- `DraftModelProposer`: a smaller model with the same tokenizer, greedy, with its own KV cache.
- `accept_greedy`, `accept_sampled`: the two acceptance rules.
- `SpeculativeEngine`: week 3's engine and its step, with proposals planned into the step's leftover
  budget (the scheduler places them: `Scheduler.verify_guesses`) and verified in the same model call.
  Speculation backs off by itself: only the tokens the decodes and prefills leave in the budget are
  proposed, a sequence guesses about one more token than it has been getting accepted, and one whose
  guesses keep failing stops guessing (it tries one now and then).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from .engine import EngineConfig, LLMEngine
from .logits_processors import TokenLogprobs, process_logits, token_logprobs
from .sampler import seed_draw
from .scheduler import ScheduledChunk, StepOutput, StepPlan, VerifyChunk
from .sequence import Sequence
from .structured import apply_constraints, constrain_guess_rows
from .validation import check_int

DEFAULT_NUM_SPECULATIVE_TOKENS = 4


# ---------------------------------------------------------------- proposers


class NgramProposer:
    """Prompt lookup: find the sequence's last n tokens earlier in its context; propose what followed."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        """Match suffixes of `max_ngram` tokens down to `min_ngram` (longer matches are tried first)."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching suffix; [] if none."""
        # TODO: for n from max_ngram down to min_ngram: the last n tokens; the latest earlier place they occur
        # TODO: (not the suffix itself); propose up to k tokens that followed them there
        raise NotImplementedError(
            "Week 4 Day 1 Task 1 (book/src/week4-01-speculative-decoding.md): n-gram prompt lookup"
        )

    def forget(self, request_id) -> None:
        """Nothing is kept per request (provided)."""


class DraftModelProposer:
    """A smaller mlx-lm model with the target's tokenizer guesses greedily, keeping a KV cache per request (provided).

    Its cache is trimmed back to what it shares with the sequence before each proposal, so rejected
    guesses cost nothing to forget.
    """

    def __init__(self, draft_model):
        """`draft_model`: an mlx-lm model (`model(inputs, cache=...)` -> logits) over the same vocabulary."""
        self.model = draft_model
        self.states: dict[object, tuple[list, list[int]]] = {}  # request id -> (cache, tokens it holds)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """The draft's `k` greedy next tokens after the sequence's tokens."""
        if k < 1:
            return []
        cache, held = self.states.get(seq.request_id) or (make_prompt_cache(self.model), [])
        context = seq.token_ids
        common = 0
        limit = min(len(held), len(context) - 1)  # feed at least one token: its logits are the first guess
        while common < limit and held[common] == context[common]:
            common += 1
        trim_prompt_cache(cache, len(held) - common)
        feed, draft = context[common:], []
        for _ in range(k):
            logits = self.model(mx.array([feed]), cache=cache)
            draft.append(mx.argmax(logits[0, -1]).item())
            feed = draft[-1:]
        self.states[seq.request_id] = (cache, context + draft[:-1])  # the last guess was never fed
        return draft

    def forget(self, request_id) -> None:
        """Drop a finished request's cache."""
        self.states.pop(request_id, None)


# ---------------------------------------------------------------- acceptance


def accept_greedy(draft: list[int], target_tokens: list[int]) -> list[int]:
    """The tokens a greedy sequence gains: the guesses the target agrees with, then the target's own next token.

    `target_tokens[i]` is the target's argmax at row i of the verify chunk, i.e. after the newest token
    and `draft[:i]`; there are `len(draft) + 1` of them.
    """
    # TODO: walk the guesses while each equals the target's token at its row; then append the target's
    # TODO: token at the first disagreeing row (or the bonus row after the last guess)
    raise NotImplementedError("Week 4 Day 1 Task 2 (book/src/week4-01-speculative-decoding.md): greedy acceptance")


def accept_sampled(draft: list[int], target_probs: mx.array, draft_probs: mx.array | None = None) -> list[int]:
    """Rejection sampling: the tokens a sampled sequence gains, distributed exactly as the target's own draws.

    `target_probs` is `(len(draft) + 1) x V`: row i is the target's distribution after `draft[:i]`.
    `draft_probs` is `len(draft) x V`, the distributions the guesses were drawn from; None means every
    guess was certain (a proposer that picks, like prompt lookup or a greedy draft: q is one-hot).
    Draws use MLX's global random state.
    """
    # TODO: for each guess x at row i: q = its draft row (one-hot on x when None); accept with probability
    # TODO: min(1, p(x) / q(x)); at the first rejection draw from max(p - q, 0) normalized and stop;
    # TODO: if every guess is accepted, draw one more token from the last row of p
    raise NotImplementedError("Week 4 Day 1 Task 3 (book/src/week4-01-speculative-decoding.md): rejection sampling")


# ---------------------------------------------------------------- bookkeeping (provided)


@dataclass
class SpeculationStats:
    """Counters over every verify chunk: guesses proposed and accepted, and chunks verified."""

    proposed: int = 0
    accepted: int = 0
    verifications: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted guesses / proposed guesses (0 before any)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted guesses per verify chunk (0 before any): each chunk also yields one token of the target's own."""
        return self.accepted / self.verifications if self.verifications else 0.0


class AcceptanceTracker:
    """Per sequence, how well its guesses do, and so how many it should make this step (provided).

    Two moving averages per sequence: its acceptance rate and its accepted guesses per verification.
    A guess the target rejects still costs a row of the verify chunk, so a sequence

    - guesses one more than it has been getting accepted (`k` while every guess is right, 2 when about
      one is), so a chunk is not padded with guesses that will be thrown away;
    - stops guessing when its acceptance rate falls below `min_rate`, and probes with a single guess
      after 2 plain decode steps, then 4, 8, ... up to `probe_interval` while the probes keep failing,
      so one that starts copying (a quote, a code block) is noticed soon and fresh text is left alone:
      a right probe grows its guesses again.

    `min_rate` 0 switches all of this off: every sequence always guesses as many as it may.
    """

    def __init__(self, min_rate: float = 0.3, probe_interval: int = 16, smoothing: float = 0.5):
        """A rate in 0..1, at most `probe_interval` >= 1 steps between probes, a smoothing weight in (0, 1]."""
        if not 0 <= min_rate <= 1 or probe_interval < 1 or not 0 < smoothing <= 1:
            raise ValueError("need 0 <= min_rate <= 1, probe_interval >= 1 and 0 < smoothing <= 1, got "
                             f"{min_rate}, {probe_interval}, {smoothing}")
        self.min_rate = min_rate
        self.probe_interval = probe_interval
        self.smoothing = smoothing
        self.rates: dict[object, float] = {}  # request id -> moving average of accepted / proposed
        self.lengths: dict[object, float] = {}  # request id -> moving average of accepted guesses per verification
        self.waits: dict[object, int] = {}  # steps left before a turned-down sequence probes again
        self.intervals: dict[object, int] = {}  # its current wait between probes: 2, 4, 8, ... up to probe_interval

    def num_guesses(self, request_id, most: int) -> int:
        """How many guesses (0 .. `most`) this sequence should make this step; counts a step of waiting at 0."""
        if self.min_rate == 0 or request_id not in self.rates:
            return most
        if self.rates[request_id] >= self.min_rate:
            self.intervals.pop(request_id, None)  # guessing again: a later turn-down starts with a short wait
            return min(most, math.ceil(self.lengths[request_id]) + 1)  # all right: one more each time
        if request_id not in self.waits:  # just turned down, or its probe failed: wait twice as long as last time
            self.intervals[request_id] = min(2 * self.intervals.get(request_id, 1), self.probe_interval)
            self.waits[request_id] = self.intervals[request_id]
        self.waits[request_id] -= 1
        if self.waits[request_id] > 0:
            return 0
        del self.waits[request_id]
        return min(most, 1)  # a probe: one guess, the cheapest question

    def observe(self, request_id, proposed: int, accepted: int) -> None:
        """Fold one verify chunk's outcome into the sequence's averages.

        The rate starts from 1 (as if a sequence's first guesses had all been right), so one unlucky
        verification only shrinks its guesses: it takes two failures in a row to turn it down.
        """
        old_rate = self.rates.get(request_id, 1.0)
        self.rates[request_id] = (1 - self.smoothing) * old_rate + self.smoothing * accepted / proposed
        old_length = self.lengths.get(request_id, float(accepted))
        self.lengths[request_id] = (1 - self.smoothing) * old_length + self.smoothing * accepted

    def forget(self, request_id) -> None:
        """Drop a finished request."""
        for state in (self.rates, self.lengths, self.waits, self.intervals):
            state.pop(request_id, None)


def can_speculate(seq: Sequence) -> bool:
    """Whether a sequence may guess; one that may not decodes as in week 3, in the same step (provided).

    Verification picks each row's token from the target's raw logits: the argmax, or rejection
    sampling against softmax(logits / temperature). So it serves greedy sequences and plain
    temperature sampling, and not a request whose token comes from other logits or that wants more
    than tokens back: top-k or top-p (a filtered distribution), penalties, min_p or logit_bias (logits
    that depend on the output so far, guesses included), or logprobs (a verify chunk computes none).
    """
    return why_not_speculate(seq) is None


def why_not_speculate(seq: Sequence) -> str | None:
    """None when `seq` may guess, else the reason it decodes without guesses (provided)."""
    params = seq.sampling
    if not params.greedy and (params.top_k or params.top_p < 1):
        return "top-k or top-p sampling"
    if params.processes_logits:
        return "penalties, min_p or logit_bias"
    if params.logprobs is not None:
        return "logprobs"
    return None


class SpeculativeRunner:
    """Wraps week 3's model runner: runs a plan with every row of each verify chunk sampled (provided)."""

    def __init__(self, runner):
        """`runner`: a week-3 `ModelRunner` (its `prepare`, model, pool and `sample` are used as they are)."""
        self.runner = runner
        self.logprobs: dict[object, TokenLogprobs] = {}  # the last step's, by request id (requests that asked)

    def run(self, plan: StepPlan) -> mx.array:
        """One model call; the logits of every sampled row in plan order: 1 row per sampling chunk, 1 + k per verify chunk.

        The engine's `update` picks the tokens from them (week 3's runner samples them itself)."""
        rows, end = [], 0
        for chunk in plan.chunks:
            end += chunk.length
            if isinstance(chunk, VerifyChunk):
                rows += range(end - chunk.length, end)
            elif chunk.samples:
                rows.append(end - 1)
        batch = replace(self.runner.prepare(plan), sample_rows=mx.array(rows, dtype=mx.int32))
        logits = self.runner.model(batch, self.runner.pool)
        mx.eval(logits, *self.runner.pool.arrays())
        return logits

    def sample(self, logits: mx.array, seqs: list[Sequence]) -> list[int]:
        """Week 3's sampling for ordinary chunks, after each request's logits processing, with its logprobs."""
        tokens = self.runner.sample(apply_constraints(process_logits(logits, seqs), seqs), seqs)
        self.logprobs = token_logprobs(logits, seqs, tokens)  # only for the requests that ask
        return tokens


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculation's knobs, beside the engine's `EngineConfig` (provided)."""

    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS  # k: the most guesses one verify chunk checks
    min_acceptance_rate: float = 0.3  # below this a sequence stops guessing (0: no back-off, always k guesses)...
    probe_interval: int = 16  # ...and probes with one guess after 2, 4, ... up to this many plain decode steps

    def __post_init__(self):
        """Reject a knob no engine can use, naming it."""
        check_int("num_speculative_tokens", self.num_speculative_tokens, 1)


# ---------------------------------------------------------------- the engine


class SpeculativeEngine(LLMEngine):
    """Week 3's engine; decoding sequences propose up to k tokens each, verified in the same model call."""

    def __init__(self, model, tokenizer, config: EngineConfig | None = None, *,
                 speculation: SpeculativeConfig | None = None, proposer=None, **engine_kwargs):
        """`proposer` (default: `NgramProposer()`) has `propose(seq, k)` and `forget(request_id)` (provided).

        `config` and the other keywords (`metrics`, `clock`, `log`) are `LLMEngine`'s.
        """
        super().__init__(model, tokenizer, config, **engine_kwargs)
        self.speculation_config = speculation = speculation or SpeculativeConfig()
        self.runner = SpeculativeRunner(self.runner)
        self.proposer = proposer or NgramProposer()
        self.num_speculative_tokens = speculation.num_speculative_tokens
        self.tracker = AcceptanceTracker(speculation.min_acceptance_rate, speculation.probe_interval)
        self.speculation = SpeculationStats()
        self.log(f"speculative decoding: up to {self.num_speculative_tokens} tokens proposed by "
                 f"{type(self.proposer).__name__}, turned down below {100 * speculation.min_acceptance_rate:.0f}% "
                 f"acceptance")

    def add_request(self, prompt, sampling=None, **options) -> Sequence:
        """Week 3's `add_request`; a request verification cannot serve is logged with the reason (provided).

        It is served all the same, one token a step, exactly as week 3's engine serves it.
        """
        seq = super().add_request(prompt, sampling, **options)
        reason = why_not_speculate(seq)
        if reason:
            self.log(f"request {seq.request_id!r} decodes without speculation: {reason}")
        return seq

    def plan_step(self) -> StepPlan:
        """Week 3's plan, then guesses for its decodes in the budget it leaves (`propose`) (provided)."""
        plan = super().plan_step()
        if not plan.is_empty:
            self.propose(plan)
        return plan

    def propose(self, plan: StepPlan) -> None:
        """Turn decodes into verify chunks with the budget the plan leaves, the free blocks and `max_tokens`."""
        # TODO: room = step budget - planned tokens; for each decode (while room is left) that can speculate:
        # TODO: most = min(num_speculative_tokens, room, tokens it may still emit - 1); k = the tracker's
        # TODO: num_guesses(request id, most); ask the proposer for k; cut the draft to what the held and free
        # TODO: blocks cover; self.scheduler.verify_guesses(plan, chunk, draft) (provided: it allocates their blocks and
        # TODO: puts a VerifyChunk in the decode's place); room -= len(draft)
        raise NotImplementedError(
            "Week 4 Day 1 Task 4 (book/src/week4-01-speculative-decoding.md): plan proposals into the step"
        )

    def update(self, plan: StepPlan, logits: mx.array) -> list[StepOutput]:
        """Ordinary chunks as in week 3 (its sampling and `update_from_output`), then each verify chunk's tokens (provided).

        The step's `report` adds each ordinary token's logprobs (a verify chunk's request never asks for them).
        """
        sampled, verified, row = [], [], 0
        for chunk in plan.chunks:  # the runner's rows, in plan order: 1 + k per verify chunk, 1 per other sampling chunk
            if isinstance(chunk, VerifyChunk):
                verified.append((chunk, logits[row : row + chunk.length]))
                row += chunk.length
            elif chunk.samples:
                sampled.append((chunk.seq, row))
                row += 1
        rows = mx.array([r for _, r in sampled], dtype=mx.int32)
        tokens = self.runner.sample(logits[rows], [seq for seq, _ in sampled])
        # Week 3's update on the plan without its verify chunks (a new plan: the scheduler's stays as it made it).
        ordinary = StepPlan(decodes=plan.decodes, prefills=[c for c in plan.prefills if not isinstance(c, VerifyChunk)])
        outputs = self.scheduler.update_from_output(ordinary, tokens)
        for chunk, chunk_logits in verified:
            outputs += self.apply_verification(chunk, self.verify(chunk, chunk_logits))
        return outputs

    def verify(self, chunk: VerifyChunk, logits: mx.array) -> list[int]:
        """The tokens the chunk's sequence gains, from its `1 + k` rows of logits (provided).

        A constrained sequence's rows are masked first, each for the state its guesses reach (day 4.5)."""
        params = chunk.seq.sampling
        logits = constrain_guess_rows(logits, chunk.seq, chunk.draft)
        if params.greedy:
            return accept_greedy(chunk.draft, mx.argmax(logits, axis=-1).tolist())
        seed_draw(params, len(chunk.seq.output_token_ids))  # as week 3's runner: whatever shares the batch
        probs = mx.softmax(logits.astype(mx.float32) / params.temperature, axis=-1)
        return accept_sampled(chunk.draft, probs)

    def apply_verification(self, chunk: VerifyChunk, accepted: list[int]) -> list[StepOutput]:
        """Append the accepted tokens (EOS and max_tokens end it as usual), count them, give back rejected positions."""
        # TODO: count the chunk in self.speculation and in the tracker (accepted guesses = len(accepted) - 1)
        # TODO: scheduler.append_token each accepted token in order; as soon as one finishes the sequence, return the
        # TODO: outputs so far (its blocks are already freed: no later token, no roll-back)
        # TODO: when none finished: only the newest token and the accepted guesses stay cached, so
        # TODO: self.scheduler.roll_back(seq, chunk.start + len(accepted)) (provided: it sets the progress, gives back
        # TODO: the blocks past it, names the new full blocks)
        raise NotImplementedError(
            "Week 4 Day 1 Task 5 (book/src/week4-01-speculative-decoding.md): accept, count, roll back"
        )

    def record(self, plan: StepPlan, outputs: list[StepOutput]) -> None:
        """Week 3's `record`; a finished request's speculation state is forgotten (provided)."""
        super().record(plan, outputs)
        for output in outputs:
            if output.finished:
                self.forget(output.request_id)

    def abort(self, request_id) -> None:
        """End a request now and forget its speculation state (provided)."""
        super().abort(request_id)
        self.forget(request_id)

    def forget(self, request_id) -> None:
        """Drop per-request speculation state (provided)."""
        self.proposer.forget(request_id)
        self.tracker.forget(request_id)

    def summary(self) -> dict:
        """Week 3's summary plus the speculation counters (provided)."""
        summary = super().summary()
        summary.update(speculative_proposed=self.speculation.proposed, speculative_accepted=self.speculation.accepted,
                       speculative_acceptance_rate=self.speculation.acceptance_rate,
                       speculative_mean_accepted_length=self.speculation.mean_accepted_length)
        return summary

    def log_details(self) -> str:
        """The log line's speculation part (provided)."""
        return (f", speculation: {100 * self.speculation.acceptance_rate:.1f}% accepted, "
                f"{self.speculation.mean_accepted_length:.2f} guesses accepted per verification")
