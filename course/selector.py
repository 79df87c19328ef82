"""Whose code runs: the one selector used by the tests, every command, every benchmark and the checks.

The course's unit is the task. Every task body in the skeleton raises
`NotImplementedError("Week W Day D Task N (book/src/<chapter>.md): <what>")`, and this module reads
those markers with `ast` (it never calls the code). From them it builds a package whose modules are
the student's files with some functions and methods swapped for the reference's:

- `for_day(W, D)` (the tests of day W.D): the student's code for that day's tasks, the reference's for
  every other day's task, even one the student has written. So each day is graded on its own code.
- `for_task(W, D, N)` (the tests of Task N that run other tasks of its day, an engine with its proposer,
  acceptance and roll-back): the student's code for that task alone, the reference's for every other.
  So a bug in one task costs that task's points, never a correct task's of the same day.
- `for_stack(W, D)` (the day's "your stack so far" tests): the student's code for day W.D's tasks and
  every earlier day of week W they have written (for week 4, from day 3.1 on: days 4.3 and 4.4 run
  week 3's engine), the reference's for the rest. So the engine the student will serve with is tested
  as a whole, not only function by function.
- `for_command("student")` (main, batch-main, compare, the benchmarks): the student's code for every
  task written, the reference's for every task whose body still raises the marker. `describe()` says
  which, in one line.
- `for_command("student", strict=True)`: the student's package as it is (`tiny_llm`).
- `reference()`: `tiny_llm_ref`.

`Choice(W, D, kind)` names one of the first three as data ("4 3 task2"), for a process that must build the
same selection (a rank program of days 4.3 and 4.4, started by `course.ranks.launch`).

A swapped-in reference function runs in the student's module (same globals), so it calls the
student's other functions, and the student's functions call it. Which function belongs to which task
is kept in `course/tasks.json`, written with the skeleton by `pdm run python -m maint.make_skeleton`,
because a student's finished function carries no marker any more.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
STUDENT_DIR = REPO_ROOT / "src" / "tiny_llm"
REFERENCE_PACKAGE = "tiny_llm_ref"
STUDENT_PACKAGE = "tiny_llm"
TASKS_FILE = Path(__file__).resolve().parent / "tasks.json"
MARKER = re.compile(r"Week (\d+) Day (\d+) Task (\d+) \((book/src/[^)\s]+)\)")


@dataclass(frozen=True)
class Task:
    week: int
    day: int
    number: int
    chapter: str = field(default="", compare=False)  # book/src/<chapter>.md, as the marker names it

    @property
    def day_key(self) -> tuple[int, int]:
        return self.week, self.day

    @property
    def test_command(self) -> str:
        return f"pdm run test --week {self.week} --day {self.day}"

    def __str__(self) -> str:
        return f"Week {self.week} Day {self.day} Task {self.number}"

    @classmethod
    def parse(cls, text: str) -> "Task | None":
        found = MARKER.search(text)
        return None if found is None else cls(int(found[1]), int(found[2]), int(found[3]), found[4])


# ---------------------------------------------------------------- reading markers


def _marker_of(function: ast.AST) -> Task | None:
    for node in ast.walk(function):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                getattr(node.exc.func, "id", None) == "NotImplementedError" and node.exc.args and \
                isinstance(node.exc.args[0], ast.Constant) and isinstance(node.exc.args[0].value, str):
            task = Task.parse(node.exc.args[0].value)
            if task is not None:
                return task
    return None


def definitions(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level functions and class methods (nested classes too), by qualified name: `Request.try_prefill`."""
    found = {}

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{scope}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(f"{scope}{child.name}", child)  # a property's setter keeps its getter's name

    visit(tree, "")
    return found


def unwritten_in_source(source: str) -> dict[str, Task]:
    """The functions of one module's source whose body still raises a task marker: qualified name -> task."""
    tasks = {}
    for name, node in definitions(ast.parse(source)).items():
        task = _marker_of(node)
        if task is not None:
            tasks[name] = task
    return tasks


def unwritten(package_dir: Path = STUDENT_DIR) -> dict[str, dict[str, Task]]:
    """module -> {qualified name -> task} for every function of a package that still raises its marker."""
    found = {}
    for path in sorted(package_dir.glob("*.py")):
        tasks = unwritten_in_source(path.read_text())
        if tasks:
            found[path.stem] = tasks
    return found


def task_table() -> dict[str, dict[str, Task]]:
    """module -> {qualified name -> task}: which task every function of the course belongs to."""
    raw = json.loads(TASKS_FILE.read_text())
    return {module: {name: Task.parse(marker) for name, marker in names.items()} for module, names in raw.items()}


# ---------------------------------------------------------------- building a package


