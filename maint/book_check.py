"""Checks that keep the book in step with the code, without mdbook (tests/test_book.py runs them).

Each check takes the repo root and returns a list of problems, each naming the chapter file, the line
and what is wrong:

- summary:   every SUMMARY.md entry exists, every chapter is listed, every course day's chapter is listed;
- includes:  every {{#include path}} / {{#include path:anchor}} / {{#include path:a:b}} resolves;
- links:     every relative link between chapters resolves;
- paths:     every repo path a chapter names in backticks (`src/tiny_llm/attention.py`) exists;
- commands:  every `pdm run X ...` shown is a script of pyproject.toml whose arguments its parser accepts;
- tasks:     every "## Task N" of a day's chapter has tests named test_task_N_... in that day's test file,
             every such test has its "## Task N", and every task with tests has points in the course map;
- coming:    no "(coming)" beside a day the course has: on a line linking to an existing chapter, or in
             a week overview's table row of a day of the course map;
- skeleton:  every "Week W Day D Task N (book/src/X.md)" message in the skeleton names day W.D's chapter
             and one of its tasks, and sits in a module the course map lists for day W.D (otherwise the
             harness would hand that task's tests the reference's module);
- titles:    a course day's SUMMARY.md entry starts with its number ("2.7 Chunked prefill") and its
             chapter's first heading with "Day W.D" ("# Day 2.7: chunked prefill");
- day links: every "day W.D" / "chapter W.D" in a chapter's prose (also "days 3.1 to 3.4": each number)
             is a link to that day's chapter, for every day of the course map, except a chapter naming its
             own day. `python -m maint.book_check --fix-links` writes the missing links.

built_book_problems(out) checks a book mdBook has built (`pdm run book --build DIR` runs it): every link
and image between its pages resolves (anchors included), and no page loads anything from the network.

A pdm script that runs `python -m module` is checked by importing `module` and calling its
`build_parser()` (it is never run); arguments after `--` pass through unchecked.
"""

import ast
import contextlib
import html.parser
import importlib
import importlib.util
import io
import re
import shlex
import sys
import tomllib
from pathlib import Path

