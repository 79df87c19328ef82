"""Grade the student package: per week, day and task, a readable table and a machine-readable report.

    pdm run grade                          # every day that has tests, against src/tiny_llm
    pdm run grade --week 2 --day 7         # one day: the score the day's chapter points to
    pdm run grade --week 2 --day 6 7       # some days of a week
    pdm run grade --json results.json      # also write Gradescope's results.json
    pdm run grade --src path/to/submission # grade a submission (a directory of module files)
    pdm run grade --solution ref           # grade the reference (every task at full points)

What is graded: only the course's module files (the modules course/course_map.py lists for its days),
copied from the submission into a package of their own; every other file of the submission is reported
and ignored. The integrity scan (course/integrity.py) lists what it finds, for the instructor: it
decides nothing.

How: each day's test file runs in a trusted pytest process (course/isolated_pytest.py) that never imports the
student's code either: `solution(week, day)` there reaches the day's package in a worker process in an
OS sandbox (course/sandbox.py: bubblewrap, user nobody, no network, its own PID namespace, read-only
files, a private scratch directory, limits), through a pipe that carries data, never code
(course/remote.py). So every verdict is made where the submission's code cannot reach. Per-test time
limits, a day budget of 1.5x the honest run's recorded time (course/grading_times.json) scaled to this
machine's speed and load (what a day leaves goes to the next days of its week), a memory limit, and every descendant process killed when the day ends bound the run. results.json is rewritten
(atomically) after each day, so an interrupted run leaves a valid report. Without bubblewrap (macOS)
it says plainly that it runs unsandboxed.

Points are declared once, in course/course_map.py (`Day.points`: task -> points). A task's points are
split evenly across its test functions (`test_task_N_...`), and a function's share evenly across its
parametrized cases, in whole 1/10000 points, so every day's tests add up to exactly its points.

Exit status: 0 when grading finished (whatever the score, "needs review" included); 2 when the grader
itself failed: bad arguments, an error in the grader, or a day whose tests could not be run at all (a
course or environment problem, not the student's). With 2 the report is still written when possible.
"""

import argparse
import ast
import itertools
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from math import floor
from pathlib import Path

from course import sandbox
from course.course_map import DAYS, Day
from course.integrity import Finding, scan_file
from course.isolated_pytest import (TEST_TIME_LIMIT, CaseResult, RunResult, become_subreaper, child_env,
                                    default_memory_mb, kill_descendants, pause_descendants, resume, run_test_file)

REPO_ROOT = Path(__file__).resolve().parent.parent
SKELETON_DIR = Path("src") / "tiny_llm"
REFERENCE_DIR = Path("src_ref") / "tiny_llm_ref"
TRUSTED_FOLDERS = ("tests", "course", "src_ref", "scripts")  # what the test process needs besides the package
TASK_TEST = re.compile(r"^test_task_(\d+)_")
UNITS = 10_000  # points are counted in whole 1/10000 points, so sums are exact
GRADER_FAILED = 2
STATUS_WORDS = {
    "passed": "passed", "xfailed": "passed", "failed": "failed", "error": "error in set-up",
    "skipped": "skipped", "timeout": "timed out", "crashed": "crashed the interpreter",
    "not_run": "not run", "not_collected": "could not be collected", "needs_review": "needs review",
}
TIMES_FILE = REPO_ROOT / "course" / "grading_times.json"  # an honest run's seconds per day (--record-times)
YARDSTICK_KEY = "yardstick"  # wall seconds of a fixed computation in that run: the machine's speed and load then
YARDSTICK_RUNS = 5
MAX_SLOWDOWN = 20.0
# A day's budget: this many times its honest run. The recorded run is the slowest of three rounds (about
# a tenth over a typical one), so 1.35x it is about 1.5x a typical honest run: what a sleeper may cost.
BUDGET_FACTOR = 1.35
DEFAULT_DAY_BUDGET = 600.0  # a day without a recorded time
INIT_TEXT = '"""tiny_llm: the package being graded (this file is written by the grader)."""\n'


def course_modules() -> set[str]:
    return {module for day in DAYS for module in day.modules}


# ---------------------------------------------------------------- data

@dataclass
class CaseScore:
    day: Day
    task: int | None  # None: not a task test (no points)
    function: str
    nodeid: str
    outcome: str
    output: str
    units: int  # earned, in 1/UNITS points
    max_units: int

    @property
    def passed(self) -> bool:
        return self.outcome in ("passed", "xfailed")

    @property
    def score(self) -> float:
        return self.units / UNITS

    @property
    def max_score(self) -> float:
        return self.max_units / UNITS

    @property
    def name(self) -> str:
        case = self.nodeid.split("::")[-1]
        return f"Week {self.day.week} Day {self.day.day} Task {self.task}: {case}"