def _rebind(function, module: types.ModuleType, owner: type | None):
    """`function`'s code, running in `module`'s globals (and with `owner` as its class for super())."""
    code, closure = function.__code__, function.__closure__
    if closure and owner is not None and "__class__" in code.co_freevars:
        cells = list(closure)
        cells[code.co_freevars.index("__class__")] = types.CellType(owner)
        closure = tuple(cells)
    new = types.FunctionType(code, module.__dict__, function.__name__, function.__defaults__, closure)
    new.__kwdefaults__, new.__annotations__ = function.__kwdefaults__, dict(function.__annotations__)
    new.__qualname__, new.__doc__, new.__module__ = function.__qualname__, function.__doc__, module.__name__
    new.__dict__.update(function.__dict__)
    return new


def _rebind_member(member, module, owner):
    if isinstance(member, (staticmethod, classmethod)):
        return type(member)(_rebind(member.__func__, module, owner))
    if isinstance(member, property):
        parts = [None if f is None else _rebind(f, module, owner) for f in (member.fget, member.fset, member.fdel)]
        return property(*parts, doc=member.__doc__)
    if isinstance(member, types.FunctionType):
        return _rebind(member, module, owner)
    return member


def swap_in_reference(module: types.ModuleType, reference: types.ModuleType, names, tasks=()) -> None:
    """Replace the functions and methods `names` (qualified) of `module` by the reference's, run in `module`.

    `tasks` are the module's task names (qualified); a task of the student's own that their file lacks
    stays missing (its tests fail), it is never filled in from the reference.
    """
    students_own = {qualname.split(".")[0] for qualname in tasks if qualname not in names}
    for global_name, value in vars(reference).items():
        if global_name not in students_own:
            module.__dict__.setdefault(global_name, value)  # an import the reference body needs
    for qualname in names:
        *owners, name = qualname.split(".")
        target, source = module, reference
        for owner in owners:
            target, source = getattr(target, owner, None), getattr(source, owner, None)
        if target is None or source is None:
            continue
        member = vars(source).get(name) if isinstance(source, type) else getattr(source, name, None)
        if member is None:
            continue
        setattr(target, name, _rebind_member(member, module, target if isinstance(target, type) else None))


class _Finder(importlib.abc.MetaPathFinder):
    """Imports `<selection package>.<module>`: the student's file, then the reference's functions swapped in."""

    def __init__(self):
        self.selections: dict[str, "Selection"] = {}

    def find_spec(self, fullname, path=None, target=None):
        package, _, module = fullname.rpartition(".")
        selection = self.selections.get(package)
        if selection is None or "." in module:
            return None
        if module in selection.borrowed_modules:  # the reference's module itself, imported when first needed
            return importlib.util.spec_from_loader(fullname, _Borrowed())
        source = STUDENT_DIR / f"{module}.py"
        if not source.exists():
            return None
        return importlib.util.spec_from_file_location(fullname, source, loader=_Loader(fullname, str(source), selection))


class _Loader(importlib.machinery.SourceFileLoader):
    def __init__(self, fullname, path, selection):
        super().__init__(fullname, path)
        self.selection = selection

    def exec_module(self, module):
        super().exec_module(module)
        self.selection._after_import(module)


class _Borrowed(importlib.abc.Loader):
    """A module of the selection that is the reference's own: the same module object, under both names."""

    def create_module(self, spec):
        return importlib.import_module(f"{REFERENCE_PACKAGE}.{spec.name.rpartition('.')[2]}")

    def exec_module(self, module):
        pass  # the reference's import ran it


_FINDER = _Finder()


class Selection:
    """One package to run: attribute access to its modules (`sel.batch`), and what it took from the reference."""

    def __init__(self, package: str, swaps: dict[str, set[str]] | None = None, borrowed_modules=()):
        self.package = package
        self.swaps = swaps or {}  # module -> qualified names to take from the reference
        self.tasks = task_table()
        self.borrowed_modules = set(borrowed_modules)  # whole modules served by the reference
        self.used: set[Task] = set()  # tasks whose reference code a loaded module took

    def __getattr__(self, module: str) -> types.ModuleType:
        if module.startswith("_"):
            raise AttributeError(module)
        return importlib.import_module(f"{self.package}.{module}")

    def _after_import(self, module: types.ModuleType) -> None:
        name = module.__name__.rpartition(".")[2]
        names = self.swaps.get(name, ())
        if names:
            swap_in_reference(module, importlib.import_module(f"{REFERENCE_PACKAGE}.{name}"), sorted(names),
                              tasks=self.tasks.get(name, {}))
        known = {**self.tasks.get(name, {}), **unwritten_in_source(Path(module.__file__).read_text())}
        self.used.update(known[n] for n in names if n in known)

    def unwritten(self, module: str) -> dict[str, str]:
        """The student's functions of `module` still raising their task marker: qualified name -> the task, as
        text. Asked of the selection, so that while grading the sandbox's copy of the student's package answers."""
        return {name: str(task) for name, task in unwritten().get(module, {}).items()}

    def describe(self) -> str:
        """One line: the tasks the loaded modules took from the reference ('' when none)."""
        if not self.used:
            return ""
        return "using the reference for: " + describe_tasks(self.used)


