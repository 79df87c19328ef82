"""Serving metrics: what a user of an inference server feels, measured per request and over a run.

For one request (times in seconds, all read from one clock):

    arrival ──── prefill ──── token 1 ── token 2 ──── token 3 ── ... ── token n ── finish
    |<-------- TTFT -------->|<- ITL ->|<--- ITL --->|

- TTFT (time to first token) = first token time - arrival: queueing plus prefill.
- ITL (inter-token latency) = the gaps between consecutive tokens: n - 1 of them.
- TPOT (time per output token) = (e2e - TTFT) / (n - 1): the average pace after the first token.
- e2e latency = finish - arrival.

Over a run, `MetricsRecorder.summary()` reports percentiles (p50, p90, p99) of each, throughput
(output tokens/s and requests/s from the first arrival to the last finish) and the longest stall:
the longest gap between two consecutive tokens of one request, which is what head-of-line blocking
looks like from the outside. The clock is injected, so tests drive it by hand.
"""

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

PERCENTILES = (50, 90, 99)


@dataclass
class RequestMetrics:
    """The timeline of one request: when it arrived, when each output token came out, when it finished."""

    request_id: Hashable
    prompt_tokens: int
    arrival: float
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None

    @property
    def output_tokens(self) -> int:
        """How many output tokens the request has produced so far."""
        return len(self.token_times)

    @property
    def first_token_time(self) -> float | None:
        """When the first output token came out (None before it did)."""
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        """Time to first token: first token time minus arrival (None before the first token)."""
        # BEGIN TASK Week 2 Day 2 Task 1: time to first token
        # TODO: the first token time minus arrival; None before the first token
        if not self.token_times:
            return None
        return self.token_times[0] - self.arrival
        # END TASK

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies: the gap before each token after the first (n - 1 values for n tokens)."""
        # BEGIN TASK Week 2 Day 2 Task 1: the inter-token latencies
        # TODO: differences of consecutive token times
        return [later - earlier for earlier, later in zip(self.token_times, self.token_times[1:])]
        # END TASK

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - TTFT) / (n - 1); None until finished with n >= 2."""
        # BEGIN TASK Week 2 Day 2 Task 1: time per output token
        # TODO: (e2e - TTFT) / (n - 1); None unless finished with at least two tokens
        if self.finish is None or self.output_tokens < 2:
            return None
        return (self.e2e_latency - self.ttft) / (self.output_tokens - 1)
        # END TASK

    @property
    def e2e_latency(self) -> float | None:
        """End-to-end latency: finish minus arrival (None until the request finished)."""
        # BEGIN TASK Week 2 Day 2 Task 1: end-to-end latency
        # TODO: finish minus arrival; None before finish
        if self.finish is None:
            return None
        return self.finish - self.arrival
        # END TASK


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0 <= p <= 100) with linear interpolation, as numpy.percentile; None if empty."""
    # BEGIN TASK Week 2 Day 2 Task 2: the p-th percentile with linear interpolation
    # TODO: sort a copy; rank = p / 100 * (n - 1); interpolate between floor and ceil
    if not values:
        return None
    ordered = sorted(values)
    # The p-th percentile sits at fractional rank p/100 * (n - 1) in the sorted list.
    rank = p / 100 * (len(ordered) - 1)
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    weight = rank - below
    return ordered[below] + (ordered[above] - ordered[below]) * weight
    # END TASK


def _distribution(values: list[float]) -> dict:
    """p50/p90/p99, mean and max of a list of seconds (all None when the list is empty)."""
    stats = {f"p{p}": percentile(values, p) for p in PERCENTILES}
    stats["mean"] = sum(values) / len(values) if values else None
    stats["max"] = max(values) if values else None
    return stats


class MetricsRecorder:
    """Records request timelines as a server runs, and summarizes them. Shared by schedulers and benchmarks.

    Call `arrive` when a request enters the server, `token` each time one of its output tokens is
    produced, `finish` when it leaves. Times come from `clock` (seconds), so tests inject a fake one.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        """An empty recorder reading times (in seconds) from `clock`."""
        self.clock = clock
        self.requests: dict[Hashable, RequestMetrics] = {}

    def arrive(self, request_id: Hashable, prompt_tokens: int) -> None:
        """A request entered the server with a prompt of `prompt_tokens` tokens."""
        # BEGIN TASK Week 2 Day 2 Task 3: record a request's arrival
        # TODO: a new RequestMetrics at clock(); ValueError for an id seen before
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already arrived")
        self.requests[request_id] = RequestMetrics(request_id, prompt_tokens, arrival=self.clock())
        # END TASK

    def token(self, request_id: Hashable) -> None:
        """The request produced one output token, now."""
        # BEGIN TASK Week 2 Day 2 Task 3: record one output token
        # TODO: append clock() to the request's token_times
        self.requests[request_id].token_times.append(self.clock())
        # END TASK

    def finish(self, request_id: Hashable) -> None:
        """The request is done (EOS, length limit, or cancelled)."""
        # BEGIN TASK Week 2 Day 2 Task 3: record a request's finish
        # TODO: set the request's finish to clock()
        self.requests[request_id].finish = self.clock()
        # END TASK

    def summary(self) -> dict:
        """Percentiles of TTFT, ITL, TPOT and e2e latency, throughput and the longest stall, over finished requests.

        Keys: count, unfinished, output_tokens, duration_s (first arrival to last finish),
        output_tokens_per_s, requests_per_s, ttft, itl, tpot, e2e (each a dict of p50, p90, p99, mean,
        max in seconds), longest_stall_s, longest_stall_request, and note (a sentence when nothing finished).
        """
        # BEGIN TASK Week 2 Day 2 Task 3: percentiles, throughput and the longest stall
        # TODO: finished requests only; every key listed in the docstring, None when unknown
        done = [r for r in self.requests.values() if r.finish is not None]
        summary = {
            "count": len(done),
            "unfinished": len(self.requests) - len(done),
            "output_tokens": sum(r.output_tokens for r in done),
            "duration_s": None,
            "output_tokens_per_s": None,
            "requests_per_s": None,
            "ttft": _distribution([r.ttft for r in done if r.ttft is not None]),
            "itl": _distribution([gap for r in done for gap in r.itls]),
            "tpot": _distribution([r.tpot for r in done if r.tpot is not None]),
            "e2e": _distribution([r.e2e_latency for r in done]),
            "longest_stall_s": None,
            "longest_stall_request": None,
            "note": None,
        }
        if not done:
            summary["note"] = "no finished requests: nothing to summarize"
            return summary
        duration = max(r.finish for r in done) - min(r.arrival for r in done)
        summary["duration_s"] = duration
        if duration > 0:
            summary["output_tokens_per_s"] = summary["output_tokens"] / duration
            summary["requests_per_s"] = len(done) / duration
        stalls = [(max(r.itls), r.request_id) for r in done if r.itls]
        if stalls:
            longest, request_id = max(stalls, key=lambda stall: stall[0])
            summary["longest_stall_s"] = longest
            summary["longest_stall_request"] = request_id
        return summary
        # END TASK

    def to_json(self) -> dict:
        """A JSON-ready dict: the summary and every request's timeline (`from_json` reads it back)."""
        # BEGIN TASK Week 2 Day 2 Task 3: the JSON form
        # TODO: {'summary': ..., 'requests': [one dict per request]}
        return {
            "summary": self.summary(),
            "requests": [
                {
                    "request_id": r.request_id,
                    "prompt_tokens": r.prompt_tokens,
                    "arrival": r.arrival,
                    "token_times": list(r.token_times),
                    "finish": r.finish,
                }
                for r in self.requests.values()
            ],
        }
        # END TASK

    @classmethod
    def from_json(cls, data: dict, clock: Callable[[], float] = time.perf_counter) -> "MetricsRecorder":
        """Rebuild a recorder from `to_json()` output (after a trip through json.dumps / json.loads)."""
        # BEGIN TASK Week 2 Day 2 Task 3: read the JSON form back
        # TODO: a recorder holding RequestMetrics rebuilt from data['requests']
        recorder = cls(clock=clock)
        for item in data["requests"]:
            request = RequestMetrics(
                request_id=item["request_id"],
                prompt_tokens=item["prompt_tokens"],
                arrival=item["arrival"],
                token_times=list(item["token_times"]),
                finish=item["finish"],
            )
            recorder.requests[request.request_id] = request
        return recorder
        # END TASK


def format_summary(summary: dict) -> str:
    """A small text table of a `MetricsRecorder.summary()`, in milliseconds, for benchmarks and demos."""
    if summary["count"] == 0:
        return summary["note"] or "no finished requests"

    def ms(value):
        return "-" if value is None else f"{value * 1000:.1f}"

    lines = [f"{'metric':8s} {'p50 ms':>10s} {'p90 ms':>10s} {'p99 ms':>10s} {'mean ms':>10s} {'max ms':>10s}"]
    for name in ("ttft", "itl", "tpot", "e2e"):
        stats = summary[name]
        cells = " ".join(f"{ms(stats[key]):>10s}" for key in ("p50", "p90", "p99", "mean", "max"))
        lines.append(f"{name:8s} {cells}")
    throughput = summary["output_tokens_per_s"]
    lines.append(
        f"{summary['count']} requests, {summary['output_tokens']} output tokens in {summary['duration_s']:.3f} s"
        + (f": {throughput:.1f} tokens/s, {summary['requests_per_s']:.2f} requests/s" if throughput else "")
    )
    if summary["longest_stall_s"] is not None:
        lines.append(f"longest stall: {ms(summary['longest_stall_s'])} ms (request {summary['longest_stall_request']})")
    return "\n".join(lines)
