"""A small pytest plugin that reports each test as it starts and finishes, one JSON line per event.

The grader and the per-day check (course/isolated_pytest.py) load it with `-p course.pytest_events`
and watch the file from another process. Each line is written with one `os.write` as soon as the
event happens, so when a test hangs or kills the interpreter, every earlier result is already on disk
and the watcher knows exactly which test was running.

Environment (read once, then removed from `os.environ` so the code under test does not see it):
    TINY_LLM_EVENTS   the file to append events to
    TINY_LLM_SKIP     (optional) a JSON list of test ids not to run again (they have a result already)

The per-test time limit is pytest-timeout's (`--timeout`, signal method): at the limit it fails the test
in place, and this plugin reports that failure as the outcome `timeout`. A test the signal cannot stop
(stuck in C code) is ended by the watcher, which kills the process (course/isolated_pytest.py).

No line is signed: while grading, the submission's code runs in a sandbox that cannot reach this process
or its files (course/sandbox.py), so only this plugin writes the stream.

Events: {"event": "collected", "items": [...]}, {"event": "collect_error", "nodeid", "output"},
{"event": "start", "nodeid"}, {"event": "finish", "nodeid", "outcome", "output", "duration"},
{"event": "session_finish", "exitstatus"}. Outcomes: passed, failed, error, skipped, xfailed, timeout.
"""

import json
import os
import sys

MAX_OUTPUT = 6000
TIMEOUT_MESSAGE = "Timeout (>"  # how pytest-timeout's failure starts: "Timeout (>60.0s) from pytest-timeout."

_state = {"fd": None, "reports": {}, "timeout": 0.0}


def _emit(event: dict) -> None:
    if _state["fd"] is not None:
        os.write(_state["fd"], (json.dumps(event) + "\n").encode())


def _clip(text: str) -> str:
    if len(text) <= MAX_OUTPUT:
        return text
    return text[: MAX_OUTPUT // 2] + "\n... (output shortened) ...\n" + text[-MAX_OUTPUT // 2:]


def pytest_configure(config):
    path = os.environ.pop("TINY_LLM_EVENTS", None)
    if path:
        _state["fd"] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    _state["timeout"] = float(config.getoption("timeout", None) or 0)  # pytest-timeout's limit, for the message


def pytest_collection_modifyitems(session, config, items):
    # After a hang or a crash the watcher starts pytest again on the same file, skipping the tests that
    # already have a result (listed in a file, not on the command line, so any test id works).
    skip_file = os.environ.pop("TINY_LLM_SKIP", None)
    if not skip_file:
        return
    with open(skip_file) as f:
        done = set(json.load(f))
    kept = [item for item in items if item.nodeid not in done]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
        items[:] = kept


def pytest_collectreport(report):
    if report.failed:
        _emit({"event": "collect_error", "nodeid": report.nodeid, "output": _clip(report.longreprtext)})


def pytest_collection_finish(session):
    _emit({"event": "collected", "items": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid, location):
    _state["reports"][nodeid] = []
    _emit({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report):
    _state["reports"].setdefault(report.nodeid, []).append(report)


def _outcome(reports) -> tuple[str, str]:
    """One outcome for a test from its setup/call/teardown reports, and the text worth showing."""
    outcome, texts = "passed", []
    for report in reports:
        if hasattr(report, "wasxfail") and report.skipped:
            outcome = "xfailed"
        elif report.failed:
            outcome = "failed" if report.when == "call" else "error"
            texts.append(report.longreprtext)
            texts.extend(f"--- {name} ---\n{content}" for name, content in report.sections)
        elif report.skipped and outcome == "passed":
            outcome = "skipped"
            texts.append(report.longreprtext)
    if not reports:
        outcome = "error"
    return outcome, "\n".join(t for t in texts if t)


def pytest_runtest_logfinish(nodeid, location):
    reports = _state["reports"].pop(nodeid, [])
    outcome, output = _outcome(reports)
    if outcome == "failed" and any(TIMEOUT_MESSAGE in getattr(r, "longreprtext", "") for r in reports if r.failed):
        outcome = "timeout"
        output = f"timed out: still running after {_state['timeout']:g} s, so it was stopped.\n{output}"
    duration = sum(getattr(r, "duration", 0.0) for r in reports)
    _emit({"event": "finish", "nodeid": nodeid, "outcome": outcome, "output": _clip(output),
           "duration": round(duration, 3)})
    _restart_if_the_worker_broke()


def _restart_if_the_worker_broke() -> None:
    """While grading, a sandboxed worker stopped at a time limit or crashed takes its objects with it (a
    module-scoped fixture may hold some): this process ends cleanly, and the watcher starts a new one on the
    tests left, as after a crash."""
    sandbox = sys.modules.get("course.sandbox")
    if sandbox is not None and sandbox.needs_restart():
        sandbox.stop_workers()
        _emit({"event": "session_finish", "exitstatus": 0})
        os._exit(0)


def pytest_sessionfinish(session, exitstatus):
    _emit({"event": "session_finish", "exitstatus": int(exitstatus)})
