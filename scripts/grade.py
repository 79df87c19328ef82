"""Grade the student package: per week, day and task, a readable table and Gradescope's results.json.

    pdm run grade                          # every day that has tests, against src/tiny_llm
    pdm run grade --week 2 --day 7         # one day: the score the day's chapter points to
    pdm run grade --week 2 --day 6 7       # some days of a week
    pdm run grade --json results.json      # also write Gradescope's results.json
    pdm run grade --src path/to/submission # grade a submission (a directory of module files)
    pdm run grade --solution ref           # grade the reference (every task at full points)
    pdm run grade --make-autograder DIR    # write a Gradescope autograder

Only the course's module files are graded, staged as regular files (no links, devices or FIFOs, at most
MAX_FILE_BYTES) into a package of their own; every other file is listed, never run. Each day's tests run in a
trusted pytest process (the judge, course/isolated_pytest.py) that reaches the package in a sandboxed worker
(course/sandbox.py) through a pipe that carries data only (course/remote.py): every verdict is made where the
submission cannot reach. Per-test limits, a flat cap per day (CAP_FACTOR x the honest run's recorded time plus
one test's limit) and a cgroup where the machine has one bound the run. With --json (or --require-sandbox) it
refuses to grade where bubblewrap cannot start. Text the submission produced is escaped before it is shown, and
results.json is rewritten atomically after each day. The integrity scan (course/integrity.py) lists, for the
instructor, what is unusual in the files: it decides nothing.

Points are declared once, in course/course_map.py (`Day.points`): a task's points are split evenly across its test
functions (`test_task_N_...`), a function's share across its cases, in whole 1/10000 points, so a day adds up
exactly. Exit status: 0 when grading finished (whatever the score); 2 when the grader itself failed (bad
arguments, an error in the grader, a day whose tests could not be run at all); the report is still written.
"""

import argparse
import ast
import errno
import itertools
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from math import floor
from pathlib import Path

from course import cgroup, sandbox, scratch
from course.course_map import DAYS, Day
from course.integrity import scan_source
from course.isolated_pytest import TEST_TIME_LIMIT, CaseResult, RunResult, child_env, default_memory_mb, run_test_file
from course.remote import printable

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
    "not_run": "not run", "not_collected": "could not be collected",
}
TIMES_FILE = REPO_ROOT / "course" / "grading_times.json"  # an honest run's seconds per day (--record-times)
CAP_FACTOR = 3.0  # a day's cap: this many times its recorded honest run, plus one test's time limit
DEFAULT_DAY_CAP = 600.0  # a day without a recorded time
MAX_FILE_BYTES = 1 << 20  # a submitted file larger than this is refused (the largest course module is 38 kB)
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
    def name(self) -> str:
        case = self.nodeid.split("::")[-1]
        return f"Week {self.day.week} Day {self.day.day} Task {self.task}: {case}"


@dataclass
class DayReport:
    day: Day
    tests: list[CaseScore] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # grader-side problems (exit 2)
    notes: list[str] = field(default_factory=list)  # course configuration notes (printed)
    seconds: float = 0.0
    pending: bool = False  # not graded (yet): a placeholder in a progressive report


@dataclass
class Submission:
    staged: Path  # the course's module files of the submission, copied once: the files that are graded
    modules: dict[str, Path] = field(default_factory=dict)  # module name -> staged file
    ignored: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # one line per file not read (a link, a device, too large)
    findings: list[str] = field(default_factory=list)  # the integrity scan's, for the instructor


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
                        help=f"time cap of one day's tests (default: {CAP_FACTOR:g}x the honest run's time recorded "
                             f"in course/grading_times.json plus --timeout; {DEFAULT_DAY_CAP:g} for a day not "
                             "recorded); tests left when it runs out score 0")
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
    parser.add_argument("--require-sandbox", action=argparse.BooleanOptionalAction, default=None,
                        help="refuse to grade a student's code where bubblewrap cannot start a sandbox (default: "
                             "on with --json; --no-require-sandbox for a dev loop on a Mac)")
    parser.add_argument("--make-autograder", metavar="DIR",
                        help="write a Gradescope autograder (setup.sh, run_autograder and the course) to DIR")
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
    """Where the modules are in a submission: DIR/src/tiny_llm, DIR/tiny_llm, or DIR itself (never through a
    link: a submission with no modules of its own is graded as the untouched skeleton)."""
    for candidate in (src / "src" / "tiny_llm", src / "tiny_llm"):
        links = [p for p in (candidate, candidate.parent) if src in p.parents and p.is_symlink()]
        if candidate.is_dir() and not links and any(candidate.glob("*.py")):
            return candidate
    return src


