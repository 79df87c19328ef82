"""Write the skeleton (`src/tiny_llm/`) and `course/tasks.json` from the reference's task markers.

The reference (`src_ref/tiny_llm_ref/`) is the one source. Each exercise body in it is wrapped:

    def softmax(x, axis):
        # BEGIN TASK Week 1 Day 1 Task 1: softmax
        # TODO: subtract the max along `axis` before exp()      <- hint lines, kept in the skeleton
        ...the reference's body...
        # END TASK

The skeleton is the reference with every such region replaced by its `# TODO:` lines and
`raise NotImplementedError("Week 1 Day 1 Task 1 (book/src/week1-01-attention.md): softmax")`, the
chapter taken from `course/course_map.py`; every other line is copied as it is. `course/tasks.json`
(which function belongs to which task, for the selector) is read from the skeleton written.

    pdm run python -m maint.make_skeleton           # rewrite src/tiny_llm/ and course/tasks.json
    pdm run python -m maint.make_skeleton --check   # exit 1, naming the files, if either is stale
"""

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from course.course_map import DAYS, Day
from course.selector import TASKS_FILE, definitions, unwritten_in_source

REPO_ROOT = Path(__file__).resolve().parent.parent
REFERENCE_DIR = REPO_ROOT / "src_ref" / "tiny_llm_ref"
SKELETON_DIR = REPO_ROOT / "src" / "tiny_llm"
BOOK_DIR = REPO_ROOT / "book" / "src"

BEGIN = re.compile(r"(?P<indent>[ \t]*)# BEGIN TASK Week (?P<week>\d+) Day (?P<day>\d+) Task (?P<task>\d+): (?P<what>\S.*)")
END = re.compile(r"[ \t]*# END TASK")
HINT = re.compile(r"[ \t]*# TODO:")
ANY_MARKER = re.compile(r"#\s*(BEGIN|END)\s+TASK")  # what a marker line looks like, well formed or not
LINE_LIMIT = 120  # a longer raise is split over three lines


class MarkerError(Exception):
    """A malformed task marker: the message is one line naming the file and line."""


@dataclass(frozen=True)
class TaskRegion:
    week: int
    day: int
    number: int
    what: str
    chapter: str  # book/src/<chapter>.md

    @property
    def marker(self) -> str:
        return f"Week {self.week} Day {self.day} Task {self.number} ({self.chapter}): {self.what}"


def task_of(begin: re.Match, where: str, days: list[Day], book_dir: Path) -> TaskRegion:
    """The task a BEGIN line names, checked against the course map and the book."""
    week, day, number = int(begin["week"]), int(begin["day"]), int(begin["task"])
    days = {(d.week, d.day): d for d in days}
    if (week, day) not in days:
        raise MarkerError(f"{where}: Week {week} Day {day} is not a day of course/course_map.py")
    course_day = days[week, day]
    if number not in course_day.points:
        raise MarkerError(f"{where}: Week {week} Day {day} has no Task {number} in course/course_map.py "
                          f"(its tasks: {sorted(course_day.points)})")
    if not (book_dir / course_day.chapter).is_file():
        raise MarkerError(f"{where}: the chapter of Week {week} Day {day}, book/src/{course_day.chapter}, does not exist")
    return TaskRegion(week, day, number, begin["what"], f"book/src/{course_day.chapter}")


def raise_lines(indent: str, task: TaskRegion) -> list[str]:
    message = '"' + task.marker.replace("\\", "\\\\").replace('"', '\\"') + '"'
    one_line = f"{indent}raise NotImplementedError({message})"
    if len(one_line) <= LINE_LIMIT:
        return [one_line]
    return [f"{indent}raise NotImplementedError(", f"{indent}    {message}", f"{indent})"]


def check_plain_line(line: str, where: str) -> None:
    """A line outside a task must not look like a marker: a misspelt one would reach the skeleton."""
    if END.fullmatch(line.rstrip()):
        raise MarkerError(f"{where}: '# END TASK' without a '# BEGIN TASK' before it")
    if ANY_MARKER.search(line):
        raise MarkerError(f"{where}: malformed task marker {line.strip()!r} (expected "
                          "'# BEGIN TASK Week W Day D Task N: <what>' or '# END TASK', alone on the line)")


