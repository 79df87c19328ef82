"""Grade the student package per week, day and task: a readable table and Gradescope's results.json.

    pdm run grade                          # every day that has tests, against src/tiny_llm
    pdm run grade --week 2 --day 6 7       # some days of a week
    pdm run grade --json results.json      # also write Gradescope's results.json
    pdm run grade --src path/to/submission # grade a submission (a directory of module files)
    pdm run grade --solution ref           # grade the reference (every task at full points)

What is graded, where it runs, how points are counted, what bounds a run: book/src/grading.md. Exit status 0 when
grading finished (whatever the score); 2 when the grader itself failed (the report is still written).
"""

import argparse
import errno
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
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path

from course import cgroup, sandbox, scratch
from course.course_map import DAYS, Day, find_day
from course.isolated_pytest import (TEST_TIME_LIMIT, CaseResult, RunResult, child_env, default_memory_mb,
                                    raise_if_stopped, run_test_file, stop_on_signal)
from course.remote import printable

REPO_ROOT = Path(__file__).resolve().parent.parent
SKELETON_DIR = Path("src") / "tiny_llm"
REFERENCE_DIR = Path("src_ref") / "tiny_llm_ref"
TRUSTED_FOLDERS = ("tests", "course", "src_ref", "scripts")  # what the test process needs besides the package
UNITS = 10_000  # points are counted in whole 1/10000 points, so sums are exact
GRADER_FAILED = 2
STATUS_WORDS = {"error": "error in set-up", "timeout": "timed out", "crashed": "crashed the test process",
                "not_run": "not run", "not_collected": "could not be collected"}
TIMES_FILE = REPO_ROOT / "course" / "grading_times.json"  # an honest run's seconds per day (maint/record_times.py)
CAP_FACTOR = 3.0  # a day's cap: this many times its recorded honest run, plus one test's time limit
DEFAULT_DAY_CAP = 600.0  # a day without a recorded time, and every day while maint/record_times.py records
MAX_FILE_BYTES = 1 << 20  # a submitted file larger than this is refused (the largest course module is 38 kB)
INIT_TEXT = '"""tiny_llm: the package being graded (this file is written by the grader)."""\n'


def course_modules() -> set[str]:
    return {module for day in DAYS for module in day.modules}


@dataclass
class CaseScore:
    day: Day
    task: int
    function: str
    nodeid: str
    outcome: str
    output: str
    units: int  # earned, in 1/UNITS points
    max_units: int

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"

    @property
    def status(self) -> str:  # the word the report shows
        unwritten = self.outcome == "failed" and "not implemented yet" in self.output
        return "not implemented yet" if unwritten else STATUS_WORDS.get(self.outcome, self.outcome)


@dataclass
class DayReport:
    day: Day
    tests: list[CaseScore] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # grader-side problems (exit 2)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    pending: bool = False  # not graded yet: a placeholder in a report written before the day is


@dataclass
class Submission:
    modules: set[str] = field(default_factory=set)  # the course modules taken from the submission
    ignored: list[str] = field(default_factory=list)  # files not graded
    refused: list[str] = field(default_factory=list)  # one line per file not read (a link, a device, too large)


# ---------------------------------------------------------------- arguments and selection

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run grade", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--week", type=int, help="grade only this week")
    parser.add_argument("--day", type=int, nargs="+", help="grade only these days of --week")
    parser.add_argument("--json", metavar="FILE", help="write Gradescope's results.json format to FILE")
    parser.add_argument("--src", metavar="DIR", help="grade the submission in DIR, DIR/tiny_llm or DIR/src/tiny_llm")
    parser.add_argument("--solution", choices=["student", "ref"], default="student",
                        help="grade the student package (default) or the reference (a sanity check)")
    parser.add_argument("--timeout", type=float, default=TEST_TIME_LIMIT, metavar="SECONDS",
                        help=f"time limit of one test (default {TEST_TIME_LIMIT:g})")
    parser.add_argument("--day-budget", type=float, default=None, metavar="SECONDS",
                        help=f"time cap of one day (default {CAP_FACTOR:g}x its recorded time plus --timeout)")
    parser.add_argument("--memory-mb", type=int, default=None, metavar="MB",
                        help="address-space limit of a test process (default: the machine's, at most 16384; 0: none)")
    parser.add_argument("--require-sandbox", action=argparse.BooleanOptionalAction, default=None,
                        help="refuse to grade a student's code where bubblewrap cannot start (default: with --json)")
    return parser