RUNS_ON_ITS_OWN = {"sitecustomize.py", "usercustomize.py", "conftest.py"}  # Python or pytest would run these


def read_regular(path: Path) -> bytes:
    """A submitted file's bytes, if it is a plain file of its own; else ValueError saying what it is.

    Opened without following a link (O_NOFOLLOW) and checked on the open descriptor: a symbolic link (to the
    reference, to a hidden test), a hard link, a device, a FIFO (opened without blocking), a directory, or a
    file over MAX_FILE_BYTES is never read. The grader runs with more rights than the sandbox: nothing it
    opens on the submission's behalf may lead outside the submission.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        raise ValueError("a symbolic link" if error.errno == errno.ELOOP else error.strerror) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        raise ValueError("a directory" if stat.S_ISDIR(info.st_mode) else "a hard link" if stat.S_ISREG(info.st_mode)
                         else "not a regular file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES >> 20} MiB")
    return data


def stage_submission(root: Path, modules_dir: Path, staged: Path, scan: bool) -> Submission:
    """Copy the course's module files out of the submission (once), list the rest, scan what was read.

    Only regular files are read (`read_regular`); a course module that is refused counts as missing. Files that
    are not graded are scanned too: they never run, but a flagged one is worth a look.
    """
    staged.mkdir(parents=True)
    submission = Submission(staged)
    wanted, provided = course_modules(), {p.name for p in (REPO_ROOT / SKELETON_DIR).glob("*.py")}
    for folder, dirs, files in os.walk(root):  # never into a link to a directory: it is listed, as a file is
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", ".git"))
        for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(folder, d))
                                    or (Path(folder) == modules_dir and d.endswith(".py"))]):
            path = Path(folder) / name
            shown = printable(path.relative_to(root).as_posix())
            in_package = path.parent == modules_dir
            module = in_package and path.suffix == ".py" and path.stem in wanted
            try:
                data = read_regular(path) if module or scan or name in provided else b""
            except ValueError as why:
                submission.refused.append(f"{shown}: not read ({why})" + (": graded as missing" if module else ""))
                continue
            if module:
                (staged / name).write_bytes(data)
                submission.modules[path.stem] = staged / name
            elif in_package and name in provided and data == trusted_file(name).read_bytes():
                continue  # provided code, unchanged
            else:
                submission.ignored.append(shown)
            unused = "" if module else " (not graded, not run)"
            if scan and not module and (name in RUNS_ON_ITS_OWN or path.suffix == ".pth"):
                submission.findings.append(f"{shown}: a file Python or pytest runs on its own{unused}")
            elif scan and path.suffix == ".py":
                submission.findings += [f"{finding}{unused}" for finding in scan_source(data, shown)]
    submission.missing = sorted(wanted - set(submission.modules))
    return submission


def trusted_file(name: str) -> Path:
    """The trusted copy of a package file that is not a course module: provided code is the reference's."""
    reference = REPO_ROOT / REFERENCE_DIR / name
    return reference if reference.exists() and name != "__init__.py" else REPO_ROOT / SKELETON_DIR / name


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


