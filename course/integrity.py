"""An integrity scan of a submission's modules: code that could make the grader report what did not happen.

The grader (scripts/grade.py) runs the student's code inside the test process, where code can always
lie: rewrite the plugin that reports results, write fake results, exit before a failure is seen, patch
the reference the tests compare against. This scan reads each submitted module with `ast` (it never runs
it) and flags the ways in, with the file and line of each:

- imports outside the short list the tasks need (MLX, numpy and a few standard modules), with a plain
  reason for the dangerous ones (the reference, the tests and the tooling, `importlib`, `ctypes`,
  `subprocess`, `os`, `sys`, `signal`, `threading`, `multiprocessing`, ...), and relative imports that
  leave the package;
- calls that reach around imports or the file system (`__import__`, `eval`, `exec`, `compile`, `open`,
  `globals`, `getattr`/`setattr`/`delattr` on a private or computed name);
- attributes that lead to the interpreter's internals whatever they are reached from (`sys.modules` as
  `logging.sys.modules`, `os._exit`, frames, `__globals__`, `__subclasses__`, ...);
- assignments to attributes of imported names (patching MLX or another module the oracle uses);
- strings naming /proc, the event stream, the reference package or results.json.

Docstrings are not read. A finding is not proof of cheating: it means a person should look. The scan
decides nothing and never stops a grade: a file it cannot read yields one note.
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

# A task module with a job beyond array code may import what that job needs, and nothing more: the
# server (day 3.5) runs its engine in a thread and speaks HTTP; the prefix cache (day 3.3) hashes blocks.
ALLOWED_BY_MODULE = {
    "server": {"asyncio", "concurrent", "contextlib", "fastapi", "json", "queue", "threading", "uuid"},
    "prefix_cache": {"hashlib"},  # a block's name is a hash of its parent's name and its tokens
    "speculative": {"mlx_lm"},
    "structured": {"json"},  # day 4.5: a schema compiled by its JSON text
    # Day 4.5 grades the server's protocol module with the constraint it builds: an HTTP body's types and answers.
    "openai_api": {"asyncio", "fastapi", "functools", "json", "pydantic"},  # day 4.1's draft-model proposer keeps its draft's KV cache with mlx-lm's
}

REASONS = {
    "tiny_llm_ref": "imports the reference solution",
    "tests": "imports the course's tests", "course": "imports the course's tooling",
    "scripts": "imports the course's tooling", "maint": "imports the course's tooling",
    "benches": "imports the course's tooling", "pytest": "imports pytest", "_pytest": "imports pytest",
    "pluggy": "imports pytest's plugin system",
    "importlib": "imports importlib (loads or replaces modules)", "sys": "imports sys (sys.modules, exit)",
    "os": "imports os (processes, files, os._exit)", "ctypes": "imports ctypes (raw memory and C calls)",
    "subprocess": "imports subprocess (starts processes)", "signal": "imports signal (timers and handlers)",
    "threading": "imports threading", "_thread": "imports threading", "multiprocessing": "imports multiprocessing",
    "concurrent": "imports concurrent (threads or processes)", "gc": "imports gc (reaches every object)",
    "inspect": "imports inspect (reaches callers' frames)", "builtins": "imports builtins",
    "atexit": "imports atexit", "faulthandler": "imports faulthandler", "resource": "imports resource",
    "shutil": "imports shutil (files)", "pathlib": "imports pathlib (files)", "io": "imports io (files)",
    "socket": "imports socket", "pty": "imports pty", "fcntl": "imports fcntl", "mmap": "imports mmap",
    "tempfile": "imports tempfile", "runpy": "imports runpy", "site": "imports site", "types": "imports types",
    "pickle": "imports pickle", "marshal": "imports marshal", "code": "imports code", "json": "imports json",
}

BAD_CALLS = {
    "__import__": "calls __import__", "eval": "calls eval", "exec": "calls exec", "compile": "calls compile",
    "open": "opens a file", "globals": "calls globals()", "breakpoint": "calls breakpoint()",
    "exit": "calls exit()", "quit": "calls quit()", "memoryview": "uses memoryview",
}

BAD_ATTRIBUTES = {
    "modules": "sys.modules", "_exit": "os._exit", "system": "os.system", "popen": "os.popen", "fork": "os.fork",
    "forkpty": "os.forkpty", "kill": "os.kill", "killpg": "os.killpg", "setsid": "os.setsid",
    "execv": "os.exec*", "execve": "os.exec*", "execvp": "os.exec*", "execl": "os.exec*", "spawnv": "os.spawn*",
    "posix_spawn": "os.posix_spawn", "chmod": "os.chmod", "setrlimit": "resource.setrlimit",
    "_getframe": "sys._getframe", "settrace": "sys.settrace", "setprofile": "sys.setprofile",
    "f_back": "a frame's caller", "f_globals": "a frame's globals", "f_locals": "a frame's locals",
    "f_builtins": "a frame's builtins", "tb_frame": "a traceback's frame", "gi_frame": "a generator's frame",
    "cr_frame": "a coroutine's frame", "__globals__": "a function's globals", "__builtins__": "the builtins",
    "__subclasses__": "every subclass of a type", "__code__": "a function's code", "__closure__": "a closure",
    "__loader__": "a module's loader", "__spec__": "a module's spec", "__import__": "__import__",
    "__bases__": "a class's bases", "__mro__": "a class's bases", "__self__": "a bound method's module",
    "sys": "the sys module", "os": "the os module", "builtins": "the builtins module",
    "importlib": "importlib", "subprocess": "subprocess", "signal": "signal", "threading": "threading",
    "ctypes": "ctypes", "_thread": "threading",
}

BAD_STRINGS = {
    "/proc": "names /proc", "/dev/fd": "names /dev/fd", "tiny_llm_ref": "names the reference package",
    "results.json": "names the grader's report", "TINY_LLM_": "names the grader's environment",
    "pytest": "names pytest", "site-packages": "names site-packages",
}

ATTR_CALLS = {"getattr", "setattr", "delattr", "hasattr"}


@dataclass(frozen=True)
class Finding:
    path: str  # as shown in the report, e.g. src/tiny_llm/attention.py
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str, allowed: set[str]):
        self.path = path
        self.allowed = ALLOWED_IMPORTS | allowed  # modules this file may import
        self.findings: list[Finding] = []
        self.imported: set[str] = set()  # names bound by an import in this module

    def flag(self, node: ast.AST, what: str) -> None:
        self.findings.append(Finding(self.path, getattr(node, "lineno", 0), what))

    def check_module(self, node: ast.AST, name: str) -> None:
        top = name.split(".")[0]
        if top in self.allowed:
            return
        if top.startswith("tiny_llm_"):
            self.flag(node, f"imports {name}: another solution package")
        else:
            reason = REASONS.get(top, f"imports {top}: not a module the tasks need")
            self.flag(node, reason if name == top else f"{reason} ({name})")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.check_module(node, alias.name)
            self.imported.add((alias.asname or alias.name).split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level > 1:
            self.flag(node, "a relative import that leaves the package (from ..)")
        elif node.level == 0:
            self.check_module(node, node.module or "")
        for alias in node.names:
            if alias.name == "*":
                self.flag(node, "a star import")
            self.imported.add(alias.asname or alias.name)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name):
            name = node.func.id
            if name in BAD_CALLS:
                self.flag(node, BAD_CALLS[name])
            elif name in ATTR_CALLS and len(node.args) >= 2:
                attribute = node.args[1]
                if not (isinstance(attribute, ast.Constant) and isinstance(attribute.value, str)):
                    self.flag(node, f"{name} with a computed attribute name")
                elif attribute.value.startswith("_") or attribute.value in BAD_ATTRIBUTES:
                    self.flag(node, f"{name}(..., {attribute.value!r})")
                elif name in ("setattr", "delattr") and _root(node.args[0]) in self.imported:
                    self.flag(node, f"{name} on an imported name ({_root(node.args[0])})")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if BAD_ATTRIBUTES.get(node.attr) in self.allowed:
            pass  # e.g. `._thread` in the server, which may use threading
        elif node.attr in BAD_ATTRIBUTES or re.fullmatch(r"(exec|spawn)[lvpe]+", node.attr):
            self.flag(node, f"uses .{node.attr} ({BAD_ATTRIBUTES.get(node.attr, 'starts a program')})")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in ("__builtins__", "__loader__", "__spec__"):
            self.flag(node, f"uses {node.id}")

    def check_targets(self, targets: list[ast.AST]) -> None:
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, (ast.Attribute, ast.Subscript)) and _root(sub) in self.imported:
                    self.flag(sub, f"assigns to an attribute of an imported name ({_root(sub)}): patches "
                                   f"code that other modules (and the reference) use")
                    break

    def visit_Assign(self, node: ast.Assign) -> None:
        self.check_targets(node.targets)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.check_targets([node.target])
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.check_targets([node.target])
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        self.check_targets(node.targets)
        self.generic_visit(node)

    def visit_Global(self, node: ast.Global) -> None:
        for name in node.names:
            if name in self.imported:
                self.flag(node, f"rebinds the imported name {name} from a function")
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # a docstring or a comment-like string: not data
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        values = [node.value] if isinstance(node.value, str) else []
        if isinstance(node.value, bytes):
            values = [node.value.decode("latin-1")]
        for value in values:
            for needle, what in BAD_STRINGS.items():
                if needle in value:
                    self.flag(node, f"a string that {what}")


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def scan_source(source: str | bytes, shown_as: str) -> list[Finding]:
    """Findings in one module's source. A file that does not parse yields none (nothing in it can run); one the
    scan cannot read at all (a nesting deep enough to exhaust the recursion limit, binary junk) yields one note
    saying so: the scan never stops a grade.

    The module's name (the file name in `shown_as`) picks any imports its job allows (ALLOWED_BY_MODULE).
    """
    try:
        tree = ast.parse(source, filename=shown_as)
    except SyntaxError:
        return []  # the module's tests fail at its import, with the syntax error
    except Exception as error:  # noqa: BLE001 - RecursionError, MemoryError, ValueError (null bytes), ...
        return [Finding(shown_as, 0, f"not scanned: {type(error).__name__} while parsing it")]
    try:
        scanner = _Scanner(shown_as, ALLOWED_BY_MODULE.get(Path(shown_as).stem, set()))
        scanner.visit(tree)
    except Exception as error:  # noqa: BLE001 - a tree too deep to walk
        return [Finding(shown_as, 0, f"not scanned: {type(error).__name__} while reading it")]
    return sorted(set(scanner.findings), key=lambda f: (f.line, f.what))


def scan_file(path: Path, shown_as: str) -> list[Finding]:
    return scan_source(path.read_bytes(), shown_as)
