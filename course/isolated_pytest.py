"""The one way the course's tooling runs pytest: a separate process, watched through an event stream.

`pdm run test` (scripts/run_tests.py), the grader (scripts/grade.py), the per-day check
(maint/check_days.py) and the skeleton check (maint/check_skeleton.py) all start pytest with
`pytest_command()`. The plugin course/pytest_events.py appends one JSON line per test event to a file;
`run_test_file()` watches that file and keeps the run bounded whatever the code under test does:

- a test that runs past `timeout` seconds is interrupted in place (an exception raised by SIGALRM) and
  scored as `timeout`; if that does not stop it (stuck in C code, or it swallows the exception), its
  stack is saved, pytest is killed, and started again on the tests not yet run;
- a test during which the interpreter dies (segfault, abort, os._exit, out of memory) is scored as
  `crashed`, with the end of pytest's output, and the remaining tests run in a new process;
- a watchdog on the stream: no event for `timeout` + a grace period, inside a test or between tests,
  kills the process; a `deadline` (the whole run's) or a `cap` (the day's: seconds from its first test's
  start, so that start-up on a loaded machine is not counted) does the same;
- after every process, its whole process group is killed (while grading, the submission's code runs in
  sandboxes of its own, course/sandbox.py, which end with it);
- `memory_mb` caps each test process's address space (RLIMIT_AS, set in the child before pytest starts);
- the stream is checked against the tests expected (`expected`, collected beforehand by `collect()` in
  a process that imports no student code): a result counts only for an expected test, reported in
  collection order with a start and a finish. Anything else (an unknown or repeated test, a finish
  without its start, tests out of order, a process that ends between tests without finishing the
  session, events after the end) goes to `RunResult.review`: the results cannot be trusted.

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
    review: list[str] = field(default_factory=list)  # the event stream broke the protocol: untrustworthy
    out_of_time: bool = False  # the deadline or the cap stopped the run
    first_start: float | None = None  # time.monotonic() when the first test started (the cap counts from it)
    expected: list[str] = field(default_factory=list)  # the tests the run had to report (given, or first collected)
    processes: int = 0
    seconds: float = 0.0


# ---------------------------------------------------------------- starting pytest

TEST_TIME_LIMIT = 60.0  # seconds one test may run: the grader's default and `pdm run test`'s (pytest-timeout)

def pytest_command(args: list[str]) -> list[str]:
    """The command line of every pytest run of the course's tooling (the plugin does nothing unless watched)."""
    return [sys.executable, "-m", "pytest", "-p", "course.pytest_events", "-p", "no:cacheprovider", *args]


PLUGIN_VARIABLES = ("TINY_LLM_EVENTS", "TINY_LLM_TRACE", "TINY_LLM_TIMEOUT", "TINY_LLM_SKIP")


def child_env(solution: str = "student", paths: tuple[str, ...] = ("src", "src_ref", ".")) -> dict:
    """The environment for a test process: the chosen solution and the import paths (relative to its cwd)."""
    env = {k: v for k, v in os.environ.items() if k not in PLUGIN_VARIABLES}
    env["TINY_LLM_SOLUTION"] = solution
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("PYTEST_ADDOPTS", None)
    return env


def default_memory_mb() -> int | None:
    """The address-space limit of a test process when none is given: the machine's memory, at most 16 GiB.

    Measured on Linux (mlx 0.32, CPU): a day's test process peaks at 1.1-1.5 GB of address space. None
    (no limit) on macOS, where Metal maps far more address space than it uses and RLIMIT_AS is not
    enforced, and where an NVIDIA driver is present (CUDA reserves address space by the terabyte).
    """
    if not sys.platform.startswith("linux") or Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists():
        return None
    try:
        with open("/proc/meminfo") as f:
            total_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration, ValueError):
        return 16_384
    return min(16_384, total_kb // 1024)


def _limit_memory(memory_mb: int | None):
    if not memory_mb:
        return None

    def apply() -> None:  # runs in the child, between fork and exec
        try:
            import resource

            limit = memory_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ImportError, ValueError, OSError):
            pass  # a platform without the limit: the time limits still hold

    return apply


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


