"""The scheduler: which tokens of which sequences run in the next step. It plans; it runs nothing.

Each step gets a token budget (`max_num_batched_tokens`, or less from an adaptive policy), and the
plan fills it in this order:

1. a decode token for every running sequence whose prompt is done: decodes come first and are never
   starved by prefill (a request that is streaming must keep streaming);
2. prefill chunks with what is left: first the sequences already part-way through their prompt,
   then waiting sequences, admitted while blocks, sequence slots (`max_num_seqs`) and budget last.
   Several sequences may prefill in the same step.

Memory is the KV block pool. A sequence is admitted only if the free blocks hold its first chunk,
and every planned token gets its block before the step runs. When a decode finds no free block,
the scheduler *preempts* the most recently admitted running sequence: its blocks go back to the
pool and it returns to the front of the waiting queue, to be recomputed later from its prompt and
output so far (recompute), giving the same tokens it would have given.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus
from .token_budget import FixedTokenBudget


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
    def is_empty(self) -> bool:
        """True when the step would run nothing."""
        return not self.decodes and not self.prefills


class Scheduler:
    """Waiting and running sequences, the block manager, and the planner `schedule()`."""

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int = 256, max_num_seqs: int = 16,
                 policy=None, log: Callable[[str], None] | None = None):
        """Plan steps of at most `max_num_batched_tokens` tokens for at most `max_num_seqs` running sequences (provided).

        `policy` (default: a fixed budget of `max_num_batched_tokens`) may ask for fewer tokens; the
        budget always covers every decode token, so `max_num_seqs` may not exceed `max_num_batched_tokens`.
        """
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}): every running sequence's decode token must fit in one step")
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy or FixedTokenBudget(max_num_batched_tokens)
        self.log = log or (lambda line: None)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (provided)."""
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """True while any sequence waits or runs (provided)."""
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """Plan the next step: decodes first, then prefill chunks, within the token budget and the free blocks."""
        plan = StepPlan()
        num_decoding = sum(seq.is_decoding for seq in self.running)
        budget = min(self.max_num_batched_tokens, max(self.policy.budget(num_decoding), num_decoding))
        self.schedule_decodes(plan)
        self.schedule_prefills(plan, budget - len(plan.decodes))
        if plan.is_empty and self.running:
            # Every running sequence is part-way through a prompt and the pool is full: nobody can move.
            # Free the newest one's blocks so the others can go on.
            self.preempt(self.running[-1], plan)
            self.schedule_prefills(plan, budget)
        return plan

    def schedule_decodes(self, plan: StepPlan) -> None:
        """One decode chunk for every decoding running sequence, preempting the newest ones when blocks run out."""
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING or not seq.is_decoding:
                continue  # preempted just now to make room, or still prefilling
            while not self.block_manager.can_allocate(seq, seq.num_tokens):
                victim = self.running[-1]
                self.preempt(victim, plan)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            self.block_manager.allocate(seq, seq.num_tokens)
            plan.decodes.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))

    def schedule_prefills(self, plan: StepPlan, budget: int) -> None:
        """Prefill chunks within `budget` tokens: sequences part-way through first, then admitted waiting ones."""
        for seq in self.running:
            if budget <= 0:
                return
            if seq.is_decoding:
                continue  # its decode token is planned already
            budget -= self.plan_chunk(seq, budget, plan)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.block_manager.reuse_cached_prefix(seq)  # day 3.3: tokens already in cached blocks
            length = self.plan_chunk(seq, budget, plan)
            if length == 0:
                # Admission by memory: its first chunk does not fit in the free blocks. It holds no
                # blocks while it waits (any cached ones go back), so it can never block the pool.
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                return
            self.block_manager.record_lookup(seq, cached)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= length

    def plan_chunk(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """Plan the next chunk of `seq`'s uncomputed tokens: as many as the budget and the free blocks allow."""
        start = seq.num_computed_tokens
        length = min(budget, seq.num_uncomputed_tokens)
        block_size = self.block_manager.block_size
        # Shrink the chunk to what the free blocks (and the sequence's own partly filled block) can hold.
        room = (len(seq.block_table) + self.block_manager.num_free_blocks) * block_size - start
        length = min(length, room)
        if length <= 0:
            return 0
        self.block_manager.allocate(seq, start + length)
        plan.prefills.append(ScheduledChunk(seq, start, length))
        return length

    def preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Take `seq` off the running list: free its blocks, forget its cache, put it first in the waiting queue."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
        self.log(f"preempted request {seq.request_id!r} (recompute): KV cache full, "
                 f"{len(seq.token_ids)} tokens to recompute later")

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` (EOS, length, abort, stop): free its blocks and drop it from the queues (provided)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
