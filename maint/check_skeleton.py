"""Check that the untouched skeleton fails cleanly: every day's tests are collected and fail, none errors.

A student who clones the course and runs a day's tests must see failures that say "not implemented
yet" and name the chapter, never an import error, a collection error or a crash in a fixture. CI runs
this on the committed skeleton:

    pdm run python -m maint.check_skeleton

The skeleton itself, and `course/tasks.json`, are written from the reference by
`pdm run python -m maint.make_skeleton` (its `--check` says when they are stale).
"""

import argparse
import sys
from pathlib import Path

from course.course_map import DAYS
from course.isolated_pytest import RunResult, child_env, run_test_file

REPO_ROOT = Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="python -m maint.check_skeleton", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def run_student_tests(test_files: list[str]) -> RunResult:
    """The day tests against the student package, in one pytest process (restarted only after a crash)."""
    return run_test_file(test_files, REPO_ROOT, child_env("student"), timeout=120.0)


def classify(run: RunResult) -> dict[str, list[str]]:
    """Test ids by outcome."""
    outcomes = {"passed": [], "not_implemented": [], "failed_otherwise": [], "error": [], "skipped": []}
    for result in run.results.values():
        if result.ok:
            outcomes["passed"].append(result.nodeid)
        elif result.outcome == "skipped":
            outcomes["skipped"].append(result.nodeid)
        elif result.outcome == "failed" and "not implemented yet" in result.output:
            outcomes["not_implemented"].append(result.nodeid)
        elif result.outcome == "failed":
            outcomes["failed_otherwise"].append(result.nodeid)
        else:  # an error in set-up, a time-out, a crash
            outcomes["error"].append(f"{result.nodeid} ({result.outcome})")
    return outcomes


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)
    test_files = [d.test_file for d in DAYS if (REPO_ROOT / d.test_file).exists()]
    run = run_student_tests(test_files)
    if run.problems or run.collect_errors:
        print("\n".join(run.problems + run.collect_errors)[-4000:])
        print("check-skeleton: pytest could not run the day tests")
        return 1
    outcomes = classify(run)
    total = sum(len(v) for v in outcomes.values())
    print(f"check-skeleton: {total} day tests in {len(test_files)} files against the untouched skeleton")
    for outcome, ids in outcomes.items():
        print(f"  {outcome:17s} {len(ids)}")
    problems = []
    if total == 0:
        problems.append("no day tests were collected")
    if outcomes["error"]:
        problems.append("tests errored (import, collection or fixture errors, time-outs, crashes): "
                        + ", ".join(outcomes["error"][:10]))
    if outcomes["skipped"]:
        problems.append("tests were skipped: " + ", ".join(outcomes["skipped"][:10]))
    if outcomes["passed"]:
        problems.append("tests pass against the empty skeleton (they cannot fail): " + ", ".join(outcomes["passed"]))
    for outcome in ("failed_otherwise",):
        if outcomes[outcome]:
            problems.append("tests fail without a 'not implemented yet' message: " + ", ".join(outcomes[outcome]))
    for problem in problems:
        print(f"check-skeleton: FAIL: {problem}")
    if not problems:
        print("check-skeleton: OK: every day test fails with 'not implemented yet'")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
