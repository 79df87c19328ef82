"""Priorities: the planner serves important requests first, and takes blocks back from unimportant ones.

Day 3.1's planner is first come, first served: a chat user who arrives behind a queue of long batch
jobs waits for all of them. Here every request carries a `priority` (an int; *larger is more
important*, 0 by default), and the plan follows it everywhere:

- the order of the running list, hence of decode tokens and of who gets a block first (and of the
  victims: the scheduler preempts from the back, the least important and most recently admitted);
- the prefill budget: part-way prompts and waiting sequences compete in one priority order, so a
  new important prompt does not wait behind the chunks of an unimportant long one;
- preemption: when the most important waiting sequence cannot be admitted (no sequence slot, no
  blocks for its first chunk, no budget left after the decode tokens), less important running
  sequences are preempted (day 3.2's recompute) until it can.

Strict priority can starve: a steady stream of important requests would keep an unimportant one
waiting (or preempted) forever. So priorities *age*: a sequence's effective priority grows by one
for every `aging_steps` steps since it arrived. A request of priority p thus competes like a new
request of priority p + k after k * aging_steps steps, and once no fresh arrival outranks it, it is
neither passed over nor preempted by them: its wait is bounded.
"""

from __future__ import annotations

from .block_manager import BlockManager, blocks_for
from .scheduler import Scheduler, StepPlan
from .sequence import Sequence, SequenceStatus

DEFAULT_AGING_STEPS = 256  # steps of waiting that raise a sequence's effective priority by one


class PriorityScheduler(Scheduler):
    """Day 3.1/3.2's scheduler with priorities: higher effective priority first, and preemption of lower ones."""

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int = 256, max_num_seqs: int = 16,
                 policy=None, log=None, aging_steps: int = DEFAULT_AGING_STEPS):
        """The base scheduler, a step counter, and each sequence's arrival step (provided)."""
        super().__init__(block_manager, max_num_batched_tokens, max_num_seqs, policy, log)
        if not isinstance(aging_steps, int) or isinstance(aging_steps, bool) or aging_steps < 1:
            raise ValueError(f"aging_steps must be an integer >= 1, got {aging_steps!r}")
        self.aging_steps = aging_steps
        self.num_steps = 0
        self.arrival_step: dict[Sequence, int] = {}

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence and remember the step it arrived at (provided)."""
        self.arrival_step[seq] = self.num_steps
        super().add(seq)

    def effective_priority(self, seq: Sequence) -> int:
        """`seq.priority`, plus one for every `aging_steps` steps since it arrived."""
        raise NotImplementedError("Week 3 Day 4 Task 1 (book/src/week3-04-priorities.md): priority plus one per aging_steps steps waited")

    def rank(self, seq: Sequence) -> tuple[int, int]:
        """Sort key, most urgent first: higher effective priority, then earlier arrival."""
        raise NotImplementedError("Week 3 Day 4 Task 1 (book/src/week3-04-priorities.md): sort key: higher effective priority, then earlier arrival")

    def schedule(self) -> StepPlan:
        """Order both queues by priority, make room for the most urgent waiting sequence, then plan as before."""
        raise NotImplementedError("Week 3 Day 4 Task 2 (book/src/week3-04-priorities.md): order both queues by rank, make room, then plan as day 3.2 does")

    def make_room(self, plan: StepPlan) -> None:
        """Preempt less urgent running sequences while the most urgent waiting one could not be admitted.

        It needs a sequence slot, budget left after the decode tokens, and free blocks for its first
        chunk plus a block for every decode that starts a new one. Victims come from the back of the
        running list (least urgent, most recently admitted), and only outranked ones.
        """
        raise NotImplementedError("Week 3 Day 4 Task 3 (book/src/week3-04-priorities.md): preempt outranked running sequences until the most urgent waiting one fits")

    def can_admit(self, seq: Sequence) -> bool:
        """True when `seq`'s first chunk would get a slot, budget and blocks in this step."""
        raise NotImplementedError("Week 3 Day 4 Task 3 (book/src/week3-04-priorities.md): slot, budget and blocks for its first chunk")

    def schedule_prefills(self, plan: StepPlan, budget: int) -> None:
        """Prefill chunks within `budget`: part-way and waiting sequences in one priority order."""
        raise NotImplementedError("Week 3 Day 4 Task 2 (book/src/week3-04-priorities.md): part-way and waiting sequences in one priority order under the budget")

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` as before, and forget its arrival step (provided)."""
        super().finish(seq, reason)
        self.arrival_step.pop(seq, None)
