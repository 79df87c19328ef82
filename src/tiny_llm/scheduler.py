"""The scheduler: which tokens of which sequences run in the next step, and the one owner of their state.

Each step gets a token budget (the budget policy's answer, never above its cap), and the plan fills
it in this order:

1. a decode token for every running sequence whose prompt is done: decodes come first and are never
   starved by prefill (a request that is streaming must keep streaming);
2. prefill chunks with what is left: sequences already part-way through their prompt and waiting
   ones, in the order policy's order (first come, first served; or by priority, day 3.4), admitted
   while blocks, sequence slots (`max_num_seqs`) and budget last. Several sequences may prefill in
   the same step.

Memory is the KV block pool. A sequence is admitted only if the free blocks hold its first chunk,
and every planned token gets its block before the step runs. When a decode finds no free block,
the scheduler *preempts* the last running sequence (the most recently admitted, or the least
urgent): its blocks go back to the pool and it returns to the front of the waiting queue, to be
recomputed later from its prompt and output so far (recompute), giving the same tokens it would
have given.

After the model ran, `update_from_output` moves every planned sequence forward and records its new
token: sequences change state here and nowhere else (the engine only reads them).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .block_manager import BlockManager, blocks_for
from .order_policy import FirstComeFirstServed, OrderPolicy
from .sequence import Sequence, SequenceStatus
from .structured import allowed_guesses
from .token_budget import BudgetPolicy

FINISH_REASONS = ("stop", "length", "abort")  # EOS or a stop string; max_tokens; cancelled by the caller


@dataclass
class ScheduledChunk:
    """`length` tokens of `seq`, at positions `start .. start + length - 1`, to run this step."""

    seq: Sequence
    start: int
    length: int

    @property
    def token_ids(self) -> list[int]:
        """The token ids this chunk feeds to the model."""
        return self.seq.token_ids[self.start : self.start + self.length]

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the sequence's newest token: its last row gives the next token."""
        return self.start + self.length == self.seq.num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        """How many of its tokens belong to the prompt (the rest are outputs being recomputed or decoded)."""
        return max(0, min(self.start + self.length, len(self.seq.prompt_token_ids)) - self.start)


@dataclass
class VerifyChunk(ScheduledChunk):
    """A decoding sequence's newest token followed by `draft`: `1 + len(draft)` tokens, every row sampled (day 4.1).

    To the model it is a prefill chunk at the sequence's offset; the draft tokens are not part of the
    sequence (yet): only the accepted ones will be.
    """

    draft: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        """The newest token, then the guesses."""
        return self.seq.token_ids[self.start : self.start + 1] + self.draft

    @property
    def samples(self) -> bool:
        """Always: its rows are what the guesses are checked against."""
        return True


@dataclass
class StepPlan:
    """One step: decode chunks (one token each) first, then prefill chunks; and who was preempted to make room."""

    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        """Every chunk in the order its tokens are laid out in the model call."""
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        """Tokens this step runs: what the budget bounds."""
        return sum(chunk.length for chunk in self.chunks)

    @property
    def num_decoding(self) -> int:
        """Sequences decoding this step: a decode chunk each, or a verify chunk (a decode and its guesses, day 4.1)."""
        return len(self.decodes) + sum(isinstance(chunk, VerifyChunk) for chunk in self.prefills)

    @property
    def is_empty(self) -> bool:
        """True when the step would run nothing."""
        return not self.decodes and not self.prefills

    @property
    def prefill_offset(self) -> float:
        """Where the prefill chunks start, the mean over their tokens (0 without prefills).

        The budget's cost model reads it: a token's cost is linear in its chunk's offset, so the mean is exact.
        """
        tokens = sum(chunk.length for chunk in self.prefills)
        return sum(chunk.start * chunk.length for chunk in self.prefills) / tokens if tokens else 0.0


@dataclass
class StepOutput:
    """What one step did for one sequence: its new token (None if it ended without one) and whether it finished.

    An EOS token ends the sequence and is not part of its output: its StepOutput has token None and
    finish_reason "stop". The reasons are OpenAI's and vLLM's: "stop", "length", "abort".
    """

    request_id: object
    token: int | None
    finished: bool
    finish_reason: str | None  # one of FINISH_REASONS once finished
    logprobs: object = None  # the token's TokenLogprobs, for a request that asked (set by the engine)
    num_cached_tokens: int | None = None  # on the finished output: prompt tokens the prefix cache served


