"""Whose code runs, function by function: the one selector of the tests (`Choice(...).select()`), the commands
(`for_command`), the benchmarks and the checks. The rules: MAINTAINERS.md, "Whose code runs: the selector"."""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
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
STACK_STARTS = {4: (3, 1)}  # week 4's engine days run on week 3's engine: their stack starts at day 3.1


@dataclass(frozen=True)
class Task:
    week: int
    day: int
    number: int
    chapter: str = field(default="", compare=False)  # book/src/<chapter>.md, as the marker names it

    @property
    def day_key(self) -> tuple[int, int]:
        return self.week, self.day

    def __str__(self) -> str:
        return f"Week {self.week} Day {self.day} Task {self.number}"

    @classmethod
    def parse(cls, text: str) -> "Task | None":
        found = MARKER.search(text)
        return None if found is None else cls(int(found[1]), int(found[2]), int(found[3]), found[4])


def _marker_of(function: ast.AST) -> Task | None:
    """The task a function's body raises the marker of, if it does."""
    for node in ast.walk(function):
        match node:
            case ast.Raise(exc=ast.Call(func=ast.Name(id="NotImplementedError"), args=[ast.Constant(str(text)), *_])):
                if (task := Task.parse(text)) is not None:
                    return task
    return None


def definitions(tree: ast.AST, scope: str = "") -> dict[str, ast.AST]:
    """Module-level functions and class methods (nested classes too), by qualified name: `Request.try_prefill`."""
    found = {}
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.ClassDef):
            found = {**definitions(child, f"{scope}{child.name}."), **found}  # the first definition of a name wins
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.setdefault(f"{scope}{child.name}", child)  # a property's setter keeps its getter's name
    return found


def unwritten_in_source(source: str) -> dict[str, Task]:
    """The functions of one module's source whose body still raises a task marker: qualified name -> task."""
    tasks = {name: _marker_of(node) for name, node in definitions(ast.parse(source)).items()}
    return {name: task for name, task in tasks.items() if task is not None}


def unwritten() -> dict[str, dict[str, Task]]:
    """Every module of the student's package -> {qualified name -> task} of its functions still raising a marker."""
    return {path.stem: unwritten_in_source(path.read_text()) for path in sorted(STUDENT_DIR.glob("*.py"))}


def task_table() -> dict[str, dict[str, Task]]:
    """module -> {qualified name -> task}: which task every function of the course belongs to."""
    raw = json.loads(TASKS_FILE.read_text())
    return {module: {name: Task.parse(marker) for name, marker in names.items()} for module, names in raw.items()}


def _rebind(function, module: types.ModuleType, owner: type | None):
    """`function`'s code, running in `module`'s globals (and with `owner` as its class for super())."""
    code = function.__code__
    cells = [types.CellType(owner) if name == "__class__" else cell
             for name, cell in zip(code.co_freevars, function.__closure__ or ())]
    # Name, qualified name, docstring and __module__ come from the code and the globals.
    new = types.FunctionType(code, module.__dict__, None, function.__defaults__, tuple(cells) or None)
    new.__kwdefaults__, new.__annotations__ = function.__kwdefaults__, dict(function.__annotations__)
    new.__dict__.update(function.__dict__)
    return new


def _rebind_member(member, module, owner):
    if isinstance(member, (staticmethod, classmethod)):
        return type(member)(_rebind(member.__func__, module, owner))
    if isinstance(member, property):
        parts = [f and _rebind(f, module, owner) for f in (member.fget, member.fset, member.fdel)]
        return property(*parts, doc=member.__doc__)
    return _rebind(member, module, owner) if isinstance(member, types.FunctionType) else member


