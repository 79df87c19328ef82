"""Week 2 Day 2: serving metrics (book/src/week2-02-serving-metrics.md).

Every time comes from an injected fake clock that the test moves by hand, so each expected value is
exact and no test depends on how fast the machine is. Oracles: hand-computed timelines, and
numpy.percentile for the percentiles.
"""

import json
import math

import numpy as np
import pytest

from tests.harness import actor_fakes, solution

sol = solution(week=2, day=2)


def fake_clock(start: float = 100.0):
    """A clock that only moves when told to (`clock.now = 3.0`), built where the recorder under test reads it."""
    return actor_fakes(sol).ManualClock(start)


def request(token_times, finish=None, arrival=1.0, request_id="r", prompt_tokens=7):
    return sol.metrics.RequestMetrics(request_id, prompt_tokens, arrival, list(token_times), finish)


# ---------------------------------------------------------------- Task 1: one request's timeline

def test_task_1_request_metrics():
    # Arrives at 1.0, tokens at 1.5, 1.7, 2.0, 2.6, finishes at 2.6.
    r = request([1.5, 1.7, 2.0, 2.6], finish=2.6)
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.2, 0.3, 0.6])
    assert r.e2e_latency == pytest.approx(1.6)
    # TPOT = (e2e - TTFT) / (n - 1) = (1.6 - 0.5) / 3
    assert r.tpot == pytest.approx(1.1 / 3)
    # It is the mean ITL when the request finishes with its last token...
    assert r.tpot == pytest.approx(sum(r.itls) / len(r.itls))
    # ...and counts the time after the last token when it finishes later.
    later = request([1.5, 1.7, 2.0, 2.6], finish=3.2)
    assert later.tpot == pytest.approx((2.2 - 0.5) / 3)
    assert later.e2e_latency == pytest.approx(2.2)


def test_task_1_one_token_and_unfinished():
    # One token: a TTFT, no gaps, no TPOT (there is no "after the first token").
    one = request([1.25], finish=1.5)
    assert one.ttft == pytest.approx(0.25)
    assert one.itls == []
    assert one.tpot is None
    assert one.e2e_latency == pytest.approx(0.5)
    # Nothing yet: no TTFT, no gaps, no end-to-end latency.
    waiting = request([])
    assert waiting.ttft is None and waiting.itls == [] and waiting.tpot is None
    assert waiting.e2e_latency is None
    # Tokens but not finished: TTFT and gaps are known, e2e and TPOT are not.
    running = request([2.0, 2.5])
    assert running.ttft == pytest.approx(1.0) and running.itls == pytest.approx([0.5])
    assert running.e2e_latency is None and running.tpot is None


# ---------------------------------------------------------------- Task 2: percentiles

@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
def test_task_2_percentile_matches_numpy(n):
    rng = np.random.default_rng(n)
    values = list(rng.exponential(0.05, size=n))
    shuffled = list(rng.permutation(values))
    for p in (0, 10, 50, 90, 99, 99.9, 100):
        assert sol.metrics.percentile(shuffled, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-12)


def test_task_2_percentile_small_cases():
    assert sol.metrics.percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)  # halfway between 2 and 3
    assert sol.metrics.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert sol.metrics.percentile([7.0], 99) == pytest.approx(7.0)
    assert sol.metrics.percentile([], 50) is None
    values = [5.0, 1.0, 3.0]
    sol.metrics.percentile(values, 50)
    assert values == [5.0, 1.0, 3.0], "percentile must not reorder the caller's list"


# ---------------------------------------------------------------- Task 3: the recorder

def record_run(recorder, clock):
    """Three requests, interleaved the way a server interleaves them. Times in seconds from 100.0."""
    clock.now = 100.0
    recorder.arrive("a", prompt_tokens=10)
    clock.now = 100.5
    recorder.arrive("b", prompt_tokens=4)
    clock.now = 101.0
    recorder.token("a")  # a: TTFT 1.0
    clock.now = 101.2
    recorder.token("a")
    recorder.token("b")  # b: TTFT 0.7
    clock.now = 101.4
    recorder.arrive("c", prompt_tokens=30)
    clock.now = 102.4
    recorder.token("a")  # a stalls 1.2 s while c's long prompt is prefilled
    recorder.token("c")  # c: TTFT 1.0
    recorder.finish("c")  # c: one token only
    clock.now = 102.5
    recorder.token("b")
    recorder.finish("a")
    clock.now = 103.0
    recorder.token("b")
    recorder.finish("b")


def test_task_3_recorder_timelines():
    clock = fake_clock()
    recorder = sol.metrics.MetricsRecorder(clock=clock)
    record_run(recorder, clock)
    a, b, c = (recorder.requests[name] for name in "abc")
    assert a.prompt_tokens == 10 and c.prompt_tokens == 30
    assert a.arrival == 100.0 and b.arrival == 100.5 and c.arrival == 101.4
    assert a.token_times == pytest.approx([101.0, 101.2, 102.4])
    assert b.token_times == pytest.approx([101.2, 102.5, 103.0])
    assert c.token_times == pytest.approx([102.4])
    assert (a.finish, b.finish, c.finish) == pytest.approx((102.5, 103.0, 102.4))
    with pytest.raises(ValueError):
        recorder.arrive("a", prompt_tokens=1)  # the same id twice is a bug in the caller


