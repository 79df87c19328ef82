"""One runner for every lab: feed a workload to an engine adapter, and measure what every request felt.

`run` adds each arrival when it is due, steps the engine while there is work, sleeps while there is
none, and records every token's time with day 2.2's `MetricsRecorder`. An arrival that falls inside
a long step is stamped with its due time, so waiting behind that step counts in its TTFT. It also
counts the machine-independent wait of each request: the steps, and the model tokens, between its
arrival and its first token (where the engine reports tokens run).

`alternate` orders configurations so that engines take turns: a machine that gets busier or
quieter during a run slows every engine alike. `summarize` turns a run into the figures the tables
print, with day 2.2's `percentile` (linear interpolation, as numpy's default).

The measuring side is always the reference's day 2.2 (`MetricsRecorder`, `percentile`): a lab
measures the student's engine with a ruler the student did not write.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from benches.workloads import Arrival
from course import selector

_metrics = selector.reference().metrics
percentile = _metrics.percentile

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass
class Run:
    """One workload through one engine configuration."""

    label: str
    arrivals: list[Arrival]
    metrics: object  # the MetricsRecorder: every request's arrival, token and finish times
    start: float
    wall_s: float
    steps: int
    peak_memory_bytes: int  # above what was allocated before the run (the weights)
    counters: dict  # the adapter's counters at the end
    outputs: dict = field(default_factory=dict)  # idx -> output token ids
    first_token_wait: dict = field(default_factory=dict)  # idx -> {"steps": .., "tokens": ..} before its first token


def _due(arrival: Arrival, metrics, elapsed: float) -> bool:
    if arrival.after_tokens is None:
        return arrival.at <= elapsed
    return all(r.output_tokens >= arrival.after_tokens or r.finish is not None for r in metrics.requests.values())


def run(adapter, arrivals: list[Arrival], label: str, clock=time.perf_counter, max_steps: int = 1_000_000) -> Run:
    """Run `arrivals` through `adapter` to the end (or `max_steps` steps: RuntimeError)."""
    metrics = _metrics.MetricsRecorder(clock=clock)
    pending = list(enumerate(arrivals))
    outputs, added, first = {}, {}, {}
    steps = 0
    mx.synchronize()
    baseline = mx.get_active_memory()
    mx.reset_peak_memory()
    start = clock()
    while pending or adapter.has_work():
        while pending and _due(pending[0][1], metrics, clock() - start):
            idx, arrival = pending.pop(0)
            metrics.arrive(idx, len(arrival.prompt))
            if arrival.after_tokens is None:
                metrics.requests[idx].arrival = start + arrival.at  # its due time, even if a step ran late
            adapter.add(idx, arrival)
            outputs[idx], added[idx] = [], (steps, adapter.counters().get("tokens_run"))
        if adapter.has_work():
            events = adapter.step()
            steps += 1
            if steps > max_steps:
                raise RuntimeError(f"{label}: still running after {max_steps} steps")
            record(events, metrics, outputs, added, first, steps, adapter)
        elif pending and pending[0][1].after_tokens is None:
            time.sleep(max(0.0, min(0.05, start + pending[0][1].at - clock())))
    wall = clock() - start
    peak = mx.get_peak_memory() - baseline
    counters = adapter.counters()
    adapter.close()
    return Run(label, arrivals, metrics, start, wall, steps, peak, counters, outputs, first)


def record(events, metrics, outputs, added, first, steps, adapter) -> None:
    """Note one step's events: token times, outputs, and each request's wait before its first token."""
    for event in events:
        if event.token is not None:
            metrics.token(event.idx)
            outputs[event.idx].append(event.token)
            if event.idx not in first:
                steps_then, tokens_then = added[event.idx]
                tokens_now = adapter.counters().get("tokens_run")
                first[event.idx] = {"steps": steps - steps_then,
                                    "tokens": None if tokens_then is None else tokens_now - tokens_then}
        if event.finished:
            metrics.finish(event.idx)


def alternate(*groups: list) -> list:
    """Interleave lists of configurations, one from each in turn: [a1, b1, a2, b2, b3, ...]."""
    order = []
    for i in range(max(map(len, groups), default=0)):
        order += [group[i] for group in groups if i < len(group)]
    return order


# ---------------------------------------------------------------- figures


def ids_of(run_: Run, kind: str | None) -> list[int]:
    """The indexes of the arrivals of one kind (all of them for None)."""
    return [i for i, a in enumerate(run_.arrivals) if kind is None or a.kind == kind]


def class_figures(run_: Run, kind: str | None) -> dict:
    """TTFT and ITL percentiles of one class of requests, their longest stall and first-token waits."""
    timelines = run_.metrics.requests
    ids = [i for i in ids_of(run_, kind) if i in timelines]
    itls = [gap for i in ids for gap in timelines[i].itls]
    ttfts = [timelines[i].ttft for i in ids if timelines[i].ttft is not None]
    waits = [run_.first_token_wait[i] for i in ids if i in run_.first_token_wait]
    itl50, itl99 = percentile(itls, 50), percentile(itls, 99)
    tokens = [w["tokens"] for w in waits if w["tokens"] is not None]
    return {
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "itl_p50_s": itl50, "itl_p99_s": itl99, "itl_p99_over_p50": itl99 / itl50 if itl50 else None,
        "longest_stall_s": max(itls) if itls else None,
        "ttft_p99_steps": percentile([w["steps"] for w in waits], 99),
        "ttft_p99_tokens": percentile(tokens, 99),
        "output_tokens_per_s": class_throughput(run_, ids),
    }


def class_throughput(run_: Run, ids: list[int]) -> float | None:
    """Output tokens of these requests over the time from the first one's arrival to the last one's finish."""
    done = [run_.metrics.requests[i] for i in ids if run_.metrics.requests[i].finish is not None]
    if not done:
        return None
    makespan = max(r.finish for r in done) - min(r.arrival for r in done)
    return sum(r.output_tokens for r in done) / makespan if makespan > 0 else None


def summarize(run_: Run) -> dict:
    """Per-run figures: per class (`<kind>_ttft_p50_s`, ...), throughput over the whole run, memory, counters."""
    row = {"label": run_.label, "steps": run_.steps, "wall_s": run_.wall_s}
    for kind in dict.fromkeys(a.kind for a in run_.arrivals):
        row.update({f"{kind}_{name}": value for name, value in class_figures(run_, kind).items()})
    done = [r for r in run_.metrics.requests.values() if r.finish is not None]
    makespan = max(r.finish for r in done) - min(r.arrival for r in done)
    output = sum(r.output_tokens for r in done)
    row.update(makespan_s=makespan, output_tokens=output, output_tokens_per_s=output / makespan,
               total_tokens_per_s=(output + sum(r.prompt_tokens for r in done)) / makespan,
               peak_memory_mb=run_.peak_memory_bytes / 2**20, **run_.counters)
    return row


def meets_targets(ttft: float | None, tpot: float | None, slo_ttft: float, slo_tpot: float) -> bool:
    """Whether one request kept both promises (DistServe's goodput; vLLM's `--goodput ttft:.. tpot:..`): its first
    token within `slo_ttft` seconds, and its time per output token after that (day 2.2's TPOT) within `slo_tpot`.
    A request with one output token has no TPOT to miss."""
    return ttft is not None and ttft <= slo_ttft and (tpot is None or tpot <= slo_tpot)


def keeps_pace(arrival: float, token_times: list[float], slo_ttft: float, slo_tpot: float) -> bool:
    """Whether no token came later than a reader would reach it who starts at the TTFT target and reads one token
    per TPOT target: token i (from 0) by `arrival + slo_ttft + i * slo_tpot`.

    TPOT is a mean: one long stall in a long answer averages away. The reader does not: tokens that came early
    build up slack, and a stall longer than that slack is one the user sees, the text stopping mid-answer
    (the generation stalls Sarathi-Serve schedules against; Andes's expected token timeline)."""
    return all(t - arrival <= slo_ttft + i * slo_tpot for i, t in enumerate(token_times))


def good_request(arrival: float, token_times: list[float], ttft: float | None, tpot: float | None,
                 slo_ttft: float, slo_tpot: float) -> bool:
    """The goodput of every lab: both of DistServe's targets met (`meets_targets`) and no stall the user sees
    (`keeps_pace`)."""
    return meets_targets(ttft, tpot, slo_ttft, slo_tpot) and keeps_pace(arrival, token_times, slo_ttft, slo_tpot)


def goodput_share(run_: Run, slo_ttft: float, slo_tpot: float, stalls: bool = True) -> float:
    """The share of the run's requests that finished and are good (`good_request`), 0..1; `stalls=False`: by
    DistServe's two targets alone (`meets_targets`), which a stall hidden in the mean passes."""
    good = [r for r in run_.metrics.requests.values() if r.finish is not None
            and (good_request(r.arrival, r.token_times, r.ttft, r.tpot, slo_ttft, slo_tpot) if stalls
                 else meets_targets(r.ttft, r.tpot, slo_ttft, slo_tpot))]
    return len(good) / len(run_.arrivals)


def token_times(run_: Run) -> dict:
    """Every request's kind and token times (seconds since the start), for the JSON and the plots."""
    return {str(i): {"kind": run_.arrivals[i].kind, "arrival_s": r.arrival - run_.start,
                     "times": [t - run_.start for t in r.token_times]}
            for i, r in run_.metrics.requests.items()}


def itl_points(run_: Run, kind: str) -> list[tuple[float, float]]:
    """(seconds since the start, gap to the previous token) for every token of one class, in time order."""
    points = []
    for i in ids_of(run_, kind):
        times = run_.metrics.requests[i].token_times
        points += [(t - run_.start, t - prev) for prev, t in zip(times, times[1:])]
    return sorted(points)