def score_day(day: Day, expected: list[str], run: RunResult, functions: list[str] | None = None) -> DayReport:
    """Spread each task's points over its test functions, and each function's share over its cases.

    `expected`: the test ids collected beforehand (their results come from `run`, missing ones score 0).
    """
    report = DayReport(day, seconds=run.seconds)
    cases: dict[str, list[str]] = {}
    for nodeid in expected:
        cases.setdefault(function_of(nodeid), []).append(nodeid)
    for function in functions or []:
        cases.setdefault(function, [])
    collect_output = "\n".join(run.collect_errors + run.problems)
    by_task: dict[int | None, list[str]] = {}
    for function in cases:
        by_task.setdefault(task_of(function), []).append(function)

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
                report.tests.append(CaseScore(day, task, function, nodeid, result.outcome, printable(result.output),
                                              share if result.ok else 0, share))
    broken = bool(run.problems or run.collect_errors)
    for task in sorted(set(day.points) - set(by_task)):
        if broken:
            # The file could not be read at all: its tasks count, at zero, with the reason.
            report.tests.append(CaseScore(day, task, f"test_task_{task}", f"{day.test_file}::test_task_{task}_*",
                                          "not_collected", collect_output, 0, day.points[task] * UNITS))
            continue
        report.notes.append(f"Task {task} of week {day.week} day {day.day} has points but no tests "
                            f"named test_task_{task}_... in {day.test_file}: left out of the total")
    if broken:
        report.problems.append(f"{day.test_file} could not be run as a whole:\n{collect_output}")
    return report


def placeholder(day: Day, why: str | None = None, pending: bool = False) -> DayReport:
    """A day that was not run: every test function at 0, and why (a note)."""
    report = score_day(day, [], RunResult(day.test_file), task_functions(REPO_ROOT / day.test_file))
    report.notes += [f"week {day.week} day {day.day}: {why}"] if why else []
    report.pending = pending
    return report


# ---------------------------------------------------------------- output

def first_lines(text: str, count: int = 3) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    # The most telling lines of a pytest failure are usually its last ones ("E   assert ...").
    telling = [line for line in lines if line.startswith("E ") or "not implemented yet" in line
               or line.startswith(("timed out", "the test process died", "Fatal Python error"))]
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
    details = [t for r in reports if not r.pending for t in r.tests if not t.passed]
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
    return printable("\n".join(lines))


def gradescope_results(reports: list[DayReport], summary: str, seconds: float, extra: dict) -> dict:
    """Gradescope's results.json: top-level score and output, one entry per test case."""
    tests = []
    graded = [t for r in reports for t in r.tests if t.task is not None]
    for test in graded:
        tests.append({
            "name": test.name,
            "score": test.units / UNITS,
            "max_score": test.max_units / UNITS,
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
            "not_graded": [f"{r.day.week}.{r.day.day}" for r in reports if r.pending],
            **extra,
        },
    }


def write_atomically(path: Path, text: str) -> None:
    """Readers see the old report or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


# ---------------------------------------------------------------- main

def day_cap(day: Day, args: argparse.Namespace, times: dict[str, float]) -> float:
    """A day's time cap, counted from its first test's start: CAP_FACTOR x its recorded honest time plus one
    test's limit (the default limit if --timeout is shorter), the same at any load.

    A hang costs only its test (the per-test limit); the cap ends a submission that makes every test slow,
    which then costs at most CAP_FACTOR x an honest day plus one test's limit. No scaling to the machine's load:
    an honest day stays under its cap up to about CAP_FACTOR + 60 s / its recorded time times slower.
    """
    if args.day_budget is not None or args.record_times or day.key not in times:
        return args.day_budget or DEFAULT_DAY_CAP
    return CAP_FACTOR * times[day.key] + max(args.timeout, TEST_TIME_LIMIT)


def recorded_times() -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(TIMES_FILE.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def record_times(reports: list["DayReport"]) -> None:
    """Keep each day's time for the caps of later runs: the slowest of the day's runs (`reports` may hold several
    rounds), and only of a day that passed every test in every round (a cut-short run is no honest run)."""
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
    TIMES_FILE.write_text(json.dumps(dict(sorted(times.items())), indent=1) + "\n")


def passed_everything(report: "DayReport") -> bool:
    return bool(report.tests) and all(case.passed for case in report.tests) and not report.problems


def submission_notes(submission: Submission, args: argparse.Namespace, warning: str | None) -> list[str]:
    """What the report says about the submission's files: ignored, refused, missing; and a missing sandbox."""
    notes = [warning.removeprefix("grade: ")] if warning else []
    if submission.ignored:
        more = len(submission.ignored) - 20
        notes.append("not graded (only the course's module files are): "
                     + ", ".join(submission.ignored[:20] + ([f"and {more} more"] if more > 0 else [])))
    notes += submission.refused
    if args.src and submission.missing:
        notes.append(f"the submission has no {', '.join(m + '.py' for m in submission.missing)}: "
                     "the untouched skeleton's are graded")
    return notes