@dataclass
class DayReport:
    day: Day
    tests: list[CaseScore] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # grader-side problems (exit 2)
    review: list[str] = field(default_factory=list)  # why the day needs a person to look (scored 0)
    notes: list[str] = field(default_factory=list)  # course configuration notes (printed)
    seconds: float = 0.0
    pending: bool = False  # not graded (yet): a placeholder in a progressive report


@dataclass
class Submission:
    staged: Path  # the course's module files of the submission, copied once: the files that are graded
    modules: dict[str, Path] = field(default_factory=dict)  # module name -> staged file
    ignored: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    findings: dict[str, list[Finding]] = field(default_factory=dict)  # module -> findings
    review: list[str] = field(default_factory=list)  # files not graded that still deserve a look


# ---------------------------------------------------------------- arguments and selection

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run grade", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--week", type=int, help="grade only this week")
    parser.add_argument("--day", type=int, nargs="+", help="grade only these days of --week")
    parser.add_argument("--json", metavar="FILE", help="write Gradescope's results.json format to FILE")
    parser.add_argument("--src", metavar="DIR",
                        help="a submission to grade instead of src/tiny_llm: a directory holding the modules "
                             "(or holding tiny_llm/ or src/tiny_llm/)")
    parser.add_argument("--solution", choices=["student", "ref"], default="student",
                        help="grade the student package (default) or the reference (a sanity check)")
    parser.add_argument("--timeout", type=float, default=TEST_TIME_LIMIT, metavar="SECONDS",
                        help=f"time limit of one test (default {TEST_TIME_LIMIT:g})")
    parser.add_argument("--day-budget", type=float, default=None, metavar="SECONDS",
                        help="time budget of one day's tests (default: 1.5x the honest run's time recorded in "
                             "course/grading_times.json, scaled to this machine's speed and load now, plus what "
                             "earlier days of the week left; 600 for a day not recorded); tests left when it runs "
                             "out score 0")
    parser.add_argument("--budget", type=float, default=3600.0, metavar="SECONDS",
                        help="time budget of the whole run (default 3600); days left when it runs out score 0")
    parser.add_argument("--memory-mb", type=int, default=None, metavar="MB",
                        help="address-space limit of each test process (default: the machine's memory, at most "
                             "16384, on Linux without an NVIDIA GPU; 0: none). A day's tests need about 1500")
    parser.add_argument("--record-times", type=int, nargs="?", const=3, default=0, metavar="ROUNDS",
                        help="grade the selection ROUNDS times (3 if not given) and save each day's slowest time as "
                             "the honest run's, for the budgets (maintainers: run with --src src_ref/tiny_llm_ref on "
                             "an idle machine)"),
    parser.add_argument("--verbose", "-v", action="store_true", help="print the full output of every failed test")
    return parser


def select_days(week: int | None, days: list[int] | None) -> list[Day]:
    if days and week is None:
        raise SystemExit("--day needs --week, e.g. `pdm run grade --week 2 --day 7`")
    chosen = [d for d in DAYS if (week is None or d.week == week) and (not days or d.day in days)]
    unknown = set(days or []) - {d.day for d in chosen}
    if unknown:
        known = ", ".join(f"{d.week}.{d.day}" for d in DAYS)
        raise SystemExit(f"week {week} day(s) {sorted(unknown)} are not in the course (days: {known})")
    if not chosen:
        raise SystemExit(f"week {week} has no days in the course")
    return chosen


# ---------------------------------------------------------------- the submission and the grading directories

def submission_dir(src: Path) -> Path:
    """Where the modules are in a submission: DIR/src/tiny_llm, DIR/tiny_llm, or DIR itself."""
    for candidate in (src / "src" / "tiny_llm", src / "tiny_llm", src):
        if candidate.is_dir() and any(candidate.glob("*.py")):
            return candidate
    raise SystemExit(f"--src {src}: no Python modules found there (nor in {src}/tiny_llm or {src}/src/tiny_llm)")


RUNS_ON_ITS_OWN = {"sitecustomize.py", "usercustomize.py", "conftest.py"}  # Python or pytest would run these


