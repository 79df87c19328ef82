"""Prove that each day stands alone: the untouched skeleton plus only that day's modules passes its tests.

    pdm run check-days                  # every day that has a test file
    pdm run check-days --week 2 --day 7 # one day
    pdm run check-days --skeleton-rev HEAD   # take the skeleton from a commit instead of the working tree

For each day of course/course_map.py, in a temporary copy of the repo: src/tiny_llm is reset to the
untouched skeleton, the day's modules (`Day.modules`) are copied in from src_ref/tiny_llm_ref (the
reference uses relative imports, so its files drop in unchanged), and the day's test file runs
against the student package, in its own pytest process with a time limit per test. Every test must
pass. This is what a student who starts the course at that day has: their own work on that day's
modules, the skeleton everywhere else. With --by-task only the functions whose skeleton body names
the day are filled in, as a student who does just that day's tasks has them; the selector
(course/selector.py) serves every other task from the reference.

The skeleton comes from the working tree by default (what CI checks out, and what a maintainer is
editing); --skeleton-rev REV takes it from a commit instead, when the working copy holds solutions.
Exit status: 0 when every checked day passes, 1 when one does not, 2 on bad arguments.
"""

import argparse
import ast
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from course.course_map import DAYS, Day
from course.isolated_pytest import child_env, run_test_file
from course.scratch import copy_repository
from course.selector import definitions, unwritten_in_source

REPO_ROOT = Path(__file__).resolve().parent.parent
SKELETON = Path("src") / "tiny_llm"
REFERENCE = Path("src_ref") / "tiny_llm_ref"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run check-days", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--week", type=int, help="only this week's days")
    parser.add_argument("--day", type=int, nargs="+", help="only these days of --week")
    parser.add_argument("--skeleton-rev", metavar="REV",
                        help="take the untouched skeleton from this git commit (default: the working tree)")
    parser.add_argument("--by-task", action="store_true",
                        help="stricter: fill only the functions whose skeleton body names this day "
                             "(NotImplementedError(\"Week W Day D ...\")), not whole modules; shows when a day "
                             "needs an earlier day's part of a module they share")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                        help="time limit of one test (default 120)")
    return parser


def skeleton_files(rev: str | None) -> dict[str, bytes]:
    """The skeleton's files (name -> bytes), from the working tree or from a commit."""
    if rev is None:
        return {p.name: p.read_bytes() for p in sorted((REPO_ROOT / SKELETON).glob("*.py"))}
    listing = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{SKELETON.as_posix()}"], cwd=REPO_ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    return {name: subprocess.run(["git", "show", f"{rev}:{SKELETON.as_posix()}/{name}"], cwd=REPO_ROOT,
                                 capture_output=True, check=True).stdout
            for name in listing if name.endswith(".py")}


def make_workspace(dest: Path) -> None:
    """A copy of what the tests need; the model directory is linked, not copied."""
    copy_repository(dest, ("scripts", "course", "maint", "tests", "src_ref"))


def fill_day(dest: Path, skeleton: dict[str, bytes], day: Day) -> list[str]:
    """Reset src/tiny_llm to the skeleton, then copy in the day's modules from the reference."""
    package = dest / SKELETON
    shutil.rmtree(package, ignore_errors=True)
    package.mkdir(parents=True)
    for name, data in skeleton.items():
        (package / name).write_bytes(data)
    problems = []
    for module in day.modules:
        source = REPO_ROOT / REFERENCE / f"{module}.py"
        if not source.exists():
            problems.append(f"the reference has no {module}.py")
            continue
        if f"{module}.py" not in skeleton:
            problems.append(f"the skeleton has no {module}.py")
        shutil.copy2(source, package / f"{module}.py")
    return problems


def _span(node) -> tuple[int, int]:
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return start - 1, node.end_lineno