def task_region(lines: list[str], begin_index: int, name: str) -> tuple[list[str], int]:
    """The hint lines of the task that begins at `lines[begin_index]`, and the index of its END line."""
    i = begin_index + 1
    hints = []
    while i < len(lines) and HINT.match(lines[i]):
        hints.append(lines[i].rstrip())
        i += 1
    while i < len(lines) and not END.fullmatch(lines[i].rstrip()):
        if BEGIN.fullmatch(lines[i].rstrip()):
            raise MarkerError(f"{name}:{i + 1}: '# BEGIN TASK' inside the task that begins at line "
                              f"{begin_index + 1} (close it with '# END TASK' first)")
        i += 1
    if i == len(lines):
        raise MarkerError(f"{name}:{begin_index + 1}: '# BEGIN TASK' without an '# END TASK' after it")
    return hints, i


def checked_skeleton(text: str, source: str, name: str) -> str:
    """`text`, once it is Python and defines every function and method the reference's `source` does."""
    try:
        tree = ast.parse(text)
    except SyntaxError as error:
        raise MarkerError(f"{name}: the skeleton written from it is not valid Python "
                          f"(line {error.lineno}: {error.msg}); check where its task markers sit") from None
    lost = sorted(set(definitions(ast.parse(source))) - set(definitions(tree)))
    if lost:
        raise MarkerError(f"{name}: a task region holds the definition of {', '.join(lost)}; keep the def "
                          "line and docstring outside '# BEGIN TASK' .. '# END TASK', so the skeleton has them")
    return text


def skeleton_of(source: str, name: str, days: list[Day] = DAYS, book_dir: Path = BOOK_DIR) -> str:
    """The skeleton of one reference module's source; `name` (its path) is only for error messages."""
    lines = source.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        begin = BEGIN.fullmatch(lines[i].rstrip())
        if begin is None:
            check_plain_line(lines[i], f"{name}:{i + 1}")
            out.append(lines[i])
            i += 1
            continue
        task = task_of(begin, f"{name}:{i + 1}", days, book_dir)
        hints, end = task_region(lines, i, name)
        out += hints + raise_lines(begin["indent"], task)
        i = end + 1
    return checked_skeleton("\n".join(out) + "\n", source, name)


def shown(path: Path) -> str:
    """A path as messages name it: relative to the repository when it is inside it."""
    return path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else path.as_posix()


def generate(reference_dir: Path) -> dict[str, str]:
    """file name -> skeleton text, for every module of the reference."""
    return {path.name: skeleton_of(path.read_text(), shown(path)) for path in sorted(reference_dir.glob("*.py"))}


def tasks_json_text(skeleton: dict[str, str]) -> str:
    """course/tasks.json: module -> {qualified function name -> "Week W Day D Task N (chapter)"}."""
    table = {}
    for file_name, text in skeleton.items():
        tasks = unwritten_in_source(text)
        if tasks:
            table[file_name.removesuffix(".py")] = {name: f"{t} ({t.chapter})" for name, t in tasks.items()}
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def stale_files(skeleton: dict[str, str], skeleton_dir: Path, tasks_file: Path) -> list[str]:
    """The files that differ from what the generator writes (missing, different, or not in the reference)."""
    stale = [skeleton_dir / name for name, text in skeleton.items()
             if not (skeleton_dir / name).is_file() or (skeleton_dir / name).read_text() != text]
    stale += [path for path in sorted(skeleton_dir.glob("*.py")) if path.name not in skeleton]
    if not tasks_file.is_file() or tasks_file.read_text() != tasks_json_text(skeleton):
        stale.append(tasks_file)
    return [shown(path) for path in stale]


def write(skeleton: dict[str, str], skeleton_dir: Path, tasks_file: Path) -> None:
    for path in skeleton_dir.glob("*.py"):
        if path.name not in skeleton:
            path.unlink()  # a module the reference no longer has
    for name, text in skeleton.items():
        (skeleton_dir / name).write_text(text)
    tasks_file.write_text(tasks_json_text(skeleton))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m maint.make_skeleton", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if src/tiny_llm/ or course/tasks.json differ from what would be written")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        skeleton = generate(REFERENCE_DIR)
    except MarkerError as error:
        print(f"make-skeleton: error: {error}", file=sys.stderr)
        return 2
    if args.check:
        stale = stale_files(skeleton, SKELETON_DIR, TASKS_FILE)
        if stale:
            print(f"make-skeleton: stale (refresh: pdm run python -m maint.make_skeleton): {', '.join(stale)}",
                  file=sys.stderr)
            return 1
        print(f"make-skeleton: OK: src/tiny_llm/ ({len(skeleton)} files) and course/tasks.json are up to date")
        return 0
    write(skeleton, SKELETON_DIR, TASKS_FILE)
    print(f"make-skeleton: wrote src/tiny_llm/ ({len(skeleton)} files) and course/tasks.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