# ---------------------------------------------------------------- reading what pytest says

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


class _EventReader:
    """The events of one process, in order; lines that are not JSON objects are `garbage`."""

    def __init__(self, path: Path):
        self.path, self.offset, self.buffer, self.garbage = path, 0, b"", 0

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
                event = json.loads(line)
            except json.JSONDecodeError:
                event = None
            if not isinstance(event, dict):
                self.garbage += 1
                continue
            events.append(event)
        return events


class _Protocol:
    """The order events must come in: the expected tests, each started then finished, once, in order."""

    def __init__(self, run: RunResult, expected: list[str] | None):
        self.run, self.expected = run, expected
        self.queue: list[str] = []  # what this process should run, in order
        self.current: str | None = None
        self.ended = False

    def wrong(self, why: str) -> None:
        if why not in self.run.review:
            self.run.review.append(why)

    def collected(self, items: list) -> None:
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            return self.wrong("the test process sent a malformed list of collected tests")
        if self.expected is None:
            self.expected = list(items)  # no list given beforehand: the first process's collection
        remaining = [n for n in self.expected if n not in self.run.results]
        if items != remaining:
            unknown = [n for n in items if n not in self.expected]
            self.wrong(f"the test process collected other tests than expected "
                       f"({len(items)} instead of {len(remaining)}"
                       + (f"; unknown: {', '.join(unknown[:3])}" if unknown else "") + ")")
        self.queue = [n for n in remaining]

    def start(self, nodeid) -> None:
        if self.ended:
            return self.wrong(f"a test started after the session ended: {nodeid}")
        if self.current is not None:
            return self.wrong(f"{nodeid} started while {self.current} had not finished")
        if nodeid not in (self.expected or []):
            return self.wrong(f"a result was reported for a test that was not expected: {nodeid}")
        if nodeid in self.run.results:
            return self.wrong(f"{nodeid} was reported twice")
        if not self.queue or self.queue[0] != nodeid:
            return self.wrong(f"{nodeid} was reported out of order (expected {self.queue[0] if self.queue else 'none'})")
        self.queue.pop(0)
        self.current = nodeid

    def finish(self, event: dict) -> None:
        nodeid = event.get("nodeid")
        if self.current is None or nodeid != self.current:
            return self.wrong(f"a finish without its start: {nodeid}")
        self.current = None
        outcome = event.get("outcome")
        if outcome not in ("passed", "failed", "error", "skipped", "xfailed", "timeout"):
            return self.wrong(f"{nodeid}: unknown outcome {outcome!r}")
        self.run.results[nodeid] = CaseResult(nodeid, outcome, str(event.get("output", "")),
                                              float(event.get("duration", 0.0) or 0.0))


# ---------------------------------------------------------------- one pytest process

@dataclass
class _Process:
    collected: list[str] | None = None
    died_in: str | None = None  # the test it was running when it died or was killed


def _one_process(args: list[str], cwd: Path, env: dict, timeout: float, startup_timeout: float,
                 deadline: float | None, cap: float | None, memory_mb: int | None, work: Path, run: RunResult,
                 protocol: _Protocol, index: int, on_result) -> _Process:
    """Run pytest once; record finished tests in `run`."""
    events_path, trace_path, log_path, skip_path = (work / f"events{index}.jsonl", work / f"trace{index}.txt",
                                                    work / f"log{index}.txt", work / f"skip{index}.json")
    skip_path.write_text(json.dumps(list(run.results)))  # tests that already have a result are not run again
    env = {**env, "TINY_LLM_EVENTS": str(events_path), "TINY_LLM_TRACE": str(trace_path),
           "TINY_LLM_TIMEOUT": str(timeout), "TINY_LLM_SKIP": str(skip_path)}
    command = pytest_command(["-q", "--color=no", *args])
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_limit_memory(memory_mb))
    run.processes += 1
    protocol.ended, protocol.current, protocol.queue = False, None, []
    try:
        return _watch(proc, run, protocol, _EventReader(events_path), trace_path, log_path, cwd,
                      timeout, startup_timeout, deadline, cap, on_result)
    finally:
        _kill_group(proc)  # and whatever it left in its group