def stage_submission(root: Path, modules_dir: Path, staged: Path, scan: bool) -> Submission:
    """Copy the course's module files out of the submission (once), list the rest, scan what was copied.

    Files that are not graded are scanned too: they never run, but a flagged one is worth a look.
    """
    staged.mkdir(parents=True)
    submission = Submission(staged)
    wanted = course_modules()
    trusted = {p.name for p in (REPO_ROOT / SKELETON_DIR).glob("*.py")}
    for path in sorted(root.rglob("*")):
        if {"__pycache__", ".git"} & set(path.parts) or path.is_dir():
            continue
        shown = path.relative_to(root).as_posix()
        if path.parent == modules_dir and path.suffix == ".py" and path.stem in wanted and path.is_file():
            target = staged / path.name
            shutil.copyfile(path, target)
            submission.modules[path.stem] = target
            continue
        if path.parent == modules_dir and path.name in trusted and path.is_file() \
                and path.read_bytes() == trusted_file(path.name).read_bytes():
            continue  # provided code, unchanged
        submission.ignored.append(shown)
        if not scan or path.is_symlink() or not path.is_file():
            continue
        if path.name in RUNS_ON_ITS_OWN or path.suffix == ".pth":
            submission.review.append(f"{shown}: a file Python or pytest runs on its own (not graded, not run)")
        elif path.suffix == ".py":
            submission.review += [f"{finding} (not graded, not run)" for finding in scan_file(path, shown)]
    submission.missing = sorted(wanted - set(submission.modules))
    if scan:
        for module, path in submission.modules.items():
            findings = scan_file(path, (modules_dir / path.name).relative_to(root).as_posix()
                                 if modules_dir != root else f"src/tiny_llm/{path.name}")
            if findings:
                submission.findings[module] = findings
    return submission


def trusted_file(name: str) -> Path:
    """The trusted copy of a package file that is not a course module: provided code is the reference's."""
    reference = REPO_ROOT / REFERENCE_DIR / name
    return reference if reference.exists() and name != "__init__.py" else REPO_ROOT / SKELETON_DIR / name


