"""An integrity scan of submitted files, for the instructor: what in them is unusual for a task module.

It reads each file with `ast` (it never runs it) and lists, with file and line: imports beyond the short list
the tasks need (the reference, the tooling, `importlib`, `os`, `sys`, `subprocess`, ...) and relative imports
that leave the package; calls that reach around imports or the file system (`eval`, `open`, `getattr` with a
computed or private name); attributes that lead to the interpreter's internals (`sys.modules`, `os._exit`,
frames, `__globals__`, `__subclasses__`); assignments to attributes of imported names (patching what the tests'
oracles use); strings naming /proc, the reference, the grader's report or its environment. Docstrings are not
read. A finding means a person should look: the scan decides nothing (the sandbox is the defence, and a scan
can be walked around) and never stops a grade: a file it cannot read yields one note, "not scanned".
"""

import ast
import re
from dataclasses import dataclass
from pathlib import Path

# What the tasks of the course use (the reference imports only these), and the package's own modules.
ALLOWED_IMPORTS = {
    "__future__", "abc", "bisect", "collections", "dataclasses", "enum", "functools", "heapq", "itertools",
    "logging", "math", "mlx", "numpy", "operator", "random", "statistics", "time", "typing", "tiny_llm",
}
# A task module with a job beyond array code may import what that job needs, and nothing more.
ALLOWED_BY_MODULE = {
    "server": {"asyncio", "concurrent", "contextlib", "fastapi", "json", "queue", "threading", "uuid"},  # day 3.5
    "prefix_cache": {"hashlib"},  # day 3.3: a block's name is a hash of its parent's name and its tokens
    "speculative": {"mlx_lm"},  # day 4.1's draft-model proposer keeps its draft's KV cache with mlx-lm's
    "structured": {"json"},  # day 4.5: a schema compiled by its JSON text
    "openai_api": {"asyncio", "fastapi", "functools", "json", "pydantic"},  # day 4.5: an HTTP body's types
}
CALLS = {"__import__", "eval", "exec", "compile", "open", "globals", "breakpoint", "exit", "quit", "memoryview"}
ATTRIBUTE_CALLS = {"getattr", "setattr", "delattr", "hasattr"}
MODULES = {"sys", "os", "builtins", "importlib", "subprocess", "signal", "threading", "ctypes", "_thread"}
ATTRIBUTES = MODULES | {
    "modules", "_exit", "system", "popen", "fork", "forkpty", "kill", "killpg", "setsid", "chmod", "setrlimit",
    "_getframe", "settrace", "setprofile", "f_back", "f_globals", "f_locals", "f_builtins", "tb_frame", "gi_frame",
    "cr_frame", "__globals__", "__builtins__", "__subclasses__", "__code__", "__closure__", "__loader__",
    "__spec__", "__import__", "__bases__", "__mro__", "__self__",
}
STARTS_A_PROGRAM = re.compile(r"(exec|spawn)[lvpe]+|posix_spawn")
NAMES = {"__builtins__", "__loader__", "__spec__"}
STRINGS = ("/proc", "/dev/fd", "tiny_llm_ref", "results.json", "TINY_LLM_", "pytest", "site-packages")


@dataclass(frozen=True)
class Finding:
    path: str  # as shown in the report, e.g. src/tiny_llm/attention.py
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _root(node: ast.AST) -> str | None:
    """The name an attribute, item or call chain starts from (`os` in `os.path.join(...).x`)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _findings(tree: ast.AST, allowed: set[str]):
    """(node, what) for each finding; `ast.walk` visits without recursion, however deep the tree."""
    nodes = list(ast.walk(tree))
    imported = {(a.asname or a.name).split(".")[0] for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}
    docstrings = {id(n.value) for n in nodes if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom) and node.level > 1:
                yield node, "a relative import that leaves the package (from ..)"
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if node.level == 0 else []
            yield from ((node, f"imports {name}") for name in names if name.split(".")[0] not in allowed)
            if any(a.name == "*" for a in node.names):
                yield node, "a star import"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name, args = node.func.id, node.args
            if name in CALLS:
                yield node, f"calls {name}"
            elif name in ATTRIBUTE_CALLS and len(args) >= 2:
                if not (isinstance(args[1], ast.Constant) and isinstance(args[1].value, str)):
                    yield node, f"{name} with a computed attribute name"
                elif args[1].value.startswith("_") or args[1].value in ATTRIBUTES:
                    yield node, f"{name}(..., {args[1].value!r})"
                elif name in ("setattr", "delattr") and _root(args[0]) in imported:
                    yield node, f"{name} on an imported name ({_root(args[0])})"
        elif isinstance(node, ast.Attribute):
            usable = node.attr in allowed or (node.attr == "_thread" and "threading" in allowed)
            if not usable and (node.attr in ATTRIBUTES or STARTS_A_PROGRAM.fullmatch(node.attr)):
                yield node, f"uses .{node.attr}"
        elif isinstance(node, ast.Name) and node.id in NAMES:
            yield node, f"uses {node.id}"
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            for target in getattr(node, "targets", None) or [node.target]:
                if any(isinstance(sub, (ast.Attribute, ast.Subscript)) and _root(sub) in imported
                       for sub in ast.walk(target)):
                    yield target, f"assigns to an attribute of an imported name ({_root(target)}): a patch"
        elif isinstance(node, ast.Global):
            yield from ((node, f"rebinds the imported name {name} from a function") for name in node.names
                        if name in imported)
        elif isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)) and id(node) not in docstrings:
            text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
            yield from ((node, f"a string that names {needle}") for needle in STRINGS if needle in text)


def scan_source(source: str | bytes, shown_as: str) -> list[Finding]:
    """Findings in one file's source; the file's name picks any imports its job allows (ALLOWED_BY_MODULE). A
    file that does not parse yields none (nothing in it can run); one the scan cannot read at all (a nesting that
    exhausts the recursion limit, binary junk) yields one note: the scan never raises."""
    try:
        tree = ast.parse(source, filename=shown_as)
        allowed = ALLOWED_IMPORTS | ALLOWED_BY_MODULE.get(Path(shown_as).stem, set())
        found = {Finding(shown_as, getattr(node, "lineno", 0), what) for node, what in _findings(tree, allowed)}
    except SyntaxError:
        return []  # the module's tests fail at its import, with the syntax error
    except Exception as error:  # noqa: BLE001 - RecursionError, MemoryError, ValueError (null bytes), ...
        return [Finding(shown_as, 0, f"not scanned: {type(error).__name__} while reading it")]
    return sorted(found, key=lambda f: (f.line, f.what))


def scan_file(path: Path, shown_as: str) -> list[Finding]:
    return scan_source(path.read_bytes(), shown_as)