def describe_tasks(tasks) -> str:
    """'Week 2 Day 6 Tasks 1-3, Week 2 Day 2 Task 3': later days first, task numbers as ranges."""
    by_day: dict[tuple[int, int], list[int]] = {}
    for task in tasks:
        by_day.setdefault(task.day_key, []).append(task.number)
    parts = []
    for (week, day), numbers in sorted(by_day.items(), reverse=True):
        numbers = sorted(set(numbers))
        runs, start = [], numbers[0]
        for previous, current in zip(numbers, numbers[1:] + [None]):
            if current != previous + 1:
                runs.append(f"{start}" if start == previous else f"{start}-{previous}")
                start = current
        label = "Tasks" if len(numbers) > 1 else "Task"
        parts.append(f"Week {week} Day {day} {label} {' & '.join(runs)}")
    return ", ".join(parts)


def _make_package(name: str, selection: Selection, alias_modules) -> None:
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    package = types.ModuleType(name, f"The student's code, with reference code where {selection!r} says so.")
    package.__path__ = []  # submodules come only from _FINDER or from the aliases below
    package.__package__ = name
    sys.modules[name] = package
    _FINDER.selections[name] = selection
    selection.borrowed_modules |= set(alias_modules)  # imported when first needed: a day's worker starts sooner


def _modules() -> list[str]:
    return sorted(p.stem for p in (REPO_ROOT / "src_ref" / REFERENCE_PACKAGE).glob("*.py") if p.stem != "__init__")


_CACHE: dict[str, Selection] = {}


def for_day(week: int, day: int) -> Selection:
    """The code under test for day W.D: the student's for that day's tasks, the reference's for every other task.

    Modules with none of the day's tasks are the reference's modules themselves.
    """
    return _selection_for_days(f"tiny_llm_week{week}_day{day}", [(week, day)],
                               lambda task, written: task.day_key == (week, day))


def for_task(week: int, day: int, number: int) -> Selection:
    """The code under test for one task's tests: the student's for Task N of day W.D alone, the reference's for
    every other task, the day's own included (the day's modules are the student's files all the same)."""
    return _selection_for_days(f"tiny_llm_week{week}_day{day}_task{number}", [(week, day)],
                               lambda task, written: task.day_key == (week, day) and task.number == number)


STACK_STARTS = {4: (3, 1)}  # week 4's engine days run on week 3's engine: their stack starts at day 3.1


def for_stack(week: int, day: int) -> Selection:
    """The code a day's "your stack so far" tests run: the student's for day W.D's tasks and for every task
    of an earlier day of the stack they have written (from day W.1; for week 4, from day 3.1: the engine
    days 4.3 and 4.4 shard and distribute is week 3's); the reference's for everything before the stack,
    for later days, and for an earlier day's task still raising its marker (a student who starts at day
    W.D has none).

    So a planner bug of day 3.1 shows in day 3.2's end-to-end tests too: they run the engine the student
    will actually serve with.
    """
    from course.course_map import DAYS

    start = STACK_STARTS.get(week, (week, 1))
    days = [(d.week, d.day) for d in DAYS if start <= (d.week, d.day) <= (week, day)]
    return _selection_for_days(f"tiny_llm_stack_week{week}_day{day}", days,
                               lambda task, written: task.day_key == (week, day) or
                               (start <= task.day_key < (week, day) and written))


@dataclass(frozen=True)
class Choice:
    """Which of the selections above runs, as data another process can be handed (a rank program gets it from
    `course.ranks.launch`): `kind` "day" (`for_day`), "taskN" (`for_task`, Task N alone) or "stack" (`for_stack`)
    of day W.D. Written as text, "4 3 task2"; `course/sandbox.py`'s workers are named by the same three parts."""

    week: int
    day: int
    kind: str = "day"

    def __post_init__(self):
        if self.kind not in ("day", "stack") and not re.fullmatch(r"task[1-9]\d*", self.kind):
            raise ValueError(f"a choice's kind is 'day', 'stack' or 'taskN', not {self.kind!r}")

    @property
    def task(self) -> int | None:
        """N for "taskN", else None."""
        return int(self.kind.removeprefix("task")) if self.kind.startswith("task") else None

    def __str__(self) -> str:
        return f"{self.week} {self.day} {self.kind}"

    @classmethod
    def parse(cls, text: str) -> "Choice":
        week, day, kind = text.split()
        return cls(int(week), int(day), kind)

    def select(self) -> "Selection":
        """The selection itself, built in this process."""
        if self.kind == "stack":
            return for_stack(self.week, self.day)
        if self.task is not None:
            return for_task(self.week, self.day, self.task)
        return for_day(self.week, self.day)


