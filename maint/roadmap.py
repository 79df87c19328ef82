"""The README's roadmap table, made from course/course_map.py and the files on disk.

    pdm run python -m maint.roadmap           # print the table
    pdm run python -m maint.roadmap --write   # refresh it in README.md

tests/test_readme.py fails when README.md's table is out of date.
"""

import argparse
import re
from pathlib import Path

from course.course_map import DAYS, Day

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
BEGIN, END = "<!-- roadmap:begin -->", "<!-- roadmap:end -->"
LATER: list[tuple[str, str]] = []  # days planned but not written yet: (number, title)


def _mark(present: bool) -> str:
    return "✅" if present else "🚧"


def day_row(day: Day) -> str:
    code = all((REPO_ROOT / "src_ref" / "tiny_llm_ref" / f"{m}.py").exists() for m in day.modules)
    tests = (REPO_ROOT / day.test_file).exists()
    chapter = (REPO_ROOT / "book" / "src" / day.chapter).exists()
    return (f"| {day.week}.{day.day} | {day.title} | {_mark(code)} | {_mark(tests)} | {_mark(chapter)} "
            f"| `pdm run test --week {day.week} --day {day.day}` |")


def roadmap_table() -> str:
    rows = ["| day | topic | code | tests | chapter | test command |", "|---|---|---|---|---|---|"]
    rows += [day_row(day) for day in DAYS]
    rows += [f"| {number} | {title} | 🔜 | 🔜 | 🔜 | |" for number, title in LATER]
    return "\n".join(rows)


def readme_with_table(text: str) -> str:
    block = f"{BEGIN}\n{roadmap_table()}\n{END}"
    return re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m maint.roadmap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="refresh the table in README.md")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.write:
        README.write_text(readme_with_table(README.read_text()))
    else:
        print(roadmap_table())


if __name__ == "__main__":
    main()