class Scheduler:
    """Waiting and running sequences, the block manager, the planner `schedule()` and the updater `update_from_output()`."""

    def __init__(self, block_manager: BlockManager, token_budget: BudgetPolicy, max_num_seqs: int = 16,
                 order: OrderPolicy | None = None,
                 eos_token_ids=(), log: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        """Plan steps within `token_budget` for at most `max_num_seqs` running sequences (provided).

        The budget policy alone owns the cap (`token_budget.max_num_batched_tokens`); every decode token
        must fit under it, so `max_num_seqs` may not exceed it. `order` is the order policy (default:
        first come, first served); `eos_token_ids` end a sequence; `clock` (the engine's, which stamps
        each sequence's `arrival_time`) tells the budget policy how long the queue's oldest request has waited.
        """
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        cap = token_budget.max_num_batched_tokens
        if cap < max_num_seqs:
            raise ValueError(f"the token budget ({cap}) must be >= max_num_seqs ({max_num_seqs}): every "
                             "running sequence's decode token must fit in one step")
        self.block_manager = block_manager
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs
        self.order = order or FirstComeFirstServed()
        self.eos_token_ids = set(eos_token_ids)
        self.log = log or (lambda line: None)
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # most urgent first: the last one is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (provided)."""
        self.order.add(seq)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """True while any sequence waits or runs (provided)."""
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------ planning

    def step_budget(self, num_decoding: int) -> int:
        """The token budget of the next step: the policy's answer, never below the decode tokens (provided).

        The policy hears where the next prefill chunk starts (late in a long prompt a token costs more)
        and how long the oldest request without a first token has waited (day 3.4's goodput budget).
        """
        budget = self.token_budget.budget(num_decoding, self.next_prefill_offset(), self.oldest_wait())
        return max(budget, num_decoding)

    def oldest_wait(self) -> float:
        """Seconds the longest-waiting request still without its first token has waited; 0 when none (provided).

        Waiting or part-way through its prompt, its time to first token runs; a preempted sequence that
        already streamed is no longer waiting for a first token.
        """
        arrivals = [seq.arrival_time for seq in (*self.waiting, *self.running) if not seq.output_token_ids]
        return max(0.0, self.clock() - min(arrivals)) if arrivals else 0.0

    def next_prefill_offset(self) -> int:
        """Where the next prefill chunk would start (provided).

        That is the computed tokens of the most urgent part-way or waiting sequence (0 when none).
        """
        partway = [seq for seq in self.running if not seq.is_decoding]
        candidates = self.order.order(partway + list(self.waiting))
        return candidates[0].num_computed_tokens if candidates else 0

    def order_queues(self) -> None:
        """Put both queues in the order policy's order, most urgent first (provided; a no-op for FCFS)."""
        self.order.next_step()
        self.running = self.order.order(self.running)
        self.waiting = deque(self.order.order(self.waiting))

    def schedule(self) -> StepPlan:
        """Plan the next step: decodes first, then prefill chunks, within the token budget and the free blocks."""
        # TODO: order the queues; make room (day 3.4); budget for the decodes; decodes; prefills with the rest; nobody moved: preempt the last
        raise NotImplementedError(
            "Week 3 Day 1 Task 2 (book/src/week3-01-token-budget.md): plan a step: decodes first, then prefill chunks"
        )

    def schedule_decodes(self, plan: StepPlan) -> None:
        """One decode chunk for every decoding running sequence, preempting from the back when blocks run out."""
        # TODO: for each decoding running sequence: make room (preempt from the back while blocks lack), allocate, add a chunk of 1
        raise NotImplementedError(
            "Week 3 Day 1 Task 2 (book/src/week3-01-token-budget.md): one decode chunk per decoding sequence"
        )

    def schedule_prefills(self, plan: StepPlan, budget: int) -> None:
        """Prefill chunks within `budget` tokens: part-way and waiting sequences in the order policy's order."""
        # TODO: part-way and waiting sequences in self.order.order(...): plan_chunk for running ones, self.admit(...) for waiting ones while slots last; stop admitting after a refusal
        raise NotImplementedError(
            "Week 3 Day 1 Task 2 (book/src/week3-01-token-budget.md): prefill chunks within the budget"
        )

    def plan_chunk(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """Plan the next chunk of `seq`'s uncomputed tokens: as many as the budget and the free blocks allow."""
        # TODO: length = min(budget, uncomputed, room in free blocks); allocate; append a ScheduledChunk; return length
        raise NotImplementedError("Week 3 Day 1 Task 2 (book/src/week3-01-token-budget.md): plan one prefill chunk")

    def verify_guesses(self, plan: StepPlan, chunk: ScheduledChunk, draft: list[int]) -> None:
        """Turn `chunk`, a planned decode, into a `VerifyChunk` of its newest token and `draft` (day 4.1) (provided).

        The guesses' positions get their blocks now (the caller cut the draft to what the held and free
        blocks cover: speculation never preempts); the chunk moves to the end of the prefills, where the
        model runs multi-token chunks. A constrained sequence's draft ends before the first guess its mask
        refuses (day 4.5); with none left, the chunk stays a plain decode.
        """
        seq = chunk.seq
        draft = allowed_guesses(seq, draft)
        if not draft:
            return
        self.block_manager.allocate(seq, seq.num_tokens + len(draft))
        plan.decodes.remove(chunk)
        plan.prefills.append(VerifyChunk(seq, chunk.start, 1 + len(draft), draft))

    def admit(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """Admit waiting `seq` with its first chunk; return the chunk's length, 0 if it must keep waiting (provided).

        Its cached prefix (day 3.3) counts as computed; the first chunk is the rest, as much as the budget
        and the free blocks allow. A sequence that cannot start holds no blocks while it waits (any
        cached ones go back), so it can never block the pool.
        """
        cached = self.block_manager.reuse_cached_prefix(seq)
        seq.num_computed_tokens = cached  # the scheduler alone moves a sequence's progress
        length = self.plan_chunk(seq, budget, plan)
        if length == 0:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            return 0
        self.block_manager.record_lookup(seq, cached)
        if seq.num_cached_tokens is None:  # the first admission's hits are the request's cached tokens
            seq.num_cached_tokens = cached
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return length

    def make_room(self, plan: StepPlan) -> None:
        """Preempt outranked running sequences while the most urgent waiting one could not be admitted (day 3.4).

        Victims come from the back of the running list, and only ones the waiting sequence outranks:
        under first come, first served nobody outranks anybody, and nothing happens.
        """
        # TODO: while the back of running is outranked by waiting[0] and waiting[0] cannot be admitted: preempt it
        raise NotImplementedError(
            "Week 3 Day 4 Task 3 (book/src/week3-04-priorities.md): preempt outranked running sequences until the most urgent waiting one fits"
        )

    def can_admit(self, seq: Sequence) -> bool:
        """True when `seq`'s first chunk would get a slot, budget and blocks in this step (day 3.4).

        It needs a sequence slot, budget left after the decode tokens, and free blocks for its first
        chunk plus a block for every decode that starts a new one.
        """
        # TODO: a free slot; budget left after the decodes; blocks for the first chunk plus every decode's new block
        raise NotImplementedError(
            "Week 3 Day 4 Task 3 (book/src/week3-04-priorities.md): slot, budget and blocks for its first chunk"
        )

    def preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Take `seq` off the running list: free its blocks, forget its cache, put it first in the waiting queue."""
        # TODO: remove from running, free blocks, num_computed_tokens = 0, WAITING, front of the queue, count, record, log
        raise NotImplementedError(
            "Week 3 Day 2 Task 3 (book/src/week3-02-paged-kv-cache.md): preempt a sequence by recompute"
        )

    # ------------------------------------------------------------ after the model ran

    def update_from_output(self, plan: StepPlan, tokens: list[int]) -> list[StepOutput]:
        """Move every chunk's sequence forward; give each sampling one its token; finish those that are done.

        `tokens` holds one token per sampling chunk, in plan order. Returns a StepOutput per sampling chunk.
        """
        # TODO: num_computed_tokens += length; block_manager.cache_computed_blocks(seq) (day 3.3's hook); a sampling chunk appends its token
        raise NotImplementedError(
            "Week 3 Day 1 Task 5 (book/src/week3-01-token-budget.md): move every chunk's sequence forward"
        )

    def append_token(self, seq: Sequence, token: int) -> StepOutput:
        """Record a sampled token: EOS ends the sequence ("stop"); otherwise append it and end at `max_tokens`."""
        # TODO: EOS (ends_at_eos): finish 'stop', token None; else append; finish 'length' at max_tokens
        raise NotImplementedError("Week 3 Day 1 Task 5 (book/src/week3-01-token-budget.md): record a sampled token")

    def ends_at_eos(self, seq: Sequence, token: int) -> bool:
        """Whether `token` is an EOS that ends `seq` (not for a request that asked to `ignore_eos`), or one of
        its `stop_token_ids` (provided)."""
        return (token in self.eos_token_ids and not seq.sampling.ignore_eos) or token in seq.sampling.stop_token_ids

    def roll_back(self, seq: Sequence, num_computed: int) -> None:
        """Keep only the first `num_computed` positions of `seq` in the cache (day 4.1's rejected guesses) (provided).

        Its progress is set back (the scheduler's part); the block manager gives back the blocks holding no
        position below it (`truncate`) and names its newly full blocks for the prefix cache.
        """
        seq.num_computed_tokens = num_computed
        self.block_manager.truncate(seq, num_computed)
        self.block_manager.cache_computed_blocks(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` ("stop", "length" or "abort"): free its blocks and drop it from the queues (provided)."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self.order.forget(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
