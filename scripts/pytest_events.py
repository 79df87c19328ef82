"""A small pytest plugin that reports each test as it starts and finishes, one JSON line per event.

The grader and the per-day check (scripts/isolated_pytest.py) load it with `-p scripts.pytest_events`
and watch the file from another process. Each line is written with one `os.write` as soon as the
event happens, so when a test hangs or kills the interpreter, every earlier result is already on disk
and the watcher knows exactly which test was running.

Environment (read once, then removed from `os.environ` so the code under test does not see it):
    TINY_LLM_EVENTS   the file to append events to
    TINY_LLM_TRACE    a file for the Python stack of a test that runs past its time limit
    TINY_LLM_TIMEOUT  that time limit in seconds (a stack is dumped there; the watcher kills the process)

Events: {"event": "collected", "items": [...]}, {"event": "collect_error", "nodeid", "output"},
{"event": "start", "nodeid"}, {"event": "finish", "nodeid", "outcome", "output", "duration"},
{"event": "session_finish", "exitstatus"}. Outcomes: passed, failed, error, skipped, xfailed.
"""

import faulthandler
import json
import os

MAX_OUTPUT = 6000

_state = {"fd": None, "trace": None, "timeout": 0.0, "reports": {}}


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
    trace = os.environ.pop("TINY_LLM_TRACE", None)
    if trace:
        _state["trace"] = open(trace, "w")
    _state["timeout"] = float(os.environ.pop("TINY_LLM_TIMEOUT", "0") or 0)


def pytest_collectreport(report):
    if report.failed:
        _emit({"event": "collect_error", "nodeid": report.nodeid, "output": _clip(report.longreprtext)})


def pytest_collection_finish(session):
    _emit({"event": "collected", "items": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid, location):
    _state["reports"][nodeid] = []
    if _state["trace"] is not None and _state["timeout"] > 0:
        # Written by a watchdog thread even while the test holds the GIL in a tight loop.
        faulthandler.dump_traceback_later(_state["timeout"], repeat=False, file=_state["trace"])
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
    if _state["trace"] is not None and _state["timeout"] > 0:
        faulthandler.cancel_dump_traceback_later()
    reports = _state["reports"].pop(nodeid, [])
    outcome, output = _outcome(reports)
    duration = sum(getattr(r, "duration", 0.0) for r in reports)
    _emit({"event": "finish", "nodeid": nodeid, "outcome": outcome, "output": _clip(output),
           "duration": round(duration, 3)})


def pytest_sessionfinish(session, exitstatus):
    _emit({"event": "session_finish", "exitstatus": int(exitstatus)})
