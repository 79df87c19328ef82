"""Priorities: the planner serves important requests first, and takes blocks back from unimportant ones.

Day 3.1's planner is first come, first served: a chat user who arrives behind a queue of long batch
jobs waits for all of them. Here every request carries a `priority` (an int; *larger is more
important*, 0 by default). The planner stays day 3.1's `Scheduler`: this module is only its order
policy, a plug-in that ranks sequences, and the plan follows the ranking everywhere:

- the order of the running list, hence of decode tokens and of who gets a block first (and of the
  victims: the scheduler preempts from the back, the least important and most recently admitted);
- the prefill budget: part-way prompts and waiting sequences compete in one priority order, so a
  new important prompt does not wait behind the chunks of an unimportant long one;
- preemption: when the most important waiting sequence cannot be admitted (no sequence slot, no
  blocks for its first chunk, no budget left after the decode tokens), the running sequences it
  outranks are preempted (day 3.2's recompute) until it can (`Scheduler.make_room`).

Strict priority can starve: a steady stream of important requests would keep an unimportant one
waiting (or preempted) forever. So priorities *age*: a sequence's effective priority grows by one
for every `aging_steps` steps since it arrived. A request of priority p thus competes like a new
request of priority p + k after k * aging_steps steps, and once no fresh arrival outranks it, it is
neither passed over nor preempted by them: its wait is bounded.
"""

from __future__ import annotations

from .sequence import Sequence

DEFAULT_AGING_STEPS = 256  # steps of waiting that raise a sequence's effective priority by one


class PriorityPolicy:
    """The scheduler's order policy by priority: higher effective priority first, then earlier arrival."""

    def __init__(self, aging_steps: int = DEFAULT_AGING_STEPS):
        """A step counter and each sequence's arrival step (provided)."""
        if not isinstance(aging_steps, int) or isinstance(aging_steps, bool) or aging_steps < 1:
            raise ValueError(f"aging_steps must be an integer >= 1, got {aging_steps!r}")
        self.aging_steps = aging_steps
        self.num_steps = 0
        self.arrival_step: dict[Sequence, int] = {}

    def add(self, seq: Sequence) -> None:
        """Remember the step `seq` arrived at (provided)."""
        self.arrival_step[seq] = self.num_steps

    def next_step(self) -> None:
        """One more step: every waiting sequence ages (provided)."""
        self.num_steps += 1

    def forget(self, seq: Sequence) -> None:
        """`seq` finished: forget its arrival step (provided)."""
        self.arrival_step.pop(seq, None)

    def effective_priority(self, seq: Sequence) -> int:
        """`seq.priority`, plus one for every `aging_steps` steps since it arrived."""
        # TODO: seq.priority + steps since its arrival // aging_steps
        raise NotImplementedError(
            "Week 3 Day 4 Task 1 (book/src/week3-04-priorities.md): priority plus one per aging_steps steps waited"
        )

    def rank(self, seq: Sequence) -> tuple[int, int]:
        """Sort key, most urgent first: higher effective priority, then earlier arrival."""
        # TODO: (-effective priority, arrival step)
        raise NotImplementedError(
            "Week 3 Day 4 Task 1 (book/src/week3-04-priorities.md): sort key: higher effective priority, then earlier arrival"
        )

    def order(self, seqs) -> list[Sequence]:
        """`seqs` most urgent first; stable, so among equals the given order stands.

        Effective priorities change as sequences age, so the queues are sorted again every step
        rather than kept in a heap whose keys would go stale.
        """
        # TODO: sort by rank (Python's sort is stable)
        raise NotImplementedError(
            "Week 3 Day 4 Task 2 (book/src/week3-04-priorities.md): most urgent first, stable among equals"
        )

    def outranks(self, seq: Sequence, other: Sequence) -> bool:
        """Whether `seq` is strictly more urgent than `other`, so it may take `other`'s blocks."""
        # TODO: compare ranks
        raise NotImplementedError("Week 3 Day 4 Task 2 (book/src/week3-04-priorities.md): strictly more urgent")

    def describe(self) -> str:
        """One line for the engine's start-up log (provided)."""
        return f"priority order, aged by one every {self.aging_steps} steps"
