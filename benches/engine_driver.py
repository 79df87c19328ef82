"""Feed timed arrivals to a week-3 `LLMEngine` and record what every request felt (days 3.3 and 3.4 labs).

An arrival is due `at` seconds after the start. The driver adds each request when due (stamping its
arrival with the due time, so waiting behind a long step counts in its TTFT), steps while there is
work, and sleeps while there is none. Token times come from the engine's own MetricsRecorder.
"""

import random
import time
from dataclasses import dataclass

from tiny_llm_ref.sequence import SamplingParams


@dataclass
class Arrival:
    kind: str  # a label: "interactive", "batch", "user", ...
    prompt: list[int]
    max_tokens: int
    at: float = 0.0
    priority: int = 0


def random_tokens(length: int, seed: int) -> list[int]:
    """`length` ordinary token ids, drawn deterministically."""
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


def drive(engine, arrivals: list[Arrival], progress=None) -> dict:
    """Run `arrivals` through `engine` to the end; per-request TTFT/ITLs, and the run's figures."""
    clock = engine.clock
    pending = sorted(enumerate(arrivals), key=lambda item: item[1].at)
    # Machine-independent waits: the steps, and the tokens the model ran, between arrival and first token.
    work = {"steps": 0, "tokens": 0}
    added, first = {}, {}
    start = clock()
    while pending or engine.has_work():
        while pending and pending[0][1].at <= clock() - start:
            idx, arrival = pending.pop(0)
            engine.add_request(arrival.prompt, SamplingParams(max_tokens=arrival.max_tokens), request_id=idx,
                               priority=arrival.priority)
            engine.metrics.requests[idx].arrival = start + arrival.at
            added[idx] = dict(work)
        if engine.has_work():
            before = engine.prompt_tokens_total + engine.generation_tokens_total
            outputs = engine.step()
            work["steps"] += 1
            work["tokens"] += engine.prompt_tokens_total + engine.generation_tokens_total - before
            for output in outputs:
                if output.token is not None and output.request_id not in first:
                    first[output.request_id] = dict(work)
                if output.finished and progress is not None:
                    progress.update(1)
        elif pending:
            time.sleep(max(0.0, min(0.05, start + pending[0][1].at - clock())))
    requests = engine.metrics.requests
    return {
        "requests": [{"kind": arrivals[idx].kind, "ttft_s": r.ttft, "itls_s": r.itls, "arrival_s": r.arrival - start,
                      "finish_s": r.finish - start, "output_tokens": r.output_tokens,
                      "ttft_steps": first[idx]["steps"] - added[idx]["steps"] if idx in first else None,
                      "ttft_tokens": first[idx]["tokens"] - added[idx]["tokens"] if idx in first else None}
                     for idx, r in requests.items()],
        "prefix_cache_hit_rate": engine.prefix_cache_hit_rate,
        "num_preemptions": engine.num_preemptions,
        "wall_s": clock() - start,
    }


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]
