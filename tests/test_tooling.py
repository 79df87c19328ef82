"""Tests of the course's tooling: the grader, its Gradescope report, the per-day check and the book check.

The grader is tested end to end on a tiny synthetic course (three days of two-line modules) built in a
temporary directory with copies of the real scripts/ and tests/harness.py, so these tests do not depend
on the state of the real course and run in seconds. The synthetic student breaks on purpose: one task
hangs, one kills the interpreter, one day's module raises at import. A second test does the same on the
real course's days 1.1 and 1.4 when their tests exist.
"""

import json
import math
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from course import sandbox
from course.scratch import copy_repository
from maint import book_check
from scripts import grade

REPO_ROOT = Path(__file__).resolve().parent.parent
# Each test here runs whole grading or checking processes, every one bounded by its own subprocess timeout:
# they get more than `pdm run test`'s per-test limit.
pytestmark = pytest.mark.timeout(900)

# ---------------------------------------------------------------- Gradescope's results.json, checked field by field
# From Gradescope's "Autograder Specifications" (gradescope-autograders.readthedocs.io/en/latest/specs/):
# every field is optional except that a score is needed at the top level or on every test.
FORMATS = {"text", "html", "simple_format", "md", "ansi"}
VISIBILITIES = {"hidden", "after_due_date", "after_published", "visible"}
STATUSES = {"passed", "failed"}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def gradescope_problems(results) -> list[str]:
    """Everything in `results` that Gradescope's documented results.json format does not allow."""
    problems = []
    if not isinstance(results, dict):
        return ["the top level must be a JSON object"]
    top_level = {
        "score": _is_number, "execution_time": _is_number, "output": lambda v: isinstance(v, str),
        "output_format": FORMATS.__contains__, "test_output_format": FORMATS.__contains__,
        "test_name_format": FORMATS.__contains__, "visibility": VISIBILITIES.__contains__,
        "stdout_visibility": VISIBILITIES.__contains__, "extra_data": lambda v: isinstance(v, dict),
        "tests": lambda v: isinstance(v, list), "leaderboard": lambda v: isinstance(v, list),
    }
    per_test = {
        "score": _is_number, "max_score": _is_number, "status": STATUSES.__contains__,
        "name": lambda v: isinstance(v, str), "name_format": FORMATS.__contains__,
        "number": lambda v: isinstance(v, str), "output": lambda v: isinstance(v, str),
        "output_format": FORMATS.__contains__,
        "tags": lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v),
        "visibility": VISIBILITIES.__contains__, "extra_data": lambda v: isinstance(v, dict),
    }
    for key, value in results.items():
        if key not in top_level:
            problems.append(f"unknown top-level field {key!r}")
        elif not top_level[key](value):
            problems.append(f"top-level {key!r} has an invalid value {value!r:.80}")
    tests = results.get("tests", [])
    for i, test in enumerate(tests if isinstance(tests, list) else []):
        if not isinstance(test, dict):
            problems.append(f"tests[{i}] is not an object")
            continue
        for key, value in test.items():
            if key not in per_test:
                problems.append(f"tests[{i}]: unknown field {key!r}")
            elif not per_test[key](value):
                problems.append(f"tests[{i}]: {key!r} has an invalid value {value!r:.80}")
        if _is_number(test.get("score")) and _is_number(test.get("max_score")) and \
                test["score"] > test["max_score"] + 1e-9:
            problems.append(f"tests[{i}]: score {test['score']} above max_score {test['max_score']}")
    if "score" not in results and not (tests and all("score" in t for t in tests if isinstance(t, dict))):
        problems.append("a score is needed at the top level or on every test")
    return problems


def test_gradescope_checker_can_fail():
    good = {"score": 1.0, "tests": [{"name": "a", "score": 1.0, "max_score": 2, "status": "passed"}]}
    assert gradescope_problems(good) == []
    assert gradescope_problems({"tests": [{"name": "a"}]})  # no score anywhere
    assert gradescope_problems({"score": 1, "max_points": 3})  # not a documented field
    assert gradescope_problems({"score": 1, "tests": [{"score": 3, "max_score": 2}]})
    assert gradescope_problems({"score": 1, "visibility": "public"})
    assert gradescope_problems({"score": 1, "tests": [{"score": 1, "status": "ok"}]})
    assert gradescope_problems({"score": float("nan")})


# ---------------------------------------------------------------- a synthetic course

SYNTHETIC_DAYS = """
DAYS[:] = [
    Day(1, 1, "Alpha", "alpha.md", ("alpha",), {1: 4, 2: 4, 3: 2}),
    Day(1, 2, "Beta", "beta.md", ("beta",), {1: 3, 2: 3}),
    Day(2, 1, "Gamma", "gamma.md", ("gamma",), {1: 5}),
]
"""

REFERENCE = {
    "alpha.py": '''
        def add(a, b):
            return a + b

        def spin():
            return 1

        def stubborn():
            return 2

        def crash():
            return 0
    ''',
    "beta.py": '''
        from .alpha import add

        def twice(x):
            return add(x, x)
    ''',
    "gamma.py": '''
        def square(x):
            return x * x
    ''',
}

BROKEN_STUDENT = {
    "alpha.py": '''
        import os
        import time

        def add(a, b):
            return a + b

        def spin():
            while True:  # hangs on purpose
                pass

        def stubborn():
            while True:  # hangs on purpose, and swallows the time-limit exception: needs a kill
                try:
                    time.sleep(10)
                except BaseException:
                    pass

        def crash():
            os.abort()  # kills the interpreter on purpose
    ''',
    "beta.py": '''
        raise RuntimeError("this module fails at import, on purpose")
    ''',
    "gamma.py": REFERENCE["gamma.py"],
}

TESTS = {
    "test_week_1_day_1.py": '''
        import pytest
        from tests.harness import solution

        @pytest.fixture(scope="module")
        def alpha():  # held across tests: after a worker breaks, the next test must get it built afresh
            return solution(1, 1).alpha

        def test_task_1_add(alpha):
            assert alpha.add(1, 2) == 3

        @pytest.mark.parametrize("a", [0, 1, 2])
        def test_task_1_add_cases(a):
            assert solution(1, 1).alpha.add(a, 1) == a + 1

        def test_task_2_spin():
            assert solution(1, 1).alpha.spin() == 1

        def test_task_2_stubborn():
            assert solution(1, 1).alpha.stubborn() == 2

        def test_task_3_crash():
            assert solution(1, 1).alpha.crash() == 0

        def test_task_1_runs_after_the_crash(alpha):
            assert alpha.add(2, 2) == 4
    ''',
    "test_week_1_day_2.py": '''
        from tests.harness import solution

        def test_task_1_twice():
            assert solution(1, 2).beta.twice(2) == 4

        def test_task_2_twice_zero():
            assert solution(1, 2).beta.twice(0) == 0
    ''',
    "test_week_2_day_1.py": '''
        from tests.harness import solution

        def test_task_1_square():
            assert solution(2, 1).gamma.square(3) == 9
    ''',
}


def write_modules(directory: Path, modules: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in modules.items():
        (directory / name).write_text(textwrap.dedent(text).lstrip())


def make_course(root: Path, student: dict[str, str]) -> Path:
    """A repo with the real tooling, the real harness and conftest, and the synthetic days."""
    copy_repository(root, ("scripts", "course", "maint"))
    with open(root / "course" / "course_map.py", "a") as f:
        f.write(SYNTHETIC_DAYS)
    (root / "tests").mkdir()
    for name in ("__init__.py", "harness.py", "conftest.py"):
        shutil.copy2(REPO_ROOT / "tests" / name, root / "tests" / name)
    write_modules(root / "tests", TESTS)
    write_modules(root / "src_ref" / "tiny_llm_ref", {**REFERENCE, "__init__.py": ""})
    write_modules(root / "src" / "tiny_llm", {**student, "__init__.py": ""})
    return root


def run_tool(root: Path, module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=root, capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ, "PYTHONPATH": "src:src_ref:."})


def scores_by_test(results: dict) -> dict[str, float]:
    return {t["name"].split(": ", 1)[1]: t["score"] for t in results["tests"]}


