"""Grade the student package: per week, day and task, a readable table and a machine-readable report.

    pdm run grade                          # every day that has tests, against src/tiny_llm
    pdm run grade --week 1                 # one week
    pdm run grade --week 2 --day 6 7       # some days of a week
    pdm run grade --json results.json      # also write Gradescope's results.json
    pdm run grade --src path/to/submission # grade a submission without touching the repo
    pdm run grade --solution ref           # grade the reference (every task at full points)

Each day's test file runs in its own pytest process (course/isolated_pytest.py), each test under a
time limit (--timeout). A test that hangs, crashes the interpreter, or meets a module that fails at
import scores zero; every other test is still run and scored, and the report is always complete.
This process never imports the code it grades.

Points are declared once, in course/course_map.py (`Day.points`: task -> points). A task's points are
split evenly across its test functions (`test_task_N_...`), and a parametrized test's share evenly
across its cases, so partial work earns partial points.

Exit status: 0 when grading finished (whatever the score); 2 when the grader itself failed: bad
arguments, an error in the grader, or a day whose tests could not be run at all (pytest did not start
or could not collect the file: a course or environment problem, not the student's). With 2 the report
is still written when possible, with those tests at zero.
"""

import argparse
import ast
import json
import re
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from course.course_map import DAYS, Day
from course.isolated_pytest import CaseResult, RunResult, child_env, run_test_file

REPO_ROOT = Path(__file__).resolve().parent.parent
SKELETON_DIR = Path("src") / "tiny_llm"
TASK_TEST = re.compile(r"^test_task_(\d+)_")
GRADER_FAILED = 2
STATUS_WORDS = {
    "passed": "passed", "xfailed": "passed", "failed": "failed", "error": "error in set-up",
    "skipped": "skipped", "timeout": "timed out", "crashed": "crashed the interpreter",
    "not_run": "not run", "not_collected": "could not be collected",
}


# ---------------------------------------------------------------- data

@dataclass
class CaseScore:
    day: Day
    task: int | None  # None: not a task test (no points)
    function: str
    nodeid: str
    outcome: str
    output: str
    score: float
    max_score: float

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


