"""The one switch between the student's package and the reference, used by every test.

    sol = solution(week=1, day=5)   # the code under test: sol.qwen2_week1, sol.embedding, ...
    mine = solution(week=4, day=1, task=4)  # Task 4's tests: the student's Task 4, every other task the reference's
    ref = reference()               # always the reference: oracles and collaborators
    mine = stack(week=3, day=2)     # "your stack so far": days 3.1 and 3.2 of the student's, together

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

from course import sandbox, selector
from course.remote import fetch


def class_of(obj) -> type:
    """`type(obj)`, asked of the process that holds `obj`: compare it with `is` (while grading, an object of the
    submission is an opaque handle, and `isinstance` on it raises; its class is a handle too)."""
    [[cls]] = fetch([obj], "__class__")
    return cls


def actor_fakes(sol):
    """tests/actor_fakes.py where `sol`'s code runs: while grading, the worker's copy (its fakes are built there and
    read in place by the engine under test, with no round trip); otherwise this process's own module."""
    if type(sol) is sandbox.RemoteSelection:
        return sol._worker().endpoint.request("import", 0, "tests.actor_fakes")
    from tests import actor_fakes as here

    return here


def solution_name() -> str:
    name = os.environ.get("TINY_LLM_SOLUTION", "student")
    if name not in ("student", "ref"):
        raise ValueError(f"TINY_LLM_SOLUTION must be 'student' or 'ref', not {name!r}")
    return name


def reference() -> selector.Selection:
    return selector.reference()


def solution(week: int, day: int, task: int | None = None) -> selector.Selection:
    """The code under test for one day: the student's code for that day's tasks (or for Task `task` alone), or
    the reference."""
    if solution_name() == "ref":
        return reference()
    if os.environ.get(sandbox.SANDBOX_ROOT_VARIABLE):  # graded: the day's package runs in the sandbox
        return sandbox.RemoteSelection(week, day, kind="day" if task is None else f"task{task}")
    return selector.for_day(week, day) if task is None else selector.for_task(week, day, task)


def stack(week: int, day: int) -> selector.Selection:
    """The engine a student serves with, for day W.D's "your stack so far" tests: their code for that day
    and every earlier day of week W they have written (the reference for the rest), or the reference."""
    if solution_name() == "ref":
        return reference()
    if os.environ.get(sandbox.SANDBOX_ROOT_VARIABLE):  # graded: the student's week runs in the sandbox
        return sandbox.RemoteSelection(week, day, kind="stack")
    return selector.for_stack(week, day)
