"""The selector (course/selector.py): whose code runs, function by function.

These tests hold whatever state src/tiny_llm is in (untouched, half done, finished): they compare the
selector's choices with the markers it reads and with course/tasks.json.
"""

import ast
import inspect
from pathlib import Path

import pytest

from course import selector
from course.course_map import DAYS
from course.user_errors import command

REFERENCE_DIR = selector.REPO_ROOT / "src_ref" / "tiny_llm_ref"


def resolve(root, qualname):
    *owners, name = qualname.split(".")
    for owner in owners:
        root = getattr(root, owner)
    member = vars(root)[name] if isinstance(root, type) else getattr(root, name)
    return member.fget if isinstance(member, property) else getattr(member, "__func__", member)


def code_file(function) -> str:
    """The file of a function's own code, through decorators (`SlotScheduler.step` is wrapped by validation.py)."""
    return Path(inspect.unwrap(function).__code__.co_filename).resolve().as_posix()


def test_task_table_agrees_with_the_skeleton_and_the_reference():
    table = selector.task_table()
    for module, names in selector.unwritten().items():
        for name, task in names.items():
            assert table[module][name] == task, f"{module}.{name}: refresh with maint.make_skeleton"
    days = {(d.week, d.day): d for d in DAYS}
    for module, names in table.items():
        source = (REFERENCE_DIR / f"{module}.py").read_text()
        defined = selector.definitions(__import__("ast").parse(source))
        for name, task in names.items():
            assert name in defined, f"course/tasks.json names {module}.{name}, which the reference lacks"
            day = days[task.day_key]
            assert task.number in day.points and task.chapter == f"book/src/{day.chapter}", (module, name, task)


def test_a_days_selection_runs_that_days_tasks_only():
    table = selector.task_table()
    selection = selector.Choice(2, 7).select()
    ref = selector.reference()
    batch = selection.batch
    for name, task in table["batch"].items():
        chosen = resolve(batch, name)
        if task.day_key == (2, 7):
            assert code_file(chosen).endswith("src/tiny_llm/batch.py"), name
        else:
            assert chosen.__code__ is resolve(ref.batch, name).__code__, f"{name} must be the reference's"
            assert chosen.__globals__ is batch.__dict__, "a swapped-in function runs in the student's module"
    assert selection.qwen2_week2 is ref.qwen2_week2, "a module with none of the day's tasks is the reference's"


def test_a_tasks_selection_runs_that_task_only():
    """Day 4.1 Task 2's engine test: the student's greedy acceptance, the reference's planning and roll-back
    (Tasks 4 and 5, in the same file): a bug there never costs Task 2's points."""
    table, ref = selector.task_table(), selector.reference()
    selection = selector.Choice(4, 1, "task2").select()
    speculative = selection.speculative
    for name, task in table["speculative"].items():
        chosen = resolve(speculative, name)
        if (task.day_key, task.number) == ((4, 1), 2):
            assert code_file(chosen).endswith("src/tiny_llm/speculative.py"), name
        else:
            assert chosen.__code__ is resolve(ref.speculative, name).__code__, f"{name} must be the reference's"
            assert chosen.__globals__ is speculative.__dict__, "a swapped-in function runs in the student's module"
    assert code_file(resolve(speculative, "SpeculativeEngine.verify")).endswith("src/tiny_llm/speculative.py"), \
        "provided code of the day's module is the student's file"
    assert selection.scheduler is ref.scheduler, "a module with none of the day's tasks is the reference's"


def test_a_stack_runs_the_days_tasks_and_the_earlier_days_written_ones():
    """Day 3.2's "your stack so far": the student's 3.2 tasks always, their 3.1 tasks once written, the rest the reference's."""
    table, unwritten = selector.task_table(), selector.unwritten()
    selection, ref = selector.Choice(3, 2, "stack").select(), selector.reference()
    for name, task in table["scheduler"].items():
        chosen = resolve(selection.scheduler, name)
        written = name not in unwritten.get("scheduler", {})
        if task.day_key == (3, 2) or (task.day_key == (3, 1) and written):
            assert code_file(chosen).endswith("src/tiny_llm/scheduler.py"), f"{name} is the student's"
        else:
            assert chosen.__code__ is resolve(ref.scheduler, name).__code__, f"{name} must be the reference's"
    assert code_file(resolve(selection.engine, "LLMEngine.__init__")).endswith("src/tiny_llm/engine.py"), \
        "a day-3.1 module is the student's file, provided code included"
    assert selection.prefix_cache is ref.prefix_cache, "a later day's module is the reference's"
    assert selection.batch is ref.batch, "an earlier week's module is the reference's"


def test_a_week_4_stack_starts_at_day_3_1():
    """Day 4.2's "your stack so far": its tasks always, the written ones of days 3.1 .. 4.1, day 4.3's never."""
    table, unwritten = selector.task_table(), selector.unwritten()
    selection, ref = selector.Choice(4, 2, "stack").select(), selector.reference()
    for module in ("quantized_kv", "scheduler", "speculative", "tensor_parallel"):
        for name, task in table[module].items():
            chosen = resolve(getattr(selection, module), name)
            written = name not in unwritten.get(module, {})
            if task.day_key == (4, 2) or ((3, 1) <= task.day_key < (4, 2) and written):
                assert code_file(chosen).endswith(f"src/tiny_llm/{module}.py"), f"{module}.{name} is the student's"
            else:
                assert chosen.__code__ is resolve(getattr(ref, module), name).__code__, f"{module}.{name}: the reference's"


