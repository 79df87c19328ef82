"""The one switch between the student's package and the reference, used by every test.

    sol = solution(week=1, day=5)   # the code under test: sol.qwen2_week1, sol.embedding, ...
    ref = reference()               # always the reference: oracles and collaborators

Against the reference (TINY_LLM_SOLUTION=ref), `solution(...)` is simply `tiny_llm_ref`.

Against the student's package (the default), `solution(week, day)` loads the student's files for
that day's modules (course/course_map.py) and serves every other module from the reference. So a
student who starts at day 2.7 is graded on day 2.7's code alone: their `batch.py` runs on the
reference model and KV cache, whatever state their earlier days are in. The student's files are
loaded under a per-day package name (`tiny_llm_week2_day7`), so days never share modules.
"""

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

from course.course_map import find_day

REPO_ROOT = Path(__file__).resolve().parent.parent
STUDENT_DIR = REPO_ROOT / "src" / "tiny_llm"


def solution_name() -> str:
    name = os.environ.get("TINY_LLM_SOLUTION", "student")
    if name not in ("student", "ref"):
        raise ValueError(f"TINY_LLM_SOLUTION must be 'student' or 'ref', not {name!r}")
    return name


class _Modules:
    """Attribute access to a package's modules, imported on first use (so errors surface in tests)."""

    def __init__(self, package: str):
        self._package = package

    def __getattr__(self, module: str) -> types.ModuleType:
        if module.startswith("_"):
            raise AttributeError(module)
        return importlib.import_module(f"{self._package}.{module}")


def reference() -> _Modules:
    return _Modules("tiny_llm_ref")


def _student_package_for_day(week: int, day: int) -> str:
    name = f"tiny_llm_week{week}_day{day}"
    if name in sys.modules:
        return name
    package = types.ModuleType(name)
    package.__path__ = [str(STUDENT_DIR)]
    package.__package__ = name
    sys.modules[name] = package
    ref_dir = REPO_ROOT / "src_ref" / "tiny_llm_ref"
    student_modules = set(find_day(week, day).modules)
    for path in sorted(ref_dir.glob("*.py")):
        module = path.stem
        if module != "__init__" and module not in student_modules:
            # Other days' modules come from the reference, so `from .attention import ...` inside
            # the student's file for this day resolves to the reference implementation.
            sys.modules[f"{name}.{module}"] = importlib.import_module(f"tiny_llm_ref.{module}")
    return name


def solution(week: int, day: int) -> _Modules:
    """The code under test for one day: the student's modules for that day, or the reference."""
    if solution_name() == "ref":
        return reference()
    return _Modules(_student_package_for_day(week, day))