def fill_day_tasks(skeleton_text: str, reference_text: str, day: Day) -> tuple[str, list[str]]:
    """The skeleton module with only the day's TODO functions replaced by the reference's definitions.

    A function is the day's when its skeleton body raises NotImplementedError("Week W Day D ...").
    The reference's top-level imports are added, since a filled body may need one the skeleton lacks.
    """
    skeleton_tree, reference_tree = ast.parse(skeleton_text), ast.parse(reference_text)
    skeleton_defs = definitions(skeleton_tree)
    todo = {name: skeleton_defs[name] for name, task in unwritten_in_source(skeleton_text).items()
            if task.day_key == (day.week, day.day)}
    reference_defs = definitions(reference_tree)
    lines, reference_lines = skeleton_text.splitlines(), reference_text.splitlines()
    missing = [name for name in todo if name not in reference_defs]
    for name, node in sorted(todo.items(), key=lambda item: -item[1].lineno):
        if name in reference_defs:
            start, end = _span(node)
            ref_start, ref_end = _span(reference_defs[name])
            lines[start:end] = reference_lines[ref_start:ref_end]
    imports = [reference_lines[n.lineno - 1:n.end_lineno] for n in reference_tree.body
               if isinstance(n, (ast.Import, ast.ImportFrom))]
    present = set(skeleton_text.splitlines())
    added = [line for block in imports for line in block if line not in present]
    if added:
        body_start = max([n.end_lineno for n in skeleton_tree.body if isinstance(n, (ast.Import, ast.ImportFrom))],
                         default=0)
        lines[body_start:body_start] = added
    return "\n".join(lines) + "\n", [f"the reference has no {name}" for name in missing]


def check_day(dest: Path, skeleton: dict[str, bytes], day: Day, timeout: float,
              by_task: bool = False) -> tuple[bool, list[str], float]:
    problems = fill_day(dest, skeleton, day)
    if by_task:
        # Put back the skeleton, then fill only this day's TODO functions in each of its modules.
        for module in day.modules:
            name = f"{module}.py"
            if name in skeleton and (REPO_ROOT / REFERENCE / name).exists():
                text, missing = fill_day_tasks(skeleton[name].decode(), (REPO_ROOT / REFERENCE / name).read_text(), day)
                (dest / SKELETON / name).write_text(text)
                problems += missing
    run = run_test_file(day.test_file, dest, child_env("student"), timeout=timeout)
    problems += run.problems + [f"collection error: {e}" for e in run.collect_errors]
    failed = [r for r in run.results.values() if not r.ok]
    for result in failed:
        lines = [line for line in result.output.strip().splitlines() if line.strip()]
        telling = [line for line in lines if line.startswith("E ") or "not implemented yet" in line] or lines
        problems.append(f"{result.nodeid} {result.outcome}: " + " | ".join(line.strip() for line in telling[:3]))
    if not run.results and not problems:
        problems.append("no tests were collected")
    passed = sum(r.ok for r in run.results.values())
    summary = f"{passed}/{len(run.results)} tests"
    return not problems, [summary, *problems], run.seconds


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.day and args.week is None:
        build_parser().error("--day needs --week")
    days = [d for d in DAYS if (args.week is None or d.week == args.week) and (not args.day or d.day in args.day)]
    if not days:
        build_parser().error("no such day in course/course_map.py")
    skeleton = skeleton_files(args.skeleton_rev)
    started, failures = time.monotonic(), 0
    with tempfile.TemporaryDirectory(prefix="tiny-llm-check-days-") as tmp:
        dest = Path(tmp)
        make_workspace(dest)
        for day in days:
            label = f"week {day.week} day {day.day} ({', '.join(day.modules)})"
            if not (REPO_ROOT / day.test_file).exists():
                print(f"SKIP  {label}: no tests yet ({day.test_file})", flush=True)
                continue
            ok, lines, seconds = check_day(dest, skeleton, day, args.timeout, by_task=args.by_task)
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'}  {label}: {lines[0]} in {seconds:.1f} s", flush=True)
            for line in lines[1:]:
                print(f"        {line[:400]}", flush=True)
    print(f"check-days: {'all days stand alone' if not failures else f'{failures} day(s) failed'} "
          f"({time.monotonic() - started:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
