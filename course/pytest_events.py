"""The judge's results plugin (book/src/grading.md): where TINY_LLM_EVENTS names a file, one JSON line, one `os.write`
each (on disk whatever kills the process): {"collected": [ids], "errors": [texts]}, then {"finish": id, "outcome":
..., "output": text} per test. It also stops pytest-timeout's clock between a test's phases, and starts the tests
after a broken worker on fresh ones.
"""
import json
import os
import signal
import sys

import pytest

MAX_OUTPUT = 6000
TIMEOUT_MESSAGE = "Timeout (>"  # how pytest-timeout's failure starts: "Timeout (>60.0s) from pytest-timeout."

_state = {"fd": None, "reports": {}, "errors": [], "timeout": 0.0, "left": 0.0}


def _emit(**event) -> None:
    if _state["fd"] is not None:
        os.write(_state["fd"], (json.dumps(event) + "\n").encode())


def _clip(text: str) -> str:
    half = MAX_OUTPUT // 2
    return text if len(text) <= MAX_OUTPUT else f"{text[:half]}\n... (output shortened) ...\n{text[-half:]}"


def pytest_configure(config):
    path = os.environ.pop("TINY_LLM_EVENTS", None)
    if path:
        _state["fd"] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    _state["timeout"] = float(config.getoption("timeout", None) or 0)  # pytest-timeout's limit, for the message


def pytest_collectreport(report):
    if report.failed:
        _state["errors"].append(f"{report.nodeid or 'collection'}:\n{_clip(report.longreprtext)}")


def pytest_collection_finish(session):  # called even when collection failed
    _emit(collected=[item.nodeid for item in session.items], errors=_state["errors"])


def pytest_runtest_logreport(report):
    _state["reports"].setdefault(report.nodeid, []).append(report)


def _clock(runs: bool) -> None:
    """pytest-timeout's clock (a SIGALRM timer) runs only within a test's phases: fired while pytest writes a report,
    it would stop the whole process (INTERNALERROR), not one test."""
    if runs and _state["left"]:
        signal.setitimer(signal.ITIMER_REAL, _state["left"])
    elif not runs:
        _state["left"] = signal.setitimer(signal.ITIMER_REAL, 0)[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield  # pytest-timeout started the clock
    _clock(runs=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _clock(runs=True)
    yield
    _clock(runs=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """While grading, a worker that broke during this test took its objects with it, some held by module fixtures:
    every fixture is torn down and every worker stopped, so the next test sets up afresh on new workers."""
    _clock(runs=True)
    sandbox = sys.modules.get("course.sandbox")
    if sandbox is not None and sandbox.needs_restart():
        try:
            item.session._setupstate.teardown_exact(None)  # pytest's own tear-down of everything, as at the end
        except Exception:  # noqa: BLE001 - finalizers of objects the broken worker held: gone either way
            pass
        finally:
            sandbox.stop_workers()
    yield
    _clock(runs=False)


def pytest_runtest_logfinish(nodeid, location):
    """One outcome from the test's set-up, call and tear-down reports, and the text worth showing."""
    reports = _state["reports"].pop(nodeid, [])
    outcome, texts = ("passed" if reports else "error"), []
    for report in reports:
        if report.failed:
            outcome = "failed" if report.when == "call" else "error"
            texts += [report.longreprtext, *(f"--- {name} ---\n{content}" for name, content in report.sections)]
        elif report.skipped and outcome == "passed":
            outcome = "skipped"
            texts.append(report.longreprtext)
    if outcome == "failed" and any(TIMEOUT_MESSAGE in r.longreprtext for r in reports if r.failed):
        outcome = "timeout"
        texts.insert(0, f"timed out: still running after {_state['timeout']:g} s, so it was stopped.")
    _emit(finish=nodeid, outcome=outcome, output=_clip("\n".join(t for t in texts if t)))
