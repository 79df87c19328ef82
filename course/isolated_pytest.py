"""The one way the course's tooling runs pytest: a separate process, watched through its results plugin.

`pdm run test` (scripts/run_tests.py), the grader (scripts/grade.py), the per-day check
(maint/check_days.py) and the skeleton check (maint/check_skeleton.py) all start pytest with
`pytest_command()`. The plugin course/pytest_events.py appends one JSON line per test event to a file;
`run_test_file()` watches that file and keeps the run bounded whatever the code under test does:

- each test has pytest-timeout's limit (`timeout` seconds, signal method): a test past it fails in place
  and is scored `timeout`; if that does not stop it (stuck in C code), pytest is killed and started again
  on the tests not yet run;
- a test during which the interpreter dies (segfault, abort, os._exit, out of memory) is scored as
  `crashed`, with the end of pytest's output, and the remaining tests run in a new process (while
  grading, the plugin also ends the process after a test that broke the sandboxed worker: the objects
  a module's fixtures hold went with it);
- a `deadline` (the whole run's) or a `cap` (the day's: seconds from its first test's start, so that
  start-up on a loaded machine is not counted) kills the process, the tests left `not_run`;
- after every process, its whole process group is killed (while grading, the submission's code runs in
  sandboxes of its own, course/sandbox.py, which end with it);
- `memory_mb` caps each test process's address space (RLIMIT_AS, set in the child before pytest starts).

The stream is not checked for forgery: the process that writes it runs no untrusted code (while grading,
the submission runs only in the sandbox, which cannot reach the stream). The tests expected are those the
first process collects. So a bad test costs only itself, and the run always finishes.
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

POLL_SECONDS = 0.05
HARD_GRACE = 5.0  # past a test's limit, seconds until the watcher kills a process the signal did not stop
STARTUP_SECONDS = 180.0  # how long pytest may take to collect the tests
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
    out_of_time: bool = False  # the deadline or the cap stopped the run
    first_start: float | None = None  # time.monotonic() when the first test started (the cap counts from it)
    expected: list[str] = field(default_factory=list)  # the tests the first process collected, in order
    processes: int = 0
    seconds: float = 0.0


# ---------------------------------------------------------------- starting pytest

TEST_TIME_LIMIT = 60.0  # seconds one test may run: the grader's default and `pdm run test`'s (pytest-timeout)

def pytest_command(args: list[str]) -> list[str]:
    """The command line of every pytest run of the course's tooling (the plugin does nothing unless watched)."""
    return [sys.executable, "-m", "pytest", "-p", "course.pytest_events", "-p", "no:cacheprovider", *args]


PLUGIN_VARIABLES = ("TINY_LLM_EVENTS", "TINY_LLM_SKIP")


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