def select_days(week: int | None, days: list[int] | None) -> list[Day]:
    if days and week is None:
        raise SystemExit("--day needs --week, e.g. `pdm run grade --week 2 --day 7`")
    chosen = [find_day(week, d) for d in sorted(set(days))] if days else [d for d in DAYS if week in (None, d.week)]
    if not chosen:
        raise SystemExit(f"week {week} is not in the course (weeks {DAYS[0].week} to {DAYS[-1].week})")
    return chosen


# ---------------------------------------------------------------- staging the submission

def submission_dir(src: Path) -> Path:
    """Where the modules are in a submission: DIR/src/tiny_llm, DIR/tiny_llm, or DIR itself (never through a
    link: a submission with no modules of its own is graded as the untouched skeleton)."""
    for candidate in (src / "src" / "tiny_llm", src / "tiny_llm"):
        links = [p for p in (candidate, candidate.parent) if src in p.parents and p.is_symlink()]
        if candidate.is_dir() and not links and any(candidate.glob("*.py")):
            return candidate
    return src


def read_regular(path: Path) -> bytes:
    """A submitted file's bytes if it is a regular file of its own of at most MAX_FILE_BYTES, checked on a descriptor
    opened without following a link or blocking; else ValueError saying what it is (grading.md, "The threat model")."""
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


def stage_submission(root: Path, package: Path) -> Submission:
    """The package being graded (grading.md, "What is graded"): every file of the submission read by `read_regular`
    (a refused module counts as missing), the course modules staged and the others listed."""
    package.mkdir(parents=True)
    wanted, provided = course_modules(), {p.name for p in (REPO_ROOT / SKELETON_DIR).glob("*.py")}
    for name in provided:  # provided code is the reference's: this checkout's src/tiny_llm may be a student's
        shutil.copyfile(REPO_ROOT / (SKELETON_DIR if name[:-3] in wanted else REFERENCE_DIR) / name, package / name)
    (package / "__init__.py").write_text(INIT_TEXT)
    submission, modules_dir = Submission(), submission_dir(root)
    for folder, dirs, files in os.walk(root):  # never into a link to a directory: it is listed, as a file is
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", ".git"))
        for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(folder, d))
                                    or (Path(folder) == modules_dir and d.endswith(".py"))]):
            path = Path(folder) / name
            shown = printable(path.relative_to(root).as_posix())
            module = path.parent == modules_dir and path.suffix == ".py" and path.stem in wanted
            try:
                data = read_regular(path)  # every file, so that a link anywhere is named in the report
            except ValueError as why:
                submission.refused.append(f"{shown}: not read ({why})" + (": graded as missing" if module else ""))
                continue
            if module:
                (package / name).write_bytes(data)
                submission.modules.add(path.stem)
            elif not (path.parent == modules_dir and name in provided
                      and data == (REPO_ROOT / REFERENCE_DIR / name).read_bytes()):
                submission.ignored.append(shown)  # not provided code left unchanged
    return submission


# ---------------------------------------------------------------- scoring