def _selection_for_days(name: str, days: list[tuple[int, int]], students) -> Selection:
    """A package of the days' modules in which `students(task, written)` says whose code each task runs.

    The days' modules (those holding one of their tasks, and `Day.modules`) are the student's files
    with the reference's functions swapped in where `students` is False; every other module is the
    reference's module itself.
    """
    if name in _CACHE:
        return _CACHE[name]
    from course.course_map import find_day

    table, current = task_table(), unwritten()
    own = {m for m, names in table.items() if any(t.day_key in days for t in names.values())}
    for week, day in days:
        own |= set(find_day(week, day).modules)
    swaps = {}
    for module in own:
        still_unwritten = current.get(module, {})
        tasks = {**table.get(module, {}), **still_unwritten}
        swaps[module] = {n for n, t in tasks.items() if not students(t, n not in still_unwritten)}
    aliases = [m for m in _modules() if m not in own]
    selection = Selection(name, swaps, aliases)
    _make_package(name, selection, aliases)
    _CACHE[name] = selection
    return selection


def for_student(name: str = "tiny_llm_selected", still_unwritten: dict | None = None) -> Selection:
    """The student's code for every task written, the reference's for every task still raising its marker.

    `still_unwritten` (module -> names, default: read from src/tiny_llm) is for tests of the selector.
    """
    if name not in _CACHE:
        found = unwritten() if still_unwritten is None else still_unwritten
        swaps = {module: set(names) for module, names in found.items()}
        selection = Selection(name, swaps)
        _make_package(name, selection, [m for m in _modules() if not (STUDENT_DIR / f"{m}.py").exists()])
        _CACHE[name] = selection
    return _CACHE[name]


def reference() -> Selection:
    return Selection(REFERENCE_PACKAGE)


def for_command(solution: str = "student", strict: bool = False) -> Selection:
    """What a command runs: "ref" -> the reference; "student" -> `for_student()`, or `tiny_llm` as it is when strict."""
    if solution == "ref":
        return reference()
    if strict:
        return Selection(STUDENT_PACKAGE)
    return for_student()


def add_arguments(parser, default: str = "ref") -> None:
    """The `--solution` and `--strict` options every command that can run student code shares."""
    parser.add_argument("--solution", choices=["ref", "student"], default=default,
                        help=f"ref: src_ref/tiny_llm_ref; student: your src/tiny_llm, with the reference's code for "
                             f"the tasks you have not written yet (default {default})")
    parser.add_argument("--strict", action="store_true",
                        help="with --solution student: your code only, no task taken from the reference")


def from_arguments(args) -> Selection:
    """The selection that parsed `--solution`/`--strict` ask for."""
    return for_command(args.solution, strict=args.strict)


def announce(selection: Selection, file=None) -> None:
    """Print the selection's one line (to stderr), if it took anything from the reference."""
    line = selection.describe()
    if line:
        print(f"[tiny-llm] {line} (--strict: your code only)", file=file or sys.stderr, flush=True)


# ---------------------------------------------------------------- commands meeting unfinished work


def not_implemented_message(error: BaseException) -> str:
    """The one line a command prints for an unfinished task: the task, its chapter, the test command."""
    task = Task.parse(str(error))
    if task is None:
        return f"not implemented yet: {error}"
    return (f"not implemented yet: {error}. Read {task.chapter}, then run `{task.test_command}`. "
            f"(Without --strict, a command takes unwritten tasks from the reference.)")


@contextlib.contextmanager
def unfinished_work_exits():
    """Turn a NotImplementedError anywhere inside into the one-line message and exit status 1 (no traceback)."""
    try:
        yield
    except NotImplementedError as error:
        while isinstance(error.__context__, NotImplementedError):
            error = error.__context__  # clean-up code that is unwritten too: report what failed first
        print(not_implemented_message(error), file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def command(main):
    """Decorator for an entry point's `main`: unfinished work ends in one line and exit status 1."""
    def wrapped(*args, **kwargs):
        with unfinished_work_exits():
            return main(*args, **kwargs)

    wrapped.__name__, wrapped.__doc__, wrapped.__wrapped__ = main.__name__, main.__doc__, main
    return wrapped
