"""The skeleton is written from the reference by `maint/make_skeleton.py`: the committed one is current,
a change to provided code makes it stale, and a malformed task marker is one clear error.

The generator copies everything outside the task markers, so the skeleton's modules, names,
signatures and docstrings are the reference's by construction; what is left to check by hand is that
the reference documents what the skeleton shows a student. Nothing here imports either package.
"""

import ast
import shutil

import pytest

from course.course_map import Day
from maint import make_skeleton as gen

REFERENCE_DIR = gen.REFERENCE_DIR


def copy_of_reference(tmp_path):
    reference = tmp_path / "tiny_llm_ref"
    shutil.copytree(REFERENCE_DIR, reference, ignore=shutil.ignore_patterns("__pycache__"))
    return reference


def test_the_committed_skeleton_and_tasks_json_are_what_the_generator_writes():
    stale = gen.stale_files(gen.generate(gen.REFERENCE_DIR), gen.SKELETON_DIR, gen.TASKS_FILE)
    assert not stale, f"stale (refresh: pdm run python -m maint.make_skeleton): {stale}"


def test_a_one_line_change_to_provided_code_makes_that_file_stale(tmp_path):
    reference = copy_of_reference(tmp_path)
    weights = reference / "weights.py"  # provided code only: no task in it
    weights.write_text(weights.read_text().replace("\n", "\n\n", 1))
    assert gen.stale_files(gen.generate(reference), gen.SKELETON_DIR, gen.TASKS_FILE) == ["src/tiny_llm/weights.py"]


def test_a_change_inside_a_task_region_leaves_the_skeleton_as_it_is(tmp_path):
    reference = copy_of_reference(tmp_path)
    basics = reference / "basics.py"
    text = basics.read_text()
    assert "    return y\n" in text, "basics.linear's task body changed: pick another line inside a task"
    basics.write_text(text.replace("    return y\n", "    return y + 0\n"))
    assert gen.stale_files(gen.generate(reference), gen.SKELETON_DIR, gen.TASKS_FILE) == []


def test_a_task_region_becomes_its_hints_and_the_raise_that_names_the_chapter():
    source = ("def softmax(x, axis):\n"
              '    """Doc."""\n'
              "    # BEGIN TASK Week 1 Day 1 Task 1: softmax\n"
              "    # TODO: subtract the max first\n"
              "    # Why this line is here.\n"
              "    return x\n"
              "    # END TASK\n")
    assert gen.skeleton_of(source, "basics.py") == (
        "def softmax(x, axis):\n"
        '    """Doc."""\n'
        "    # TODO: subtract the max first\n"
        '    raise NotImplementedError("Week 1 Day 1 Task 1 (book/src/week1-01-attention.md): softmax")\n')


def test_a_quote_in_what_a_task_does_stays_inside_the_message():
    source = 'def f():\n    # BEGIN TASK Week 1 Day 1 Task 1: the "causal" mask\n    return 1\n    # END TASK\n'
    raised = ast.parse(gen.skeleton_of(source, "m.py")).body[0].body[0].exc.args[0].value
    assert raised == 'Week 1 Day 1 Task 1 (book/src/week1-01-attention.md): the "causal" mask'


BAD_MARKERS = {
    "no END": ("def f():\n    # BEGIN TASK Week 1 Day 1 Task 1: x\n    return 1\n",
               "bad.py:2: '# BEGIN TASK' without an '# END TASK' after it"),
    "END alone": ("def f():\n    return 1\n    # END TASK\n", "bad.py:3: '# END TASK' without a '# BEGIN TASK'"),
    "nested": ("def f():\n    # BEGIN TASK Week 1 Day 1 Task 1: x\n    # BEGIN TASK Week 1 Day 1 Task 2: y\n"
               "    # END TASK\n", "bad.py:3: '# BEGIN TASK' inside the task that begins at line 2"),
    "unknown day": ("def f():\n    # BEGIN TASK Week 9 Day 1 Task 1: x\n    return 1\n    # END TASK\n",
                    "bad.py:2: Week 9 Day 1 is not a day of course/course_map.py"),
    "unknown task": ("def f():\n    # BEGIN TASK Week 1 Day 1 Task 7: x\n    return 1\n    # END TASK\n",
                     "bad.py:2: Week 1 Day 1 has no Task 7 in course/course_map.py"),
    "misspelt": ("def f():\n    # BEGIN TASK week 1 day 1 task 1: x\n    return 1\n",
                 "bad.py:2: malformed task marker"),
    "no what": ("def f():\n    # BEGIN TASK Week 1 Day 1 Task 1\n    return 1\n", "bad.py:2: malformed task marker"),
    "def inside": ("# BEGIN TASK Week 1 Day 1 Task 1: x\ndef f():\n    return 1\n# END TASK\n",
                   "bad.py: a task region holds the definition of f"),
}


@pytest.mark.parametrize("case", BAD_MARKERS)
def test_a_malformed_marker_is_one_line_naming_the_place(case):
    source, message = BAD_MARKERS[case]
    with pytest.raises(gen.MarkerError) as error:
        gen.skeleton_of(source, "bad.py")
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_day_whose_chapter_is_missing_is_an_error(tmp_path):
    days = [Day(1, 1, "Attention", "no-such-chapter.md", ("basics",), {1: 5})]
    source = "def f():\n    # BEGIN TASK Week 1 Day 1 Task 1: x\n    return 1\n    # END TASK\n"
    with pytest.raises(gen.MarkerError, match=r"bad.py:2: the chapter of Week 1 Day 1, "
                                              r"book/src/no-such-chapter.md, does not exist"):
        gen.skeleton_of(source, "bad.py", days=days, book_dir=tmp_path)


def test_the_command_prints_one_line_for_a_bad_marker_and_names_stale_files(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "m.py").write_text("def f():\n    # END TASK\n")
    monkeypatch.setattr(gen, "REFERENCE_DIR", bad)
    assert gen.main(["--check"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0

    monkeypatch.setattr(gen, "REFERENCE_DIR", copy_of_reference(tmp_path))
    monkeypatch.setattr(gen, "SKELETON_DIR", tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(gen, "TASKS_FILE", tmp_path / "tasks.json")
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "empty/basics.py" in err and "tasks.json" in err and err.strip().count("\n") == 0
    assert gen.main([]) == 0, "writing into an empty folder"
    assert gen.main(["--check"]) == 0
    capsys.readouterr()

    (tmp_path / "empty" / "extra.py").write_text("")  # a module the reference does not have
    (tmp_path / "tasks.json").write_text("{}\n")
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "empty/extra.py" in err and "tasks.json" in err and "basics.py" not in err
    assert gen.main([]) == 0 and not (tmp_path / "empty" / "extra.py").exists()


def public_definitions(tree: ast.Module):
    return [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
            and not node.name.startswith("_")]


@pytest.mark.parametrize("path", sorted(REFERENCE_DIR.glob("*.py")), ids=lambda p: p.stem)
def test_every_public_name_of_the_reference_has_a_docstring(path):
    """The skeleton shows a student the reference's docstrings: they are the task's specification."""
    undocumented = [node.name for node in public_definitions(ast.parse(path.read_text()))
                    if not ast.get_docstring(node)]
    assert not undocumented, f"{path.stem}: public names without a docstring: {undocumented}"
