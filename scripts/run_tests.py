"""Run the course's tests: a day, a week, or everything; against the student package or the reference.

    pdm run test --week 2 --day 7            # that day's tests, against src/tiny_llm
    pdm run test --week 2 --day 7 -- -k task_1   # narrowed to Task 1 (any pytest arguments after --)
    pdm run test --week 2 --day 7 --ref      # the same tests against the reference solution
    pdm run test-ref                         # every test against the reference

Every test has the grader's time limit (60 s; `-- --timeout=N` changes it): one that runs longer
fails with its name and where it was. A day or a week runs in one process, its failures in order; the
whole suite runs on one worker per core (pytest-xdist, at most 4; `-- -n 0` for one process, `-- -n N`
for N workers): much of it waits on subprocesses (sandboxes starting, time limits running out).
"""

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from course.course_map import DAYS, find_day
from course.isolated_pytest import TEST_TIME_LIMIT, child_env, pytest_command

REPO_ROOT = Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdm run test", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--week", type=int, help="only this week's days")
    parser.add_argument("--day", type=int, help="only this day (needs --week)")
    parser.add_argument("--ref", action="store_true", help="test the reference solution (same as --solution ref)")
    parser.add_argument("--solution", choices=["student", "ref"], default="student",
                        help="which package the tests grade (default: student, src/tiny_llm)")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest, after --")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Our options, plus everything else passed on to pytest (after `--` or not: pdm may drop the `--`)."""
    if "--" in argv:
        split = argv.index("--")
        ours, theirs = argv[:split], argv[split + 1:]
    else:
        ours, theirs = argv, []
    args, unknown = build_parser().parse_known_args(ours)
    args.pytest_args = [*args.pytest_args, *unknown, *theirs]
    return args


def test_targets(week: int | None, day: int | None) -> list[str]:
    """The test files to run; everything under tests/ when no week is given."""
    if day is not None and week is None:
        raise SystemExit("--day needs --week, e.g. `pdm run test --week 2 --day 7`")
    if week is None:
        return ["tests"]
    days = [find_day(week, day)] if day is not None else [d for d in DAYS if d.week == week]
    if not days:
        raise SystemExit(f"week {week} has no days in the course yet")
    missing = [d.test_file for d in days if not (REPO_ROOT / d.test_file).exists()]
    if missing:
        raise SystemExit(f"no tests yet: {', '.join(missing)}")
    return [d.test_file for d in days]


def with_time_limit(pytest_args: list[str]) -> list[str]:
    """The grader's per-test limit (pytest-timeout), unless the arguments set one: an endless loop fails
    with its test's name, not silence."""
    if any(arg.startswith("--timeout") for arg in pytest_args):
        return list(pytest_args)
    return [f"--timeout={TEST_TIME_LIMIT:g}", *pytest_args]


MAX_WORKERS = 4  # each worker loads its own models and starts its own servers: more costs memory, not time


def with_workers(pytest_args: list[str], whole_suite: bool) -> list[str]:
    """The whole suite on one worker per core (pytest-xdist), unless the arguments choose (`-n`) or xdist is not
    installed; tests/conftest.py keeps a file's tests on one worker and lets an `alone` test run by itself."""
    chosen = any(arg in ("-n", "no:xdist") or arg.startswith(("--numprocesses", "--dist"))
                 or (arg.startswith("-n") and arg[2:].isalnum()) for arg in pytest_args)
    if not whole_suite or chosen or importlib.util.find_spec("xdist") is None:
        return list(pytest_args)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(cores, MAX_WORKERS)
    return list(pytest_args) if workers < 2 else ["-n", str(workers), "--dist", "loadgroup", *pytest_args]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    solution = "ref" if args.ref else args.solution
    targets = test_targets(args.week, args.day)
    pytest_args = with_workers(with_time_limit(args.pytest_args), whole_suite=args.week is None)
    print(f"[tiny-llm] testing the {'reference' if solution == 'ref' else 'student'} solution: "
          f"{' '.join(targets)}", flush=True)
    # The same pytest command as the grader's, in its own process; its output goes straight to the terminal.
    process = subprocess.Popen(pytest_command([*targets, *pytest_args]), cwd=REPO_ROOT, env=child_env(solution))
    try:
        return process.wait()
    except KeyboardInterrupt:  # pytest got the Ctrl-C too: let it print its summary
        return process.wait()


if __name__ == "__main__":
    sys.exit(main())