class Selection:
    """One package to run: attribute access to its modules (`sel.batch`), and what it took from the reference."""

    def __init__(self, package: str, tasks=None, swaps=None, borrowed=()):
        self.package = package
        self.tasks: dict[str, dict[str, Task]] = tasks or {}  # module -> its tasks, for the student's modules
        self.swaps: dict[str, set[str]] = swaps or {}  # module -> qualified names taken from the reference
        self.borrowed = set(borrowed)  # modules that are the reference's own, imported when first needed
        self.used: set[Task] = set()  # tasks whose reference code a loaded module took

    def __getattr__(self, module: str) -> types.ModuleType:
        if module.startswith("_"):
            raise AttributeError(module)
        return importlib.import_module(f"{self.package}.{module}")

    def _swap_in(self, module: types.ModuleType) -> None:
        """The reference's functions and methods in the student's `module`, just run, where `swaps` says."""
        name = module.__name__.rpartition(".")[2]
        swapped = self.swaps.get(name)
        if not swapped:
            return
        reference = importlib.import_module(f"{REFERENCE_PACKAGE}.{name}")
        # A task of the student's own that their file lacks stays missing (its tests fail), never the reference's.
        students_own = {qualname.split(".")[0] for qualname in self.tasks[name] if qualname not in swapped}
        for global_name, value in vars(reference).items():
            if global_name not in students_own:
                module.__dict__.setdefault(global_name, value)  # an import the reference's bodies need
        for qualname in swapped:
            *owners, member_name = qualname.split(".")
            target, source = module, reference
            for owner in owners:
                target, source = getattr(target, owner, None), getattr(source, owner, None)
            member = vars(source).get(member_name) if isinstance(source, type) else getattr(source, member_name, None)
            if target is not None and member is not None:
                cls = target if isinstance(target, type) else None
                setattr(target, member_name, _rebind_member(member, module, cls))
        self.used.update(self.tasks[name][qualname] for qualname in swapped)

    def unwritten(self, module: str) -> dict[str, str]:
        """`unwritten()`'s tasks of `module`, as text: asked of the selection, a grader's worker answers."""
        return {name: str(task) for name, task in unwritten().get(module, {}).items()}

    def describe(self) -> str:
        """One line: the tasks the loaded modules took from the reference ('' when none)."""
        return "using the reference for: " + describe_tasks(self.used) if self.used else ""


def describe_tasks(tasks) -> str:
    """'Week 2 Day 6 Tasks 1-3, Week 2 Day 2 Task 3': later days first, task numbers as ranges."""
    by_day = {key: {task.number for task in tasks if task.day_key == key} for key in {task.day_key for task in tasks}}
    parts = []
    for (week, day), numbers in sorted(by_day.items(), reverse=True):
        # Consecutive numbers keep the same difference to their index in the sorted list: one group per run.
        runs = [[n for _, n in run] for _, run in itertools.groupby(enumerate(sorted(numbers)), lambda p: p[1] - p[0])]
        text = " & ".join(f"{run[0]}" if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
        parts.append(f"Week {week} Day {day} {'Tasks' if len(numbers) > 1 else 'Task'} {text}")
    return ", ".join(parts)


_SELECTIONS: dict[str, Selection] = {}  # the packages built in this process, by name


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `<selection>.<module>` for the selections built here: the reference's module itself where the
    selection borrows it (imported when first needed), else the student's file, run, then swapped into."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, module = fullname.rpartition(".")
        source = STUDENT_DIR / f"{module}.py"
        if package not in _SELECTIONS:
            return None
        if module in _SELECTIONS[package].borrowed:
            return importlib.util.spec_from_loader(fullname, self)  # a spec without a file
        return importlib.util.spec_from_file_location(fullname, source, loader=self) if source.exists() else None

    def create_module(self, spec):
        if spec.origin is None:  # borrowed: the reference's module, under the selection's name too
            return importlib.import_module(f"{REFERENCE_PACKAGE}.{spec.name.rpartition('.')[2]}")
        return None  # the default module

    def exec_module(self, module):
        if module.__spec__.origin is None:
            return  # borrowed: the reference's import ran it
        importlib.machinery.SourceFileLoader(module.__spec__.name, module.__file__).exec_module(module)
        _SELECTIONS[module.__spec__.parent]._swap_in(module)


def _build(name: str, own: set[str], students) -> Selection:
    """The package `name`: the modules `own` are the student's files, with the reference's function for each task
    where `students(task, written)` is False; every other module is the reference's own."""
    if name in _SELECTIONS:
        return _SELECTIONS[name]
    table, current = task_table(), unwritten()
    tasks = {module: {**table.get(module, {}), **current.get(module, {})} for module in own}
    swaps = {module: {qualname for qualname, task in tasks[module].items()
                      if not students(task, qualname not in current.get(module, {}))} for module in own}
    references = {p.stem for p in (REPO_ROOT / "src_ref" / REFERENCE_PACKAGE).glob("*.py")}
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    # A package without a folder (`__path__` empty): its modules come only from _Finder.
    sys.modules[name] = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(name, None, is_package=True))
    _SELECTIONS[name] = Selection(name, tasks, swaps, borrowed=references - own)
    return _SELECTIONS[name]