def grade_day(day: Day, args: argparse.Namespace, work: Path, trusted: Path, env: dict, package: Path | None,
              cap: float, deadline: float, memory_mb: int | None) -> DayReport:
    """One day's tests in a trusted process of their own, the submission's code in sandboxes beside it. The tests
    expected are those that process collects: no test decides which tests exist from what the submission returns."""
    if package is not None:
        root = sandbox.prepare_root(work / "sandbox", package, REPO_ROOT / REFERENCE_DIR, REPO_ROOT / "course",
                                    day.week, day.day)
        (work / "logs").mkdir()  # the workers' output: a test process killed at a limit cannot clean up
        env = {**env, sandbox.SANDBOX_ROOT_VARIABLE: str(root), sandbox.LOGS_VARIABLE: str(work / "logs"),
               sandbox.LIMITS_VARIABLE: f"{cap:.0f},{memory_mb or 0}"}
    run = run_test_file(day.test_file, trusted, env, timeout=args.timeout, deadline=deadline, cap=cap,
                        memory_mb=memory_mb)
    report = score_day(day, run.expected, run, task_functions(REPO_ROOT / day.test_file))
    if run.out_of_time:
        how = "--day-budget" if args.day_budget else f"{CAP_FACTOR:g}x an honest run plus one test's limit"
        report.notes.append(f"week {day.week} day {day.day}: stopped when its time budget ran out ({cap:.0f} s: "
                            f"{how}; --budget {args.budget:g} s for the whole run)")
    return report


def grade(args: argparse.Namespace) -> int:
    started = time.monotonic()
    student = args.solution == "student"
    if student and (args.json if args.require_sandbox is None else args.require_sandbox) and not sandbox.bwrap_path():
        print(f"grade: refused: the sandbox cannot start here ({sandbox.why_unsandboxed()}); "
              "--no-require-sandbox grades without it", file=sys.stderr)
        return GRADER_FAILED
    groups = f"tiny-llm-grade-{os.getpid()}-"  # the cgroups of this run's sandboxes, removed after each day
    selected = select_days(args.week, args.day)
    days = [d for d in selected if (REPO_ROOT / d.test_file).exists()]
    notes = [f"week {d.week} day {d.day}: no tests yet ({d.test_file}), not graded" for d in selected if d not in days]
    if not days:
        print("grade: no day in the selection has tests yet", file=sys.stderr)
        return GRADER_FAILED
    json_path = Path(args.json).resolve() if args.json else None
    integrity, extra, rounds = [], {}, args.record_times or 1
    reports = [placeholder(d, pending=True) for d in days]
    graded: list[DayReport] = []  # every day graded, in every round (--record-times N grades N rounds)
    tmp = Path(tempfile.mkdtemp(prefix="tiny-llm-grade-"))

    def save() -> None:
        if json_path is not None:
            summary = render(reports, False, notes, args.solution, integrity)
            write_atomically(json_path, json.dumps(gradescope_results(
                reports, summary, time.monotonic() - started, extra), indent=2) + "\n")

    try:
        root = Path(args.src).resolve() if args.src else REPO_ROOT / SKELETON_DIR
        if not root.is_dir():
            raise SystemExit(f"--src {args.src}: not a directory")
        submission = stage_submission(root, submission_dir(root), tmp / "submission", scan=student)
        if student:
            warning = sandbox.unsandboxed_warning()
            if warning:
                print(warning, file=sys.stderr, flush=True)
            notes += submission_notes(submission, args, warning)
            integrity = submission.findings
            extra = {"ignored_files": submission.ignored, "integrity_flags": integrity, "sandboxed": warning is None}
        trusted = scratch.copy_repository(tmp / "trusted", TRUSTED_FOLDERS)  # for every test process, no student code
        package = make_package(tmp / "package", submission) if student else None
        env = {**child_env(args.solution, ("src_ref", ".")), sandbox.CGROUP_PREFIX_VARIABLE: groups}
        times, memory_mb = recorded_times(), default_memory_mb() if args.memory_mb is None else args.memory_mb or None
        save()
        for repeat, (index, day) in itertools.product(range(rounds), enumerate(days)):
            label = f"week {day.week} day {day.day}" + (f" (round {repeat + 1} of {rounds})" if rounds > 1 else "")
            print(f"[grade] {label}: {day.test_file}", file=sys.stderr, flush=True)
            if time.monotonic() >= started + args.budget:
                reports[index] = placeholder(day, "not run: the run's time budget ran out before this day")
            else:
                (tmp / f"{day.key}-{repeat}").mkdir()
                reports[index] = grade_day(day, args, tmp / f"{day.key}-{repeat}", trusted, env, package,
                                           day_cap(day, args, times), started + args.budget, memory_mb)
                graded.append(reports[index])
                cgroup.remove_all(groups)  # a test process killed at a limit cannot end its sandboxes itself
            save()
    finally:
        cgroup.remove_all(groups)
        shutil.rmtree(tmp, ignore_errors=True)
    if args.record_times:
        record_times(graded)
    print(render(reports, args.verbose, notes, args.solution, integrity))
    print(f"\ngraded {len(reports)} day(s) in {time.monotonic() - started:.0f} s")
    if json_path is not None:
        print(f"wrote {json_path}")
    return GRADER_FAILED if any(r.problems for r in reports) else 0


