"""Helpers for day 3.5's tests: a server on a free port, and a strict Prometheus text parser.

`running_server(app)` runs the app under uvicorn where the app lives (tests/actor_fakes/serving.py: while
grading, in the sandboxed worker, on a socket the grader handed it; otherwise in a thread of this process) and
yields the base URL: the test's clients talk real HTTP to it, so only bytes cross to the worker. If anything
inside fails while the engine thread has died (for instance, on a skeleton still raising NotImplementedError
there), the engine thread's own exception is raised instead, so the test reports the real cause rather than an
HTTP error.
"""

import contextlib
import importlib
import math
import re
import time

from course import remote


def serving_beside(app):
    """tests/actor_fakes/serving in the process that holds `app`: the worker's while grading, else this one's."""
    if type(app) is remote.Handle:
        return app._endpoint.request("import", 0, "tests.actor_fakes.serving")
    return importlib.import_module("tests.actor_fakes.serving")


@contextlib.contextmanager
def running_server(app, timeout: float = 30.0):
    serving = serving_beside(app)
    port = serving.serve(app, timeout=timeout)
    try:
        yield f"http://127.0.0.1:{port}"
    except BaseException:
        serving.raise_engine_error(app)
        raise
    finally:
        serving.stop(port, timeout)
    serving.raise_engine_error(app)


def wait_until(condition, timeout: float = 30.0, interval: float = 0.02) -> bool:
    """Poll `condition()` until it is true; False after `timeout` seconds (tests never assert on time)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


# ---------------------------------------------------------------- Prometheus text format

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_VALUE = r"[-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|Inf|NaN)"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
HELP_LINE = re.compile(rf"# HELP ({_NAME}) (.*)")
TYPE_LINE = re.compile(rf"# TYPE ({_NAME}) (counter|gauge|histogram|summary|untyped)")
SAMPLE_LINE = re.compile(rf"({_NAME})(?:\{{({_LABEL}(?:,{_LABEL})*)?\}})? ({_VALUE})(?: -?\d+)?")


def parse_prometheus(text: str) -> dict[str, dict]:
    """Parse Prometheus text (format 0.0.4) strictly: {family: {"type", "help", "samples": [(name, labels, value)]}}.

    Raises AssertionError on any line that is not a HELP, TYPE or sample line, on a sample whose
    family has no TYPE before it, on histogram buckets that are not cumulative or whose +Inf bucket
    differs from _count.
    """
    assert text.endswith("\n"), "the exposition must end with a newline"
    families: dict[str, dict] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line:
            continue
        if match := HELP_LINE.fullmatch(line):
            families.setdefault(match[1], {"type": None, "help": None, "samples": []})["help"] = match[2]
        elif match := TYPE_LINE.fullmatch(line):
            family = families.setdefault(match[1], {"type": None, "help": None, "samples": []})
            assert family["type"] is None and not family["samples"], f"line {number}: TYPE after samples"
            family["type"] = match[2]
        elif match := SAMPLE_LINE.fullmatch(line):
            name, labels, value = match[1], match[2], match[3]
            # prometheus_client names a counter's family without its `_total`, and adds `_created` samples.
            stem = re.sub(r"_(bucket|sum|count|total|created)$", "", name)
            family_name = next((f for f in (name, stem) if f in families), None)
            assert family_name is not None and families[family_name]["type"], f"line {number}: no TYPE for {name}"
            parsed = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels or ""))
            number_value = float(value.replace("Inf", "inf").replace("NaN", "nan"))
            families[family_name]["samples"].append((name, parsed, number_value))
        else:
            raise AssertionError(f"line {number} is not Prometheus text: {line!r}")
    for name, family in families.items():
        if family["type"] != "histogram":
            continue
        buckets = [(s[1]["le"], s[2]) for s in family["samples"] if s[0] == f"{name}_bucket"]
        counts = [value for _, value in buckets]
        assert counts == sorted(counts), f"{name}: buckets are not cumulative"
        assert buckets and buckets[-1][0] == "+Inf", f"{name}: no +Inf bucket"
        bounds = [float(le.replace("Inf", "inf")) for le, _ in buckets]
        assert bounds == sorted(bounds) and math.isinf(bounds[-1]), f"{name}: bucket bounds out of order"
        count = [s[2] for s in family["samples"] if s[0] == f"{name}_count"]
        assert count == [buckets[-1][1]], f"{name}: _count differs from the +Inf bucket"
    return families