def _events(path: Path, offset: int) -> tuple[list[dict], int]:
    """The whole lines appended to the event file since `offset`, and the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    complete = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()], offset + len(complete)


# ---------------------------------------------------------------- one pytest process

@dataclass
class _Process:
    collected: list[str] | None = None
    current: str | None = None  # the test running now: the one it was in when it died or was killed
    started: float = 0.0


def _one_process(targets: list[str], cwd: Path, env: dict, timeout: float, deadline: float | None,
                 cap: float | None, memory_mb: int | None, work: Path, run: RunResult, index: int) -> _Process:
    """Run pytest once on the tests without a result; record what it finishes in `run`."""
    events_path, log_path, skip_path = work / f"events{index}.jsonl", work / f"log{index}.txt", work / f"skip{index}.json"
    skip_path.write_text(json.dumps(list(run.results)))  # tests that already have a result are not run again
    env = {**env, "TINY_LLM_EVENTS": str(events_path), "TINY_LLM_SKIP": str(skip_path)}
    command = pytest_command(["-q", "--color=no", f"--timeout={timeout:g}", "--timeout-method=signal", *targets])
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_limit_memory(memory_mb))
    run.processes += 1
    try:
        return _watch(proc, run, events_path, log_path, timeout, deadline, cap)
    finally:
        _kill_group(proc)  # and whatever it left in its group


def _record(run: RunResult, result: CaseResult) -> None:
    run.results[result.nodeid] = result


def _watch(proc, run, events_path, log_path, timeout, deadline, cap) -> _Process:
    state, offset = _Process(), 0
    launched, finished_at = time.monotonic(), None
    while True:
        exited = proc.poll() is not None
        events, offset = _events(events_path, offset)
        for event in events:
            kind = event.get("event")
            if kind == "collected" and state.collected is None:
                state.collected = list(event.get("items", []))
                if not run.expected:
                    run.expected = list(state.collected)
            elif kind == "collect_error":
                run.collect_errors.append(f"{event.get('nodeid') or 'collection'}:\n{event.get('output', '')}")
            elif kind == "start":
                state.current, state.started = event["nodeid"], time.monotonic()
                run.first_start = run.first_start or state.started
            elif kind == "finish":
                state.current = None
                _record(run, CaseResult(event["nodeid"], event["outcome"], event.get("output", ""),
                                        float(event.get("duration", 0.0))))
            elif kind == "session_finish":
                finished_at = time.monotonic()
        if exited:
            break
        now = time.monotonic()
        if (deadline is not None and now > deadline) or \
                (cap is not None and run.first_start is not None and now > run.first_start + cap):
            _kill_group(proc)
            run.out_of_time = True
            if state.current is not None:
                _record(run, CaseResult(state.current, "timeout", "stopped: the time budget ran out during this test",
                                        round(now - state.started, 3)))
                state.current = None
            return state
        if state.current is not None and now - state.started > timeout + HARD_GRACE:
            _kill_group(proc)
            _record(run, CaseResult(state.current, "timeout", f"timed out: still running after {timeout:g} s, so it "
                                    "was stopped.", round(now - state.started, 3)))
            state.current = None
            return state
        if state.collected is None and now - launched > STARTUP_SECONDS:
            _kill_group(proc)
            run.problems.append(f"pytest did not finish collecting {run.test_file} within {STARTUP_SECONDS:g} s"
                                f"\n{_tail(log_path)}")
            return state
        if finished_at is not None and now - finished_at > EXIT_GRACE_SECONDS:
            _kill_group(proc)  # every result is in; only the shutdown hangs
            return state
        time.sleep(POLL_SECONDS)
    if state.collected is None and not run.collect_errors:
        run.problems.append(f"pytest exited (status {proc.returncode}) before collecting {run.test_file}:\n"
                            f"{_tail(log_path)}")
    return state


def run_test_file(test_file: str | list[str], cwd: Path, env: dict, timeout: float = 60.0,
                  deadline: float | None = None, cap: float | None = None, memory_mb: int | None = None) -> RunResult:
    """Run `test_file` (relative to `cwd`; or a list of files) with per-test time limits; see the module docstring.

    `deadline`: a `time.monotonic()` value at which the run stops, remaining tests `not_run`; `cap`: seconds
    after the first test's start at which it stops likewise.
    """
    targets = [test_file] if isinstance(test_file, str) else list(test_file)
    run = RunResult(" ".join(targets))
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tiny-llm-pytest-") as tmp:
        for index in range(10_000):
            done_before = len(run.results)
            state = _one_process(targets, cwd, env, timeout, deadline, cap, memory_mb, Path(tmp), run, index)
            if not run.expected:  # nothing was ever collected: the problem is recorded
                break
            if state.current is not None:
                log = _tail(Path(tmp) / f"log{index}.txt")
                _record(run, CaseResult(
                    state.current, "crashed",
                    "the test process died during this test (a crash, an abort or an exit of the interpreter)."
                    f"\nEnd of pytest's output:\n{readable_stack(_crash_part(log), cwd)}"))
            remaining = [nodeid for nodeid in run.expected if nodeid not in run.results]
            if not remaining or run.problems:
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
    run.results = {nodeid: run.results[nodeid] for nodeid in run.expected if nodeid in run.results}
    run.seconds = round(time.monotonic() - began, 2)
    return run
