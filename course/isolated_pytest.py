"""The one way the course's tooling runs pytest (`pytest_command()`): a process of its own, read through its results
plugin, course/pytest_events.py (`run_test_file()`; book/src/grading.md says how the running test is known).
"""

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

TEST_TIME_LIMIT = 60.0  # seconds one test may run: the grader's default and `pdm run test`'s (pytest-timeout)
POLL_SECONDS = 0.05
STARTUP_SECONDS = 180.0  # how long pytest may take to collect the tests
LOG_TAIL = 3000
STOP = threading.Event()  # a stop was asked for (`stop_on_signal`)


def stop_on_signal(signum, frame) -> None:
    """SIGTERM as Ctrl-C. Python drops a KeyboardInterrupt raised in a fork handler (a signal landing while `subprocess`
    forks pytest), so the request is also kept, for the watch loop and the grader's loop to check."""
    STOP.set()
    raise KeyboardInterrupt


def raise_if_stopped() -> None:
    if STOP.is_set():
        raise KeyboardInterrupt


@dataclass
class CaseResult:
    nodeid: str
    outcome: str  # passed, failed, error (in set-up or tear-down), skipped, timeout, crashed, not_run
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == "passed"


@dataclass
class RunResult:
    test_file: str
    results: dict[str, CaseResult] = field(default_factory=dict)  # nodeid -> result, in the order run
    collect_errors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # the run itself went wrong (not one test)
    out_of_time: bool = False  # the cap stopped the run
    expected: list[str] = field(default_factory=list)  # the tests collected, in order
    seconds: float = 0.0


def pytest_command(args: list[str]) -> list[str]:
    """The command line of every pytest run of the course's tooling (the plugin writes nothing unless asked)."""
    return [sys.executable, "-m", "pytest", "-p", "course.pytest_events", "-p", "no:cacheprovider", *args]


def child_env(solution: str = "student", paths: tuple[str, ...] = ("src", "src_ref", ".")) -> dict:
    """The environment for a test process: the chosen solution and the import paths (relative to its cwd)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TINY_LLM_EVENTS", "PYTEST_ADDOPTS")}
    return {**env, "TINY_LLM_SOLUTION": solution, "PYTHONPATH": os.pathsep.join(paths)}


def default_memory_mb() -> int | None:
    """The machine's memory, at most 16 GiB (a day's test process peaks at 1.1-1.5 GB); None on macOS, where Metal
    maps far more than it uses, and where an NVIDIA driver is (CUDA reserves terabytes of address space)."""
    if not sys.platform.startswith("linux") or Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists():
        return None
    return min(16_384, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20)


def _watch(proc: subprocess.Popen, run: RunResult, lines: BinaryIO, cap: float | None) -> None:
    """Read the plugin's lines until every test collected has its result (pytest's summary and its workers' shut-down
    change no grade: it is killed, not waited for), pytest exits, or a limit says to stop it."""
    unread, launched, collected = b"", time.monotonic(), None
    while True:
        raise_if_stopped()
        exited = proc.poll() is not None
        *complete, unread = (unread + lines.read()).split(b"\n")  # a line not yet whole waits for the next round
        for event in map(json.loads, complete):
            if "collected" in event:
                run.expected, run.collect_errors, collected = event["collected"], event["errors"], time.monotonic()
            else:
                run.results[event["finish"]] = CaseResult(event["finish"], event["outcome"], event["output"])
        now = time.monotonic()
        if exited or (run.expected and len(run.results) == len(run.expected)):
            return
        if cap is not None and collected is not None and now > collected + cap:
            run.out_of_time = True
            return
        if collected is None and now - launched > STARTUP_SECONDS:
            run.problems.append(f"pytest did not finish collecting {run.test_file} within {STARTUP_SECONDS:g} s")
            return
        time.sleep(POLL_SECONDS)


def run_test_file(test_file: str | list[str], cwd: Path, env: dict, timeout: float = TEST_TIME_LIMIT,
                  cap: float | None = None, memory_mb: int | None = None) -> RunResult:
    """Run `test_file` (relative to `cwd`; or a list of files) in one pytest process: each test with pytest-timeout's
    `timeout`, the whole run stopped `cap` seconds after collection, its address space at most `memory_mb`."""
    targets = [test_file] if isinstance(test_file, str) else list(test_file)
    run, began = RunResult(" ".join(targets)), time.monotonic()
    command = pytest_command(["-q", "--color=no", f"--timeout={timeout:g}", "--timeout-method=signal", *targets])
    limit = (memory_mb or 0) << 20  # set in the child, before pytest starts
    with tempfile.TemporaryDirectory(prefix="tiny-llm-pytest-") as tmp:
        events, log_path = Path(tmp) / "events.jsonl", Path(tmp) / "log.txt"
        events.touch()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(command, cwd=cwd, env={**env, "TINY_LLM_EVENTS": str(events)}, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
                                    if limit else None)
        try:
            with open(events, "rb") as lines:
                _watch(proc, run, lines, cap)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # and whatever it left in its group
            proc.wait()
        tail = log_path.read_bytes()[-LOG_TAIL:].decode(errors="replace").replace(f"{cwd}/", "")
    if not run.expected and not run.collect_errors and not run.problems:
        run.problems.append(f"pytest exited (status {proc.returncode}) before collecting {run.test_file}:\n{tail}")
    left = [nodeid for nodeid in run.expected if nodeid not in run.results]
    if left and not run.collect_errors and not run.problems:  # stopped, or died, during left[0]
        if run.out_of_time:
            run.results[left[0]] = CaseResult(left[0], "timeout", "stopped: the time budget ran out during this test")
            why = "the time budget ran out before this test"
        else:
            run.results[left[0]] = CaseResult(left[0], "crashed", "the test process died during this test (a crash, "
                                              f"an abort or an exit of the interpreter).\nEnd of its output:\n{tail}")
            why = f"the test process died during {left[0]}"
        run.results.update({nodeid: CaseResult(nodeid, "not_run", f"not run: {why}") for nodeid in left[1:]})
    run.seconds = round(time.monotonic() - began, 2)
    return run