# ---------------------------------------------------------------- arguments and selection

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run grade", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--week", type=int, help="grade only this week")
    parser.add_argument("--day", type=int, nargs="+", help="grade only these days of --week")
    parser.add_argument("--json", metavar="FILE", help="write Gradescope's results.json format to FILE")
    parser.add_argument("--src", metavar="DIR",
                        help="a submission to grade instead of src/tiny_llm: a directory holding the modules "
                             "(or holding tiny_llm/ or src/tiny_llm/); graded in a temporary copy of the repo")
    parser.add_argument("--solution", choices=["student", "ref"], default="student",
                        help="grade the student package (default) or the reference (a sanity check)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="time limit of one test (default 60)")
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


# ---------------------------------------------------------------- workspace for --src

def submission_dir(src: Path) -> Path:
    """Where the modules are in a submission: DIR/src/tiny_llm, DIR/tiny_llm, or DIR itself."""
    for candidate in (src / "src" / "tiny_llm", src / "tiny_llm", src):
        if candidate.is_dir() and any(candidate.glob("*.py")):
            return candidate
    raise SystemExit(f"--src {src}: no Python modules found there (nor in {src}/tiny_llm or {src}/src/tiny_llm)")


def make_workspace(repo: Path, src: Path, dest: Path) -> list[str]:
    """A copy of the repo at `dest` whose src/tiny_llm is the submission; returns notes for the report.

    Only the submission's module files are taken from it; a module it lacks is the untouched skeleton's,
    so that module's tasks fail with "not implemented yet" rather than an import error.
    """
    modules_dir = submission_dir(src)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in ("scripts", "course", "maint", "tests", "src_ref"):
        shutil.copytree(repo / name, dest / name, ignore=ignore)
    for name in ("pyproject.toml",):
        shutil.copy2(repo / name, dest / name)
    if (repo / "models").exists():
        (dest / "models").symlink_to((repo / "models").resolve(), target_is_directory=True)
    target = dest / SKELETON_DIR
    shutil.copytree(repo / SKELETON_DIR, target, ignore=ignore)
    skeleton_modules = {p.name for p in target.glob("*.py")}
    submitted = {p.name for p in modules_dir.glob("*.py")}
    for name in sorted(submitted):
        shutil.copy2(modules_dir / name, target / name)
    notes = []
    missing = sorted(skeleton_modules - submitted - {"__init__.py"})
    if missing:
        notes.append(f"the submission has no {', '.join(missing)}: the untouched skeleton's are graded")
    return notes


# ---------------------------------------------------------------- scoring

def task_functions(test_file: Path) -> list[str]:
    """The `test_task_N_...` functions of a test file, in order, read with `ast` (never imported here).

    They are known even when the file cannot be collected, so their points still appear, at zero.
    """
    try:
        tree = ast.parse(test_file.read_text(), filename=str(test_file))
    except SyntaxError:
        return []  # pytest reports the error when it collects the file
    scopes = [tree] + [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name.startswith("Test")]
    return [node.name for scope in scopes for node in scope.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and TASK_TEST.match(node.name)]


def function_of(nodeid: str) -> str:
    return nodeid.split("::")[-1].split("[")[0]


def task_of(function: str) -> int | None:
    match = TASK_TEST.match(function)
    return int(match.group(1)) if match else None


def score_day(day: Day, functions: list[str], run: RunResult) -> DayReport:
    """Spread each task's points over its test functions, and each function's share over its cases."""
    report = DayReport(day, seconds=run.seconds)
    cases: dict[str, list[CaseResult]] = {}
    for result in run.results.values():
        cases.setdefault(function_of(result.nodeid), []).append(result)
    for function in functions + [f for f in cases if f not in functions]:
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
        share = points / len(task_functions_)
        for function in task_functions_:
            results = cases[function]
            if not results:
                # Never collected (the file did not import) or never reported: zero, with the reason.
                results = [CaseResult(f"{day.test_file}::{function}", "not_collected",
                                      collect_output or "pytest did not report this test")]
            for result in results:
                each = share / len(results)
                earned = each if result.ok else 0.0
                report.tests.append(CaseScore(day, task, function, result.nodeid, result.outcome, result.output,
                                              earned, each))
    broken = bool(run.problems or run.collect_errors)
    for task in sorted(set(day.points) - set(by_task)):
        if broken:
            # The file could not be read at all: its tasks count, at zero, with the reason.
            report.tests.append(CaseScore(day, task, f"test_task_{task}", f"{day.test_file}::test_task_{task}_*",
                                          "not_collected", collect_output, 0.0, float(day.points[task])))
            continue
        report.notes.append(f"Task {task} of week {day.week} day {day.day} has points but no tests "
                            f"named test_task_{task}_... in {day.test_file}: left out of the total")
    if broken:
        report.problems.append(f"{day.test_file} could not be run as a whole:\n{collect_output}")
    return report


def grade_day(day: Day, root: Path, solution: str, timeout: float) -> DayReport:
    test_file = root / day.test_file
    functions = task_functions(test_file)
    run = run_test_file(day.test_file, root, child_env(solution), timeout=timeout)
    return score_day(day, functions, run)


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


def render(reports: list[DayReport], verbose: bool, workspace_notes: list[str], solution: str) -> str:
    lines = [f"Grading the {'reference' if solution == 'ref' else 'student'} solution", "",
             f"{'week':>4} {'day':>4} {'task':>4}  {'points':>13}  status",
             f"{'-' * 4:>4} {'-' * 4:>4} {'-' * 4:>4}  {'-' * 13:>13}  {'-' * 40}"]
    total = maximum = 0.0
    for report in reports:
        tasks: dict[int, list[CaseScore]] = {}
        for test in report.tests:
            if test.task is not None:
                tasks.setdefault(test.task, []).append(test)
        for task, tests in sorted(tasks.items()):
            got, of = sum(t.score for t in tests), sum(t.max_score for t in tests)
            total, maximum = total + got, maximum + of
            lines.append(f"{report.day.week:>4} {report.day.day:>4} {task:>4}  {got:>6.1f} / {of:<4g}  "
                         f"{task_status(tests)}")
    lines += ["", f"total: {total:.1f} / {maximum:g}"]
    details = [t for r in reports for t in r.tests if not t.passed]
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
    problems = [p for r in reports for p in r.problems]
    if problems:
        lines += ["", "GRADER PROBLEMS (not the student's code; these tests are at zero):"]
        lines += [f"  - {p.splitlines()[0]}" for p in problems]
    return "\n".join(lines)


def gradescope_results(reports: list[DayReport], summary: str, seconds: float) -> dict:
    """Gradescope's results.json: top-level score and output, one entry per test case."""
    tests = []
    for report in reports:
        for test in report.tests:
            if test.task is None:
                continue
            tests.append({
                "name": test.name,
                "score": round(test.score, 4),
                "max_score": round(test.max_score, 4),
                "status": "passed" if test.passed else "failed",
                "output": (f"{status_word(test)}\n{test.output}".strip()
                           if not test.passed else "passed"),
                "tags": [f"week {test.day.week}", f"day {test.day.week}.{test.day.day}", f"task {test.task}"],
                "visibility": "visible",
            })
    graded = [t for r in reports for t in r.tests if t.task is not None]
    return {
        "score": round(sum(t.score for t in graded), 3),
        "execution_time": round(seconds),
        "output": summary,
        "visibility": "visible",
        "stdout_visibility": "visible",
        "tests": tests,
        "extra_data": {"max_score": round(sum(t.max_score for t in graded), 3)},
    }


# ---------------------------------------------------------------- main

def grade(args: argparse.Namespace) -> int:
    started = time.monotonic()
    days = select_days(args.week, args.day)
    with tempfile.TemporaryDirectory(prefix="tiny-llm-grade-") as tmp:
        root, workspace_notes = REPO_ROOT, []
        if args.src:
            root = Path(tmp) / "repo"
            root.mkdir()
            workspace_notes = make_workspace(REPO_ROOT, Path(args.src).resolve(), root)
        reports = []
        for day in days:
            if not (root / day.test_file).exists():
                workspace_notes.append(f"week {day.week} day {day.day}: no tests yet ({day.test_file}), not graded")
                continue
            print(f"[grade] week {day.week} day {day.day}: {day.test_file}", file=sys.stderr, flush=True)
            reports.append(grade_day(day, root, args.solution, args.timeout))
    if not reports:
        print("grade: no day in the selection has tests yet", file=sys.stderr)
        return GRADER_FAILED
    summary = render(reports, args.verbose, workspace_notes, args.solution)
    print(summary)
    seconds = time.monotonic() - started
    print(f"\ngraded {len(reports)} day(s) in {seconds:.0f} s")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(gradescope_results(reports, summary, seconds), indent=2) + "\n")
        print(f"wrote {path}")
    return GRADER_FAILED if any(r.problems for r in reports) else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # bad arguments exit with status 2
    try:
        return grade(args)
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
