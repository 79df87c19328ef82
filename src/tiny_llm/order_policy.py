"""Order policies: which sequences the planner serves first, and whose blocks it may take back.

The scheduler (scheduler.py) plans; an order policy only ranks. `FirstComeFirstServed` is day 3.1's
(provided); `PriorityPolicy` and `ShortestPrefillFirst` are day 3.4's. (This module was
`priority_scheduler.py`: it never held a scheduler.)

Priorities: the planner serves important requests first, and takes blocks back from unimportant ones.

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

Length is a second key (`ShortestPrefillFirst`): among equal priorities, the sequence with the fewest
tokens left to prefill goes first. Under first come, first served a short prompt that arrives behind
a long one waits for all the long one's chunks; with this order it takes the budget first (one or
two steps), starts decoding, and the long prompt's chunks fill what the decodes leave. Length never
takes blocks (`outranks` is by priority alone), and aging still bounds a long prompt's wait.

`OrderPolicy` is the contract between the scheduler and its order policy: every policy here has all of it.
"""

from __future__ import annotations

from typing import Protocol

from .sequence import Sequence
from .validation import check_int

DEFAULT_AGING_STEPS = 256  # steps of waiting that raise a sequence's effective priority by one


class OrderPolicy(Protocol):
    """What the scheduler tells its order policy, and asks of it (provided)."""

    def add(self, seq: Sequence) -> None:
        """A sequence arrived."""

    def next_step(self) -> None:
        """A step is being planned."""

    def forget(self, seq: Sequence) -> None:
        """A sequence finished."""

    def order(self, seqs) -> list[Sequence]:
        """`seqs` most urgent first."""

    def outranks(self, seq: Sequence, other: Sequence) -> bool:
        """Whether `seq` may take `other`'s blocks."""

    def describe(self) -> str:
        """One line for the engine's start-up log."""


class FirstComeFirstServed:
    """Day 3.1's order: queues in arrival order, the newest admission preempted first, nobody outranks anybody (provided).

    The scheduler tells its order policy about arrivals, steps and endings, and asks it two things; day 3.4's `PriorityPolicy` answers them by priority.
    """

    def add(self, seq: Sequence) -> None:
        """A sequence arrived."""

    def next_step(self) -> None:
        """A step is being planned."""

    def forget(self, seq: Sequence) -> None:
        """A sequence finished."""

    def order(self, seqs) -> list[Sequence]:
        """`seqs` most urgent first: as they are (running in admission order, waiting in queue order)."""
        return list(seqs)

    def outranks(self, seq: Sequence, other: Sequence) -> bool:
        """Whether `seq` may take `other`'s blocks: never, among equals."""
        return False

    def describe(self) -> str:
        """One line for the engine's start-up log."""
        return "first come, first served"


class PriorityPolicy:
    """The scheduler's order policy by priority: higher effective priority first, then earlier arrival."""

    def __init__(self, aging_steps: int = DEFAULT_AGING_STEPS):
        """A step counter and each sequence's arrival step (provided)."""
        self.aging_steps = check_int("aging_steps", aging_steps, 1)
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


class ShortestPrefillFirst(PriorityPolicy):
    """Priority order, and among equals the fewest uncomputed tokens first: a short prompt passes a long one."""

    def rank(self, seq: Sequence) -> tuple[int, int, int]:
        """Sort key, most urgent first: higher effective priority, then fewer uncomputed tokens, then earlier arrival."""
        # TODO: (-effective priority, uncomputed tokens, arrival step)
        raise NotImplementedError(
            "Week 3 Day 4 Task 4 (book/src/week3-04-priorities.md): priority, then fewest tokens left to prefill, then arrival"
        )

    def outranks(self, seq: Sequence, other: Sequence) -> bool:
        """Whether `seq` may take `other`'s blocks: by priority and arrival alone, never for being shorter.

        A preempted prompt is recomputed from its start: taking a long prompt's blocks to admit a short one
        would throw its chunks away, and the next short arrival would do it again.
        """
        # TODO: compare PriorityPolicy's ranks (priority, then arrival), not this policy's
        raise NotImplementedError("Week 3 Day 4 Task 4 (book/src/week3-04-priorities.md): length never takes blocks")

    def describe(self) -> str:
        """One line for the engine's start-up log (provided)."""
        return f"shortest prefill first within priority order, aged by one every {self.aging_steps} steps"
