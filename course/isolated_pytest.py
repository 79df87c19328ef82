"""The one way the course's tooling runs pytest: a separate process, read through its results plugin.

`pdm run test` (scripts/run_tests.py), the grader (scripts/grade.py), `check-days` (maint/check_days.py) and
`check_skeleton` start pytest with `pytest_command()`. `run_test_file()` runs one such process and reads the lines
course/pytest_events.py writes, one per test. Each test has pytest-timeout's limit (`timeout`, signal method); a
`deadline` (the whole run's) or a `cap` (the day's: seconds from its first test's start, so that start-up on a
loaded machine is not counted) kills the process and its group, the tests left `not_run`; `memory_mb` caps its
address space (RLIMIT_AS). The process runs trusted code only (the tests, the reference; while grading, the
submission runs in sandboxed workers, course/sandbox.py), so it runs once: a test during which it died anyway is
`crashed`, the tests after it `not_run`. The tests expected are those it collects.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

TEST_TIME_LIMIT = 60.0  # seconds one test may run: the grader's default and `pdm run test`'s (pytest-timeout)
POLL_SECONDS = 0.05
STARTUP_SECONDS = 180.0  # how long pytest may take to collect the tests
EXIT_GRACE_SECONDS = 20.0  # after the last test, how long pytest may take to shut down
LOG_TAIL = 3000


@dataclass
class CaseResult:
    nodeid: str
    outcome: str  # passed, failed, error, skipped, xfailed, timeout, crashed, not_run
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome in ("passed", "xfailed")


@dataclass
class RunResult:
    test_file: str
    results: dict[str, CaseResult] = field(default_factory=dict)  # nodeid -> result, in collection order
    collect_errors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # the run itself went wrong (not one test)
    out_of_time: bool = False  # the deadline or the cap stopped the run
    expected: list[str] = field(default_factory=list)  # the tests collected, in order
    seconds: float = 0.0


def pytest_command(args: list[str]) -> list[str]:
    """The command line of every pytest run of the course's tooling (the plugin does nothing unless read)."""
    return [sys.executable, "-m", "pytest", "-p", "course.pytest_events", "-p", "no:cacheprovider", *args]


def child_env(solution: str = "student", paths: tuple[str, ...] = ("src", "src_ref", ".")) -> dict:
    """The environment for a test process: the chosen solution and the import paths (relative to its cwd)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TINY_LLM_EVENTS", "PYTEST_ADDOPTS")}
    return {**env, "TINY_LLM_SOLUTION": solution, "PYTHONPATH": os.pathsep.join(paths)}


def default_memory_mb() -> int | None:
    """The address-space limit of a test process when none is given: the machine's memory, at most 16 GiB.

    Measured on Linux (mlx 0.32, CPU): a day's test process peaks at 1.1-1.5 GB of address space. None
    (no limit) on macOS, where Metal maps far more address space than it uses and RLIMIT_AS is not
    enforced, and where an NVIDIA driver is present (CUDA reserves address space by the terabyte).
    """
    if not sys.platform.startswith("linux") or Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists():
        return None
    return min(16_384, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20)


def _limit_memory(memory_mb: int | None):
    if not memory_mb:
        return None
    import resource

    limit = memory_mb << 20
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # in the child, before pytest starts


def _new_lines(path: Path, offset: int) -> tuple[list[dict], int]:
    """The whole lines appended to the plugin's file since `offset`, and the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    complete = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()], offset + len(complete)


def _watch(proc: subprocess.Popen, run: RunResult, lines: Path, deadline: float | None, cap: float | None):
    """Read the plugin's lines until pytest exits or a limit stops it; the test running at its end, if any."""
    offset, current, collected, launched, first_start, done = 0, None, False, time.monotonic(), None, None
    while True:
        exited = proc.poll() is not None
        events, offset = _new_lines(lines, offset)
        for event in events:
            if "collected" in event:
                run.expected, collected = event["collected"], True
            elif "collect_error" in event:
                run.collect_errors.append(f"{event['collect_error']}:\n{event['output']}")
            elif "start" in event:
                current, first_start = event["start"], first_start or time.monotonic()
            elif "finish" in event:
                current, run.results[event["finish"]] = None, CaseResult(event["finish"], event["outcome"],
                                                                        event["output"])
            elif "done" in event:
                done = time.monotonic()
        now = time.monotonic()
        if exited or (done is not None and now - done > EXIT_GRACE_SECONDS):  # every result is in
            return current
        if (deadline is not None and now > deadline) or (cap is not None and first_start and now > first_start + cap):
            run.out_of_time = True
            if current is not None:
                run.results[current] = CaseResult(current, "timeout", "stopped: the time budget ran out during this test")
            return None
        if not collected and now - launched > STARTUP_SECONDS:
            run.problems.append(f"pytest did not finish collecting {run.test_file} within {STARTUP_SECONDS:g} s")
            return None
        time.sleep(POLL_SECONDS)


def run_test_file(test_file: str | list[str], cwd: Path, env: dict, timeout: float = TEST_TIME_LIMIT,
                  deadline: float | None = None, cap: float | None = None, memory_mb: int | None = None) -> RunResult:
    """Run `test_file` (relative to `cwd`; or a list of files) in one pytest process; see the module docstring.

    `deadline`: a `time.monotonic()` value at which the run stops; `cap`: seconds after the first test's start
    at which it stops likewise. Either way the tests left are `not_run`.
    """
    targets = [test_file] if isinstance(test_file, str) else list(test_file)
    run, began = RunResult(" ".join(targets)), time.monotonic()
    command = pytest_command(["-q", "--color=no", f"--timeout={timeout:g}", "--timeout-method=signal", *targets])
    with tempfile.TemporaryDirectory(prefix="tiny-llm-pytest-") as tmp:
        lines, log_path = Path(tmp) / "events.jsonl", Path(tmp) / "log.txt"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(command, cwd=cwd, env={**env, "TINY_LLM_EVENTS": str(lines)}, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=_limit_memory(memory_mb))
        try:
            crashed_in = _watch(proc, run, lines, deadline, cap)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # and whatever it left in its group
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        tail = log_path.read_bytes()[-LOG_TAIL:].decode(errors="replace").replace(f"{cwd}/", "")
    if not run.expected and not run.collect_errors and not run.problems:
        run.problems.append(f"pytest exited (status {proc.returncode}) before collecting {run.test_file}:\n{tail}")
    why = "not run: the time budget ran out before this test"
    if crashed_in is not None:
        run.results[crashed_in] = CaseResult(crashed_in, "crashed", "the test process died during this test (a "
                                             f"crash, an abort or an exit of the interpreter).\nEnd of its output:\n{tail}")
        why = f"not run: the test process died during {crashed_in}"
    if run.out_of_time or crashed_in is not None:
        run.results.update({n: CaseResult(n, "not_run", why) for n in run.expected if n not in run.results})
    run.results = {nodeid: run.results[nodeid] for nodeid in run.expected if nodeid in run.results}
    run.seconds = round(time.monotonic() - began, 2)
    return run
