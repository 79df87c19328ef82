"""What the labs send: one `Arrival` type, and the four workloads every lab draws from.

A workload is a list of `Arrival`s: a prompt (token ids), how many tokens to generate, a label
(`kind`) the figures group by, a priority, and when it arrives: `at` seconds after the start, or
once every earlier request has produced `after_tokens` tokens (so "a long prompt arrives while the
short ones stream" holds on a fast machine and a slow one alike).

- `head_of_line`: a few short requests stream; one long prompt arrives and its prefill stalls them.
- `mixed`: every fifth request long (20/80), Poisson arrivals, a fixed seed.
- `shared_prefix`: one system prompt before every request's own turn, Poisson arrivals.
- `interactive_and_batch`: long low-priority batch jobs at t=0, short high-priority requests later.

Prompts are random ordinary token ids drawn from fixed seeds: the same workload on every run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Arrival:
    kind: str  # the class the figures group by: "short", "long", "interactive", "batch", "user", ...
    prompt: list[int]
    max_tokens: int
    at: float = 0.0  # seconds after the start
    after_tokens: int | None = None  # or: once every earlier request has produced this many tokens
    priority: int = 0  # larger is more important (day 3.4)


def random_prompt(length: int, seed: int) -> list[int]:
    """`length` token ids drawn deterministically from the ordinary (non-special) vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(100, 150_000) for _ in range(length)]


def poisson_times(count: int, rate: float, seed: int) -> list[float]:
    """`count` arrival times of a Poisson process of `rate` requests/s, the first at 0."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def head_of_line(shorts: int, short_tokens: int, short_output: int, long_tokens: int, long_output: int,
                 long_at: float = 0.0, after_tokens: int | None = None) -> list[Arrival]:
    """`shorts` short requests at t=0; one long prompt at `long_at` s, or once each short one has `after_tokens` tokens."""
    arrivals = [Arrival("short", random_prompt(short_tokens, seed=i), short_output) for i in range(shorts)]
    arrivals.append(Arrival("long", random_prompt(long_tokens, seed=100), long_output, at=long_at,
                            after_tokens=after_tokens))
    return arrivals


def mixed(requests: int, short_tokens: int, short_output: int, long_tokens: int, long_output: int,
          seed: int, prompt_seed: int, mean_gap: float = 1.0) -> list[Arrival]:
    """Every fifth request long, the rest short; Poisson arrivals with `mean_gap` s between them."""
    times = poisson_times(requests, 1 / mean_gap, seed)
    arrivals = []
    for i, at in enumerate(times):
        long = i % 5 == 1
        arrivals.append(Arrival("long" if long else "short",
                                random_prompt(long_tokens if long else short_tokens, seed=prompt_seed + i),
                                long_output if long else short_output, at=at))
    return arrivals


def shared_prefix(requests: int, system_tokens: int, user_tokens: int, max_tokens: int, rate: float) -> list[Arrival]:
    """The same `system_tokens` system prompt, then each request's own `user_tokens`; Poisson arrivals at `rate`/s."""
    system = random_prompt(system_tokens, seed=0)
    return [Arrival("user", system + random_prompt(user_tokens, seed=100 + i), max_tokens, at=at)
            for i, at in enumerate(poisson_times(requests, rate, seed=1))]


def interactive_and_batch(batch: int, batch_tokens: int, batch_output: int, interactive: int,
                          interactive_tokens: int, interactive_output: int, rate: float,
                          with_batch: bool = True) -> list[Arrival]:
    """`batch` jobs at t=0 (priority 0); `interactive` requests (priority 1) at Poisson times from t=1 s."""
    arrivals = []
    if with_batch:
        arrivals += [Arrival("batch", random_prompt(batch_tokens, seed=i), batch_output, priority=0)
                     for i in range(batch)]
    arrivals += [Arrival("interactive", random_prompt(interactive_tokens, seed=100 + i), interactive_output,
                         at=1.0 + at, priority=1)
                 for i, at in enumerate(poisson_times(interactive, rate, seed=7))]
    return arrivals