def test_a_week_4_stack_starts_at_week_3():
    """Days 4.3 and 4.4 shard and distribute week 3's engine: their stack is the student's from day 3.1 on."""
    selection, ref = selector.Choice(4, 3, "stack").select(), selector.reference()
    assert code_file(resolve(selection.engine, "LLMEngine.__init__")).endswith("src/tiny_llm/engine.py"), \
        "a day-3.1 module is the student's file in a week-4 stack"
    assert code_file(resolve(selection.tensor_parallel, "ShardedMLP.__call__")).endswith("src/tiny_llm/tensor_parallel.py")
    assert selection.distributed_engine is ref.distributed_engine, "a later day's module is the reference's"
    assert selection.batch is ref.batch, "week 2 is not in the stack"


def test_commands_take_only_unwritten_tasks_from_the_reference():
    selection = selector.for_student()
    ref = selector.reference()
    unwritten = selector.unwritten()
    for module, names in selector.task_table().items():
        loaded = getattr(selection, module)
        for name in names:
            chosen = resolve(loaded, name)
            if name in unwritten.get(module, {}):
                assert chosen.__code__ is resolve(getattr(ref, module), name).__code__, f"{module}.{name}"
            else:
                assert code_file(chosen).endswith(f"src/tiny_llm/{module}.py"), f"{module}.{name} is the student's"


def test_a_written_task_is_the_students_even_when_others_are_not(monkeypatch):
    """As if the student had written everything in batch.py but day 2.6's Task 2: only that task is swapped."""
    table = selector.task_table()
    pending = {name: task for name, task in table["batch"].items() if task.day_key == (2, 6) and task.number == 2}
    monkeypatch.setattr(selector, "unwritten", lambda: {"batch": pending})
    selection = selector.for_student("tiny_llm_selected_for_test")
    ref = selector.reference()
    for name in table["batch"]:
        chosen = resolve(selection.batch, name)
        if name in pending:
            assert chosen.__code__ is resolve(ref.batch, name).__code__, name
        else:
            assert code_file(chosen).endswith("src/tiny_llm/batch.py"), f"{name} is written: the student's"
    assert selection.describe() == "using the reference for: Week 2 Day 6 Task 2"


def test_reference_methods_keep_working_inside_the_student_class():
    """A swapped-in method that calls super() or a sibling still finds them: it runs as part of the student class."""
    selection = selector.Choice(2, 6).select()
    request = selection.batch.Request
    assert request.record_token.__qualname__ == "Request.record_token"
    assert inspect.signature(request.try_prefill) == inspect.signature(selector.reference().batch.Request.try_prefill)


def test_a_swapped_in_method_calls_super_of_the_student_class():
    """`super()` in a reference method (day 4.3 Task 4's `Qwen2TensorParallel.__init__`) names the student's class."""
    cls = selector.Choice(4, 3, "task1").select().tensor_parallel.Qwen2TensorParallel
    init = cls.__init__
    assert init.__code__ is selector.reference().tensor_parallel.Qwen2TensorParallel.__init__.__code__
    assert init.__closure__[init.__code__.co_freevars.index("__class__")].cell_contents is cls


def test_a_task_missing_from_the_students_file_stays_missing(tmp_path, monkeypatch):
    """A student who deletes a task's function (`basics.softmax`) gets no reference function in its place."""
    source = (selector.STUDENT_DIR / "basics.py").read_text()
    node = selector.definitions(ast.parse(source))["softmax"]
    lines = source.splitlines(keepends=True)
    del lines[node.lineno - 1:node.end_lineno]
    (tmp_path / "basics.py").write_text("".join(lines))
    monkeypatch.setattr(selector, "STUDENT_DIR", tmp_path)
    basics = selector.for_student("tiny_llm_selected_without_softmax").basics
    assert basics.__file__ == str(tmp_path / "basics.py")
    assert not hasattr(basics, "softmax"), "a task the student's file lacks is never filled in from the reference"
    assert hasattr(basics, "linear")

def test_the_reference_line_names_tasks_as_ranges():
    tasks = [selector.Task(2, 6, n) for n in (1, 2, 3)] + [selector.Task(2, 2, 3), selector.Task(2, 5, 1),
                                                            selector.Task(2, 5, 3)]
    assert selector.describe_tasks(tasks) == "Week 2 Day 6 Tasks 1-3, Week 2 Day 5 Tasks 1 & 3, Week 2 Day 2 Task 3"


def test_markers_are_read_without_running_the_code():
    source = '''
class A:
    def done(self):
        return 1

    def todo(self):
        # TODO
        raise NotImplementedError(
            "Week 2 Day 7 Task 3 (book/src/week2-07-chunked-prefill.md): "
            "prefill one chunk"
        )

def helper():
    raise NotImplementedError("not a task marker")
'''
    assert selector.unwritten_in_source(source) == {"A.todo": selector.Task(2, 7, 3)}
    assert selector.unwritten_in_source(source)["A.todo"].chapter == "book/src/week2-07-chunked-prefill.md"


def test_unfinished_work_ends_in_one_line_and_status_1(capsys):
    @command
    def main():
        try:
            raise NotImplementedError("Week 2 Day 6 Task 2 (book/src/week2-06-continuous-batching.md): admit")
        finally:
            raise NotImplementedError("Week 2 Day 6 Task 3 (book/src/week2-06-continuous-batching.md): release")

    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Week 2 Day 6 Task 2" in err[0], "the first failure is the one reported"
    assert "book/src/week2-06-continuous-batching.md" in err[0] and "pdm run test --week 2 --day 6" in err[0]