def test_grade_survives_a_hang_a_crash_and_an_import_error(tmp_path):
    # The repo's own package is correct; the submission given with --src is the broken one.
    root = make_course(tmp_path / "course", student=REFERENCE)
    submission = tmp_path / "submission"
    write_modules(submission, BROKEN_STUDENT)
    report = tmp_path / "out" / "results.json"
    # 5 s a test: the worker's start-up (Python, MLX) falls inside a day's first test, and took over 2 s at load 15.
    done = run_tool(root, "scripts.grade", "--src", str(submission), "--timeout", "5", "--json", str(report),
                    "--day-budget", "120")  # the real course's recorded times say nothing about these days
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(report.read_text())
    assert gradescope_problems(results) == []
    by_test = scores_by_test(results)
    assert set(by_test) == {
        "test_task_1_add", "test_task_1_add_cases[0]", "test_task_1_add_cases[1]", "test_task_1_add_cases[2]",
        "test_task_2_spin", "test_task_2_stubborn", "test_task_3_crash", "test_task_1_runs_after_the_crash",
        "test_task_1_twice",
        "test_task_2_twice_zero", "test_task_1_square"}
    for name, expected in {"test_task_1_add": 4 / 3, "test_task_1_add_cases[0]": 4 / 9,
                           "test_task_2_spin": 0.0, "test_task_2_stubborn": 0.0, "test_task_3_crash": 0.0,
                           "test_task_1_runs_after_the_crash": 4 / 3, "test_task_1_twice": 0.0,
                           "test_task_2_twice_zero": 0.0, "test_task_1_square": 5.0}.items():
        assert by_test[name] == pytest.approx(expected, abs=1e-3), name
    assert results["score"] == pytest.approx(4 + 5, abs=1e-2)
    assert results["extra_data"]["max_score"] == pytest.approx(21)
    outputs = {t["name"].split(": ", 1)[1]: t["output"] for t in results["tests"]}
    for hang in ("spin", "stubborn"):  # interrupted in place, and killed: both say where they were
        assert "timed out" in outputs[f"test_task_2_{hang}"] and hang in outputs[f"test_task_2_{hang}"]
    assert "crash" in outputs["test_task_3_crash"]
    assert "fails at import" in outputs["test_task_1_twice"]
    # The table: exactly the broken tasks at zero, the rest at full points.
    rows = {tuple(line.split()[:3]): line for line in done.stdout.splitlines()
            if line[:4].strip().isdigit()}
    assert "4.0 / 4" in rows[("1", "1", "1")] and "0.0 / 4" in rows[("1", "1", "2")]
    assert "0.0 / 2" in rows[("1", "1", "3")] and "0.0 / 3" in rows[("1", "2", "1")]
    assert "5.0 / 5" in rows[("2", "1", "1")]
    # The repo's own package was not touched.
    assert "while True" not in (root / "src" / "tiny_llm" / "alpha.py").read_text()


def test_grade_reference_gets_full_points_and_bad_arguments_exit_2(tmp_path):
    root = make_course(tmp_path / "course", student=BROKEN_STUDENT)
    report = tmp_path / "results.json"
    done = run_tool(root, "scripts.grade", "--solution", "ref", "--week", "1", "--day", "2",
                    "--json", str(report))
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(report.read_text())
    assert results["score"] == pytest.approx(6) and gradescope_problems(results) == []
    assert run_tool(root, "scripts.grade", "--day", "1").returncode == 2
    assert run_tool(root, "scripts.grade", "--week", "9").returncode == 2