def for_student(name: str = "tiny_llm_selected") -> Selection:
    """The student's code for every task written, the reference's for every task still raising its marker."""
    return _build(name, {path.stem for path in STUDENT_DIR.glob("*.py")}, lambda task, written: written)


def reference() -> Selection:
    return Selection(REFERENCE_PACKAGE)


@dataclass(frozen=True)
class Choice:
    """The code a test runs, as data another process can be handed ("4 3 task2": to a rank program, to a grader's
    worker): `kind` of day W.D is "day", "taskN" or "stack" (MAINTAINERS.md, "Whose code runs: the selector")."""

    week: int
    day: int
    kind: str = "day"

    def __post_init__(self):
        if self.kind not in ("day", "stack") and not re.fullmatch(r"task[1-9]\d*", self.kind):
            raise ValueError(f"a choice's kind is 'day', 'stack' or 'taskN', not {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.week} {self.day} {self.kind}"

    @classmethod
    def parse(cls, text: str) -> "Choice":
        week, day, kind = text.split()
        return cls(int(week), int(day), kind)

    def select(self) -> Selection:
        """The selection itself, built in this process (once)."""
        from course.course_map import DAYS, find_day

        today = self.week, self.day
        number = int(self.kind.removeprefix("task")) if self.kind.startswith("task") else None  # "taskN": N alone
        start = STACK_STARTS.get(self.week, (self.week, 1)) if self.kind == "stack" else today
        days = [(d.week, d.day) for d in DAYS if start <= (d.week, d.day) <= today]
        own = {module for module, names in task_table().items() if any(t.day_key in days for t in names.values())}
        own.update(*(find_day(week, day).modules for week, day in days))

        def students(task: Task, written: bool) -> bool:
            if self.kind == "stack" and start <= task.day_key < today:
                return written
            return task.day_key == today and number in (None, task.number)

        return _build(f"tiny_llm_{self.kind}_week{self.week}_day{self.day}", own, students)


def for_command(solution: str, strict: bool = False) -> Selection:
    """What a command runs: "ref" -> the reference; "student" -> `for_student()`, or `tiny_llm` as it is when strict."""
    if solution == "ref":
        return reference()
    return Selection(STUDENT_PACKAGE) if strict else for_student()


def add_arguments(parser) -> None:
    """The `--solution` and `--strict` options every command that can run student code shares."""
    parser.add_argument("--solution", choices=["ref", "student"], default="ref",
                        help="ref: src_ref/tiny_llm_ref; student: your src/tiny_llm, with the reference's code for "
                             "the tasks you have not written yet (default ref)")
    parser.add_argument("--strict", action="store_true",
                        help="with --solution student: your code only, no task taken from the reference")


def announce(selection: Selection, file=None) -> None:
    """Print the selection's one line (to stderr), if it took anything from the reference."""
    if selection.used:
        print(f"[tiny-llm] {selection.describe()} (--strict: your code only)", file=file or sys.stderr, flush=True)
