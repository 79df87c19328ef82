"""Two rules of the reference's shape, read from its AST: one owner per piece of state, functions a chapter can show.

    pdm run python -m maint.ownership        # exit 1 and one line per breach

1. **Ownership.** A module writes the attributes of its own classes' objects and of nobody else's.
   A write is `x.attr = ...`, `x.attr += ...`, `x.attr[i] = ...`, `del x.attr`, or a call that changes
   a container in place (`x.attr.append(...)`, `.pop`, `.clear`, ...), where `x` is not `self` or
   `cls` (a class writes its own state; a subclass in another module goes through its base's methods
   like everybody else, so `self` writes are trusted only in the module that defines the attribute:
   see `own_attributes`). The attribute's owner is the module whose classes define it (assigned on
   `self` in a method, or a class-level field, e.g. a dataclass's); a write is a breach when the
   writing module defines no attribute of that name and another module does. That is a heuristic
   (attributes are matched by name, not by type), cheap and right for this package: names that two
   modules share are few, and a shared name is never reported.

   A `Sequence` is data that the engine's modules move forward: each of its fields has one declared
   writer (`DATA_OWNERS`: the block manager its block table, the scheduler its progress and tokens,
   day 4.5's structured.py its automaton state). The writes that remain, for now, are listed in
   `ALLOWED` with the reason: at most three.

2. **Length.** No function (or method) is longer than `MAX_FUNCTION_LINES` lines, from its `def` to
   its last line: a function a chapter shows must fit on a screen.

CI runs this (`.ci/run`), and tests/test_ownership.py runs it and plants a breach of each rule.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src_ref" / "tiny_llm_ref"
MAX_FUNCTION_LINES = 60

# Calls that change a list, deque, dict or set in place.
MUTATING_METHODS = frozenset({"append", "appendleft", "extend", "extendleft", "insert", "pop", "popleft",
                              "popitem", "remove", "clear", "update", "add", "discard", "setdefault",
                              "move_to_end", "sort", "reverse"})

# A `Sequence` (sequence.py) is plain data that other modules move forward, each field by one owner: the
# design (COURSE.md: "request state is data; the scheduler plans"), not an exception. attribute -> its writer.
DATA_OWNERS = {
    "block_table": "block_manager",  # allocate, append, truncate, detach, free: the block manager alone
    "num_computed_tokens": "scheduler",  # progress: admit, update_from_output, preempt, roll_back
    "status": "scheduler",
    "output_token_ids": "scheduler",  # new tokens: append_token
    "finish_reason": "scheduler",
    "num_preemptions": "scheduler",
    "num_cached_tokens": "scheduler",  # the first admission's prefix-cache hits
    "constraint_progress": "structured",  # day 4.5's cache of the automaton's state, read by structured.py alone
}

# The writes that stay for now, each with its reason: (writing module, attributes, why). At most MAX_ALLOWED.
ALLOWED = [
    ("engine", {"finished", "finish_reason", "logprobs", "num_cached_tokens"},
     "LLMEngine.report and finish_completed complete the scheduler's StepOutputs with what the engine alone "
     "knows (the runner's logprobs, the prefix cache's hits, day 4.5's completion); in place, because while "
     "grading the outputs can be the submission's objects, which the judge can change but not copy"),
    ("validation", {"failure"}, "refuse_after_failure and clear_failure wrap SlotScheduler.step and release_all: "
                                "the object they write is the method's own `self`; they stay in validation.py "
                                "because students' batch.py imports them from there"),
]
MAX_ALLOWED = 3

@dataclass(frozen=True)
class Breach:
    """One write to another module's object, or one function too long."""

    module: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"src_ref/tiny_llm_ref/{self.module}.py:{self.line}: {self.text}"


def own_attributes(tree: ast.Module) -> set[str]:
    """The attributes a module's classes define: `self.x = ...` in a method, or a name assigned in a class body."""
    names = set()
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for item in cls.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names.add(item.target.id)
            elif isinstance(item, ast.Assign):
                names.update(target.id for target in item.targets if isinstance(target, ast.Name))
        for node in ast.walk(cls):
            for target in assigned(node):
                if isinstance(target, ast.Attribute) and is_self(target.value):
                    names.add(target.attr)
    return names


