"""The one switch between the student's package and the reference, used by every test.

    sol = solution(week=1, day=5)   # the code under test: sol.qwen2_week1, sol.embedding, ...
    mine = solution(week=4, day=1, task=4)  # Task 4's tests: the student's Task 4, every other task the reference's
    ref = reference()               # always the reference: oracles and collaborators
    mine = stack(week=3, day=2)     # "your stack so far": days 3.1 and 3.2 of the student's, together
    sol = launched()                # in a rank program: the code its launch names (`RankLaunches`)

Against the reference (TINY_LLM_SOLUTION=ref), `solution(...)` is simply `tiny_llm_ref`.

Against the student's package (the default), `solution(week, day)` is the selector's package for that
day (course/selector.py): the student's code for the day's tasks, the reference's for every other task,
function by function. So a student who starts at day 2.7 is graded on day 2.7's code alone, and a
mistake in day 2.7's part of batch.py cannot fail day 2.6's tests. With `task=N` it is the student's
code for that one task: a test of Task N that runs an engine made of several tasks of the day uses it,
so a bug in another task of the day never costs Task N's points.

While grading (`pdm run grade` sets TINY_LLM_SANDBOX_ROOT), that package runs in a sandboxed worker
process and `solution(...)` reaches it through a pipe (course/sandbox.py): the tests, and the verdict,
stay in this process, which never imports the student's code. There every attribute a test reads of the
student's objects is a round trip: a fake that reads many at once uses `fetch(objects, "seq.block_table", ...)`,
one round trip for all of them (and plain `getattr` when the objects are in this process). Only data comes
back as a value: any other object of the submission is an opaque handle that a test may read, call or pass
back, never compare, hash, iterate or convert (course/remote.py); `class_of(obj) is sol.module.Class` stands
for `isinstance`.
"""

import os
import tempfile
from pathlib import Path

from course import ranks, sandbox, selector
from course.remote import fetch


def class_of(obj) -> type:
    """`type(obj)`, asked of the process that holds `obj`: compare it with `is` (while grading, an object of the
    submission is an opaque handle, and `isinstance` on it raises; its class is a handle too)."""
    [[cls]] = fetch([obj], "__class__")
    return cls


def actor_fakes(sol, module: str = ""):
    """The package tests/actor_fakes (or its `module`) where `sol`'s code runs: while grading, the worker's copy (its
    fakes are built there and read in place by the engine under test, with no round trip; in a rank program, its
    rank's worker); otherwise this process's own. A test's object that wraps a selection names it `.wrapped`."""
    name = f"tests.actor_fakes.{module}" if module else "tests.actor_fakes"
    while type(sol) is not sandbox.RemoteSelection and "wrapped" in getattr(sol, "__dict__", {}):
        sol = sol.wrapped  # a test's wrapper of a selection (a stack whose model is built another way)
    if type(sol) is sandbox.RemoteSelection:  # its worker (in a rank program, its rank's)
        return sol._worker().endpoint.request("import", 0, name)
    import importlib

    return importlib.import_module(name)


def solution_name() -> str:
    name = os.environ.get("TINY_LLM_SOLUTION", "student")
    if name not in ("student", "ref"):
        raise ValueError(f"TINY_LLM_SOLUTION must be 'student' or 'ref', not {name!r}")
    return name


def reference() -> selector.Selection:
    return selector.reference()


def solution(week: int, day: int, task: int | None = None, reads_text: bool = False) -> selector.Selection:
    """The code under test for one day: the student's code for that day's tasks (or for Task `task` alone), or
    the reference. `reads_text`: the tests hand it the tests' tokenizer to read text with, not only its EOS ids
    (while grading, its worker then begins loading its own copy at start, beside the judge's start-up, instead of
    in the first test that needs it, while the judge waits)."""
    return chosen(selector.Choice(week, day, "day" if task is None else f"task{task}"), reads_text)


def stack(week: int, day: int, reads_text: bool = False) -> selector.Selection:
    """The engine a student serves with, for day W.D's "your stack so far" tests: their code for that day
    and every earlier day of week W they have written (the reference for the rest), or the reference."""
    return chosen(selector.Choice(week, day, "stack"), reads_text)


def chosen(choice: selector.Choice, reads_text: bool = False) -> selector.Selection:
    """The code `choice` names (`solution` and `stack` above, as data): the reference when testing it; while
    grading, the package in its sandboxed worker; otherwise the selector's package, built here."""
    if solution_name() == "ref":
        return reference()
    if os.environ.get(sandbox.SANDBOX_ROOT_VARIABLE):  # graded: the package runs in the sandbox
        return sandbox.RemoteSelection(choice.week, choice.day, kind=choice.kind, reads_text=reads_text)
    return choice.select()


def launched() -> selector.Selection:
    """In a rank program: the code its launch names (`course.ranks.launch(..., code=...)`), got as the tests get it."""
    return chosen(ranks.launched_code())


class RankLaunches:
    """A test module's launches of one rank program on `world` ranks: one per code under test, started when a
    test first asks for it (`run("task2")`), each making the checks `checks[kind]` names (passed as `--checks`).

    So Task N's checks on several ranks run the student's Task N alone, as its tests in this process do, and
    the stack's run the student's stack. Against the reference every code is the same: one launch makes
    every check.
    """

    def __init__(self, program: list[str], week: int, day: int, checks: dict[str, list[str]], world: int,
                 timeout: float):
        self.program, self.week, self.day, self.checks = program, week, day, checks
        self.world, self.timeout = world, timeout
        self.runs: dict[str, ranks.RankRun] = {}

    def run(self, kind: str) -> ranks.RankRun:
        """The launch of `kind`'s code, made now or earlier (by another test)."""
        key = "reference" if solution_name() == "ref" else kind
        if key not in self.runs:
            every = [name for names in self.checks.values() for name in names]
            with tempfile.TemporaryDirectory() as out_dir:
                self.runs[key] = self.launch(kind, every if key == "reference" else self.checks[kind], Path(out_dir))
        return self.runs[key]

    def launch(self, kind: str, checks: list[str], out_dir: Path, *args: str) -> ranks.RankRun:
        """A launch of its own: `kind`'s code making `checks`, results in `out_dir`; `args` go to the program too
        (a rank told to die)."""
        return ranks.launch([*self.program, "--checks", ",".join(checks), *args], self.world, out_dir,
                            timeout=self.timeout, code=selector.Choice(self.week, self.day, kind))