def split(total: int, count: int) -> list[int]:
    """`total` in `count` whole shares as even as can be, the remainder to the first ones: they add up exactly."""
    return [total // count + (i < total % count) for i in range(count)]


def score_day(day: Day, run: RunResult) -> DayReport:
    """Each case's points (grading.md, "How points are counted") among the cases collected; a task none of whose
    tests was collected counts as one case, at zero."""
    report = DayReport(day, seconds=run.seconds)
    cases: dict[str, list[str]] = {}
    for nodeid in run.expected:
        cases.setdefault(nodeid.split("::")[-1].split("[")[0], []).append(nodeid)
    why = "\n".join(run.collect_errors + run.problems)
    for task, points in sorted(day.points.items()):
        names = [f for f in cases if f.startswith(f"test_task_{task}_")] or [f"test_task_{task}_*"]
        for function, share in zip(names, split(points * UNITS, len(names))):
            nodeids = cases.get(function, [f"{day.test_file}::{function}"])
            for nodeid, units in zip(nodeids, split(share, len(nodeids))):
                result = run.results.get(nodeid) or CaseResult(nodeid, "not_collected" if why else "not_run",
                                                               why or "the test process did not report this test")
                report.tests.append(CaseScore(day, task, function, nodeid, result.outcome, printable(result.output),
                                              units if result.ok else 0, units))
    if why:
        report.problems.append(f"{day.test_file} could not be run as a whole:\n{why}")
    return report


# ---------------------------------------------------------------- output

def first_lines(text: str, count: int = 3) -> str:
    """The most telling lines of a failure ("E   assert ..."), and the innermost frame in the student's package."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    chosen = [line for line in lines if line.startswith(("E ", "timed out", "the test process died", "not run"))
              or "not implemented yet" in line][:count] or lines[:count]
    where = [line for line in lines if re.search(r"src/tiny_llm\S*:\d+", line)][-1:]
    if where and where[0] not in chosen:
        chosen = chosen[: count - 1] + where
    return "\n".join("      " + line[:160] for line in chosen)


def task_status(tests: list[CaseScore]) -> str:
    bad = [t for t in tests if not t.passed]
    if not bad:
        return f"passed ({len(tests)} test{'s' * (len(tests) != 1)})"
    return f"{len(bad)} of {len(tests)} not passed: {', '.join(sorted({t.status for t in bad}))}"


def points(units: int) -> str:
    """Exact: 2099999 units are "209.9999", never "209.99999999999966"."""
    return str(Decimal(units) / UNITS)


def render(reports: list[DayReport], notes: list[str], solution: str) -> str:
    lines = [f"Grading the {'reference' if solution == 'ref' else 'student'} solution", "",
             f"{'week':>4} {'day':>4} {'task':>4}  {'points':>13}  status",
             f"{'-' * 4:>4} {'-' * 4:>4} {'-' * 4:>4}  {'-' * 13:>13}  {'-' * 40}"]
    for report in reports:
        for task in sorted(report.day.points):
            tests = [t for t in report.tests if t.task == task]
            got, of = sum(t.units for t in tests), sum(t.max_units for t in tests)
            status = "not graded: the run stopped before this day" if report.pending else task_status(tests)
            lines.append(f"{report.day.week:>4} {report.day.day:>4} {task:>4}  {got / UNITS:>6.1f} / {points(of):<4}  "
                         f"{status}")
    every = [t for r in reports for t in r.tests]
    lines += ["", f"total: {points(sum(t.units for t in every))} / {points(sum(t.max_units for t in every))}"]
    groups: dict[tuple, list[CaseScore]] = {}  # cases of one test function that fail the same way are shown once
    for test in (t for r in reports if not r.pending for t in r.tests if not t.passed):
        groups.setdefault((test.function, test.status, first_lines(test.output)), []).append(test)
    lines += ["", "Tests not passed:"] if groups else []
    for (function, word, text), tests in groups.items():
        name = tests[0].nodeid if len(tests) == 1 else f"{tests[0].day.test_file}::{function} ({len(tests)} cases)"
        lines += [f"  {name}  [{word}]", text]
    notes = notes + [n for r in reports for n in r.notes]
    lines += ["", "Notes:", *(f"  - {n}" for n in notes)] if notes else []
    problems = [f"  - {p.splitlines()[0]}" for r in reports for p in r.problems]
    lines += ["", "GRADER PROBLEMS (not the student's code; these tests are at zero):", *problems] if problems else []
    return printable("\n".join(lines))


def gradescope_results(reports: list[DayReport], summary: str, seconds: float, extra: dict) -> dict:
    """Gradescope's results.json: top-level score and output, one entry per test case."""
    graded = [t for r in reports for t in r.tests]
    tests = [{"name": f"Week {t.day.week} Day {t.day.day} Task {t.task}: {t.nodeid.split('::')[-1]}",
              "score": t.units / UNITS, "max_score": t.max_units / UNITS, "status": "passed" if t.passed else "failed",
              "output": "passed" if t.passed else f"{t.status}\n{t.output}".strip(),
              "tags": [f"week {t.day.week}", f"day {t.day.week}.{t.day.day}", f"task {t.task}"],
              "visibility": "visible"} for t in graded]
    return {"score": sum(t.units for t in graded) / UNITS, "execution_time": round(seconds), "output": summary,
            "visibility": "visible", "stdout_visibility": "visible", "tests": tests,
            "extra_data": {"max_score": sum(t.max_units for t in graded) / UNITS,
                           "not_graded": [f"{r.day.week}.{r.day.day}" for r in reports if r.pending],
                           "seconds": {f"{r.day.week}.{r.day.day}": r.seconds for r in reports if not r.pending},
                           **extra}}


def write_atomically(path: Path, text: str) -> None:
    """Readers see the old report or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


# ---------------------------------------------------------------- main

def day_cap(day: Day, args: argparse.Namespace, times: dict[str, float]) -> float:
    """A day's flat time cap (grading.md, "A day has a flat time cap"): CAP_FACTOR x its recorded honest time plus
    one test's limit, never less than the default one; --day-budget replaces it."""
    if args.day_budget is not None or day.key not in times:
        return args.day_budget or DEFAULT_DAY_CAP
    return CAP_FACTOR * times[day.key] + max(args.timeout, TEST_TIME_LIMIT)


def submission_notes(submission: Submission, args: argparse.Namespace) -> list[str]:
    """What the report says about the submission's files: not graded, missing, not read."""
    notes, missing = [], sorted(course_modules() - submission.modules)
    if submission.ignored:
        more = [f"and {len(submission.ignored) - 20} more"] if len(submission.ignored) > 20 else []
        notes.append(f"not graded (only the course's module files are): {', '.join(submission.ignored[:20] + more)}")
    if args.src and missing:
        notes.append(f"the submission has no {', '.join(m + '.py' for m in missing)}: the skeleton's are graded")
    return notes + submission.refused


def grade_day(day: Day, args: argparse.Namespace, work: Path, trusted: Path, env: dict, package: Path | None,
              cap: float, memory_mb: int | None) -> DayReport:
    """One day's tests in a trusted process of their own, the submission's code in sandboxes beside it."""
    work.mkdir()
    if package is not None:
        root = sandbox.prepare_root(work / "sandbox", package, REPO_ROOT / REFERENCE_DIR, REPO_ROOT / "course",
                                    day.week, day.day)
        (work / "logs").mkdir()  # the workers' output: a test process killed at a limit cannot clean up
        env = {**env, sandbox.SANDBOX_ROOT_VARIABLE: str(root), sandbox.LOGS_VARIABLE: str(work / "logs"),
               sandbox.LIMITS_VARIABLE: f"{cap:.0f},{memory_mb or 0}"}
    run = run_test_file(day.test_file, trusted, env, timeout=args.timeout, cap=cap, memory_mb=memory_mb)
    report = score_day(day, run)
    if run.out_of_time:
        how = "--day-budget" if args.day_budget else f"{CAP_FACTOR:g}x an honest run plus one test's limit"
        report.notes.append(f"week {day.week} day {day.day}: stopped when its time budget ran out ({cap:.0f} s: {how})")
    return report


def grade(args: argparse.Namespace) -> int:
    started = time.monotonic()
    student = args.solution == "student"
    if student and (args.json if args.require_sandbox is None else args.require_sandbox) and not sandbox.bwrap_path():
        print(f"grade: refused: the sandbox cannot start here ({sandbox.why_unsandboxed()}); "
              "--no-require-sandbox grades without it", file=sys.stderr)
        return GRADER_FAILED
    days, notes = select_days(args.week, args.day), []
    groups = f"tiny-llm-grade-{os.getpid()}-"  # the cgroups of this run's sandboxes, removed after each day
    reports, extra = [replace(score_day(d, RunResult(d.test_file)), pending=True) for d in days], {}  # 0 till graded
    tmp = Path(tempfile.mkdtemp(prefix="tiny-llm-grade-"))

    def save() -> None:
        if args.json:
            results = gradescope_results(reports, render(reports, notes, args.solution),
                                         time.monotonic() - started, extra)
            write_atomically(Path(args.json).resolve(), json.dumps(results, indent=2) + "\n")

    try:
        root, package = Path(args.src).resolve() if args.src else REPO_ROOT / SKELETON_DIR, None
        if not root.is_dir():
            raise SystemExit(f"--src {args.src}: not a directory")
        if student:  # the reference is trusted: it runs in the test process, unsandboxed
            submission, package = stage_submission(root, tmp / "package"), tmp / "package"
            warning = sandbox.unsandboxed_warning()
            if warning:
                print(warning, file=sys.stderr, flush=True)
            notes += ([warning.removeprefix("grade: ")] if warning else []) + submission_notes(submission, args)
            extra = {"ignored_files": submission.ignored, "sandboxed": warning is None}
        trusted = scratch.copy_repository(tmp / "trusted", TRUSTED_FOLDERS)  # for every test process, no student code
        env = {**child_env(args.solution, ("src_ref", ".")), sandbox.CGROUP_PREFIX_VARIABLE: groups}
        times = json.loads(TIMES_FILE.read_text()) if TIMES_FILE.exists() else {}
        memory_mb = default_memory_mb() if args.memory_mb is None else args.memory_mb or None
        save()
        for index, day in enumerate(days):
            print(f"[grade] week {day.week} day {day.day}: {day.test_file}", file=sys.stderr, flush=True)
            reports[index] = grade_day(day, args, tmp / day.key, trusted, env, package, day_cap(day, args, times),
                                       memory_mb)
            cgroup.remove_all(groups)  # a test process killed at a limit cannot end its sandboxes itself
            save()
        raise_if_stopped()
    finally:
        cgroup.remove_all(groups)
        shutil.rmtree(tmp, ignore_errors=True)
    print(render(reports, notes, args.solution))
    print(f"\ngraded {len(reports)} day(s) in {time.monotonic() - started:.0f} s")
    if args.json:
        print(f"wrote {Path(args.json).resolve()}")
    return GRADER_FAILED if any(r.problems for r in reports) else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # bad arguments exit with status 2
    signal.signal(signal.SIGTERM, stop_on_signal)  # as Ctrl-C: the test processes are killed on the way out
    try:
        return grade(args)
    except KeyboardInterrupt:
        print("grade: interrupted; the report (--json) holds the days graded so far", file=sys.stderr)
        return 130
    except SystemExit as stop:  # a selection or --src that cannot be graded: one line
        print(f"grade: {stop.code}", file=sys.stderr)
        return GRADER_FAILED
    except Exception:
        traceback.print_exc()
        print("grade: the grader itself failed (see above); no grade was produced", file=sys.stderr)
        return GRADER_FAILED


if __name__ == "__main__":
    sys.exit(main())
