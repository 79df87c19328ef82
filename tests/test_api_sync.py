"""The skeleton's public API equals the reference's: same modules, names, signatures and docstrings.

Students write into `src/tiny_llm`; the tests, the book and the tools are written against the API of
`src_ref/tiny_llm_ref`. When the two drift, a student's correct code fails for the wrong reason.
This test runs in both modes (student and reference) and does not depend on any body being filled.
"""

import importlib
import inspect
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
REF_DIR = REPO_ROOT / "src_ref" / "tiny_llm_ref"
STUDENT_DIR = REPO_ROOT / "src" / "tiny_llm"
MODULES = sorted(p.stem for p in REF_DIR.glob("*.py"))


def public_api(module) -> dict[str, object]:
    """Public functions and classes defined in `module` itself (not imported into it)."""
    return {
        name: obj
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and obj.__module__ == module.__name__
    }


def members(cls) -> dict[str, object]:
    """A class's own public methods and properties, plus __init__ and __call__."""
    return {
        name: obj
        for name, obj in vars(cls).items()
        if (not name.startswith("_") or name in ("__init__", "__call__"))
        and (inspect.isfunction(obj) or isinstance(obj, (property, staticmethod, classmethod)))
    }


def describe(obj) -> tuple[str, str]:
    """(signature, docstring) of a function, method or property, as text for comparison."""
    if isinstance(obj, property):
        obj = obj.fget
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    signature = str(inspect.signature(obj)) if callable(obj) else ""
    return signature, inspect.cleandoc(obj.__doc__ or "")


def test_every_reference_module_has_a_skeleton():
    missing = [m for m in MODULES if not (STUDENT_DIR / f"{m}.py").exists()]
    extra = sorted(p.stem for p in STUDENT_DIR.glob("*.py") if p.stem not in MODULES)
    assert not missing, f"src/tiny_llm lacks modules the reference has: {missing}"
    assert not extra, f"src/tiny_llm has modules the reference lacks: {extra}"


@pytest.mark.parametrize("module_name", MODULES)
def test_public_api_matches_reference(module_name):
    ref = importlib.import_module(f"tiny_llm_ref.{module_name}")
    student = importlib.import_module(f"tiny_llm.{module_name}")
    ref_api, student_api = public_api(ref), public_api(student)
    assert sorted(student_api) == sorted(ref_api), (
        f"{module_name}: public names differ; reference has {sorted(ref_api)}, skeleton has {sorted(student_api)}")
    for name, ref_obj in ref_api.items():
        student_obj = student_api[name]
        where = f"{module_name}.{name}"
        if inspect.isclass(ref_obj):
            assert inspect.cleandoc(student_obj.__doc__ or "") == inspect.cleandoc(ref_obj.__doc__ or ""), (
                f"{where}: class docstring differs")
            assert [b.__name__ for b in student_obj.__bases__] == [b.__name__ for b in ref_obj.__bases__], (
                f"{where}: base classes differ")
            ref_members, student_members = members(ref_obj), members(student_obj)
            assert sorted(student_members) == sorted(ref_members), (
                f"{where}: methods differ; reference {sorted(ref_members)}, skeleton {sorted(student_members)}")
            for member, ref_member in ref_members.items():
                assert describe(student_members[member]) == describe(ref_member), (
                    f"{where}.{member}: signature or docstring differs from the reference")
        else:
            assert describe(student_obj) == describe(ref_obj), (
                f"{where}: signature or docstring differs from the reference")


@pytest.mark.parametrize("module_name", MODULES)
def test_reference_api_is_documented(module_name):
    ref = importlib.import_module(f"tiny_llm_ref.{module_name}")
    undocumented = [name for name, obj in public_api(ref).items() if not (obj.__doc__ or "").strip()]
    assert not undocumented, f"{module_name}: public names without a docstring: {undocumented}"