def assigned(node: ast.AST) -> list[ast.AST]:
    """The targets a statement assigns to (tuples unpacked)."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    else:
        return []
    flat = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets += target.elts
        else:
            flat.append(target)
    return flat


def is_self(node: ast.AST) -> bool:
    """`self` or `cls`: a class writing its own state."""
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def parts_of_self(tree: ast.Module) -> set[str]:
    """Names bound by `for x in self.attr` (or `self.attr[...]`): parts of the object's own state, written as its own."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            source = node.iter.value if isinstance(node.iter, ast.Subscript) else node.iter
            if isinstance(source, ast.Attribute) and is_self(source.value):
                names.add(node.target.id)
    return names


def written_attributes(tree: ast.Module):
    """Every (line, attribute node) a module writes through an object that is not `self` or a part of it."""
    own = parts_of_self(tree)

    def foreign(node: ast.AST) -> bool:
        return not is_self(node) and not (isinstance(node, ast.Name) and node.id in own)

    for node in ast.walk(tree):
        for target in assigned(node):
            while isinstance(target, ast.Subscript):  # x.attr[i] = ... writes x.attr
                target = target.value
            if isinstance(target, ast.Attribute) and foreign(target.value):
                yield node.lineno, target
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATING_METHODS and isinstance(node.func.value, ast.Attribute)
                and foreign(node.func.value.value)):
            yield node.lineno, node.func.value


def ownership_breaches(trees: dict[str, ast.Module]) -> list[Breach]:
    """Writes to attributes that only other modules' classes define, less the `ALLOWED` ones."""
    owners: dict[str, set[str]] = {}
    for module, tree in trees.items():
        for name in own_attributes(tree):
            owners.setdefault(name, set()).add(module)
    for name, owner in DATA_OWNERS.items():  # the Sequence's field goes to its writer; another class's stays
        owners[name] = owners.get(name, set()) - {"sequence"} | {owner}
    allowed = {(module, name) for module, names, _ in ALLOWED for name in names}
    breaches, used = [], set()
    for module, tree in trees.items():
        for line, target in written_attributes(tree):
            defined_by = owners.get(target.attr, set())
            if not defined_by or module in defined_by:
                continue
            if (module, target.attr) in allowed:
                used.add((module, target.attr))
                continue
            breaches.append(Breach(module, line, f"writes {ast.unparse(target)} (state of "
                                                 f"{', '.join(sorted(defined_by))}.py)"))
    for module, name in sorted(allowed - used):  # an exception nothing needs any more goes, so none hides a new write
        breaches.append(Breach(module, 0, f"ALLOWED lists a write of .{name} that no longer happens: remove it"))
    return breaches


def length_breaches(trees: dict[str, ast.Module], limit: int = MAX_FUNCTION_LINES) -> list[Breach]:
    """Functions longer than `limit` lines, `def` to last line."""
    breaches = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    breaches.append(Breach(module, node.lineno, f"{node.name} is {lines} lines (most: {limit})"))
    return breaches


def parse_package(package: Path = PACKAGE) -> dict[str, ast.Module]:
    """Every module of the package, by name, parsed."""
    return {path.stem: ast.parse(path.read_text(), str(path)) for path in sorted(package.glob("*.py"))}


def check(package: Path = PACKAGE) -> list[Breach]:
    """Every breach of both rules in `package`."""
    if len(ALLOWED) > MAX_ALLOWED:
        raise SystemExit(f"maint/ownership.py allows {len(ALLOWED)} exceptions; at most {MAX_ALLOWED}: fix one")
    trees = parse_package(package)
    return ownership_breaches(trees) + length_breaches(trees)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", type=Path, default=PACKAGE, help="the package to read (default: the reference)")
    args = parser.parse_args(argv)
    breaches = check(args.package)
    for breach in breaches:
        print(breach)
    if breaches:
        print(f"{len(breaches)} breaches: see maint/ownership.py for the rules and the allowed exceptions")
        return 1
    print(f"ownership and function length: {args.package} is clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