def _copy_trusted(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in TRUSTED_FOLDERS:
        shutil.copytree(REPO_ROOT / name, dest / name, ignore=ignore)
    shutil.copyfile(REPO_ROOT / "pyproject.toml", dest / "pyproject.toml")
    if (REPO_ROOT / "models").exists():
        (dest / "models").symlink_to((REPO_ROOT / "models").resolve(), target_is_directory=True)


def make_grading_dir(dest: Path) -> Path:
    """A fresh, read-only directory for the trusted test process: tests, tooling and reference, no student code."""
    dest.mkdir(parents=True)
    _copy_trusted(dest)
    read_only(dest)
    return dest


def make_package(dest: Path, submission: Submission) -> Path:
    """The package being graded: the submission's course modules, the untouched skeleton's for a module it
    lacks, the reference's provided code, and an `__init__.py` the grader writes."""
    dest.mkdir(parents=True)
    for path in sorted((REPO_ROOT / SKELETON_DIR).glob("*.py")):
        if path.stem in submission.modules:
            shutil.copyfile(submission.modules[path.stem], dest / path.name)
        elif path.name == "__init__.py":
            (dest / path.name).write_text(INIT_TEXT)
        elif path.stem in course_modules():
            shutil.copyfile(path, dest / path.name)  # not submitted: the untouched skeleton
        else:
            shutil.copyfile(trusted_file(path.name), dest / path.name)
    return dest


def read_only(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def remove_tree(root: Path) -> None:
    """Delete a grading directory that was made read-only (and whatever a test wrote into it)."""
    if not root.exists():
        return
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            try:
                path.chmod(path.stat().st_mode | stat.S_IWUSR | stat.S_IRUSR | stat.S_IXUSR)
            except OSError:
                pass
    shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- scoring

def task_functions(test_file: Path) -> list[str]:
    """The `test_task_N_...` functions of a test file, in order, read with `ast` (never imported here).

    They are known even when the file cannot be collected, so their points still appear, at zero.
    """
    try:
        tree = ast.parse(test_file.read_text(), filename=str(test_file))
    except (SyntaxError, OSError):
        return []  # pytest reports the error when it collects the file
    scopes = [tree] + [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name.startswith("Test")]
    return [node.name for scope in scopes for node in scope.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and TASK_TEST.match(node.name)]


def function_of(nodeid: str) -> str:
    return nodeid.split("::")[-1].split("[")[0]


def task_of(function: str) -> int | None:
    match = TASK_TEST.match(function)
    return int(match.group(1)) if match else None


def apportion(total: int, weights: list[Fraction]) -> list[int]:
    """Whole units for each weight (weights sum to 1), adding up to exactly `total` (largest remainders)."""
    ideal = [total * w for w in weights]
    units = [floor(x) for x in ideal]
    by_remainder = sorted(range(len(ideal)), key=lambda i: (-(ideal[i] - units[i]), i))
    for i in by_remainder[: total - sum(units)]:
        units[i] += 1
    return units


def score_day(day: Day, expected: list[str], run: RunResult, functions: list[str] | None = None,
              review: list[str] | None = None) -> DayReport:
    """Spread each task's points over its test functions, and each function's share over its cases.

    `expected`: the test ids collected beforehand (their results come from `run`, missing ones score 0).
    `review`: reasons the day cannot be trusted: every test then scores 0, "needs review".
    """
    report = DayReport(day, seconds=run.seconds, review=list(review or []) + run.review)
    cases: dict[str, list[str]] = {}
    for nodeid in expected:
        cases.setdefault(function_of(nodeid), []).append(nodeid)
    for function in functions or []:
        cases.setdefault(function, [])
    collect_output = "\n".join(run.collect_errors + run.problems)
    by_task: dict[int | None, list[str]] = {}
    for function in cases:
        by_task.setdefault(task_of(function), []).append(function)
    review_text = "needs review: " + "; ".join(report.review) if report.review else ""

    for task, task_functions_ in sorted(by_task.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        points = day.points.get(task, 0) if task is not None else 0
        if task is not None and task not in day.points:
            report.notes.append(f"{day.test_file} has tests for Task {task}, which has no points in "
                                f"course/course_map.py: scored 0")
        ids = [(function, cases[function] or [f"{day.test_file}::{function}"]) for function in task_functions_]
        weights = [Fraction(1, len(ids) * len(nodeids)) for _, nodeids in ids for _ in nodeids]
        shares = iter(apportion(points * UNITS, weights))
        for function, nodeids in ids:
            for nodeid in nodeids:
                share = next(shares)
                result = run.results.get(nodeid) or CaseResult(
                    nodeid, "not_collected" if not cases[function] or collect_output else "not_run",
                    collect_output or "the test process did not report this test")
                if review_text:
                    result = CaseResult(nodeid, "needs_review", review_text)
                report.tests.append(CaseScore(day, task, function, nodeid, result.outcome, result.output,
                                              share if result.ok else 0, share))
    broken = bool(run.problems or run.collect_errors)
    for task in sorted(set(day.points) - set(by_task)):
        if broken or review_text:
            # The file could not be read at all: its tasks count, at zero, with the reason.
            report.tests.append(CaseScore(day, task, f"test_task_{task}", f"{day.test_file}::test_task_{task}_*",
                                          "needs_review" if review_text else "not_collected",
                                          review_text or collect_output, 0, day.points[task] * UNITS))
            continue
        report.notes.append(f"Task {task} of week {day.week} day {day.day} has points but no tests "
                            f"named test_task_{task}_... in {day.test_file}: left out of the total")
    if broken:
        report.problems.append(f"{day.test_file} could not be run as a whole:\n{collect_output}")
    return report


def placeholder(day: Day, expected: list[str], why: str, review: list[str] | None = None,
                pending: bool = False) -> DayReport:
    """A day that was not run: every expected test at 0 with the reason."""
    run = RunResult(day.test_file)
    for nodeid in expected:
        run.results[nodeid] = CaseResult(nodeid, "not_run", why)
    report = score_day(day, expected, run, task_functions(REPO_ROOT / day.test_file), review)
    report.pending = pending
    return report


# ---------------------------------------------------------------- output

def first_lines(text: str, count: int = 3) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    # The most telling lines of a pytest failure are usually its last ones ("E   assert ...").
    telling = [line for line in lines if line.startswith("E ") or "not implemented yet" in line
               or line.startswith(("timed out", "the test process died", "Fatal Python error", "needs review"))]
    chosen = (telling or lines)[:count]
    # Where it happened: the innermost frame in the student's package (a faulthandler "File" line first).
    where = [line for line in lines if line.strip().startswith("File ") and "tiny_llm" in line][:1]
    where = where or [line for line in lines if re.search(r"src/tiny_llm\S*:\d+", line)][-1:]
    if where and where[0] not in chosen:
        chosen = chosen[: count - 1] + where
    return "\n".join("      " + line.strip()[:160] for line in chosen)


def status_word(test: CaseScore) -> str:
    if test.outcome == "failed" and "not implemented yet" in test.output:
        return "not implemented yet"
    return STATUS_WORDS.get(test.outcome, test.outcome)


def task_status(tests: list[CaseScore]) -> str:
    bad = [t for t in tests if not t.passed]
    if not bad:
        return f"passed ({len(tests)} test{'s' * (len(tests) != 1)})"
    if all(t.outcome == "needs_review" for t in tests):
        return "NEEDS REVIEW (see below)"
    kinds = sorted({status_word(t) for t in bad})
    return f"{len(bad)} of {len(tests)} not passed: {', '.join(kinds)}"


def points(units: int) -> str:
    """Exact: 2099999 units are "209.9999", never "209.99999999999966"."""
    return str(Decimal(units) / UNITS)


def render(reports: list[DayReport], verbose: bool, workspace_notes: list[str], solution: str,
           integrity: list[str] = ()) -> str:
    lines = [f"Grading the {'reference' if solution == 'ref' else 'student'} solution", "",
             f"{'week':>4} {'day':>4} {'task':>4}  {'points':>13}  status",
             f"{'-' * 4:>4} {'-' * 4:>4} {'-' * 4:>4}  {'-' * 13:>13}  {'-' * 40}"]
    total = maximum = 0
    for report in reports:
        tasks: dict[int, list[CaseScore]] = {}
        for test in report.tests:
            if test.task is not None:
                tasks.setdefault(test.task, []).append(test)
        for task, tests in sorted(tasks.items()):
            got, of = sum(t.units for t in tests), sum(t.max_units for t in tests)
            total, maximum = total + got, maximum + of
            status = "not graded: the run stopped before this day" if report.pending else task_status(tests)
            lines.append(f"{report.day.week:>4} {report.day.day:>4} {task:>4}  {got / UNITS:>6.1f} / "
                         f"{points(of):<4}  {status}")
    lines += ["", f"total: {points(total)} / {points(maximum)}"]
    reviewed = [r for r in reports if r.review]
    if reviewed:
        lines += ["", "NEEDS REVIEW (these days score 0 until a person has looked):"]
        for report in reviewed:
            lines.append(f"  week {report.day.week} day {report.day.day}:")
            lines += [f"    - {reason}" for reason in report.review]
    details = [t for r in reports if not r.review and not r.pending for t in r.tests if not t.passed]
    if details:
        lines += ["", "Tests not passed:"]
        # Cases of one test function that fail the same way are shown once.
        groups: dict[tuple, list[CaseScore]] = {}
        for test in details:
            summary = test.output.rstrip() if verbose else first_lines(test.output)
            key = (test.day.test_file, test.function, status_word(test), summary if not verbose else test.nodeid)
            groups.setdefault(key, []).append(test)
        for (test_file, function, word, _), tests in groups.items():
            name = tests[0].nodeid if len(tests) == 1 else f"{test_file}::{function} ({len(tests)} cases)"
            lines.append(f"  {name}  [{word}]")
            lines.append(tests[0].output.rstrip() if verbose else first_lines(tests[0].output))
    notes = workspace_notes + [n for r in reports for n in r.notes]
    if notes:
        lines += ["", "Notes:"] + [f"  - {n}" for n in notes]
    if integrity:
        lines += ["", "Integrity report (for the instructor; it decides nothing, the sandbox does):"]
        lines += [f"  - {finding}" for finding in integrity]
    problems = [p for r in reports for p in r.problems]
    if problems:
        lines += ["", "GRADER PROBLEMS (not the student's code; these tests are at zero):"]
        lines += [f"  - {p.splitlines()[0]}" for p in problems]
    return "\n".join(lines)


def gradescope_results(reports: list[DayReport], summary: str, seconds: float, extra: dict) -> dict:
    """Gradescope's results.json: top-level score and output, one entry per test case."""
    tests = []
    graded = [t for r in reports for t in r.tests if t.task is not None]
    for test in graded:
        tests.append({
            "name": test.name,
            "score": test.score,
            "max_score": test.max_score,
            "status": "passed" if test.passed else "failed",
            "output": f"{status_word(test)}\n{test.output}".strip() if not test.passed else "passed",
            "tags": [f"week {test.day.week}", f"day {test.day.week}.{test.day.day}", f"task {test.task}"],
            "visibility": "visible",
        })
    return {
        "score": sum(t.units for t in graded) / UNITS,
        "execution_time": round(seconds),
        "output": summary,
        "visibility": "visible",
        "stdout_visibility": "visible",
        "tests": tests,
        "extra_data": {
            "max_score": sum(t.max_units for t in graded) / UNITS,
            "needs_review": {f"{r.day.week}.{r.day.day}": r.review for r in reports if r.review},
            "not_graded": [f"{r.day.week}.{r.day.day}" for r in reports if r.pending],
            **extra,
        },
    }


def write_atomically(path: Path, text: str) -> None:
    """Readers see the old report or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------- main

def progress_bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:  # the report does not depend on it
        return None
    return tqdm(total=total, unit="day", file=sys.stderr, disable=None, dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} days [{elapsed}<{remaining}]")


def integrity_report(submission: Submission) -> list[str]:
    """What the integrity scan found, for the instructor: it decides nothing (the sandbox is the defence)."""
    return [str(f) for findings in submission.findings.values() for f in findings] + submission.review


class DayBudgets:
    """Each day's time budget: 1.5x its honest run's recorded time, scaled by how slow this machine is now,
    plus what the earlier days of its week left unused in this run.

    The scale is the yardstick's wall time just before the day starts against its time when the honest
    times were recorded: wall time, so it follows the machine's load as well as its processor, and taken
    while none of the submission's processes is alive, so the submission cannot stretch it. What a day
    leaves carries over to the next days of its week: an honest day slowed by a burst of load borrows
    from the quicker ones, and a submission that sleeps spends every day's share, so a week (and the
    whole run) never takes more than 1.5x its honest time at the load it was graded under.
    """

    def __init__(self, args: argparse.Namespace):
        self.by_hand = args.day_budget  # --day-budget: a fixed budget per day, nothing carried
        self.recording = args.record_times  # the old times must not bound the run that records new ones
        self.times = recorded_times()
        self.left: dict[int, float] = {}  # week -> seconds its graded days left unused

    def follows_load(self, day: Day) -> bool:
        """Whether the day's budget is scaled (not set by hand, not recording, a time recorded)."""
        return self.by_hand is None and not self.recording and day.key in self.times

    def for_day(self, day: Day, slowdown: float) -> float:
        if not self.follows_load(day):
            return self.by_hand or DEFAULT_DAY_BUDGET
        return BUDGET_FACTOR * self.times[day.key] * slowdown + self.left.get(day.week, 0.0)

    def spent(self, day: Day, budget: float, seconds: float) -> None:
        """A day used `seconds` of its `budget`: the rest goes to the next days of its week."""
        if self.follows_load(day):
            self.left[day.week] = max(0.0, budget - seconds)


class DayClock:
    """Whether a day's time is up (the deadline `run_test_file` asks): its budget at the day's mean slowdown.

    The slowdown is timed before the day starts; when the budget runs out, the day's processes are
    frozen (SIGSTOP), the yardstick is timed again, and the budget is taken at the mean of the slowdowns
    timed so far: an honest day goes on if the load rose since it started (at least a second more, so
    the re-timings stay few), and a submission cannot slow the yardstick, frozen while it runs.
    """

    def __init__(self, budgets: DayBudgets, day: Day, first_slowdown: float, run_deadline: float):
        self.budgets, self.day, self.run_deadline = budgets, day, run_deadline
        self.slowdowns = [first_slowdown]
        self.started = time.monotonic()
        self.budget = budgets.for_day(day, first_slowdown)

    def end(self) -> float:
        return min(self.started + self.budget, self.run_deadline)

    def __call__(self, now: float) -> bool:
        if now < self.end():
            return False
        if now >= self.run_deadline or not self.budgets.follows_load(self.day):
            return True
        frozen = pause_descendants()
        try:
            self.slowdowns.append(slowdown(yardstick()))
        finally:
            resume(frozen)
        budget = self.budgets.for_day(self.day, sum(self.slowdowns) / len(self.slowdowns))
        if self.started + budget < time.monotonic() + 1.0:
            return True
        self.budget = budget
        return False


def recorded_times() -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(TIMES_FILE.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def record_times(reports: list["DayReport"], yardstick_seconds: float) -> None:
    """Keep each day's time (and the yardstick's, the machine's speed and load then) for the budgets of later
    runs: the slowest of the day's runs (`reports` may hold several rounds), so that a budget starts from an
    honest run's spread and not from its luckiest moment; and only of a day that passed every test in every
    round, since a failing or cut-short run is no honest run's time."""
    times = recorded_times()
    by_day: dict[str, list[DayReport]] = {}
    for report in reports:
        if not report.pending:
            by_day.setdefault(report.day.key, []).append(report)
    for key, runs in by_day.items():
        if all(passed_everything(run) for run in runs):
            times[key] = round(max(run.seconds for run in runs), 2)
        else:
            print(f"[grade] week {runs[0].day.week} day {runs[0].day.day}: not every test passed; time not recorded")
    times[YARDSTICK_KEY] = round(yardstick_seconds, 4)
    TIMES_FILE.write_text(json.dumps(dict(sorted(times.items())), indent=1) + "\n")


def passed_everything(report: "DayReport") -> bool:
    return bool(report.tests) and all(case.passed for case in report.tests) and not report.problems \
        and not report.review


YARDSTICK_WORK = """
import statistics, sys, time
sys.stdin.buffer.read(1)  # the go signal: every copy starts its work at the same moment
def once():
    began, total = time.perf_counter(), 0
    for i in range(1_000_000):
        total += i % 7
    return time.perf_counter() - began
print(statistics.median(once() for _ in range(RUNS)))
"""


def yardstick_copies() -> int:
    """How many copies of the yardstick run at once: as many processors as a day's tests keep busy.

    A day runs two processes that work at the same time (the trusted test process and the sandboxed
    worker; MLX and a test's server add threads): day 3.5's honest grade uses about 1.2 processors'
    worth of CPU time. One copy alone does not see a load that leaves one processor free (another
    busy process on two cores), which slows such a day by about half: two copies, each wanting a
    processor, do.
    """
    return max(1, min(2, os.cpu_count() or 1))


def yardstick() -> float:
    """Wall seconds of a fixed piece of Python work run in `yardstick_copies()` processes at once (the mean of
    each copy's median of five): how fast this machine runs a day's processes now.

    Wall time, not CPU time: on a loaded machine the honest run's tests wait for a processor as this work
    does (at load 10 on 2 cores, about 5x longer), and a budget that ignored that would fail honest runs.
    The median, so that a burst of a tenth of a second (another process starting) does not count as load.
    The copies start together (each waits for one byte on its stdin), after their interpreters have started.
    """
    work = YARDSTICK_WORK.replace("RUNS", str(YARDSTICK_RUNS))
    copies = [subprocess.Popen([sys.executable, "-I", "-c", work], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True) for _ in range(yardstick_copies())]
    for copy in copies:
        copy.stdin.write("g")
        copy.stdin.close()
    seconds = [float(copy.stdout.read()) for copy in copies]
    for copy in copies:
        copy.wait()
    return sum(seconds) / len(seconds)


def slowdown(seconds: float) -> float:
    """How much slower this machine runs now than the one that recorded the times did then (1/8x to 20x)."""
    recorded = recorded_times().get(YARDSTICK_KEY)
    if not recorded:
        return 1.0
    return min(MAX_SLOWDOWN, max(1 / 8, seconds / recorded))


def grade(args: argparse.Namespace) -> int:
    started = time.monotonic()
    become_subreaper()  # detached processes the tests leave behind are re-parented here, and killed
    run_deadline = started + args.budget
    days = select_days(args.week, args.day)
    days = [d for d in days if (REPO_ROOT / d.test_file).exists()]
    workspace_notes = [f"week {d.week} day {d.day}: no tests yet ({d.test_file}), not graded"
                       for d in select_days(args.week, args.day) if d not in days]
    if not days:
        print("grade: no day in the selection has tests yet", file=sys.stderr)
        return GRADER_FAILED
    json_path = Path(args.json).resolve() if args.json else None
    integrity: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="tiny-llm-grade-"))
    bar = None
    try:
        student = args.solution == "student"
        root = Path(args.src).resolve() if args.src else REPO_ROOT / SKELETON_DIR
        submission = stage_submission(root, submission_dir(root), tmp / "submission", scan=student)
        extra: dict = {}
        if student:
            warning = sandbox.unsandboxed_warning()
            if warning:
                print(warning, file=sys.stderr, flush=True)
                workspace_notes.append(warning.removeprefix("grade: "))
            if submission.ignored:
                listed = submission.ignored[:20] + ([f"and {len(submission.ignored) - 20} more"]
                                                    if len(submission.ignored) > 20 else [])
                workspace_notes.append("not graded (only the course's module files are): " + ", ".join(listed))
            if args.src and submission.missing:
                workspace_notes.append(f"the submission has no {', '.join(m + '.py' for m in submission.missing)}: "
                                       "the untouched skeleton's are graded")
            integrity = integrity_report(submission)
            extra = {"ignored_files": submission.ignored, "integrity_flags": integrity,
                     "sandboxed": warning is None}

        # One trusted directory for every test process: tests, tooling and reference, never student code.
        trusted = make_grading_dir(tmp / "trusted")
        package = make_package(tmp / "package", submission) if student else None
        trusted_env = child_env(args.solution, ("src_ref", "."))
        budgets = DayBudgets(args)
        yardsticks: list[float] = []  # one before each day, while none of the submission's processes is alive
        rounds = args.record_times or 1
        bar = progress_bar(len(days) * rounds)

        reports: list[DayReport] = [placeholder(d, [], "not graded yet", pending=True) for d in days]

        def save() -> None:
            if json_path is not None:
                summary = render(reports, False, workspace_notes, args.solution, integrity)
                write_atomically(json_path, json.dumps(gradescope_results(
                    reports, summary, time.monotonic() - started, extra), indent=2) + "\n")

        save()
        memory_mb = default_memory_mb() if args.memory_mb is None else args.memory_mb or None
        graded: list[DayReport] = []  # every day graded, in every round (--record-times N grades N rounds)
        for repeat, (index, day) in itertools.product(range(rounds), enumerate(days)):
            label = f"week {day.week} day {day.day}" + (f" (round {repeat + 1} of {rounds})" if rounds > 1 else "")
            if bar is not None and not bar.disable:
                bar.set_description(label)
            else:
                print(f"[grade] {label}: {day.test_file}", file=sys.stderr, flush=True)
            if time.monotonic() >= run_deadline:
                reports[index] = placeholder(day, [], "not run: the run's time budget ran out before this day")
            else:
                yardsticks.append(yardstick())
                env = trusted_env
                if package is not None:
                    root_dir = sandbox.prepare_root(tmp / f"sandbox-{day.key}-{repeat}", package,
                                                    REPO_ROOT / REFERENCE_DIR, REPO_ROOT / "course", day.week, day.day)
                    logs = tmp / f"logs-{day.key}-{repeat}"  # a test process killed at a limit cannot clean up
                    logs.mkdir()
                    env = {**trusted_env, sandbox.SANDBOX_ROOT_VARIABLE: str(root_dir), sandbox.LOGS_VARIABLE: str(logs)}
                # The day's clock starts where `run.seconds`, the time --record-times keeps, starts: a budget
                # and the time it is scaled from measure the same thing.
                clock = DayClock(budgets, day, slowdown(yardsticks[-1]), run_deadline)
                if package is not None:
                    env[sandbox.LIMITS_VARIABLE] = f"{clock.budget:.0f},{memory_mb or 0}"
                # The tests expected are those this trusted process collects: the submission's code runs only in
                # the sandbox, and no test file decides which tests exist from what the submission returns.
                run = run_test_file(day.test_file, trusted, env, timeout=args.timeout, deadline=clock,
                                    memory_mb=memory_mb)
                kill_descendants()
                budgets.spent(day, clock.budget, run.seconds)
                reports[index] = score_day(day, run.expected, run, task_functions(REPO_ROOT / day.test_file))
                graded.append(reports[index])
                if run.out_of_time:
                    reports[index].notes.append(f"{label}: stopped when its time budget ran out ({clock.budget:.0f} s: "
                                                f"{BUDGET_FACTOR:g}x an honest run at this machine's speed and load, "
                                                f"with what earlier days of the week left; --budget "
                                                f"{args.budget:g} s for the whole run)")
            if bar is not None:
                bar.update(1)
            save()
    finally:
        if bar is not None:
            bar.close()
        kill_descendants()
        remove_tree(tmp)
    if args.record_times and yardsticks:
        record_times(graded, sum(yardsticks) / len(yardsticks))
    summary = render(reports, args.verbose, workspace_notes, args.solution, integrity)
    print(summary)
    seconds = time.monotonic() - started
    print(f"\ngraded {len(reports)} day(s) in {seconds:.0f} s")
    if json_path is not None:
        print(f"wrote {json_path}")
    return GRADER_FAILED if any(r.problems for r in reports) else 0


def _stop(signum, frame):
    raise KeyboardInterrupt  # so the test processes are killed on the way out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # bad arguments exit with status 2
    signal.signal(signal.SIGTERM, _stop)
    try:
        return grade(args)
    except KeyboardInterrupt:
        print("grade: interrupted; the report (--json) holds the days graded so far", file=sys.stderr)
        return 130
    except SystemExit as stop:
        if stop.code not in (None, 0):
            print(f"grade: {stop.code}", file=sys.stderr)
            return GRADER_FAILED
        return 0
    except Exception:
        traceback.print_exc()
        print("grade: the grader itself failed (see above); no grade was produced", file=sys.stderr)
        return GRADER_FAILED


if __name__ == "__main__":
    sys.exit(main())