# ---------------------------------------------------------------- a Gradescope autograder

AUTOGRADER_PARTS = ("pyproject.toml", "pdm.lock", "README.md", "course", "maint", "scripts", "tests", "src", "src_ref",
                    "models/qwen2-tiny-random")
SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu, Python 3.11 or later):
# bubblewrap for the sandbox, then the course's packages from its lock file.
set -euo pipefail
apt-get update -qq
apt-get install -y -qq bubblewrap
cd /autograder/source/course
python3 -m pip install --quiet 'pdm[locked]'
PDM_CHECK_UPDATE=false pdm install --frozen-lockfile --prod
"""
RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for each submission: it grades /autograder/submission (a student's modules, in
# src/tiny_llm/, tiny_llm/ or the top folder) and writes /autograder/results/results.json. The variables
# below move each place, to run it elsewhere (the course's own test does).
course="${TINY_LLM_AUTOGRADER_COURSE:-/autograder/source/course}"
cd "$course" || exit 2
export PYTHONPATH=src:src_ref:.
exec "${TINY_LLM_AUTOGRADER_PYTHON:-$course/.venv/bin/python}" -m scripts.grade \\
    --src "${TINY_LLM_AUTOGRADER_SUBMISSION:-/autograder/submission}" \\
    --json "${TINY_LLM_AUTOGRADER_RESULTS:-/autograder/results/results.json}" "$@"
"""


def make_autograder(dest: Path) -> None:
    """Gradescope's autograder: setup.sh and run_autograder at the top (zip DIR's contents and upload them), and
    the course (tests, tooling, reference, embedded model) in course/, with the skeleton written afresh from the
    reference: whatever is in this checkout's src/tiny_llm (a student's work) never goes in."""
    from maint.make_skeleton import generate
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"--make-autograder {dest}: the folder is not empty")
    (dest / "course").mkdir(parents=True)
    for name in AUTOGRADER_PARTS:
        source = REPO_ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / "course" / name, ignore=scratch.IGNORE, symlinks=True)
        elif source.exists():
            shutil.copyfile(source, dest / "course" / name)
    for name, text in generate(REPO_ROOT / REFERENCE_DIR).items():
        (dest / "course" / SKELETON_DIR / name).write_text(text)
    for name, text in (("setup.sh", SETUP_SH), ("run_autograder", RUN_AUTOGRADER)):
        (dest / name).write_text(text)
        (dest / name).chmod(0o755)
    print(f"wrote a Gradescope autograder to {dest}: upload a zip of its contents "
          f"(cd {dest} && zip -r ../autograder.zip .)")


def _stop(signum, frame):
    raise KeyboardInterrupt  # so the test processes are killed on the way out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # bad arguments exit with status 2
    signal.signal(signal.SIGTERM, _stop)
    try:
        if args.make_autograder:
            make_autograder(Path(args.make_autograder).resolve())
            return 0
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