def _watch(proc, run, protocol, reader, trace_path, log_path, cwd, timeout, startup_timeout, deadline, cap,
           on_result) -> _Process:
    state = _Process()
    launched = last_event = time.monotonic()
    started_at, finished_at, exitstatus = None, None, None
    while True:
        exited = proc.poll() is not None
        for event in reader.read():
            last_event = time.monotonic()
            kind = event.get("event")
            if protocol.ended and kind != "session_finish":
                protocol.wrong(f"the test process reported {kind!r} after the session ended")
            elif kind == "collected":
                if state.collected is not None:
                    protocol.wrong("the test process reported its collection twice")
                state.collected = event.get("items")
                protocol.collected(state.collected)
            elif kind == "collect_error":
                run.collect_errors.append(f"{event.get('nodeid') or 'collection'}:\n{event.get('output', '')}")
            elif kind == "start":
                protocol.start(event.get("nodeid"))
                started_at = time.monotonic()
                run.first_start = run.first_start or started_at
            elif kind == "finish":
                protocol.finish(event)
                if on_result is not None and event.get("nodeid") in run.results:
                    on_result(run.results[event["nodeid"]])
            elif kind == "session_finish":
                if protocol.ended:
                    protocol.wrong("the test process ended its session twice")
                protocol.ended, finished_at, exitstatus = True, time.monotonic(), event.get("exitstatus")
            else:
                protocol.wrong(f"the test process sent an unknown event {kind!r}")
        if reader.garbage:
            protocol.wrong("the event stream holds lines the reporting plugin did not write")
        if exited:
            break
        now = time.monotonic()
        current = protocol.current
        if (deadline is not None and now > deadline) or \
                (cap is not None and run.first_start is not None and now > run.first_start + cap):
            _kill_group(proc)
            run.out_of_time = True
            if current is not None:
                run.results[current] = CaseResult(current, "timeout", "stopped: the time budget ran out during this test",
                                                  duration=round(now - started_at, 3))
                protocol.current = None
            return state
        if current is not None and now - started_at > timeout + HARD_GRACE:
            time.sleep(0.2)  # let the watchdog thread finish writing the stack
            _kill_group(proc)
            stack = readable_stack(_read(trace_path), cwd)
            run.results[current] = CaseResult(
                current, "timeout",
                f"timed out: still running after {timeout:g} s, so it was stopped.\n"
                + (f"Where it was:\n{stack}" if stack else ""),
                duration=round(now - started_at, 3))
            protocol.current = None
            if on_result is not None:
                on_result(run.results[current])
            return state
        if state.collected is None and current is None and now - launched > startup_timeout:
            _kill_group(proc)
            run.problems.append(f"pytest did not finish collecting {run.test_file} within {startup_timeout:g} s"
                                f"\n{_tail(log_path)}")
            return state
        if state.collected is not None and current is None and finished_at is None \
                and now - last_event > timeout + HARD_GRACE:
            _kill_group(proc)  # silent between tests: the event stream itself was tampered with
            protocol.wrong(f"the test process stopped reporting between tests (no event for {now - last_event:.0f} s)")
            return state
        if finished_at is not None and now - finished_at > EXIT_GRACE_SECONDS:
            _kill_group(proc)  # every result is in; only the shutdown hangs
            return state
        time.sleep(POLL_SECONDS)
    if state.collected is None and not run.collect_errors:
        run.problems.append(f"pytest exited (status {proc.returncode}) before collecting {run.test_file}:\n"
                            f"{_tail(log_path)}")
    elif protocol.current is not None:
        state.died_in = protocol.current
        protocol.current = None
    elif state.collected is not None and not protocol.ended:
        protocol.wrong(f"the test process ended (status {proc.returncode}) between tests without finishing "
                       f"its session")
    elif protocol.ended and exitstatus != proc.returncode:
        protocol.wrong(f"the test process reported exit status {exitstatus} but exited with {proc.returncode}")
    return state