TOP_LEVEL_DIRS = ("src", "src_ref", "tests", "scripts", "course", "maint", "benches", "book", "models", ".ci")
INCLUDE = re.compile(r"(?<!\\)\{\{#(include|rustdoc_include)\s+([^}\s]+)\s*\}\}")  # \{{#...}} is escaped
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
TASK_HEADING = re.compile(r"^#{1,6}\s+Task\s+(\d+)\b")
TASK_TEST = re.compile(r"^test_task_(\d+)_")
SKELETON_MESSAGE = re.compile(r"Week (\d+) Day (\d+) Task (\d+) \((book/src/[^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
COMING = re.compile(r"\(coming\)", re.IGNORECASE)
OVERVIEW = re.compile(r"^week(\d+)-overview\.md$")
DAY_ROW = re.compile(r"^\|\s*(\d+)\s*\|")  # a table row whose first cell is a day number


# ---------------------------------------------------------------- reading the repo

def load_course_map(root: Path):
    """The course map of the repo at `root` (loaded from its file, so a synthetic repo has its own)."""
    path = root / "course" / "course_map.py"
    spec = importlib.util.spec_from_file_location(f"_course_map_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def chapters(root: Path) -> list[Path]:
    return sorted(p for p in (root / "book" / "src").rglob("*.md") if p.name != "SUMMARY.md")


def rel(root: Path, path: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def lines_outside_code(text: str):
    """(line number, line, inside a fenced code block?) for every line."""
    inside = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            inside = not inside
            yield number, line, True
            continue
        yield number, line, inside


def summary_entries(root: Path) -> list[tuple[int, str]]:
    summary = root / "book" / "src" / "SUMMARY.md"
    entries = []
    for number, line, in_code in lines_outside_code(summary.read_text()):
        if in_code:
            continue
        for target in LINK.findall(line):
            entries.append((number, target))
    return entries


# ---------------------------------------------------------------- checks

def summary_problems(root: Path) -> list[str]:
    src = root / "book" / "src"
    summary = src / "SUMMARY.md"
    if not summary.exists():
        return ["book/src/SUMMARY.md: missing"]
    problems, listed = [], set()
    for number, target in summary_entries(root):
        path = (src / target.split("#")[0]).resolve()
        listed.add(path)
        if not path.exists():
            problems.append(f"book/src/SUMMARY.md:{number}: lists {target}, which does not exist")
    for chapter in chapters(root):
        if chapter.resolve() not in listed:
            problems.append(f"{rel(root, chapter)}: not listed in book/src/SUMMARY.md (mdbook would not show it)")
    for day in load_course_map(root).DAYS:
        if (src / day.chapter).resolve() not in listed:
            problems.append(f"book/src/SUMMARY.md: week {day.week} day {day.day}'s chapter {day.chapter} "
                            f"(course/course_map.py) is not listed")
    return problems


def _anchor_lines(text: str, anchor: str) -> list[str] | None:
    lines, inside, found = [], False, False
    for line in text.splitlines():
        if re.search(rf"ANCHOR_END:\s*{re.escape(anchor)}\b", line):
            inside = False
            continue
        if re.search(rf"ANCHOR:\s*{re.escape(anchor)}\b", line):
            inside, found = True, True
            continue
        if inside:
            lines.append(line)
    return lines if found else None


def include_problems(root: Path) -> list[str]:
    problems = []
    for chapter in chapters(root) + [root / "book" / "src" / "SUMMARY.md"]:
        if not chapter.exists():
            continue
        for number, line in enumerate(chapter.read_text().splitlines(), start=1):
            for _, spec in INCLUDE.findall(line):
                where = f"{rel(root, chapter)}:{number}"
                path_text, _, selector = spec.partition(":")
                path = (chapter.parent / path_text).resolve()
                if not path.is_file():
                    problems.append(f"{where}: {{{{#include {spec}}}}}: {path_text} does not exist")
                    continue
                text = path.read_text()
                if not selector:
                    continue
                parts = selector.split(":")
                if all(p.isdigit() or p == "" for p in parts):
                    count = len(text.splitlines())
                    numbers = [int(p) for p in parts if p]
                    if any(n < 1 or n > count for n in numbers):
                        problems.append(f"{where}: {{{{#include {spec}}}}}: line {max(numbers)} is past the end "
                                        f"of {path_text} ({count} lines)")
                    elif len(numbers) == 2 and numbers[0] > numbers[1]:
                        problems.append(f"{where}: {{{{#include {spec}}}}}: the line range is reversed")
                elif _anchor_lines(text, parts[0]) is None:
                    problems.append(f"{where}: {{{{#include {spec}}}}}: {path_text} has no "
                                    f"'ANCHOR: {parts[0]}' ... 'ANCHOR_END: {parts[0]}'")
    return problems


def link_problems(root: Path) -> list[str]:
    problems = []
    for chapter in chapters(root):
        for number, line, in_code in lines_outside_code(chapter.read_text()):
            if in_code:
                continue
            for target in LINK.findall(CODE_SPAN.sub("", line)):
                if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                    continue  # a URL, mail address or an anchor on the same page
                path = (chapter.parent / target.split("#")[0]).resolve()
                if not path.exists():
                    problems.append(f"{rel(root, chapter)}:{number}: the link to {target} leads nowhere")
    return problems


def path_problems(root: Path) -> list[str]:
    """Backticked repo paths (first component one of the repo's top-level folders) must exist."""
    problems = []
    for chapter in chapters(root):
        for number, line, in_code in lines_outside_code(chapter.read_text()):
            if in_code:
                continue
            for _, span in CODE_SPAN.findall(line):
                candidate = span.strip().rstrip(".,:;")
                if not re.fullmatch(r"[\w.\-]+(/[\w.\-]*)+", candidate):
                    continue
                first = candidate.split("/")[0]
                # `tiny_llm/x.py` is short for src/tiny_llm/x.py (and the same for the reference).
                location = {"tiny_llm": "src", "tiny_llm_ref": "src_ref"}.get(first, "")
                if first not in TOP_LEVEL_DIRS and not location:
                    continue
                if not (root / location / candidate).exists() and not _ignored(root, candidate):
                    problems.append(f"{rel(root, chapter)}:{number}: names `{candidate}`, which does not exist")
    return problems


def _ignored(root: Path, path: str) -> bool:
    """Generated outputs (benchmark results, built books) may be named before they exist."""
    return path.startswith(("benches/results/", "book/book/"))


# ---------------------------------------------------------------- pdm run commands

ERROR_LINE = re.compile(r"^pdm run [\w-]+: error: ")  # a command's one-line error message, not a command


def shown_commands(root: Path) -> list[tuple[Path, int, str]]:
    """Every `pdm run ...` a chapter shows: in inline code and in code blocks (not the errors commands print)."""
    found = []
    for chapter in chapters(root):
        for number, line, in_code in lines_outside_code(chapter.read_text()):
            if in_code:
                text = re.sub(r"^\s*\$\s+", "", line)
                if text.strip().startswith("pdm run ") and not ERROR_LINE.match(text.strip()):
                    found.append((chapter, number, text.strip()))
            else:
                for _, span in CODE_SPAN.findall(line):
                    if span.strip().startswith("pdm run ") and not ERROR_LINE.match(span.strip()):
                        found.append((chapter, number, span.strip()))
    return found


def pdm_scripts(root: Path) -> dict:
    with open(root / "pyproject.toml", "rb") as f:
        return tomllib.load(f).get("tool", {}).get("pdm", {}).get("scripts", {})


def _script_module(definition) -> tuple[str | None, list[str]]:
    """(module, fixed arguments) of a script that runs `python -m module ...`; (None, []) otherwise."""
    command = definition.get("cmd") if isinstance(definition, dict) else definition
    if isinstance(command, str):
        command = shlex.split(command)
    if isinstance(command, list) and len(command) >= 3 and command[0] in ("python", "python3") \
            and command[1] == "-m":
        return command[2], list(command[3:])
    return None, []


PASS_THROUGH_MODULES = ("pytest",)  # `pdm run python -m pytest ...`: any arguments


def parse_with(module: str, args: list[str]) -> str | None:
    """None when `module.build_parser()` accepts `args`; otherwise what is wrong."""
    if module in PASS_THROUGH_MODULES:
        return None
    try:
        parser_module = importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - report any import failure as a problem
        return f"cannot import {module}: {type(error).__name__}: {error}"
    build = getattr(parser_module, "build_parser", None)
    if build is None:
        return f"{module} has no build_parser(), so its arguments cannot be checked"
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            build().parse_args(args)
    except SystemExit as stop:
        if stop.code not in (0, None):
            message = errors.getvalue().strip().splitlines()
            return message[-1] if message else f"exit status {stop.code}"
    return None


def command_problems(root: Path) -> list[str]:
    scripts = pdm_scripts(root)
    problems = []
    for chapter, number, command in shown_commands(root):
        where = f"{rel(root, chapter)}:{number}: `{command}`"
        try:
            words = shlex.split(command, comments=True)
        except ValueError as error:
            problems.append(f"{where}: cannot be split into words ({error})")
            continue
        for stop in ("&&", "||", ";", "|", ">", "2>&1"):
            if stop in words:
                words = words[: words.index(stop)]
        if len(words) < 3:
            problems.append(f"{where}: names no script")
            continue
        name, args = words[2], words[3:]
        if "--" in args:
            args = args[: args.index("--")]  # pass-through arguments (to pytest) are not checked
        if name in ("python", "python3") and len(words) >= 5 and words[3] == "-m":
            module, fixed, args = words[4], [], [a for a in args[2:]]
        elif name not in scripts or name.startswith("_"):
            problems.append(f"{where}: pyproject.toml defines no pdm script named {name!r}")
            continue
        else:
            module, fixed = _script_module(scripts[name])
        if module is None:
            continue  # not a `python -m` script: its existence is all we can check
        problem = parse_with(module, fixed + args)
        if problem:
            problems.append(f"{where}: {problem}")
    return problems


# ---------------------------------------------------------------- tasks, tests and points

def tasks_in_tests(test_file: Path) -> dict[int, list[str]]:
    """Task number -> test function names, read with `ast` (the file is not imported)."""
    tasks: dict[int, list[str]] = {}
    for node in ast.walk(ast.parse(test_file.read_text(), filename=str(test_file))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            match = TASK_TEST.match(node.name)
            if match:
                tasks.setdefault(int(match.group(1)), []).append(node.name)
    return tasks


def chapter_tasks(chapter: Path) -> dict[int, int]:
    """Task number -> line of its heading ("## Task N: ...") in a chapter."""
    tasks = {}
    for number, line, in_code in lines_outside_code(chapter.read_text()):
        match = TASK_HEADING.match(line) if not in_code else None
        if match:
            tasks.setdefault(int(match.group(1)), number)
    return tasks


def task_problems(root: Path) -> list[str]:
    problems = []
    for day in load_course_map(root).DAYS:
        chapter = root / "book" / "src" / day.chapter
        test_file = root / day.test_file
        label = f"week {day.week} day {day.day}"
        chapter_name = f"book/src/{day.chapter}"
        if not chapter.exists():
            problems.append(f"{chapter_name}: {label}'s chapter does not exist yet")
        if not test_file.exists():
            problems.append(f"{day.test_file}: {label}'s test file does not exist yet")
        if not chapter.exists() or not test_file.exists():
            continue
        in_chapter, in_tests = chapter_tasks(chapter), tasks_in_tests(test_file)
        for node in ast.parse(test_file.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test") \
                    and not TASK_TEST.match(node.name):
                problems.append(f"{day.test_file}:{node.lineno}: {node.name} is not named test_task_N_..., so it "
                                f"belongs to no task and earns no points")
        for task, line in sorted(in_chapter.items()):
            if task not in in_tests:
                problems.append(f"{chapter_name}:{line}: Task {task} has no tests named test_task_{task}_... "
                                f"in {day.test_file}")
        for task, names in sorted(in_tests.items()):
            if task not in in_chapter:
                problems.append(f"{chapter_name}: has no '## Task {task}' heading, but {day.test_file} has "
                                f"{', '.join(names)}")
            if task not in day.points:
                problems.append(f"course/course_map.py: {label} Task {task} has tests in {day.test_file} but no "
                                f"points")
        for task in sorted(set(day.points) - set(in_tests)):
            problems.append(f"course/course_map.py: {label} Task {task} has points but {day.test_file} has no "
                            f"test_task_{task}_... tests (chapter {chapter_name})")
    return problems


def coming_problems(root: Path) -> list[str]:
    """Lines saying "(coming)" beside a day that exists: a link to its chapter, or its row in its week's overview."""
    days = {(d.week, d.day) for d in load_course_map(root).DAYS}
    problems = []
    for chapter in chapters(root):
        overview = OVERVIEW.match(chapter.name)
        for number, line, in_code in lines_outside_code(chapter.read_text()):
            if in_code or not COMING.search(line):
                continue
            row = DAY_ROW.match(line)
            listed_day = overview is not None and row is not None and (int(overview[1]), int(row[1])) in days
            linked = [t for t in LINK.findall(line) if not t.startswith(("http:", "https:", "#"))
                      and (chapter.parent / t.split("#")[0]).exists()]
            if listed_day or linked:
                what = f"links to {linked[0]}" if linked else f"is week {overview[1]} day {row[1]} of course/course_map.py"
                problems.append(f"{rel(root, chapter)}:{number}: says \"(coming)\", but the day {what}")
    return problems


def skeleton_problems(root: Path) -> list[str]:
    """The skeleton's "not implemented" messages point at the right chapter and at a task it has."""
    days = {(d.week, d.day): d for d in load_course_map(root).DAYS}
    problems = []
    for module in sorted((root / "src" / "tiny_llm").glob("*.py")):
        for number, line in enumerate(module.read_text().splitlines(), start=1):
            for week, day_number, task, chapter in SKELETON_MESSAGE.findall(line):
                where = f"{rel(root, module)}:{number}"
                day = days.get((int(week), int(day_number)))
                if day is None:
                    problems.append(f"{where}: names week {week} day {day_number}, which is not in the course")
                    continue
                if module.stem not in day.modules:
                    # The harness serves modules outside Day.modules from the reference: this task's tests
                    # would grade the reference, not the student.
                    problems.append(f"{where}: a week {week} day {day_number} task in {module.name}, but "
                                    f"course/course_map.py does not list {module.stem!r} in that day's modules")
                if chapter != f"book/src/{day.chapter}":
                    problems.append(f"{where}: names {chapter}, but week {week} day {day_number}'s chapter is "
                                    f"book/src/{day.chapter}")
                path = root / "book" / "src" / day.chapter
                if path.exists() and int(task) not in chapter_tasks(path):
                    problems.append(f"{where}: names Task {task}, which book/src/{day.chapter} does not have")
    return problems


# ---------------------------------------------------------------- titles and links between days

SUMMARY_TITLE = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
FIRST_HEADING = re.compile(r"^#\s+(.*)$", re.MULTILINE)
# "day 2.7", "Chapter 3.1", "days 3.1 to 3.4", "days 1.6 and 2.1", "days 3.2-3.4": the word, then numbers.
DAY_REFERENCE = re.compile(r"\b(?:days?|chapters?)\s+\d+\.\d+(?:(?:\s*(?:,|-|–|and|or|to)\s*)+\d+\.\d+)*",
                           re.IGNORECASE)
DAY_NUMBER = re.compile(r"(?<![\d.])(\d+)\.(\d+)(?![\d])")
# What the link rule reads a chapter as: code it skips, links whose text it keeps.
PROSE_PIECE = re.compile(r"(?P<code>(`+)[\s\S]+?\2)|!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def title_problems(root: Path) -> list[str]:
    src = root / "book" / "src"
    titles = {}
    for number, line, in_code in lines_outside_code((src / "SUMMARY.md").read_text()):
        for title, target in SUMMARY_TITLE.findall(line) if not in_code else []:
            titles[(src / target.split("#")[0]).resolve()] = (number, title)
    problems = []
    for day in load_course_map(root).DAYS:
        chapter = src / day.chapter
        label = f"{day.week}.{day.day}"
        number, title = titles.get(chapter.resolve(), (None, None))
        if title is not None and not re.match(rf"{re.escape(label)}\s", title):
            problems.append(f"book/src/SUMMARY.md:{number}: day {label}'s entry is \"{title}\"; start it with the "
                            f"day's number: [{label} {day.title}](./{day.chapter})")
        heading = FIRST_HEADING.search(chapter.read_text()) if chapter.exists() else None
        if heading and not re.match(rf"Day {re.escape(label)}\b", heading.group(1)):
            problems.append(f"book/src/{day.chapter}:1: the first heading is \"{heading.group(1)}\"; start it with "
                            f"\"Day {label}\": # Day {label}: {day.title}")
    return problems


def _prose(text: str) -> tuple[str, list]:
    """The chapter as a reader sees it, character for character: code blanked out, link syntax dropped
    (the link's text kept). Returns that text and, for each of its characters, (its offset in `text`,
    the target of the link it sits in or None)."""
    lines = [" " * len(line) if in_code else line for _, line, in_code in lines_outside_code(text)]
    masked = "\n".join(lines)  # the same offsets as `text`
    plain, where = [], []

    def keep(start: int, end: int, target: str | None = None, blank: bool = False):
        for offset in range(start, end):
            plain.append(" " if blank and masked[offset] != "\n" else masked[offset])
            where.append((offset, target))

    position = 0
    for piece in PROSE_PIECE.finditer(masked):
        keep(position, piece.start())
        if piece.group("code") is not None:
            keep(piece.start(), piece.end(), blank=True)
        else:
            keep(piece.start("text"), piece.end("text"), target=piece.group("target"))
        position = piece.end()
    keep(position, len(masked))
    return "".join(plain), where


def day_references(root: Path, chapter: Path):
    """(line, (week, day), its chapter, offsets in the file, link target or None) of every reference to
    another day of the course in `chapter`'s prose."""
    days = {(d.week, d.day): d.chapter for d in load_course_map(root).DAYS}
    text = chapter.read_text()
    plain, where = _prose(text)
    for reference in DAY_REFERENCE.finditer(plain):
        for number in DAY_NUMBER.finditer(reference.group()):
            key = (int(number.group(1)), int(number.group(2)))
            target_chapter = days.get(key)
            if target_chapter is None or target_chapter == chapter.name:
                continue  # not a day of the course (yet), or the chapter's own day
            start, end = reference.start() + number.start(), reference.start() + number.end()
            target = where[start][1]
            offsets = (where[start][0], where[end - 1][0] + 1)
            line = text.count("\n", 0, offsets[0]) + 1
            yield line, key, target_chapter, offsets, target


def day_link_problems(root: Path) -> list[str]:
    problems = []
    for chapter in chapters(root):
        for line, (week, day), target_chapter, _, target in day_references(root, chapter):
            expected = (root / "book" / "src" / target_chapter).resolve()
            where = f"{rel(root, chapter)}:{line}"
            if target is None:
                problems.append(f"{where}: day {week}.{day} is not a link; write [day {week}.{day}](./{target_chapter}) "
                                f"(or run python -m maint.book_check --fix-links)")
            elif (chapter.parent / target.split("#")[0]).resolve() != expected:
                problems.append(f"{where}: day {week}.{day} links to {target}; its chapter is ./{target_chapter}")
    return problems


def fix_day_links(root: Path) -> list[tuple[Path, int]]:
    """Turn every unlinked day reference into a link to its chapter: "day 2.7" as a whole when the
    number follows the word, each further number of "days 3.1 to 3.4" on its own."""
    fixed = []
    for chapter in chapters(root):
        text = chapter.read_text()
        edits = []
        for _, _, target_chapter, (start, end), target in day_references(root, chapter):
            if target is not None:
                continue
            word = re.search(r"\b(?:days?|chapters?)\s+$", text[max(0, start - 12):start], re.IGNORECASE)
            if word:
                start -= len(word.group())
            edits.append((start, end, target_chapter))
        for start, end, target_chapter in reversed(edits):
            text = f"{text[:start]}[{text[start:end]}](./{target_chapter}){text[end:]}"
        if edits:
            chapter.write_text(text)
            fixed.append((chapter, len(edits)))
    return fixed


# ---------------------------------------------------------------- the built book

class _PageReader(html.parser.HTMLParser):
    """The ids a built page defines and the links and sources it uses."""

    def __init__(self):
        super().__init__()
        self.ids, self.links = set(), []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        for name in ("href", "src"):
            if attrs.get(name) is not None:
                self.links.append((tag, name, attrs[name], self.getpos()[0]))


def built_book_problems(out: Path) -> list[str]:
    """Broken links and images, and anything fetched from the network, in a book mdBook built into `out`."""
    pages = {}
    for page in sorted(out.rglob("*.html")):
        reader = _PageReader()
        reader.feed(page.read_text(errors="replace"))
        pages[page.resolve()] = reader
    problems = []
    for page, reader in pages.items():
        if page.name == "404.html":
            continue  # mdBook writes it with site-absolute links for a web server
        where = page.relative_to(out.resolve()).as_posix()
        for tag, name, value, line in reader.links:
            if re.match(r"^[a-z]+:", value):
                if tag != "a" and value.startswith(("http:", "https:", "//")):
                    problems.append(f"{where}:{line}: <{tag} {name}=\"{value}\"> loads from the network")
                continue
            path, _, anchor = value.partition("#")
            path = path.split("?")[0]
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                problems.append(f"{where}:{line}: <{tag} {name}=\"{value}\"> leads nowhere")
            elif anchor and target in pages and anchor not in pages[target].ids:
                problems.append(f"{where}:{line}: <{tag} {name}=\"{value}\">: {target.name} has no id \"{anchor}\"")
    return problems


CHECKS = {
    "summary": summary_problems,
    "includes": include_problems,
    "links": link_problems,
    "paths": path_problems,
    "commands": command_problems,
    "tasks": task_problems,
    "coming": coming_problems,
    "skeleton": skeleton_problems,
    "titles": title_problems,
    "day links": day_link_problems,
}


def all_problems(root: Path) -> list[str]:
    return [problem for check in CHECKS.values() for problem in check(root)]


if __name__ == "__main__":
    repo = Path(__file__).resolve().parent.parent
    if sys.argv[1:] == ["--fix-links"]:
        for path, count in fix_day_links(repo):
            print(f"{rel(repo, path)}: linked {count} reference(s)")
    found = all_problems(repo)
    print("\n".join(found) or "the book is in step with the code")
    sys.exit(1 if found else 0)
