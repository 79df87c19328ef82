"""Check that the untouched skeleton fails cleanly: every day's tests are collected and fail, none errors.

A student who clones the course and runs a day's tests must see failures that say "not implemented
yet" and name the chapter, never an import error, a collection error or a crash in a fixture. CI runs
this on the committed skeleton:

    pdm run python -m maint.check_skeleton
    pdm run python -m maint.check_skeleton --write-tasks   # after adding or renumbering a task

It also checks `course/tasks.json`, the table of which task each skeleton function belongs to (the
selector, course/selector.py, reads it): `--write-tasks` rewrites it from the untouched skeleton.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from course.course_map import DAYS
from course.selector import TASKS_FILE, task_table_of

REPO_ROOT = Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m maint.check_skeleton", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-tasks", action="store_true",
                        help="rewrite course/tasks.json from the skeleton's markers, then check")
    return parser


def tasks_json_text() -> str:
    return json.dumps(task_table_of(), indent=1, sort_keys=True) + "\n"


def run_student_tests(test_files: list[str], report: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TINY_LLM_SOLUTION": "student"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               *test_files]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)


def classify(report: Path) -> dict[str, list[str]]:
    """Test ids by outcome, read from pytest's JUnit XML report."""
    outcomes = {"passed": [], "not_implemented": [], "failed_otherwise": [], "error": [], "skipped": []}
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        failure, error, skipped = case.find("failure"), case.find("error"), case.find("skipped")
        if error is not None:
            outcomes["error"].append(test_id)
        elif skipped is not None:
            outcomes["skipped"].append(test_id)
        elif failure is None:
            outcomes["passed"].append(test_id)
        elif "not implemented yet" in (failure.get("message", "") + (failure.text or "")):
            outcomes["not_implemented"].append(test_id)
        else:
            outcomes["failed_otherwise"].append(test_id)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.write_tasks:
        TASKS_FILE.write_text(tasks_json_text())
        print(f"check-skeleton: wrote {TASKS_FILE.relative_to(REPO_ROOT)}")
    test_files = [d.test_file for d in DAYS if (REPO_ROOT / d.test_file).exists()]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        result = run_student_tests(test_files, report)
        if not report.exists():
            print(result.stdout[-4000:], result.stderr[-4000:])
            print("check-skeleton: pytest produced no report")
            return 1
        outcomes = classify(report)
    total = sum(len(v) for v in outcomes.values())
    print(f"check-skeleton: {total} day tests in {len(test_files)} files against the untouched skeleton")
    for outcome, ids in outcomes.items():
        print(f"  {outcome:17s} {len(ids)}")
    problems = []
    if not TASKS_FILE.exists() or TASKS_FILE.read_text() != tasks_json_text():
        problems.append("course/tasks.json does not match the skeleton's markers "
                        "(refresh: pdm run python -m maint.check_skeleton --write-tasks)")
    if total == 0:
        problems.append("no day tests were collected")
    if outcomes["error"] or result.returncode in (2, 3, 4):
        problems.append("tests errored (import, collection or fixture errors): " + ", ".join(outcomes["error"][:10]))
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