def test_a_stopped_grade_leaves_a_whole_report_with_the_days_not_graded_at_zero(tmp_path):
    """The report is written before the first day (every day a placeholder at zero) and after each: a grade stopped
    at any point (SIGTERM, as Gradescope's time-out) still leaves a valid results.json."""
    import os
    import signal
    import time

    root = make_course(tmp_path / "course", student=BROKEN_STUDENT)
    report = tmp_path / "results.json"
    grading = subprocess.Popen([sys.executable, "-m", "scripts.grade", "--week", "1", "--json", str(report),
                                "--no-require-sandbox", "--timeout", "30"], cwd=root, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": "src:src_ref:."})
    deadline = time.monotonic() + 120
    while not report.exists() and grading.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    grading.send_signal(signal.SIGTERM)  # during day 1.1's first test (spin hangs for its 30 s)
    output = grading.communicate(timeout=120)[0]
    assert grading.returncode == 130, output
    results = json.loads(report.read_text())
    assert gradescope_problems(results) == [] and results["score"] == 0, results
    assert results["extra_data"]["not_graded"] == ["1.1", "1.2"] and results["extra_data"]["max_score"] == 16
    assert all(t["status"] == "failed" for t in results["tests"])


def test_grade_reports_an_uncollectable_test_file_as_a_grader_failure(tmp_path):
    root = make_course(tmp_path / "course", student=REFERENCE)
    (root / "tests" / "test_week_2_day_1.py").write_text("def test_task_1_square(:\n")
    report = tmp_path / "results.json"
    done = run_tool(root, "scripts.grade", "--week", "2", "--json", str(report))
    assert done.returncode == 2, done.stdout + done.stderr
    results = json.loads(report.read_text())
    assert results["score"] == 0 and results["extra_data"]["max_score"] == 5
    assert gradescope_problems(results) == []
    assert "GRADER PROBLEMS" in done.stdout


def test_check_days_passes_each_day_alone_and_catches_a_broken_reference(tmp_path):
    root = make_course(tmp_path / "course", student={})
    # The untouched skeleton: the same names, bodies that raise NotImplementedError.
    write_modules(root / "src" / "tiny_llm", {
        "alpha.py": 'def add(a, b):\n    raise NotImplementedError("Week 1 Day 1 Task 1")\n\n'
                    'def spin():\n    raise NotImplementedError("Week 1 Day 1 Task 2")\n\n'
                    'def crash():\n    raise NotImplementedError("Week 1 Day 1 Task 3")\n',
        "beta.py": 'def twice(x):\n    raise NotImplementedError("Week 1 Day 2 Task 1")\n',
        "gamma.py": 'def square(x):\n    raise NotImplementedError("Week 2 Day 1 Task 1")\n',
    })
    done = run_tool(root, "maint.check_days")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASS") == 3
    # Break the reference of day 2.1: check-days fails and names the day and the test.
    (root / "src_ref" / "tiny_llm_ref" / "gamma.py").write_text("def square(x):\n    return x + x\n")
    done = run_tool(root, "maint.check_days")
    assert done.returncode == 1
    assert "week 2 day 1" in done.stdout and "test_task_1_square" in done.stdout
    assert done.stdout.count("PASS") == 2
    # The skeleton itself was never modified.
    assert "NotImplementedError" in (root / "src" / "tiny_llm" / "gamma.py").read_text()


def test_pdm_run_test_gives_every_test_the_graders_time_limit(tmp_path):
    from course.isolated_pytest import TEST_TIME_LIMIT
    from scripts import run_tests

    assert run_tests.with_time_limit(["-q"]) == [f"--timeout={TEST_TIME_LIMIT:g}", "-q"]
    assert run_tests.with_time_limit(["--timeout=5", "-x"]) == ["--timeout=5", "-x"]
    spin = tmp_path / "test_spin.py"
    spin.write_text("def test_spins_forever():\n    while True:\n        pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(spin),
                           *run_tests.with_time_limit(["--timeout=1"])], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Timeout" in done.stdout and "test_spins_forever" in done.stdout, done.stdout


def test_pdm_run_test_spreads_only_the_whole_suite_over_workers(monkeypatch):
    """A day or a week in one process (a student reads its failures in order); the whole suite on one worker per
    core, unless the arguments choose; one core: one process."""
    import importlib.util

    from scripts import run_tests

    monkeypatch.setattr(run_tests.os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    monkeypatch.setattr(run_tests.os, "cpu_count", lambda: 2)
    assert run_tests.with_workers(["-q"], whole_suite=False) == ["-q"]
    for chosen in (["-n", "0"], ["-n3"], ["--numprocesses=3"], ["-p", "no:xdist"]):
        assert run_tests.with_workers(["-q", *chosen], whole_suite=True) == ["-q", *chosen]
    if importlib.util.find_spec("xdist") is not None:
        assert run_tests.with_workers(["-q"], whole_suite=True) == ["-n", "2", "--dist", "loadgroup", "-q"]
    monkeypatch.setattr(run_tests.os, "sched_getaffinity", lambda _: {0}, raising=False)
    monkeypatch.setattr(run_tests.os, "cpu_count", lambda: 1)
    assert run_tests.with_workers(["-q"], whole_suite=True) == ["-q"]


def test_the_whole_suite_keeps_a_files_tests_on_one_worker(tmp_path):
    """Under `pdm run test-ref`'s workers (tests/conftest.py's scheduler): every test of a file on one worker, so its
    module fixtures (a two-rank launch, a server) start once; a spread file's tests each a unit of their own (which
    worker takes which depends on timing); the longest files first."""
    import os

    from tests import conftest

    (tmp_path / "tests").mkdir()
    shutil.copy2(REPO_ROOT / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    record = 'import os\n\n\ndef record():\n    with open(os.environ["WHERE"], "a") as f:\n' \
             '        f.write(f"{__name__} {os.environ[\'PYTEST_XDIST_WORKER\']}\\n")\n\n\n'
    files = {"test_a.py": 6, "test_b.py": 6, next(iter(conftest.SPREAD_FILES)): 6, conftest.LONGEST_FILES[-1]: 2}
    for name, count in files.items():
        (tmp_path / "tests" / name).write_text(record + "".join(f"def test_{i}():\n    record()\n\n\n"
                                                                for i in range(count)))
    where = tmp_path / "where.txt"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "tests"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "WHERE": str(where), "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    ran = [line.split() for line in where.read_text().splitlines()]
    workers = {module: {w for m, w in ran if m == module} for module, _ in ran}
    assert len(ran) == sum(files.values()) and len(workers) == len(files), ran
    spread = Path(next(iter(conftest.SPREAD_FILES))).stem
    assert all(len(w) == 1 for module, w in workers.items() if module != spread), workers
    assert conftest.work_unit(f"tests/{spread}.py::test_1") == f"tests/{spread}.py::test_1"
    assert conftest.work_unit("tests/test_a.py::test_1[x]") == "tests/test_a.py"
    first = Path(conftest.LONGEST_FILES[-1]).stem
    worker = next(iter(workers[first]))
    assert next(m for m, w in ran if w == worker) == first, ran  # handed out first: its worker starts with it


# ---------------------------------------------------------------- the book check, on small synthetic books

def make_book(root: Path) -> Path:
    """A course repo with a correct little book; each test then breaks one thing."""
    make_course(root, student=REFERENCE)
    src = root / "book" / "src"
    src.mkdir(parents=True)
    (src / "SUMMARY.md").write_text(textwrap.dedent("""\
        # Summary

        [Preface](./preface.md)

        - [1.1 Alpha](./alpha.md)
        - [1.2 Beta](./beta.md)
        - [2.1 Gamma](./gamma.md)
    """))
    (src / "preface.md").write_text("# Preface\n\nStart with [Alpha](./alpha.md).\n")
    (src / "alpha.md").write_text(textwrap.dedent("""\
        # Day 1.1: Alpha

        The function lives in `src/tiny_llm/alpha.py`:

        ```python
        {{#include ../../src_ref/tiny_llm_ref/alpha.py:1:2}}
        ```

        ## Task 1: add

        Edit `add` in `src/tiny_llm/alpha.py`, then run `pdm run test --week 1 --day 1`.

        ## Task 2: spin

        ```bash
        pdm run test --week 1 --day 1 -- -k task_2
        ```

        ## Task 3: crash

        Narrow with `pdm run test --week 1 --day 1 -- -k task_3`.
    """))
    (src / "beta.md").write_text("# Day 1.2: Beta\n\n## Task 1: twice\n\n## Task 2: twice zero\n\n"
                                 "{{#include ../../tests/test_week_1_day_2.py:tests}}\n")
    (src / "gamma.md").write_text("# Day 2.1: Gamma\n\n## Task 1: square\n\n`pdm run grade --week 2 --json out.json`\n")
    test_file = root / "tests" / "test_week_1_day_2.py"
    test_file.write_text("# ANCHOR: tests\n" + test_file.read_text() + "# ANCHOR_END: tests\n")
    return root


@pytest.fixture(scope="module")
def book_root(tmp_path_factory):
    return make_book(tmp_path_factory.mktemp("book"))


def _problems(root: Path) -> list[str]:
    return book_check.all_problems(root)


def test_book_check_accepts_a_correct_book(book_root):
    assert _problems(book_root) == []


@pytest.mark.parametrize("breakage, expected", [
    (("SUMMARY.md", "- [2.1 Gamma](./gamma.md)", "- [2.1 Gamma](./gamma-old.md)"), "gamma-old.md"),
    (("SUMMARY.md", "- [1.2 Beta](./beta.md)\n", ""), "beta.md"),  # a chapter no longer listed
    (("alpha.md", "alpha.py:1:2}}", "alpha.py:1:99}}"), "line"),
    (("alpha.md", "alpha.py:1:2}}", "nothing.py}}"), "nothing.py"),
    (("beta.md", "py:tests}}", "py:no_such_anchor}}"), "no_such_anchor"),
    (("alpha.md", "`src/tiny_llm/alpha.py`:", "`src/tiny_llm/alfa.py`:"), "src/tiny_llm/alfa.py"),
    (("alpha.md", "pdm run test --week 1 --day 1`", "pdm run tset --week 1 --day 1`"), "tset"),
    (("alpha.md", "pdm run test --week 1 --day 1`", "pdm run test --wek 1`"), "--wek"),
    (("gamma.md", "--json out.json", "--jsn out.json"), "--jsn"),
    (("alpha.md", "## Task 3: crash", "## Task 4: crash"), "Task 4"),
    (("beta.md", "## Task 2: twice zero", "## Twice zero"), "test_task_2"),
    (("preface.md", "(./alpha.md)", "(./alfa.md)"), "alfa.md"),
    (("preface.md", "(./alpha.md).", "(./alpha.md) (coming)."), "coming"),
])
def test_book_check_catches_each_kind_of_drift(tmp_path, breakage, expected):
    root = make_book(tmp_path / "course")
    name, old, new = breakage
    path = root / "book" / "src" / name
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    problems = _problems(root)
    assert problems, f"breaking {name} went unnoticed"
    assert any(expected in p for p in problems), problems
    # Each message names the chapter file (and a line where there is one).
    assert all(".md" in p or "course_map" in p or "tests/" in p for p in problems), problems


def test_book_check_catches_points_without_tests(tmp_path):
    root = make_book(tmp_path / "course")
    path = root / "tests" / "test_week_2_day_1.py"
    path.write_text(path.read_text().replace("test_task_1_square", "test_square"))
    problems = _problems(root)
    assert any("test_task_1" in p and "gamma.md" in p for p in problems), problems
    assert any("points" in p for p in problems), problems


# ---------------------------------------------------------------- the real course, broken on purpose

REAL_DAYS = ("tests/test_week_1_day_2.py", "tests/test_week_1_day_4.py")


@pytest.mark.skipif(not all((REPO_ROOT / f).exists() for f in REAL_DAYS), reason="week 1 days 2 and 4 not written yet")
def test_grade_on_the_real_course_with_a_hanging_task_and_a_module_failing_at_import(tmp_path):
    """Days 1.2 and 1.4 solved, except: the MLP hangs (day 1.4 Task 2, the last of the day's tasks) and RoPE's module
    raises at import."""
    submission = tmp_path / "submission"
    shutil.copytree(REPO_ROOT / "src" / "tiny_llm", submission, ignore=shutil.ignore_patterns("__pycache__"))
    for module in ("basics", "attention", "positional_encoding", "layer_norm", "mlp"):
        shutil.copy2(REPO_ROOT / "src_ref" / "tiny_llm_ref" / f"{module}.py", submission / f"{module}.py")
    with open(submission / "mlp.py", "a") as f:
        f.write("\n\ndef _hang(self, *args, **kwargs):\n    while True:\n        pass\n\n\nQwen2MLP.__call__ = _hang\n")
    rope = submission / "positional_encoding.py"
    rope.write_text('raise RuntimeError("broken on purpose")\n' + rope.read_text())
    report = tmp_path / "results.json"
    done = subprocess.run([sys.executable, "-m", "scripts.grade", "--src", str(submission), "--week", "1",
                           "--day", "2", "4", "--timeout", "3", "--json", str(report), "--day-budget", "20"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(report.read_text())
    assert gradescope_problems(results) == []
    by_task: dict[tuple[str, str], list[float]] = {}
    for test in results["tests"]:
        day, task = test["tags"][1], test["tags"][2]
        got = by_task.setdefault((day, task), [0.0, 0.0])
        got[0] += test["score"]
        got[1] += test["max_score"]
    zero = {("day 1.2", "task 1"), ("day 1.2", "task 2"), ("day 1.4", "task 2")}
    for key, (score, max_score) in by_task.items():
        expected = 0.0 if key in zero else max_score
        assert score == pytest.approx(expected, abs=1e-3), (key, done.stdout)
    assert zero <= set(by_task) and ("day 1.4", "task 1") in by_task
    hung = [t for t in results["tests"] if t["tags"][1:] == ["day 1.4", "task 2"]]
    # The hang is stopped at the time limit; the day's cap (20 s here, by hand: day 1.4's own is 3x its honest run
    # plus 60 s) ends the rest of the task, the day's last.
    assert "timed out" in hung[0]["output"]
    assert all("timed out" in t["output"] or "time budget ran out" in t["output"] for t in hung)


def test_check_days_by_task_fills_only_the_days_functions():
    from maint.check_days import fill_day_tasks
    from course.course_map import Day

    skeleton = textwrap.dedent('''\
        import mlx.core as mx


        def early(x):
            """Day 1."""
            raise NotImplementedError("Week 1 Day 1 Task 1 (book/src/a.md): early")


        class Later:
            """Day 3."""

            def __call__(self, x):
                """Call."""
                raise NotImplementedError("Week 1 Day 3 Task 2 (book/src/c.md): later")
    ''')
    reference = textwrap.dedent('''\
        import math

        import mlx.core as mx


        def early(x):
            """Day 1."""
            return x + 1


        class Later:
            """Day 3."""

            @staticmethod
            def helper(x):
                return x

            def __call__(self, x):
                """Call."""
                return math.floor(early(x))
    ''')
    filled, missing = fill_day_tasks(skeleton, reference, Day(1, 3, "Later", "c.md", ("m",)))
    assert missing == []
    namespace: dict = {}
    exec(compile(filled, "filled", "exec"), namespace)  # the filled module is valid Python
    assert "return math.floor(early(x))" in filled and "import math" in filled
    with pytest.raises(NotImplementedError, match="Week 1 Day 1"):
        namespace["Later"]()(1.5)  # day 1.3's method is filled; day 1.1's function it calls is not


def test_book_check_catches_skeleton_messages_that_drift_from_the_course_map(tmp_path):
    root = make_book(tmp_path / "course")
    skeleton = root / "src" / "tiny_llm"
    (skeleton / "gamma.py").write_text(
        'def square(x):\n    raise NotImplementedError("Week 2 Day 1 Task 1 (book/src/gamma.md): square")\n')
    assert book_check.skeleton_problems(root) == []
    (skeleton / "alpha.py").write_text(
        'def add(a, b):\n    raise NotImplementedError("Week 2 Day 1 Task 1 (book/src/gamma.md): add")\n')
    (skeleton / "beta.py").write_text(
        'def twice(x):\n    raise NotImplementedError("Week 1 Day 2 Task 7 (book/src/alpha.md): twice")\n')
    problems = book_check.skeleton_problems(root)
    assert any("src/tiny_llm/alpha.py:2" in p and "'alpha'" in p for p in problems), problems  # not 2.1's module
    assert any("src/tiny_llm/beta.py:2" in p and "book/src/beta.md" in p for p in problems), problems  # wrong chapter
    assert any("Task 7" in p for p in problems), problems  # no such task


# ---------------------------------------------------------------- compare

def test_every_days_compare_workload_is_known():
    from scripts.compare import WORKLOADS
    from course.course_map import DAYS

    assert all(day.compare in WORKLOADS + ("",) for day in DAYS)


def test_first_difference():
    from scripts.compare import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_compare_says_what_is_missing_then_matches_the_reference(tmp_path):
    from maint.check_days import fill_day, make_workspace, skeleton_files
    from course.course_map import DAYS

    day = next((d for d in DAYS if d.compare == "model" and (REPO_ROOT / d.test_file).exists()), None)
    if day is None:
        pytest.skip("no model-level day yet")
    make_workspace(tmp_path)
    fill_day(tmp_path, skeleton_files(None), day)
    command = ["--week", str(day.week), "--day", str(day.day), "--max-tokens", "3", "--repeat", "1",
               "--prompt", "Hello"]
    done = run_tool(tmp_path, "scripts.compare", *command)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "matches the reference" in done.stdout and "largest logit difference" in done.stdout
    # The untouched skeleton: compare takes every task from the reference and says so; with --strict
    # it names the missing piece and the chapter.
    shutil.rmtree(tmp_path / "src" / "tiny_llm")
    shutil.copytree(REPO_ROOT / "src" / "tiny_llm", tmp_path / "src" / "tiny_llm")
    done = run_tool(tmp_path, "scripts.compare", *command)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"using the reference for: Week {day.week} Day {day.day} " in done.stdout
    done = run_tool(tmp_path, "scripts.compare", *command, "--strict")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not implemented yet" in done.stdout and "book/src/" in done.stdout
    # A day without a model-level run points to its tests.
    plain = next(d for d in DAYS if not d.compare)
    done = run_tool(tmp_path, "scripts.compare", "--week", str(plain.week), "--day", str(plain.day))
    assert done.returncode == 0 and f"pdm run test --week {plain.week} --day {plain.day}" in done.stdout


# ---------------------------------------------------------------- the grader against a dishonest student (issues 11, 24)

ATTACKS = REPO_ROOT / "tests" / "attacks"
# Every attack fixture laid over the skeleton (tests/attacks/README.md): the sandbox, not a scan, stops each.
ATTACKS_LAID_OVER = sorted(p.name for p in ATTACKS.iterdir() if p.is_dir())
# attack -> the day it is graded on, where that is not day 1.1 (it scores what the untouched skeleton scores: 0)
ATTACK_DAYS = {"lying_eq": (2, 2), "fake_float64": (2, 2), "lying_class": (2, 2), "approx_liar": (2, 2),
               "oracle_writes": (1, 5),
               "fake_private_state": (2, 2), "deep_result": (2, 2), "raising_dunders": (2, 2),
               "lying_exception": (2, 2)}
# "sleep" sleeps 2 s in every task: graded with a 3 s per-test limit and an 8 s day cap (by hand, not 3x its
# recorded honest time plus 60 s, which is what `day_cap` is tested for below), each is cut in seconds, not minutes.
QUICK_CAP = ["--timeout", "3", "--day-budget", "8"]
ATTACK_ARGS = {"memory": ["--memory-mb", "2560"], "sleep": QUICK_CAP, "hang": QUICK_CAP}
# attack -> the command line of the processes it starts, to outlive the grade (none may be left after it). Each test
# looks for its own attack's only: another attack's may be alive in a grade running beside it (pytest-xdist).
MARKERS = {"zombie_parent": "sleep 4242", "fork_bomb": "sleep 4243", "outlives_day": "sleep 4244"}


def _reference_links(submission: Path) -> None:
    """Day 1.1's modules as symbolic links to the reference's files (the grader reads as root)."""
    for module in ("basics", "attention"):
        target = submission / "src" / "tiny_llm" / f"{module}.py"
        target.unlink()
        target.symlink_to(REPO_ROOT / "src_ref" / "tiny_llm_ref" / f"{module}.py")


def _hidden_test_link(submission: Path) -> None:
    """A module linked to a hidden test file of the grader's: its text must not come back in the report."""
    hidden = submission.parent / "hidden_tests.py"
    hidden.write_text('SECRET = "hidden-31"\nraise AssertionError(SECRET)\n')
    target = submission / "src" / "tiny_llm" / "attention.py"
    target.unlink()
    target.symlink_to(hidden)


def _hard_link(submission: Path) -> None:
    """The reference's module, hard-linked (a second name of one file: it could be anything of the grader's)."""
    target = submission / "src" / "tiny_llm" / "basics.py"
    target.unlink()
    shutil.copyfile(REPO_ROOT / "src_ref" / "tiny_llm_ref" / "basics.py", submission / "copy.txt")
    import os

    os.link(submission / "copy.txt", target)


def _fifo(submission: Path) -> None:
    """A FIFO where a module should be: reading it would block the grader for ever."""
    import os

    target = submission / "src" / "tiny_llm" / "attention.py"
    target.unlink()
    os.mkfifo(target)


def _directory(submission: Path) -> None:
    """A directory (a package holding the reference's code) where a module should be."""
    target = submission / "src" / "tiny_llm" / "basics.py"
    target.unlink()
    target.mkdir()
    shutil.copyfile(REPO_ROOT / "src_ref" / "tiny_llm_ref" / "basics.py", target / "__init__.py")


def _huge(submission: Path) -> None:
    """The reference's module behind 2 GiB of nothing (a sparse file): the grader must not read it all."""
    target = submission / "src" / "tiny_llm" / "basics.py"
    target.write_bytes(b"")
    with open(target, "r+b") as f:
        f.truncate(2 << 30)
        f.seek(0, 2)
        f.write(b"\n" + (REPO_ROOT / "src_ref" / "tiny_llm_ref" / "basics.py").read_bytes())


def _linked_package(submission: Path) -> None:
    """The whole package folder a link to the reference's."""
    shutil.rmtree(submission / "src" / "tiny_llm")
    (submission / "src" / "tiny_llm").symlink_to(REPO_ROOT / "src_ref" / "tiny_llm_ref", target_is_directory=True)


# Attacks git cannot hold as they must be (a link into this machine's repository, a FIFO, a sparse file): built
# over the skeleton at run time. Each scores as the skeleton, with a note naming the file.
# Each is refused before anything reads it, so two on different modules share one grade (basics.py's tasks score
# on their own: a module read after all would show): the pairs below, "+"-joined.
BUILT_ATTACKS = {"reference_links": _reference_links, "hidden_test_link": _hidden_test_link, "hard_link": _hard_link,
                 "fifo": _fifo, "directory": _directory, "huge": _huge, "linked_package": _linked_package}
BUILT_TARGETS = {"reference_links": ("src/tiny_llm/basics.py", "src/tiny_llm/attention.py"),
                 "hidden_test_link": ("src/tiny_llm/attention.py",), "hard_link": ("src/tiny_llm/basics.py",),
                 "fifo": ("src/tiny_llm/attention.py",), "directory": ("src/tiny_llm/basics.py",),
                 "huge": ("src/tiny_llm/basics.py",), "linked_package": ("src/tiny_llm",)}
BUILT_GRADES = ["reference_links", "hard_link+hidden_test_link", "directory+fifo", "huge", "linked_package"]


# A fixture file that starts with this line is the tail of a skeleton module: the submission's file is that module,
# with every task's `raise NotImplementedError("...")` replaced by the statement named (if one is), then the tail.
# So an attack on one day's tasks does not carry a whole copy of the skeleton's module.
LAID_OVER = re.compile(r"# Laid over the skeleton's \S+\.py(?:: every task's raise becomes `([^`]+)`)?\.\n")
TASK_RAISE = re.compile(r'raise NotImplementedError\(\s*"[^"]*"\s*\)')


def attack_submission(tmp_path: Path, attack: str) -> Path:
    """The untouched skeleton with the attack's files laid over it (or its builders run on it: "a+b" runs two)."""
    submission = tmp_path / "submission"
    shutil.copytree(REPO_ROOT / "src" / "tiny_llm", submission / "src" / "tiny_llm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if all(part in BUILT_ATTACKS for part in attack.split("+")):
        for part in attack.split("+"):
            BUILT_ATTACKS[part](submission)
        return submission
    for path in sorted(p for p in (ATTACKS / attack).rglob("*") if p.is_file()):
        target = submission / path.relative_to(ATTACKS / attack)
        target.parent.mkdir(parents=True, exist_ok=True)
        data = path.read_bytes()  # some are not text (binary junk)
        over = LAID_OVER.match(data.decode(errors="replace"))
        if over is not None:
            skeleton = target.read_text()
            armed = TASK_RAISE.sub(over[1], skeleton) if over[1] else skeleton
            assert not over[1] or not TASK_RAISE.search(armed), f"{path}: a task still raises: the attack is not armed"
            data = (armed + "\n\n").encode() + data
        target.write_bytes(data)
    return submission


def leftover_processes(attack: str) -> list[str]:
    """The processes `attack` starts that are still alive (read from /proc)."""
    import os

    if attack not in MARKERS:
        return []
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if command == MARKERS[attack]:
            found.append(f"{entry}: {command}")
    return found


def grade_submission(tmp_path: Path, submission: Path, *args: str, day: tuple[int, int] = (1, 1)
                     ) -> tuple[subprocess.CompletedProcess, dict, float]:
    """Grade one day of `submission` (1.1 unless told), with the grader's temporary files in a folder of their own."""
    import os
    import time

    report = tmp_path / "results.json"
    scratch = tmp_path / "grader-tmp"
    scratch.mkdir(exist_ok=True)
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "scripts.grade", "--src", str(submission), "--json", str(report),
                           "--week", str(day[0]), "--day", str(day[1]), *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TMPDIR": str(scratch)})
    seconds = time.monotonic() - began
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(report.read_text())
    assert gradescope_problems(results) == []
    # MLX's CPU backend caches the kernels it compiles (mlx-lm's oracle compiles its SwiGLU) in $TMPDIR/mlx: a
    # cache the next run reuses, not something the grader or the submission left.
    assert [p for p in scratch.iterdir() if p.name != "mlx"] == [], "the grader left files behind"
    return done, results, seconds


def repository_state() -> list[str]:
    """Every file git sees changed, untracked or ignored, less the caches the test processes themselves write (a
    module's bytecode, Hypothesis's constants): a test beside this one (pytest-xdist) may write them any time. The
    sandboxed submission sees no repository at all (test_the_sandbox_confines_the_submission)."""
    listed = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=REPO_ROOT,
                            capture_output=True, text=True).stdout.splitlines()
    return [line for line in listed if "__pycache__/" not in line and not line[3:].startswith(".hypothesis/")]


def test_every_attack_fixture_is_described_and_never_collected():
    described = (ATTACKS / "README.md").read_text()
    assert [name for name in ATTACKS_LAID_OVER + list(BUILT_ATTACKS) if f"`{name}`" not in described] == []
    assert set(ATTACK_DAYS) <= set(ATTACKS_LAID_OVER)
    assert not list(ATTACKS.rglob("test_*.py")) and not list(ATTACKS.rglob("*_test.py"))
    assert not list(ATTACKS.rglob("conftest.py"))


@pytest.mark.skipif(sandbox.bwrap_path() is None, reason="the sandbox needs bubblewrap (Linux): CI installs it")
@pytest.mark.parametrize("attack", sorted(set(ATTACKS_LAID_OVER) - set(ATTACK_DAYS)) + BUILT_GRADES)
def test_an_attack_scores_no_more_than_the_skeleton_and_changes_nothing(tmp_path, attack):
    before = repository_state()
    done, results, seconds = grade_submission(tmp_path, attack_submission(tmp_path, attack),
                                              *ATTACK_ARGS.get(attack, []))
    assert results["score"] == 0 and results["extra_data"]["max_score"] == 10, done.stdout
    assert results["extra_data"]["sandboxed"] is True
    assert repository_state() == before, "the attack changed the repository"
    assert leftover_processes(attack) == [], "the attack left processes behind"
    extra = {p.relative_to(ATTACKS / attack).as_posix() for p in (ATTACKS / attack).rglob("*.py")
             if p.stem not in grade.course_modules()}  # listed as not graded, never run (scan_crash's too)
    assert extra <= set(results["extra_data"]["ignored_files"]), results["extra_data"]["ignored_files"]
    if attack in ("sleep", "hang"):
        assert "time budget" in done.stdout
    # What the submission wrote reaches the terminal and the report escaped: no table drawn over, no line rewritten.
    assert "\x1b" not in done.stdout and "\x1b" not in results["output"]
    assert all("\x1b" not in t["output"] and "\r" not in t["output"] for t in results["tests"])
    if attack == "ansi_table":
        assert "\\x1b[2J" in done.stdout, "the escape is shown as text"
    if attack == "carriage_return":
        # Escaped once (course.remote.printable), where the text first reaches the judge.
        assert "\\r   1    1    1" in done.stdout, "the carriage return is shown as text"
    if attack in BUILT_GRADES:
        refused = [f"{target}: not read (" for part in attack.split("+") for target in BUILT_TARGETS[part]]
        assert all(note in done.stdout for note in refused), (refused, done.stdout)  # each file, by name
        assert "hidden-31" not in done.stdout + json.dumps(results), "a hidden file's text came back"


@pytest.mark.skipif(sandbox.bwrap_path() is None, reason="the sandbox needs bubblewrap (Linux): CI installs it")
@pytest.mark.parametrize("attack", sorted(ATTACK_DAYS))
def test_an_attack_on_the_pipe_scores_what_the_skeleton_scores(tmp_path, attack):
    """Results that lie, oracles written through a handle, a fake's private state, results too deep or too large,
    objects and exceptions that raise, lie or end the process: the day scores 0, as the untouched skeleton."""
    from course.course_map import find_day

    before = repository_state()
    week, day = ATTACK_DAYS[attack]
    done, results, _ = grade_submission(tmp_path, attack_submission(tmp_path, attack), day=(week, day))
    assert results["score"] == 0, done.stdout
    assert results["extra_data"]["max_score"] == sum(find_day(week, day).points.values())
    assert results["extra_data"]["sandboxed"] is True
    assert repository_state() == before, "the attack changed the repository"
    assert leftover_processes(attack) == [], "the attack left processes behind"
    assert "\x1b" not in done.stdout and "\x1b" not in json.dumps(results, ensure_ascii=False)


def test_grade_untouched_skeleton_scores_zero(tmp_path):
    done, results, _ = grade_submission(tmp_path, REPO_ROOT / "src" / "tiny_llm")
    assert results["score"] == 0
    assert all("not implemented yet" in t["output"] for t in results["tests"])


@pytest.mark.skipif(sandbox.bwrap_path() is None, reason="the sandbox needs bubblewrap (Linux): CI installs it")
def test_the_sandbox_confines_the_submission(tmp_path):
    """What the worker can see and do, asked from inside: nobody, no network, no answers, no grader, own /proc."""
    import os

    from course.sandbox import Worker, prepare_root

    package = tmp_path / "package"
    shutil.copytree(REPO_ROOT / "src_ref" / "tiny_llm_ref", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "probe.py").write_text(textwrap.dedent('''
        import os, socket

        def look(repo):
            found = {"uid": os.getuid(), "gid": os.getgid(), "pids": sorted(p for p in os.listdir("/proc") if p.isdigit())}
            # The venv may live inside the repository (pdm's .venv): only it is mounted, never the course's files.
            found["repo"] = any(os.path.exists(os.path.join(repo, name)) for name in ("tests", "src_ref", "course", "src"))
            for name, path in (("grade", "/grade/src/tiny_llm/x"), ("scratch", "/tmp/x")):
                try:
                    open(path, "w").close()
                    found[name] = True
                except OSError:
                    found[name] = False
            try:
                socket.create_connection(("1.1.1.1", 53), timeout=2)
                found["network"] = True
            except OSError:
                found["network"] = False
            with open("/grade/src_ref/tiny_llm_ref/basics.py") as f:
                found["reference"] = f.read()
            return found

        def fork_bomb(hide):
            """Forks 600 sleepers, counted in the scratch; `hide`: from a thread of a process whose main thread
            exited (state Z, which a walk of /proc that skips Z never looks below)."""
            import ctypes, threading, time

            def spawn():
                for _ in range(600):
                    try:
                        if os.fork() == 0:
                            time.sleep(30)
                            os._exit(0)
                    except OSError:  # refused: the limit on processes
                        continue
                    with open("/tmp/forked", "a") as f:
                        f.write("x")
                open("/tmp/spawned", "w").close()

            if not hide:
                spawn()
            elif os.fork() == 0:
                threading.Thread(target=spawn).start()
                ctypes.CDLL(None).syscall(60, 0)  # SYS_exit (x86-64): the main thread alone ends
            # Until the spawner (maybe another process's thread) is done, then a second for the watchdog, which
            # looks every 0.1 s where no cgroup refuses the forks.
            deadline = time.monotonic() + 60
            while not os.path.exists("/tmp/spawned") and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1)
            with open("/tmp/forked") as f:
                return len(f.read())
    '''))
    root = prepare_root(tmp_path / "root", package, REPO_ROOT / "src_ref" / "tiny_llm_ref", REPO_ROOT / "course", 1, 1)
    worker = Worker(root, 1, 1, "day", cpu_seconds=60, memory_mb=None)
    try:
        seen = worker.endpoint.request("getattr", 0, "probe").look(str(REPO_ROOT))
    finally:
        worker.stop()
    for hide in (False, True):
        worker = Worker(root, 1, 1, "day", cpu_seconds=60, memory_mb=None)
        try:  # a cgroup refuses the forks past its pids.max, RLIMIT_NPROC past a user's share; root has neither
            forked = worker.endpoint.request("getattr", 0, "probe").fork_bomb(hide)
            assert forked < sandbox.MAX_TASKS or (worker.group is None and os.getuid() == 0), forked
        finally:
            worker.stop()
    assert (seen["uid"], seen["gid"]) == (65534, 65534)
    assert len(seen["pids"]) <= 3, seen["pids"]  # its own PID namespace: bwrap's init and the worker
    assert seen["repo"] is False and seen["grade"] is False and seen["scratch"] is True
    assert seen["network"] is False
    assert "not available while this day is graded" in seen["reference"]
    assert "x_max = mx.max(x, axis=axis, keepdims=True)" not in seen["reference"], "day 1.1's softmax answer is stripped"


@pytest.fixture
def probe_worker(tmp_path):
    """A sandboxed worker of day 1.1 whose package holds `probe.py`, written by the test: (worker, probe)."""
    from course.sandbox import Worker, prepare_root

    def start(source: str):
        package = tmp_path / f"package{len(started)}"
        shutil.copytree(REPO_ROOT / "src_ref" / "tiny_llm_ref", package, ignore=shutil.ignore_patterns("__pycache__"))
        (package / "probe.py").write_text(textwrap.dedent(source))
        root = prepare_root(tmp_path / f"root{len(started)}", package, REPO_ROOT / "src_ref" / "tiny_llm_ref",
                            REPO_ROOT / "course", 1, 1)
        started.append(Worker(root, 1, 1, "day", cpu_seconds=60, memory_mb=None))
        return started[-1].endpoint.request("getattr", 0, "probe")

    started = []
    yield start
    for worker in started:
        worker.stop()


def test_the_pipe_refuses_what_would_reach_past_it(probe_worker):
    """Calls go one way (course/remote.py): the judge never hands the submission an object of its own (a test's fake,
    a lambda, a reference object it built: refused before anything is sent), and the actor cannot call the judge
    (a request from it breaks the pipe; nothing of the judge's runs). Nor can it seed the test process's random
    numbers or send a message too large to read; its exceptions arrive as stand-ins of their own class."""
    import mlx.core as mx

    from course.remote import MAX_MESSAGE, RemoteGone
    from tiny_llm_ref.sequence import Sequence

    probe = probe_worker('''
        import gc, json, os, struct

        class Sneaky(Exception):
            pass

        def endpoint():
            return next(o for o in gc.get_objects() if type(o).__name__ == "Endpoint")

        def write(header, *sizes):
            header = json.dumps({**header, "sizes": sizes}).encode()
            os.write(endpoint().write_fd, struct.pack("<Q", len(header)) + header)

        def seed():
            endpoint().pending_seed = 1234  # would ask the test's process to seed with it
            return 1

        def huge():
            write({"k": "ok", "v": None}, 1 << 40)

        def sneaky():
            raise Sneaky("mine")

        def identity(value):
            return value
    ''')
    for judges_own in (lambda: 1, Sequence("s", [1, 2, 3]), type("Fake", (), {})(), print, mx):
        with pytest.raises(TypeError, match="an object of the grader's"):
            probe.identity(judges_own)
    halves = probe.identity(mx.array([1.5, -2.25], dtype=mx.bfloat16))  # data both ways, numpy has no bfloat16
    assert halves.dtype == mx.bfloat16 and halves.tolist() == [1.5, -2.25]
    mx.random.seed(5)
    expected = mx.random.uniform().item()
    mx.random.seed(5)
    probe.seed()
    assert mx.random.uniform().item() == expected, "submitted code seeded the test's random numbers"
    with pytest.raises(Exception) as raised:
        probe.sneaky()
    assert type(raised.value).__name__ == "Sneaky" and isinstance(raised.value, Exception)
    with pytest.raises(probe.Sneaky):  # its own class is caught by name, as in-process
        probe.sneaky()
    with pytest.raises(RemoteGone, match=f"more than {MAX_MESSAGE}"):
        probe.huge()


def test_the_actor_cannot_call_the_judge(probe_worker):
    """A request written by the actor on its own pipe ends the grade's use of that worker: the judge serves nothing,
    whether the request comes during a call or while the judge asks nothing (a thread of the submission's)."""
    from course.remote import RemoteGone
    from tests.serve_fakes import wait_until

    source = '''
        import gc, json, os, struct, sys, threading, time
        from traceback import walk_stack

        def call_back():
            ends = next(o for o in gc.get_objects() if type(o).__name__ == "Endpoint")
            header = json.dumps({"k": "req", "op": "getattr", "h": 0, "a": {"$": "list", "v": ["__class__"]},
                                 "sizes": []}).encode()
            os.write(ends.write_fd, struct.pack("<Q", len(header)) + header)
            return 1

        def call_back_later():
            """Calls back once this call's answer is sent, while the worker waits for the judge's next request."""
            main = threading.main_thread().ident

            def when_idle():
                while "receive_message" not in [f.f_code.co_name for f, _ in walk_stack(sys._current_frames()[main])]:
                    time.sleep(0.01)
                call_back()

            threading.Thread(target=when_idle).start()
            return 1
    '''
    with pytest.raises(RemoteGone, match="never calls the judge"):
        probe_worker(source).call_back()
    probe = probe_worker(source)
    assert probe.call_back_later() == 1
    assert wait_until(lambda: probe._endpoint.broken), "a request written between calls went unseen"
    with pytest.raises(RemoteGone, match="wrote unasked"):
        probe.call_back()


def test_only_data_crosses_to_the_judge_and_objects_are_opaque(probe_worker):
    """What the submission returns arrives as the judge's own plain types, read with the base types' methods (a
    lying `__eq__`, `__iter__` or `__class__` stays behind), and a reference data class as the judge's own when it
    holds only data; anything else is a handle the judge never asks to compare, hash, iterate or convert; a failure
    carries the student's frames, control characters escaped."""
    import numpy as np

    from tiny_llm_ref.distributed_engine import PlannedChunk

    probe = probe_worker('''
        import collections
        import numpy as np

        class Liar:
            def __eq__(self, other):
                return True
            def __hash__(self):
                return 0
            def __bool__(self):
                return True
            def __len__(self):
                return 1
            def __iter__(self):
                return iter([1])
            def __float__(self):
                return 0.5
            @property
            def __class__(self):
                return float

        class LyingList(list):
            def __eq__(self, other):
                return True
            def __iter__(self):
                return iter([9, 9])

        class LyingFloat(float):
            def __eq__(self, other):
                return True
            __hash__ = float.__hash__

        def values():
            return (LyingList([1, 2]), LyingFloat(0.25), np.float64(1.5), np.int32(3), collections.deque([4, 5]),
                    collections.OrderedDict(a=1), {6}, True)

        def liar():
            return Liar()

        def chunks():
            from tiny_llm_ref.distributed_engine import BlockTable, PlannedChunk

            return PlannedChunk(BlockTable([1]), 0, 1, [5], True), PlannedChunk(BlockTable([Liar()]), 0, 1, [5], True)

        THE_ONE = Liar()

        def same():
            return THE_ONE

        def crash():
            table = []
            return table[3]  # the line a student would look for

        def escape():
            raise ValueError("\x1b[2J\x1b[Hall passed")
    ''')
    lying, number, scalar, small, queue, ordered, members, flag = probe.values()
    assert (type(lying), lying) == (list, [1, 2]) and lying != [9, 9]
    assert (type(number), number) == (float, 0.25) and number != 0.5
    assert (type(scalar), scalar, type(small), small) == (float, 1.5, int, 3)
    assert (type(queue), queue, type(ordered), ordered, members, flag) == (list, [4, 5], dict, {"a": 1}, {6}, True)
    handle = probe.liar()
    assert type(handle) is not float and "object of the submission" in repr(handle)
    data, holding = probe.chunks()
    assert type(data) is PlannedChunk and (data.seq.block_table, data.token_ids, data.samples) == ([1], [5], True)
    assert type(holding) is not PlannedChunk and "PlannedChunk" in repr(holding), "a data class holding an object"
    for use in (lambda: handle == 1.0, lambda: 1.0 == handle, lambda: handle != 1.0, lambda: hash(handle),
                lambda: bool(handle), lambda: len(handle), lambda: list(handle), lambda: 1 in handle,
                lambda: float(handle), lambda: int(handle), lambda: handle + 1, lambda: 1 - handle, lambda: -handle,
                lambda: handle < 1, lambda: handle == pytest.approx(0.5), lambda: pytest.approx(0.5) == handle,
                lambda: isinstance(1.0, handle), lambda: np.asarray(handle, dtype=float)):
        with pytest.raises(TypeError):
            use()
    assert not isinstance(handle, float) and handle is not probe.liar()  # a new Liar each call
    assert probe.same() is probe.same(), "the same object of the submission is the same handle"
    with pytest.raises(IndexError) as raised:
        probe.crash()
    note = "\n".join(getattr(raised.value, "__notes__", []))
    assert "probe.py" in note and "return table[3]" in note and "crash" in note, note
    assert 'File "src/tiny_llm/probe.py", line' in note, "the student's own path, as `pdm run test` shows it"
    assert "remote.py" not in note and "sandbox.py" not in note, note
    with pytest.raises(ValueError) as raised:
        probe.escape()
    assert "\x1b" not in str(raised.value) and "\\x1b[2J" in str(raised.value)


def test_a_trusted_model_crosses_as_the_workers_copy(probe_worker):
    """A test's mlx-lm model handed to submitted code, float or quantized: the worker gets its own copy, built from
    the class, arguments, quantized layers and weights; whatever the submission does to it (attributes set, items
    assigned, mutating methods of a module or its containers) the judge's oracle computes what it computed before,
    and the copy computes what the oracle does."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import qwen2 as mlx_qwen2

    probe = probe_worker('''
        import mlx.core as mx

        def logits(model, inputs):
            return model(inputs)

        def tamper(model):
            zeros = mx.zeros_like(model.model.norm.weight)
            attempts = {
                "setattr": lambda: setattr(model.model.norm, "weight", zeros),
                "args": lambda: setattr(model.args, "rms_norm_eps", 1e30),
                "item": lambda: model.model.norm.__setitem__("weight", zeros),
                "update": lambda: model.update({"model": {"norm": {"weight": zeros}}}),
                "apply": lambda: model.apply(lambda a: a * 0),
                "train": lambda: model.train(True),
                "layers": lambda: model.model.layers.pop(),
            }
            for attempt in attempts.values():
                attempt()
            return len(attempts)
    ''')
    args = mlx_qwen2.ModelArgs(model_type="qwen2", hidden_size=32, num_hidden_layers=2, intermediate_size=48,
                               num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=64, num_key_value_heads=2)
    mx.random.seed(0)
    model = mlx_qwen2.Model(args)
    inputs = mx.array([[1, 2, 3]])
    quantized = mlx_qwen2.Model(args)
    quantized.update(model.parameters())
    nn.quantize(quantized, group_size=32, bits=4, class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % 32 == 0)
    for oracle in (model, quantized):
        before, training = oracle(inputs), oracle.training
        assert mx.array_equal(probe.logits(oracle, inputs), before).item(), "the worker's copy computes otherwise"
        assert probe.tamper(oracle) == 7
        assert mx.array_equal(oracle(inputs), before).item() and len(oracle.model.layers) == 2
        assert oracle.args.rms_norm_eps == 1e-6 and "norm" in oracle.model and oracle.training is training


def test_points_add_up_exactly_for_every_day():
    """Every day's per-test points add up to exactly its points, in the report's own decimal numbers."""
    from fractions import Fraction

    from course.course_map import DAYS
    from course.isolated_pytest import CaseResult, RunResult, child_env, pytest_command
    from scripts.grade import gradescope_results, score_day

    days = [d for d in DAYS if (REPO_ROOT / d.test_file).exists()]
    listed = subprocess.run(pytest_command(["-q", "--collect-only", *[d.test_file for d in days]]), cwd=REPO_ROOT,
                            env=child_env("ref", ("src_ref", ".")), capture_output=True, text=True, timeout=600)
    assert listed.returncode == 0, listed.stdout[-3000:]
    expected = {d.test_file: [line for line in listed.stdout.splitlines() if line.startswith(d.test_file + "::")]
                for d in days}
    reports = []
    for day in days:
        run = RunResult(day.test_file, {n: CaseResult(n, "passed") for n in expected[day.test_file]},
                        expected=expected[day.test_file])
        reports.append(score_day(day, run))
    results = gradescope_results(reports, "", 0.0, {})
    for day in days:
        tag = f"day {day.week}.{day.day}"
        tests = [t for t in results["tests"] if tag in t["tags"]]
        assert sum(Fraction(str(t["max_score"])) for t in tests) == sum(day.points.values()), tag
        assert sum(Fraction(str(t["score"])) for t in tests) == sum(day.points.values()), tag
    total = sum(sum(d.points.values()) for d in days)
    assert results["score"] == results["extra_data"]["max_score"] == total


def test_a_days_cap_is_flat_three_times_its_honest_run_plus_one_tests_limit(monkeypatch):
    """No scaling to the load: CAP_FACTOR x the recorded time plus --timeout; --day-budget replaces it; a day never
    recorded, or a run that records new times (maint/record_times.py), gets the default."""
    import argparse

    from course.course_map import find_day
    from maint import record_times

    times = {"week1-day1": 4.0}
    args = argparse.Namespace(day_budget=None, timeout=60.0)
    assert grade.day_cap(find_day(1, 1), args, times) == grade.CAP_FACTOR * 4.0 + 60.0
    quick = argparse.Namespace(day_budget=None, timeout=3.0)
    assert grade.day_cap(find_day(1, 1), quick, times) == grade.CAP_FACTOR * 4.0 + 60.0, "a short --timeout keeps 60 s"
    slow = argparse.Namespace(day_budget=None, timeout=90.0)
    assert grade.day_cap(find_day(1, 1), slow, times) == grade.CAP_FACTOR * 4.0 + 90.0
    assert grade.day_cap(find_day(1, 2), args, times) == grade.DEFAULT_DAY_CAP, "a day never recorded"
    assert grade.day_cap(find_day(1, 1), argparse.Namespace(day_budget=30.0, timeout=60.0), times) == 30.0
    recording = grade.build_parser().parse_args(
        record_times.grade_arguments(record_times.build_parser().parse_args(["--week", "1", "--day", "1"]), Path("r")))
    assert recording.week == 1 and recording.day == [1] and recording.src.endswith("tiny_llm_ref")
    assert grade.day_cap(find_day(1, 1), recording, times) == grade.DEFAULT_DAY_CAP


@pytest.mark.skipif(sandbox.bwrap_path() is None, reason="the sandbox needs bubblewrap (Linux): CI installs it")
@pytest.mark.alone  # its load would push a test beside it past that test's time limit
def test_an_honest_run_on_a_loaded_machine_gets_full_marks(tmp_path):
    """Ten busy processes beside the grader (load 10 on two cores): the flat cap (3x the honest run plus one test's
    limit) still fits the reference submitted as a student's work. The busy processes
    inherit this process's niceness: under `nice` on a shared machine they load the grader as load 10 would,
    and weigh little on other people's work."""
    spin = "while True:\n    pass\n"
    # Each in a session of its own: with autogroup scheduling a session shares one group's time, as the grader's
    # test process (a session of its own) would against all ten in one.
    busy = [subprocess.Popen([sys.executable, "-c", spin], start_new_session=True) for _ in range(10)]
    try:
        honest = tmp_path / "honest"
        shutil.copytree(REPO_ROOT / "src_ref" / "tiny_llm_ref", honest, ignore=shutil.ignore_patterns("__pycache__"))
        done, results, _ = grade_submission(tmp_path, honest)
        assert all(process.poll() is None for process in busy), "the load ended early: this test checked nothing"
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert results["score"] == results["extra_data"]["max_score"] == 10, done.stdout


@pytest.mark.skipif(sandbox.bwrap_path() is None, reason="the sandbox needs bubblewrap (Linux): CI installs it")
def test_the_gradescope_autograder_grades_a_submission_folder(tmp_path):
    """`make-autograder DIR` writes setup.sh, run_autograder and the course; run_autograder, with its places moved
    by environment variables, grades a folder of modules (day 1.1 solved) into a valid results.json."""
    import os

    autograder = tmp_path / "autograder"
    done = subprocess.run([sys.executable, "-m", "scripts.autograder", str(autograder)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for script in ("setup.sh", "run_autograder"):
        assert os.access(autograder / script, os.X_OK), script
        assert (autograder / script).read_bytes() == (REPO_ROOT / "scripts" / "autograder" / script).read_bytes()
    course = autograder / "course"
    assert (course / "scripts" / "grade.py").exists() and (course / "tests" / "test_week_1_day_1.py").exists()
    from maint.make_skeleton import generate

    skeleton = generate(REPO_ROOT / "src_ref" / "tiny_llm_ref")
    assert {p.name: p.read_text() for p in (course / "src" / "tiny_llm").glob("*.py")} == skeleton, \
        "the skeleton written from the reference, never a student's work"
    submission = tmp_path / "submission"  # as a student uploads it: the modules at the top
    submission.mkdir()
    for module in ("basics", "attention"):
        shutil.copyfile(REPO_ROOT / "src_ref" / "tiny_llm_ref" / f"{module}.py", submission / f"{module}.py")
    results = tmp_path / "results" / "results.json"
    env = {**os.environ, "TINY_LLM_AUTOGRADER_COURSE": str(course), "TINY_LLM_AUTOGRADER_SUBMISSION": str(submission),
           "TINY_LLM_AUTOGRADER_RESULTS": str(results), "TINY_LLM_AUTOGRADER_PYTHON": sys.executable}
    done = subprocess.run(["bash", str(autograder / "run_autograder"), "--week", "1", "--day", "1"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(results.read_text())
    assert gradescope_problems(report) == []
    assert report["score"] == report["extra_data"]["max_score"] == 10, done.stdout


def test_grade_refuses_without_the_sandbox_where_it_is_required(tmp_path):
    """With --json (a grade that counts) and no bubblewrap: one line, exit 2, nothing graded; --no-require-sandbox
    grades anyway, with the warning."""
    import os

    env = {**os.environ, "TINY_LLM_UNSANDBOXED": "forced off by the test"}
    command = [sys.executable, "-m", "scripts.grade", "--src", str(REPO_ROOT / "src" / "tiny_llm"), "--week", "1",
               "--day", "1", "--json", str(tmp_path / "results.json")]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2 and not (tmp_path / "results.json").exists()
    assert done.stderr.strip().count("\n") == 0 and "refused" in done.stderr, done.stderr
    done = subprocess.run(command + ["--no-require-sandbox"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0 and "UNSANDBOXED" in done.stderr, done.stdout + done.stderr
    assert json.loads((tmp_path / "results.json").read_text())["extra_data"]["sandboxed"] is False


def test_staging_reads_regular_files_only(tmp_path):
    """Each kind of file the grader must not open on the submission's behalf is refused, with a note, and the module
    counts as missing; an honest module next to it is staged."""
    for attack, build in BUILT_ATTACKS.items():
        submission = attack_submission(tmp_path / attack, attack)
        root = submission
        staged = grade.stage_submission(root, tmp_path / attack / "package")
        assert staged.refused and all("not read (" in note for note in staged.refused), (attack, staged.refused)
        assert "basics" not in staged.modules or attack in ("hidden_test_link", "fifo"), (attack, staged.modules)
        assert "attention" not in staged.modules or attack not in ("reference_links", "hidden_test_link", "fifo")
        assert all(b"hidden-31" not in path.read_bytes() for path in (tmp_path / attack / "package").iterdir())


def test_record_times_keeps_only_days_that_passed_every_test(tmp_path):
    """A day cut short by its budget (or failing) is not an honest run: recording its time would shrink the
    next budget until honest runs fail. maint/record_times.py reads each round's results.json."""
    from course.course_map import find_day
    from maint import record_times

    times_file = tmp_path / "times.json"
    times_file.write_text(json.dumps({"week1-day1": 5.0, "week1-day2": 7.0}))

    def report(day, outcome, seconds):
        case = grade.CaseScore(find_day(1, day), 1, "test_task_1_x", "t::test_task_1_x", outcome, "", 0, 1)
        return grade.DayReport(find_day(1, day), tests=[case], seconds=seconds)

    def results(*reports):  # one round's results.json, as the grader writes it
        return json.loads(json.dumps(grade.gradescope_results(list(reports), "", 0.0, {})))

    record_times.record([results(report(1, "passed", 3.0), report(2, "timed out", 2.0))], times_file)
    times = json.loads(times_file.read_text())
    assert times["week1-day1"] == 3.0, "a day that passed everything records its time"
    assert times["week1-day2"] == 7.0, "a day cut short keeps its earlier time"
    rounds = [results(report(1, "passed", 20.0), report(2, "passed", 4.0)),
              results(report(1, "passed", 26.0), report(2, "timed out", 9.0)),
              results(report(1, "passed", 23.0), report(2, "passed", 5.0))]
    record_times.record(rounds, times_file)  # --rounds 3: each day graded three times
    times = json.loads(times_file.read_text())
    assert times["week1-day1"] == 26.0, "several rounds: the slowest is recorded"
    assert times["week1-day2"] == 7.0, "a day cut short in one round of several records nothing"


def test_bench_grading_grades_the_chosen_solution_and_refuses_a_day_without_its_week(capsys):
    from maint import bench_grading

    assert bench_grading.SUBMISSIONS["student"].parts[-2:] == ("src", "tiny_llm")
    assert bench_grading.build_parser().parse_args(["--solution", "student"]).solution == "student"
    with pytest.raises(SystemExit) as exit_:
        bench_grading.main(["--day", "1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_a_tasks_sandbox_root_hides_that_tasks_answer_only(tmp_path):
    """The worker of Task N's tests (solution(..., task=N)) takes the day's other tasks from the reference, so its
    root holds them; Task N's own reference bodies are never there, and the day's root holds none of the day's."""
    from course.sandbox import prepare_root, task_root

    reference = REPO_ROOT / "src_ref" / "tiny_llm_ref"
    day_root = prepare_root(tmp_path / "sandbox-4.1", REPO_ROOT / "src" / "tiny_llm", reference, REPO_ROOT / "course",
                            4, 1)
    root = task_root(day_root, 4, 1, 2)
    assert root == tmp_path / "sandbox-4.1-task2" and task_root(day_root, 4, 1, 2) == root, "made once, beside the day's"
    hidden = 'raise NotImplementedError("not available while this day is graded")'
    day_copy = (day_root / "src_ref" / "tiny_llm_ref" / "speculative.py").read_text()
    task_copy = (root / "src_ref" / "tiny_llm_ref" / "speculative.py").read_text()
    assert "accepted.append(target_tokens[len(accepted)])" not in task_copy, "Task 2's answer is hidden from its worker"
    assert "self.scheduler.roll_back(seq, chunk.start + len(accepted))" in task_copy, "Task 5 is the reference's there"
    assert "self.scheduler.roll_back(seq, chunk.start + len(accepted))" not in day_copy and day_copy.count(hidden) >= 5
    assert [p.name for p in tmp_path.iterdir()].count("sandbox-4.1-task2") == 1 and len(list(tmp_path.iterdir())) == 2


def test_a_time_limit_never_fires_while_pytest_writes_a_report(tmp_path):
    """The judge runs once per day: a per-test limit that fired while pytest built a failure's report (slow on a loaded
    machine) stopped the whole process (INTERNALERROR), and every test after it went unrun. The clock now stops
    between a test's phases (course/pytest_events.py)."""
    from course.isolated_pytest import child_env, run_test_file

    (tmp_path / "conftest.py").write_text(textwrap.dedent('''
        import time
        import pytest

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(item, call):
            if call.when == "call" and call.excinfo is not None:
                time.sleep(1.5)  # a report slower than the test's limit, as on a loaded machine
            yield
    '''))
    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_fails():\n    time.sleep(0.5)\n    assert False\n\n"
                                           "def test_after():\n    pass\n")
    run = run_test_file("test_slow.py", tmp_path, child_env("ref", (str(REPO_ROOT),)), timeout=1)
    assert {nodeid: result.outcome for nodeid, result in run.results.items()} == {
        "test_slow.py::test_fails": "failed", "test_slow.py::test_after": "passed"}, run.results


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped interrupt, on purpose
def test_a_stop_python_drops_still_stops_the_judge_at_once(tmp_path):
    """A SIGTERM that lands while `subprocess` forks raises its KeyboardInterrupt inside a fork handler, where Python
    only prints it (CI saw a stopped grade carry on to the end and exit 0). The request is kept and the watch loop
    acts on it: the run stops at once instead of after its tests."""
    import signal
    import time

    from course import isolated_pytest

    class StoppedInAFinalizer:  # Python ignores an exception raised in __del__, as in a fork handler
        def __del__(self):
            isolated_pytest.stop_on_signal(signal.SIGTERM, None)

    (tmp_path / "test_sleeps.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(60)\n")
    StoppedInAFinalizer()
    try:
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            isolated_pytest.run_test_file("test_sleeps.py", tmp_path,
                                          isolated_pytest.child_env("ref", (str(REPO_ROOT),)))
        assert time.monotonic() - started < 10
    finally:
        isolated_pytest.STOP.clear()


def test_the_test_running_when_the_judge_dies_or_its_cap_ends_is_named(tmp_path):
    """Tests run in the order collected, so the first without a result line is the one that was running: when the
    process died (crashed), or when the day's cap stopped it (timeout); those after it were not run."""
    from course.isolated_pytest import child_env, run_test_file

    (tmp_path / "test_order.py").write_text("import os, time\n\ndef test_first():\n    pass\n\n"
                                            "def test_dies():\n    os._exit(3)\n\n"
                                            "def test_sleeps():\n    time.sleep(30)\n\ndef test_last():\n    pass\n")
    env = child_env("ref", (str(REPO_ROOT),))
    died = run_test_file("test_order.py", tmp_path, env, timeout=60)
    assert {n.split("::")[1]: r.outcome for n, r in died.results.items()} == {
        "test_first": "passed", "test_dies": "crashed", "test_sleeps": "not_run", "test_last": "not_run"}
    capped = run_test_file("test_order.py::test_first test_order.py::test_sleeps test_order.py::test_last".split(),
                           tmp_path, env, timeout=60, cap=1)
    assert capped.out_of_time and {n.split("::")[1]: r.outcome for n, r in capped.results.items()} == {
        "test_first": "passed", "test_sleeps": "timeout", "test_last": "not_run"}
