"""Run one test file in a separate pytest process, each test under a time limit, surviving hangs and crashes.

Used by the grader (scripts/grade.py) and the per-day check (maint/check_days.py). The code under
test never runs in the caller's process. pytest runs with the plugin course/pytest_events.py, which
appends one JSON line per test event to a file; this module watches that file:

- a test that runs past `timeout` seconds is interrupted in place (an exception raised by SIGALRM) and
  scored as `timeout`; if that does not stop it (stuck in C code, or it swallows the exception), its
  stack is saved, pytest is killed, and started again on the tests not yet run;
- a test during which the interpreter dies (segfault, abort, os._exit, out of memory) is scored as
  `crashed`, with the end of pytest's output, and the remaining tests run in a new process;
- a test file that cannot be collected gives `collect_errors`; its tests are not in `results`.

So a bad test costs only itself, and the run always finishes: at most one restart per test.
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

from course.pytest_events import HARD_GRACE

POLL_SECONDS = 0.05
EXIT_GRACE_SECONDS = 20.0  # after the last test, how long pytest may take to shut down
LOG_TAIL = 4000


@dataclass
class CaseResult:
    nodeid: str
    outcome: str  # passed, failed, error, skipped, xfailed, timeout, crashed, not_run
    output: str = ""
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome in ("passed", "xfailed")


@dataclass
class RunResult:
    test_file: str
    results: dict[str, CaseResult] = field(default_factory=dict)  # nodeid -> result, in collection order
    collect_errors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # the run itself went wrong (not one test)
    processes: int = 0
    seconds: float = 0.0


def _tail(path: Path, limit: int = LOG_TAIL) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode(errors="replace")


def readable_stack(text: str, cwd: Path, lines: int = 25) -> str:
    """A faulthandler dump or crash log without the frames of pytest, pluggy and runpy, paths relative."""
    kept = []
    for line in text.splitlines():
        if any(noise in line for noise in ("/site-packages/", "<frozen ", "Extension modules:")):
            continue
        kept.append(line.replace(f"{cwd}/", ""))
    return "\n".join(kept[-lines:] if len(kept) > lines else kept)


def _crash_part(log: str) -> str:
    """The part of pytest's output about the crash, not earlier tests' failures."""
    for marker in ("Fatal Python error", "KeyboardInterrupt", "Killed", "MemoryError"):
        if marker in log:
            return log[log.rindex(marker):]
    return "\n".join(log.splitlines()[-12:])


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class _EventReader:
    def __init__(self, path: Path):
        self.path, self.offset, self.buffer = path, 0, b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        events = []
        for line in lines:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return events


def _one_process(args: list[str], cwd: Path, env: dict, timeout: float, startup_timeout: float,
                 work: Path, run: RunResult, index: int) -> tuple[list[str] | None, str | None]:
    """Run pytest once; record finished tests in `run`. Returns (collected ids or None, the id it died in)."""
    events_path, trace_path, log_path, skip_path = (work / f"events{index}.jsonl", work / f"trace{index}.txt",
                                                    work / f"log{index}.txt", work / f"skip{index}.json")
    skip_path.write_text(json.dumps(list(run.results)))  # tests that already have a result are not run again
    env = {**env, "TINY_LLM_EVENTS": str(events_path), "TINY_LLM_TRACE": str(trace_path),
           "TINY_LLM_TIMEOUT": str(timeout), "TINY_LLM_SKIP": str(skip_path)}
    command = [sys.executable, "-m", "pytest", "-p", "course.pytest_events", "-p", "no:cacheprovider",
               "-q", "--color=no", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    run.processes += 1
    try:
        return _watch(proc, run, events_path, trace_path, log_path, cwd, timeout, startup_timeout)
    finally:
        if proc.poll() is None:  # the watcher itself was interrupted (Ctrl-C): leave no stray pytest behind
            _kill_group(proc)


def _watch(proc, run, events_path, trace_path, log_path, cwd, timeout, startup_timeout):
    reader = _EventReader(events_path)
    collected, current, started_at, finished_at = None, None, time.monotonic(), None
    launched = time.monotonic()
    while True:
        exited = proc.poll() is not None
        for event in reader.read():
            kind = event.get("event")
            if kind == "collected":
                collected = event["items"]
            elif kind == "collect_error":
                run.collect_errors.append(f"{event.get('nodeid') or 'collection'}:\n{event.get('output', '')}")
            elif kind == "start":
                current, started_at = event["nodeid"], time.monotonic()
            elif kind == "finish":
                run.results[event["nodeid"]] = CaseResult(event["nodeid"], event["outcome"],
                                                          event.get("output", ""), event.get("duration", 0.0))
                current = None
            elif kind == "session_finish":
                finished_at = time.monotonic()
        if exited:
            break
        now = time.monotonic()
        if current is not None and now - started_at > timeout + HARD_GRACE:
            time.sleep(0.2)  # let the watchdog thread finish writing the stack
            _kill_group(proc)
            stack = readable_stack(_read(trace_path), cwd)
            run.results[current] = CaseResult(
                current, "timeout",
                f"timed out: still running after {timeout:g} s, so it was stopped.\n"
                + (f"Where it was:\n{stack}" if stack else ""),
                duration=round(now - started_at, 3))
            return collected, None
        if collected is None and current is None and now - launched > startup_timeout:
            _kill_group(proc)
            run.problems.append(f"pytest did not finish collecting {run.test_file} within {startup_timeout:g} s"
                                f"\n{_tail(log_path)}")
            return collected, None
        if finished_at is not None and now - finished_at > EXIT_GRACE_SECONDS:
            _kill_group(proc)  # every result is in; only the shutdown hangs
            return collected, None
        time.sleep(POLL_SECONDS)
    if collected is None and not run.collect_errors:
        run.problems.append(f"pytest exited (status {proc.returncode}) before collecting {run.test_file}:\n"
                            f"{_tail(log_path)}")
    return collected, current if current not in run.results else None


def run_test_file(test_file: str, cwd: Path, env: dict, timeout: float = 60.0,
                  startup_timeout: float = 180.0, pytest_args: tuple[str, ...] = ()) -> RunResult:
    """Run `test_file` (relative to `cwd`) with per-test time limits; see the module docstring."""
    run = RunResult(test_file)
    began = time.monotonic()
    order: list[str] | None = None
    with tempfile.TemporaryDirectory(prefix="tiny-llm-pytest-") as tmp:
        for index in range(10_000):
            done_before = len(run.results)
            collected, died_in = _one_process([*pytest_args, test_file], cwd, env, timeout, startup_timeout,
                                              Path(tmp), run, index)
            if order is None:
                if collected is None:
                    break
                order = list(collected)
            if died_in is not None:
                run.results[died_in] = CaseResult(
                    died_in, "crashed",
                    "the test process died during this test (a crash, an abort or an exit of the interpreter)."
                    f"\nEnd of pytest's output:\n{readable_stack(_crash_part(_tail(Path(tmp) / f'log{index}.txt')), cwd)}")
            remaining = [nodeid for nodeid in order if nodeid not in run.results]
            if not remaining:
                break
            if len(run.results) == done_before:
                # No test finished, timed out or crashed in this process: starting again would loop.
                for nodeid in remaining:
                    run.results[nodeid] = CaseResult(
                        nodeid, "not_run", "pytest stopped before running this test:\n"
                        + _tail(Path(tmp) / f"log{index}.txt"))
                break
    if order is not None:
        run.results = {nodeid: run.results[nodeid] for nodeid in order if nodeid in run.results}
    run.seconds = round(time.monotonic() - began, 2)
    return run


def child_env(solution: str = "student") -> dict:
    """The environment for a test process: the chosen solution, and the repo's import paths."""
    env = {**os.environ, "TINY_LLM_SOLUTION": solution}
    env["PYTHONPATH"] = os.pathsep.join(["src", "src_ref", ".", *filter(None, [os.environ.get("PYTHONPATH")])])
    env.pop("PYTEST_ADDOPTS", None)
    return env