def run_test_file(test_file: str | list[str], cwd: Path, env: dict, timeout: float = 60.0, startup_timeout: float = 180.0,
                  pytest_args: tuple[str, ...] = (), expected: list[str] | None = None,
                  deadline: float | None = None, cap: float | None = None, memory_mb: int | None = None, on_result=None) -> RunResult:
    """Run `test_file` (relative to `cwd`; or a list of files) with per-test time limits; see the module docstring.

    `expected`: the test ids the file must report, in order (None: whatever the first process collects).
    `deadline`: a `time.monotonic()` value at which the run stops, remaining tests `not_run`; `cap`: seconds
    after the first test's start at which it stops likewise.
    `on_result`: called with each CaseResult as it arrives (progress bars).
    """
    targets = [test_file] if isinstance(test_file, str) else list(test_file)
    run = RunResult(" ".join(targets))
    protocol = _Protocol(run, list(expected) if expected is not None else None)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tiny-llm-pytest-") as tmp:
        for index in range(10_000):
            done_before = len(run.results)
            state = _one_process([*pytest_args, *targets], cwd, env, timeout, startup_timeout, deadline, cap, memory_mb,
                                 Path(tmp), run, protocol, index, on_result)
            if protocol.expected is None or (state.collected is None and index == 0):
                break
            if state.died_in is not None:
                run.results[state.died_in] = CaseResult(
                    state.died_in, "crashed",
                    "the test process died during this test (a crash, an abort or an exit of the interpreter)."
                    f"\nEnd of pytest's output:\n{readable_stack(_crash_part(_tail(Path(tmp) / f'log{index}.txt')), cwd)}")
                if on_result is not None:
                    on_result(run.results[state.died_in])
            remaining = [nodeid for nodeid in protocol.expected if nodeid not in run.results]
            if not remaining or run.review or run.problems:
                break
            why = None
            if run.out_of_time:
                why = "not run: the time budget ran out before this test"
            elif len(run.results) == done_before:
                # No test finished, timed out or crashed in this process: starting again would loop.
                why = "pytest stopped before running this test:\n" + _tail(Path(tmp) / f"log{index}.txt")
            if why:
                for nodeid in remaining:
                    run.results[nodeid] = CaseResult(nodeid, "not_run", why)
                break
    if protocol.expected is not None:
        run.results = {nodeid: run.results[nodeid] for nodeid in protocol.expected if nodeid in run.results}
        run.expected = list(protocol.expected)
    run.seconds = round(time.monotonic() - began, 2)
    return run


def collect(test_files: list[str], cwd: Path, env: dict,
            timeout: float = 180.0) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The test ids of each file, in order, and the collection errors by file, from `pytest --collect-only`.

    The grader runs this with no student code on the import path, so what it lists cannot be forged.
    """
    with tempfile.TemporaryDirectory(prefix="tiny-llm-collect-") as tmp:
        events, log = Path(tmp) / "events.jsonl", Path(tmp) / "log.txt"
        with open(log, "wb") as out:
            proc = subprocess.Popen(pytest_command(["-q", "--collect-only", *test_files]), cwd=cwd,
                                    env={**env, "TINY_LLM_EVENTS": str(events)}, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _kill_group(proc)
        by_file: dict[str, list[str]] = {name: [] for name in test_files}
        errors: dict[str, str] = {}
        events_read = _EventReader(events).read()
        for event in events_read:
            if event.get("event") == "collected":
                for nodeid in event.get("items", []):
                    by_file.setdefault(nodeid.split("::")[0], []).append(nodeid)
            elif event.get("event") == "collect_error":
                where = str(event.get("nodeid") or "")
                errors[where.split("::")[0] or "collection"] = str(event.get("output", ""))
        if not any(e.get("event") == "collected" for e in events_read) and not errors:
            errors["collection"] = f"pytest could not collect the tests:\n{_tail(log)}"
        return by_file, errors