def test_task_3_summary_values():
    clock = fake_clock()
    recorder = sol.metrics.MetricsRecorder(clock=clock)
    record_run(recorder, clock)
    s = recorder.summary()
    assert s["count"] == 3 and s["unfinished"] == 0
    assert s["output_tokens"] == 7
    ttfts = [1.0, 0.7, 1.0]
    itls = [0.2, 1.2, 1.3, 0.5]  # a: 0.2, 1.2; b: 1.3, 0.5; c: none
    tpots = [(2.5 - 1.0) / 2, (2.5 - 0.7) / 2]  # c has one token: no TPOT
    e2es = [2.5, 2.5, 1.0]
    for name, values in (("ttft", ttfts), ("itl", itls), ("tpot", tpots), ("e2e", e2es)):
        for p in (50, 90, 99):
            assert s[name][f"p{p}"] == pytest.approx(float(np.percentile(values, p))), f"{name} p{p}"
        assert s[name]["mean"] == pytest.approx(float(np.mean(values))), f"{name} mean"
        assert s[name]["max"] == pytest.approx(max(values)), f"{name} max"
    # Throughput over the run: first arrival (100.0) to last finish (103.0).
    assert s["duration_s"] == pytest.approx(3.0)
    assert s["output_tokens_per_s"] == pytest.approx(7 / 3.0)
    assert s["requests_per_s"] == pytest.approx(3 / 3.0)
    # The longest gap between two tokens of one request: b waited 1.3 s for its second token.
    assert s["longest_stall_s"] == pytest.approx(1.3)
    assert s["longest_stall_request"] == "b"


def test_task_3_summary_counts_finished_requests_only():
    clock = fake_clock()
    recorder = sol.metrics.MetricsRecorder(clock=clock)
    recorder.arrive(0, prompt_tokens=3)
    recorder.arrive(1, prompt_tokens=3)
    clock.now += 0.25
    recorder.token(0)
    recorder.token(1)
    clock.now += 0.25
    recorder.token(0)
    recorder.finish(0)
    clock.now += 5.0
    recorder.token(1)  # still running: not in the percentiles yet
    s = recorder.summary()
    assert s["count"] == 1 and s["unfinished"] == 1
    assert s["output_tokens"] == 2
    assert s["ttft"]["p50"] == pytest.approx(0.25)
    assert s["itl"]["max"] == pytest.approx(0.25)
    assert s["longest_stall_s"] == pytest.approx(0.25) and s["longest_stall_request"] == 0
    assert s["duration_s"] == pytest.approx(0.5)


def test_task_3_no_requests_and_single_token_requests():
    recorder = sol.metrics.MetricsRecorder(clock=fake_clock())
    empty = recorder.summary()
    assert empty["count"] == 0
    assert empty["note"], "with nothing finished, the summary says so"
    assert empty["ttft"]["p50"] is None and empty["output_tokens_per_s"] is None
    assert empty["longest_stall_s"] is None
    json.dumps(recorder.to_json())  # and it still has a JSON form

    clock = fake_clock()
    recorder = sol.metrics.MetricsRecorder(clock=clock)
    recorder.arrive("x", prompt_tokens=5)
    clock.now += 0.4
    recorder.token("x")
    recorder.finish("x")
    s = recorder.summary()
    assert s["count"] == 1 and s["note"] is None
    assert s["ttft"]["p99"] == pytest.approx(0.4)
    assert s["itl"]["p50"] is None and s["tpot"]["p50"] is None  # one token: no gaps
    assert s["longest_stall_s"] is None
    assert s["output_tokens_per_s"] == pytest.approx(1 / 0.4)


def test_task_3_json_round_trip():
    clock = fake_clock()
    recorder = sol.metrics.MetricsRecorder(clock=clock)
    record_run(recorder, clock)
    data = json.loads(json.dumps(recorder.to_json()))
    assert data["summary"] == json.loads(json.dumps(recorder.summary()))
    assert len(data["requests"]) == 3
    back = sol.metrics.MetricsRecorder.from_json(data)
    assert back.summary() == recorder.summary()
    for name in "abc":
        assert back.requests[name].token_times == recorder.requests[name].token_times
        assert back.requests[name].arrival == recorder.requests[name].arrival
        assert back.requests[name].finish == recorder.requests[name].finish
        assert back.requests[name].prompt_tokens == recorder.requests[name].prompt_tokens
    assert not any(isinstance(v, float) and math.isnan(v) for v in data["summary"].values())


def test_task_3_default_clock_is_wall_time():
    # No timing assertion: only that the default recorder reads a real, monotonic clock.
    recorder = sol.metrics.MetricsRecorder()
    recorder.arrive("w", prompt_tokens=1)
    recorder.token("w")
    recorder.finish("w")
    r = recorder.requests["w"]
    assert r.arrival <= r.token_times[0] <= r.finish
