"""The lab harness (benches/): the runner, its figures, and a lab end to end on the embedded model.

No timing is asserted: only that the runner feeds and counts correctly, and that a lab runs the code
the selector picks and writes its JSON where --out says.
"""

import json

import pytest

from benches import runner, workloads
from benches.engines import Adapter, Event


class Echo(Adapter):
    """A fake engine: one token per request per step, each request finishing after its max_tokens."""

    def __init__(self):
        self.left = {}

    def add(self, idx, arrival):
        self.left[idx] = arrival.max_tokens

    def has_work(self):
        return bool(self.left)

    def step(self):
        events = []
        for idx in list(self.left):
            self.left[idx] -= 1
            events.append(Event(idx, 7, self.left[idx] == 0))
            if not self.left[idx]:
                del self.left[idx]
        return events

    def counters(self):
        return {"tokens_run": 0}


class Ticks:
    """A clock that moves one second each time it is read."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


def test_runner_feeds_every_arrival_and_counts_every_token():
    arrivals = [workloads.Arrival("short", [1, 2], 3), workloads.Arrival("long", [1] * 8, 2, after_tokens=2)]
    run = runner.run(Echo(), arrivals, "echo", clock=Ticks())
    assert run.outputs == {0: [7, 7, 7], 1: [7, 7]}
    assert run.first_token_wait[1]["steps"] == 1  # added after the short one's second token, served next step
    row = runner.summarize(run)
    assert row["output_tokens"] == 5 and row["short_itl_p50_s"] is not None and row["long_itl_p50_s"] is not None


def test_goodput_counts_the_requests_that_meet_both_targets():
    assert runner.meets_targets(1.0, 0.2, slo_ttft=1.0, slo_tpot=0.2)  # on the line is in
    assert not runner.meets_targets(1.1, 0.1, slo_ttft=1.0, slo_tpot=0.2)  # a late first token
    assert not runner.meets_targets(0.5, 0.3, slo_ttft=1.0, slo_tpot=0.2)  # a slow stream
    assert runner.meets_targets(0.5, None, slo_ttft=1.0, slo_tpot=0.2)  # one output token: no TPOT to miss
    assert not runner.meets_targets(None, None, slo_ttft=1.0, slo_tpot=0.2)  # no first token at all
    # Ticks: every clock read is a second. The short request's token gaps are 2-3 s, the long one's first token late.
    arrivals = [workloads.Arrival("short", [1, 2], 3), workloads.Arrival("long", [1] * 8, 2, after_tokens=2)]
    run = runner.run(Echo(), arrivals, "echo", clock=Ticks())
    ttfts = {i: r.ttft for i, r in run.metrics.requests.items()}
    tpots = {i: r.tpot for i, r in run.metrics.requests.items()}
    assert runner.goodput_share(run, slo_ttft=max(ttfts.values()), slo_tpot=max(tpots.values())) == 1.0
    assert runner.goodput_share(run, slo_ttft=min(ttfts.values()) - 0.5, slo_tpot=100) == 0.0
    assert runner.goodput_share(run, slo_ttft=100, slo_tpot=min(tpots.values())) == 0.5


def test_goodput_counts_a_stall_the_mean_hides():
    # Targets: first token within 2 s, then one token a second. Arrival at 10.
    steady = [11.0, 12.0, 13.0, 14.0, 15.0]
    assert runner.keeps_pace(10.0, steady, slo_ttft=2.0, slo_tpot=1.0)
    early_then_stall = [10.5, 10.7, 10.9, 14.4, 14.6]  # slack from early tokens covers a 3.5 s gap: token 3 due at 15
    assert runner.keeps_pace(10.0, early_then_stall, slo_ttft=2.0, slo_tpot=1.0)
    stall = [10.5, 10.7, 10.9, 16.0, 16.1, 16.2, 16.3, 16.4, 16.5]  # token 3 due at 15: the reader waits a second
    assert not runner.keeps_pace(10.0, stall, slo_ttft=2.0, slo_tpot=1.0)
    tpot = (stall[-1] - stall[0]) / (len(stall) - 1)
    assert runner.meets_targets(stall[0] - 10.0, tpot, slo_ttft=2.0, slo_tpot=1.0)  # the mean passes it
    assert not runner.good_request(10.0, stall, stall[0] - 10.0, tpot, slo_ttft=2.0, slo_tpot=1.0)
    assert not runner.keeps_pace(10.0, [12.5], slo_ttft=2.0, slo_tpot=1.0)  # a late first token is late too


def test_runner_fails_with_a_message_instead_of_looping_forever():
    class Stuck(Echo):
        def step(self):
            return []

    with pytest.raises(RuntimeError, match="still running after 5 steps"):
        runner.run(Stuck(), [workloads.Arrival("short", [1], 1)], "stuck", clock=Ticks(), max_steps=5)


def test_figures_use_day_2_2s_interpolated_percentile():
    assert runner.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5  # nearest-rank would say 2.0


def test_alternate_takes_turns():
    assert runner.alternate([1, 2, 3], ["a"]) == [1, "a", 2, 3]


def test_workloads_are_the_same_on_every_call():
    assert workloads.mixed(5, 4, 2, 16, 1, seed=3, prompt_seed=300) == workloads.mixed(5, 4, 2, 16, 1, seed=3,
                                                                                         prompt_seed=300)
    kinds = [a.kind for a in workloads.mixed(10, 4, 2, 16, 1, seed=3, prompt_seed=300)]
    assert kinds.count("long") == 2
    shared = workloads.shared_prefix(3, 8, 2, 1, rate=1.0)
    assert all(a.prompt[:8] == shared[0].prompt[:8] for a in shared)


def test_a_lab_runs_the_students_selection_and_writes_out_as_a_file(tmp_path, capsys):
    from benches import bench_priorities

    out = tmp_path / "x.json"
    status = bench_priorities.main(["--model", "embedded", "--solution", "student", "--batch", "1", "--batch-tokens",
                                    "16", "--batch-output", "2", "--interactive", "2", "--interactive-tokens", "4",
                                    "--interactive-output", "2", "--rate", "50", "--out", str(out)])
    assert status == 0 and out.is_file()
    results = json.loads(out.read_text())
    assert results["solution"] == "student" and [f["label"] for f in results["figures"]] == [
        "interactive alone", "FCFS", "priority"]
    assert (tmp_path / "x_ttft.png").is_file()
    assert "code: your src/tiny_llm;" in capsys.readouterr().out  # the student's selection, and it says so


def test_a_bad_option_is_one_line(capsys):
    from benches import bench_prefix_cache

    with pytest.raises(SystemExit) as exit_:
        bench_prefix_cache.main(["--model", "embedded", "--requests", "0"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


@pytest.mark.parametrize("option", [["--requests", "0"], ["--memory-mb", "0"]])
def test_bench_kv_quant_bad_option_is_one_line(capsys, option):
    from benches import bench_kv_quant

    with pytest.raises(SystemExit) as exit_:
        bench_kv_quant.main(["--model", "embedded", *option])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


@pytest.mark.parametrize("option", [["--schemas", "0"], ["--prompts", "6"], ["--batch", "0"]])
def test_bench_structured_bad_option_is_one_line(capsys, option):
    from benches import bench_structured

    with pytest.raises(SystemExit) as exit_:
        bench_structured.main(["--model", "embedded", *option])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_bench_structured_schemas_are_served_and_valid_schemas():
    import jsonschema

    from benches import bench_structured
    from course import selector

    structured = selector.reference().structured
    for name, schema in bench_structured.SCHEMAS.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        structured.compile_schema(schema)  # a keyword outside the served subset raises, naming it


def test_bench_structured_reads_an_output_strictly_and_leniently():
    from benches.bench_structured import verdict

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    assert verdict('{"a": 1}', schema, True) == {"parses": True, "valid": True, "valid_lenient": True, "finished": True}
    fenced = verdict('Sure! Here it is: ```json\n{"a": 1}\n``` {"b"', schema, False)
    assert fenced == {"parses": False, "valid": False, "valid_lenient": True, "finished": False}
    assert verdict('{"a": "1"}', schema, True) == {"parses": True, "valid": False, "valid_lenient": False,
                                                   "finished": True}
    assert not any(verdict('{"a": 1', schema, False).values())


def test_bench_serve_launches_the_chosen_solution_and_says_no_to_it_with_base_url(capsys):
    from benches import bench_serve

    args = bench_serve.build_parser().parse_args(["--launch", "--solution", "student", "--strict"])
    assert bench_serve.solution_arguments(args) == ["--solution", "student", "--strict"]
    with pytest.raises(SystemExit) as exit_:  # a server already running is whatever it is: --solution cannot pick it
        bench_serve.main(["--base-url", "http://127.0.0.1:9", "--solution", "student"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
