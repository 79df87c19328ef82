"""Drive a batch.Scheduler with requests that arrive over time, and measure what each request felt.

Shared by `pdm run bench-batching` and `pdm run bench-chunked-prefill`. A workload is a list of
`Arrival`s: a prompt (token ids), how many tokens to generate, and when it arrives: `at` seconds
after the start, or once every earlier request has produced `after_tokens` tokens (so "a long prompt
arrives while the short ones stream" holds on a fast machine and on a slow one alike).

The driver adds each request when it is due, runs `scheduler.step()` while there is work, sleeps
while there is none, and records token times with the scheduler's MetricsRecorder. An arrival that
falls inside a long step is stamped with its due time, so queueing behind that step counts in TTFT.
"""

import random
import time
from dataclasses import dataclass, field

import mlx.core as mx

from tiny_llm_ref.metrics import percentile  # day 2.2's: linear interpolation, as numpy


@dataclass
class Arrival:
    kind: str  # a label: "short", "long", ...
    prompt: list[int]
    max_tokens: int
    at: float = 0.0  # seconds after the start
    after_tokens: int | None = None  # or: once every earlier request has produced this many tokens


@dataclass
class RunResult:
    label: str
    kinds: dict  # prompt_idx -> kind
    metrics: object  # the MetricsRecorder
    stats: dict  # the scheduler's SchedulerStats.to_dict()
    start: float
    wall_s: float
    peak_memory_bytes: int  # above what was allocated before the run (the weights)
    outputs: dict = field(default_factory=dict)  # prompt_idx -> output token ids


def random_prompt(length: int, seed: int, vocab: int = 150_000) -> list[int]:
    """`length` token ids drawn deterministically from the ordinary (non-special) vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(100, min(vocab, 151_000)) for _ in range(length)]


def run_workload(batch_module, model, tokenizer, arrivals: list[Arrival], *, label: str, batch_size: int,
                 max_seq_len: int, prefill_step: int, policy=None, log=None, on_step=None) -> RunResult:
    """Run one workload to the end on a fresh Scheduler; `on_step(scheduler)` after every iteration."""
    from tiny_llm_ref.metrics import MetricsRecorder  # the measuring side is always the reference

    clock = time.perf_counter
    metrics = MetricsRecorder(clock=clock)
    scheduler = batch_module.Scheduler(model, tokenizer, max_seq_len=max_seq_len, batch_size=batch_size,
                                       prefill_step=prefill_step, policy=policy, metrics=metrics, clock=clock,
                                       log=log or (lambda line: None))
    pending = list(enumerate(arrivals))
    kinds, requests = {}, {}
    mx.synchronize()
    baseline = mx.get_active_memory()
    mx.reset_peak_memory()
    start = clock()

    def due(arrival: Arrival, now: float) -> bool:
        if arrival.after_tokens is not None:
            return all(len(r.output_tokens) >= arrival.after_tokens or r.is_done for r in requests.values())
        return arrival.at <= now - start

    while pending or scheduler.has_work():
        now = clock()
        while pending and due(pending[0][1], now):
            idx, arrival = pending.pop(0)
            requests[idx] = scheduler.add_request(arrival.prompt, idx, max_tokens=arrival.max_tokens)
            kinds[idx] = arrival.kind
            if arrival.after_tokens is None:
                metrics.requests[idx].arrival = start + arrival.at  # due time, even if a step ran late
        if scheduler.has_work():
            scheduler.step()
            if on_step is not None:
                on_step(scheduler)
        elif pending:
            time.sleep(max(0.0, min(0.05, start + pending[0][1].at - clock())))
    wall = clock() - start
    peak = mx.get_peak_memory() - baseline
    outputs = {r.prompt_idx: list(r.output_tokens) for r in scheduler.finished}
    return RunResult(label, kinds, metrics, scheduler.stats.to_dict(), start, wall, peak, outputs)


def summarize(result: RunResult, focus: str = "short") -> dict:
    """Per-run figures: TTFT and ITL percentiles of the `focus` requests, the longest stall, throughput."""
    timelines = result.metrics.requests
    focus_ids = [i for i, k in result.kinds.items() if k == focus] or list(result.kinds)
    itls = [gap for i in focus_ids for gap in timelines[i].itls]
    ttfts = [timelines[i].ttft for i in focus_ids if timelines[i].ttft is not None]
    other_ttft = {k: [timelines[i].ttft for i, kind in result.kinds.items() if kind == k and timelines[i].ttft]
                  for k in set(result.kinds.values()) if k != focus}
    done = [r for r in timelines.values() if r.finish is not None]
    makespan = max(r.finish for r in done) - min(r.arrival for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    itl50, itl99 = percentile(itls, 50), percentile(itls, 99)
    return {
        "label": result.label,
        f"{focus}_ttft_p50_s": percentile(ttfts, 50),
        f"{focus}_ttft_p99_s": percentile(ttfts, 99),
        f"{focus}_itl_p50_s": itl50,
        f"{focus}_itl_p99_s": itl99,
        f"{focus}_itl_p99_over_p50": (itl99 / itl50) if itl50 else None,
        "longest_stall_s": max(itls) if itls else None,
        **{f"{k}_ttft_mean_s": sum(v) / len(v) for k, v in other_ttft.items() if v},
        "makespan_s": makespan,
        "output_tokens_per_s": output_tokens / makespan,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / makespan,
        "peak_memory_mb": result.peak_memory_bytes / 2**20,
        "chunks": result.stats["chunks"],
        "avg_chunk_s": result.stats["avg_chunk_time"],
        "interleave_ratio": result.stats["interleave_ratio"],
    }


def itl_timeline(result: RunResult, focus: str = "short") -> list[tuple[float, float]]:
    """(seconds since start, gap to the previous token) for every token of the `focus` requests."""
    points = []
    for i, kind in result.kinds.items():
        if kind != focus:
            continue
        times = result.metrics.requests[i].token_times
        points += [(t - result.start, t - prev) for prev, t in zip(times, times[1:])]
    return sorted(points)
