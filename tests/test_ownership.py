"""maint/ownership.py: the reference keeps one owner per piece of state and functions under 60 lines, and the
check sees a breach of each rule when one is planted."""

from __future__ import annotations

import ast
import functools
import textwrap

from maint import ownership


@functools.cache
def reference_trees() -> dict[str, ast.Module]:
    return ownership.parse_package()


def plant(module: str, code: str) -> list[str]:
    """The breaches of the reference with `code` appended to `module`.py (parsed again, nothing written)."""
    trees = dict(reference_trees())
    source = (ownership.PACKAGE / f"{module}.py").read_text()
    trees[module] = ast.parse(source + "\n\n" + textwrap.dedent(code))
    return [str(breach) for breach in ownership.ownership_breaches(trees) + ownership.length_breaches(trees)]


def test_the_reference_has_one_owner_per_piece_of_state_and_short_functions():
    assert [str(breach) for breach in ownership.check()] == []
    assert len(ownership.ALLOWED) <= ownership.MAX_ALLOWED


def test_a_write_to_another_modules_object_is_a_breach():
    breaches = plant("engine", """
        def shorten(seq, plan):
            seq.block_table = []
            plan.decodes.append(None)
        """)
    assert any("engine.py" in b and "seq.block_table" in b and "block_manager" in b for b in breaches), breaches
    assert any("engine.py" in b and "plan.decodes" in b and "scheduler" in b for b in breaches), breaches


def test_writes_of_a_modules_own_state_are_not_breaches():
    assert plant("block_manager", """
        def grow(seq, block):
            seq.block_table.append(block)
        """) == []
    assert plant("engine", """
        class Counter:
            def __init__(self):
                self.count = 0

            def bump(self, other):
                other.count += 1
        """) == []


def test_a_function_over_the_limit_is_a_breach():
    body = "\n".join(f"    x{i} = {i}" for i in range(ownership.MAX_FUNCTION_LINES))
    breaches = plant("sampler", f"def long_one():\n{body}\n")
    assert any("long_one is 61 lines" in b for b in breaches), breaches
