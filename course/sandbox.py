"""The submission's code runs here: a worker process in an OS sandbox (bubblewrap), reached through course/remote.py.

What it sees, and each bound: book/src/grading.md, "Where your code runs" and "The bounds, and where each holds".
"""

from __future__ import annotations

import ast
import atexit
import fcntl
import functools
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from contextlib import suppress
from pathlib import Path

from course import cgroup, models, remote, selector

BWRAP = "/usr/bin/bwrap"
NOBODY = 65534
SANDBOX_ROOT_VARIABLE = "TINY_LLM_SANDBOX_ROOT"  # set by the grader in the trusted test process
LIMITS_VARIABLE = "TINY_LLM_SANDBOX_LIMITS"  # "cpu_seconds,memory_mb" for the worker
RANK_PIPES_VARIABLE = "TINY_LLM_RANK_PIPES"  # "read_fd,write_fd": a rank program's pipes to its worker
LOGS_VARIABLE = "TINY_LLM_SANDBOX_LOGS"  # where the workers' output goes (the grader removes it)
UNSANDBOXED_VARIABLE = "TINY_LLM_UNSANDBOXED"  # why bubblewrap cannot be used (set once, inherited)
CGROUP_PREFIX_VARIABLE = "TINY_LLM_CGROUP_PREFIX"  # how the grading run names its cgroups (it removes them all)
WORKER_FILES = ("__init__.py", "remote.py", "sandbox.py", "cgroup.py", "selector.py", "course_map.py", "fast_mlx.py",
                "models.py", "tasks.json")
SERVER_SOCKETS_VARIABLE = "TINY_LLM_SERVER_SOCKETS"  # "fd:port,...": the worker's listening sockets (see Worker)
PRELOAD_VARIABLE = "TINY_LLM_PRELOAD_TOKENIZER"  # the tests' tokenizer, for a worker to begin loading at start
SERVER_SOCKETS = 4  # a test's servers at once in one worker (module-scoped ones stay up beside a test's own)
ACTOR_FAKES = "tests/actor_fakes"  # the one package of tests/ the worker holds (see its docstring)
MAX_OUTPUT_BYTES = 16 << 20
# Threads and processes of one sandbox: the cgroup's pids.max, and RLIMIT_NPROC set inside the sandbox's user
# namespace (`_worker_main`). Day 3.5's server, its client and MLX's pools run many: at 64 an honest 3.5 hung.
MAX_TASKS = 512
MAX_OPEN_FILES = 4096  # mlx_lm sets its own limit to (2048, 4096) at import, and may not raise the hard one
SCRATCH_BYTES = 256 << 20
INSIDE = "/grade"
BLAS_THREADS = ("MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@functools.cache  # probed once per process; a failure is remembered for its children too
def bwrap_path() -> str | None:
    """bubblewrap, where it is installed and can start a sandbox (a container may forbid namespaces)."""
    found = shutil.which("bwrap") or (BWRAP if os.path.exists(BWRAP) else None)
    if os.environ.get(UNSANDBOXED_VARIABLE) or not sys.platform.startswith("linux") or not found:
        return None
    probe = subprocess.run([found, "--ro-bind", "/", "/", "--unshare-all", "--uid", str(NOBODY), "--gid",
                            str(NOBODY), "true"], capture_output=True)
    if probe.returncode != 0:
        os.environ[UNSANDBOXED_VARIABLE] = probe.stderr.decode(errors="replace").strip() or "bwrap failed"
        return None
    return found


def why_unsandboxed() -> str:
    """One line: why bubblewrap cannot start a sandbox here."""
    broken = os.environ.get(UNSANDBOXED_VARIABLE)
    if sys.platform == "darwin" or not broken:
        return "macOS has no bubblewrap" if sys.platform == "darwin" else "bubblewrap is not installed"
    return f"bubblewrap cannot start a sandbox here ({broken.splitlines()[0]}): user namespaces may be disabled"


def unsandboxed_warning() -> str | None:
    """None where the sandbox is used; otherwise what running without it means, and why it cannot be used."""
    return None if bwrap_path() else (
        "grade: WARNING: running UNSANDBOXED. The submission's code runs as you, with your files and network; "
        "results are still decided outside its process, but a submission could read the reference or change "
        f"files. Fine for grading your own work; not for grading someone else's ({why_unsandboxed()}).")


# ---------------------------------------------------------------- the sandbox root (prepared by the grader)

def strip_task_bodies(source: str, functions: set[str]) -> str:
    """`source` with the bodies of the named functions (qualified names) replaced by a raise."""
    lines = source.splitlines(keepends=True)
    spans = []
    for name, node in selector.definitions(ast.parse(source)).items():
        if name in functions:
            first = node.body[0]
            spans.append((first.lineno, node.end_lineno, first.col_offset))
    for start, end, indent in sorted(spans, reverse=True):
        lines[start - 1:end] = [" " * indent + 'raise NotImplementedError("not available while this day is graded")\n']
    return "".join(lines)


def prepare_root(dest: Path, package: Path, reference: Path, course: Path, week: int, day: int,
                 task: int | None = None) -> Path:
    """The sandbox's read-only view: the graded package, the reference without day W.D's tasks (or without
    Task `task` of it alone), the worker."""
    graded = {}
    for module, names in selector.task_table().items():
        graded[module] = {name for name, t in names.items() if t is not None and t.day_key == (week, day)
                          and task in (None, t.number)}
    (dest / "course").mkdir(parents=True)
    for name in WORKER_FILES:
        shutil.copyfile(course / name, dest / "course" / name)
    if (course.parent / ACTOR_FAKES).exists():  # fakes that need no trust: no test, no answer (a course may have none)
        (dest / "tests").mkdir()
        shutil.copytree(course.parent / ACTOR_FAKES, dest / ACTOR_FAKES, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(package, dest / "src" / "tiny_llm", ignore=shutil.ignore_patterns("__pycache__"))
    target = dest / "src_ref" / reference.name
    target.mkdir(parents=True)
    for path in sorted(reference.glob("*.py")):
        text = path.read_text()
        if graded.get(path.stem):
            text = strip_task_bodies(text, graded[path.stem])
        (target / path.name).write_text(text)
    return dest


def task_root(root: Path, week: int, day: int, task: int) -> Path:
    """The root of the worker that runs Task `task`'s tests of the day graded in `root` (trusted side): the same
    package, the reference without that task's bodies alone; made beside `root` on first use."""
    dest = root.parent / f"{root.name}-task{task}"
    if not dest.exists():
        here = Path(__file__).resolve().parent
        building = Path(tempfile.mkdtemp(prefix=f"{dest.name}-", dir=root.parent)) / "root"
        prepare_root(building, root / "src" / "tiny_llm", here.parent / "src_ref" / "tiny_llm_ref", here, week, day,
                     task)
        building.rename(dest)  # whole or not at all: a test process stopped half-way leaves no half root
        building.parent.rmdir()
    return dest


# ---------------------------------------------------------------- starting the worker (trusted side)

def _python_dirs() -> list[str]:
    """What the interpreter needs to run, read-only: its installation and the virtual environment."""
    dirs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    dirs |= {os.path.realpath(p) for p in sys.path if p and os.path.isdir(p) and "site-packages" in p}
    return sorted(dirs)


def _bwrap_command(root: Path, inner: list[str], environment: dict[str, str]) -> list[str]:
    command = [bwrap_path(), "--unshare-all", "--die-with-parent", "--new-session", "--uid", str(NOBODY),
               "--gid", str(NOBODY), "--clearenv", "--proc", "/proc", "--dev", "/dev",
               "--size", str(SCRATCH_BYTES), "--tmpfs", "/tmp"]
    for system in ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/ld.so.cache", "/etc/alternatives"):
        if os.path.exists(system):
            command += ["--ro-bind", system, system]
    for directory in _python_dirs():
        command += ["--ro-bind", directory, directory]
    command += ["--ro-bind", str(root), INSIDE]
    if models.EMBEDDED_MODEL_DIR.is_dir():  # the tests' model: the actor loads its tokenizer from its files
        shared = os.path.realpath(models.EMBEDDED_MODEL_DIR)
        command += ["--ro-bind", shared, shared]
    environment = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1",
                   "PYTHONPATH": f"{INSIDE}/src:{INSIDE}/src_ref:{INSIDE}", "PYTHONHASHSEED": "0", **environment}
    for name, value in environment.items():
        command += ["--setenv", name, value]
    return command + ["--chdir", "/tmp", *inner]


def _limits(cpu_seconds: float | None, memory_mb: int | None, group: cgroup.Group | None):
    def apply() -> None:  # in the child, between fork and exec: inherited by bwrap and the worker
        limits = [(resource.RLIMIT_FSIZE, MAX_OUTPUT_BYTES), (resource.RLIMIT_CORE, 0),
                  (resource.RLIMIT_NOFILE, MAX_OPEN_FILES)]
        if cpu_seconds:
            limits.append((resource.RLIMIT_CPU, int(cpu_seconds) + 1))
        if memory_mb:
            limits.append((resource.RLIMIT_AS, memory_mb << 20))
        for which, value in limits:
            with suppress(ValueError, OSError):  # a hard limit already lower stays
                resource.setrlimit(which, (value, value))
        if group is not None:
            group.join()

    return apply


PIPE_BYTES = 1 << 20  # a model's logits (1.5 MB for a chunk of tests' tiny model) cross in one or two writes


def _pipe() -> tuple[int, int]:
    """A pipe as large as an unprivileged process may make one (1 MiB on Linux; 64 KiB elsewhere, or if refused):
    an array crosses in few system calls, each a wake-up of the other side, not one per 64 KiB."""
    read_fd, write_fd = os.pipe()
    with suppress(AttributeError, OSError):  # Linux alone has F_SETPIPE_SZ
        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return read_fd, write_fd


class Worker:
    """One sandbox and the pipes to its worker process(es): one worker and the endpoint that talks to it, or
    (`ranks` N) N workers in an `mx.distributed` ring, each reached by the rank program the pipes go to."""

    def __init__(self, root: Path, week: int, day: int, kind: str, cpu_seconds: float | None, memory_mb: int | None,
                 ranks: int = 0, threads_per_rank: int | None = None, reads_text: bool = False):
        pipes = [(_pipe(), _pipe()) for _ in range(max(ranks, 1))]  # (to the worker, from the worker) each
        inside = [str(fd) for (to_r, _), (_, from_w) in pipes for fd in (to_r, from_w)]
        inner = [os.path.join(os.path.realpath(sys.prefix), "bin", "python"), "-s", "-m", "course.sandbox", str(week),
                 str(day), kind, "ring" if ranks else "one", *inside]
        self.group = cgroup.Group.make(os.environ.get(CGROUP_PREFIX_VARIABLE, "tiny-llm-"), MAX_TASKS,
                                       memory_mb << 20 if memory_mb else None)
        # A server the tests start in the worker (day 3.5's, 4.5's) listens on one of these: made here, on this
        # machine's loopback, and handed over open, so the tests talk HTTP to it while the worker, with no network
        # of its own, can only accept on them (bytes cross; no object of either side does).
        listeners = [] if ranks else [socket.create_server(("127.0.0.1", 0), backlog=64) for _ in range(SERVER_SOCKETS)]
        environment = {SERVER_SOCKETS_VARIABLE: ",".join(f"{s.fileno()}:{s.getsockname()[1]}" for s in listeners)}
        if threads_per_rank:
            environment.update(dict.fromkeys(BLAS_THREADS, str(threads_per_rank)))
        if reads_text:  # its tests read text: it begins loading its own tokenizer while the judge starts up
            environment[PRELOAD_VARIABLE] = str(models.EMBEDDED_MODEL_DIR.resolve())
        self.log = tempfile.NamedTemporaryFile(prefix="tiny-llm-worker-", suffix=".log", delete=False,
                                               dir=os.environ.get(LOGS_VARIABLE) or None)
        if bwrap_path():
            command, cwd, env = _bwrap_command(root, inner, environment), "/", {}
        else:
            command, cwd = inner, str(root)
            env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(["src", "src_ref", "."]),
                   "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(root), **environment}
        self.process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        pass_fds=[int(fd) for fd in inside] + [s.fileno() for s in listeners],
                                        preexec_fn=_limits(cpu_seconds, memory_mb, self.group))
        for fd in inside:
            os.close(int(fd))
        for listener in listeners:
            listener.close()  # the worker's now
        # This side's ends: (read, write) per worker.
        self.ends = [(from_r, to_w) for (_, to_w), (from_r, _) in pipes]
        self.fds = tuple(fd for pair in self.ends for fd in pair)
        self.modules: dict[str, remote.Handle] = {}  # the selection's modules read so far (RemoteSelection)
        self.endpoint = None
        if not ranks:
            self.endpoint = remote.Endpoint(*self.ends[0], "trusted")
            self.endpoint.explain_loss = self._why_it_ended

    def _why_it_ended(self) -> str:
        try:
            status = self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return ""
        how = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
        limit = self.group and self.group.hit_limit()
        if limit:
            how += f"; it reached the sandbox's limit on {limit}"
        return (f": the submission's process ended ({how}: a crash, an abort, an exit of the interpreter, or a "
                f"limit on memory, CPU time or output). The end of its output:\n{self.output_tail(1500)}")

    def output_tail(self, limit: int = 3000) -> str:
        with suppress(OSError), open(self.log.name, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            return f.read().decode(errors="replace")
        return ""

    def close_pipes(self) -> None:
        """The worker's pipes closed: it ends on its own (and is counted in CPU time)."""
        for fd in self.fds:
            with suppress(OSError):
                os.close(fd)
        self.fds = ()  # closed once: the numbers may belong to other files by now

    def stop(self, wait: float = 2, keep_log: bool = False) -> None:
        """Close the pipes so the worker ends on its own; kill it if it does not."""
        self.close_pipes()
        try:
            self.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, 9)
            self.process.wait()
        if self.group is not None:
            self.group.remove()  # whatever it left behind, however detached
        if not keep_log:
            self.remove_log()

    def remove_log(self) -> None:
        with suppress(OSError):
            os.unlink(self.log.name)


def _start(week: int, day: int, kind: str, ranks: int = 0, threads_per_rank: int | None = None,
           reads_text: bool = False) -> Worker:
    """A sandbox for `kind`'s code of day W.D, with the grader's limits: on Task N's own root (`task_root`) for
    "taskN", so it runs the day's other tasks of the reference and never Task N's answer; on the day's otherwise."""
    root = Path(os.environ[SANDBOX_ROOT_VARIABLE])
    if kind.startswith("task"):
        root = task_root(root, week, day, int(kind.removeprefix("task")))
    cpu, memory = (float(limit or 0) for limit in os.environ.get(LIMITS_VARIABLE, ",").split(","))
    return Worker(root, week, day, kind, cpu or None, int(memory) or None, ranks, threads_per_rank, reads_text)


class RemoteSelection:
    """`solution(week, day)` while grading: the day's package (`kind` "day", "taskN" or "stack", each with a worker
    of its own), in a sandboxed worker; in a rank program, in its rank's (`RankLink`). A worker that died or was
    stopped at a time limit is replaced on the next use, so a module-level `sol = solution(...)` survives it."""

    _workers: dict[tuple, Worker] = {}
    _reading_text: set[tuple] = set()  # the keys whose tests read text (`reads_text`): their workers preload
    restart_needed = False  # a worker broke and was replaced during the test running now

    def __init__(self, week: int, day: int, kind: str = "day", reads_text: bool = False):
        self._key = (week, day, kind)
        if reads_text:
            self._reading_text.add(self._key)
        _forward_seeds()
        # Started now, while this process is still importing and collecting the tests: on two cores the worker's
        # own start-up (Python, MLX, the package) runs beside this process's, not after it.
        self._worker()

    def _worker(self) -> Worker | RankLink:
        if os.environ.get(RANK_PIPES_VARIABLE):
            return RankLink.get()
        worker = self._workers.get(self._key)
        if worker is not None and worker.endpoint.broken:
            RemoteSelection.restart_needed = True
            worker.stop()
            worker = None
        if worker is None:
            if not self._workers:
                atexit.register(stop_workers)  # the workers' output files go with them
            worker = self._workers[self._key] = _start(*self._key, reads_text=self._key in self._reading_text)
        return worker

    def __getattr__(self, module: str):
        if module.startswith("_"):
            raise AttributeError(module)
        worker = self._worker()
        found = worker.modules.get(module)
        if found is None:
            found = worker.endpoint.request("getattr", 0, module)
            if type(found) is remote.Handle:  # a module stays one object: `sol.engine` in a loop is one round trip
                worker.modules[module] = found
        return found


class RankLink:
    """A rank program's pipes to its worker in the launch's sandbox (course/ranks.py starts both), which serves
    the launch's code and this rank's `mx.distributed` group (`rank_group`)."""

    def __init__(self):
        read_fd, write_fd = (int(fd) for fd in os.environ[RANK_PIPES_VARIABLE].split(","))
        self.endpoint = remote.Endpoint(read_fd, write_fd, "trusted")
        self.modules: dict[str, remote.Handle] = {}

    @classmethod
    @functools.cache
    def get(cls) -> RankLink:
        return cls()


def rank_group():
    """In a rank program while grading: this rank's `mx.distributed` group, in its worker; None otherwise."""
    return RankLink.get().endpoint.request("getattr", 0, "rank_group") if os.environ.get(RANK_PIPES_VARIABLE) else None


def start_ranks(world_size: int, threads_per_rank: int | None, code) -> Worker:
    """One sandbox of `world_size` workers in an `mx.distributed` ring on its own loopback, for the rank programs of
    a launch that runs `code` (a `selector.Choice`). `.ends[r]` are the pipes of rank r's program (pass them on
    with `RANK_PIPES_VARIABLE`)."""
    return _start(code.week, code.day, code.kind, world_size, threads_per_rank)


def _forward_seeds() -> None:
    """`mx.random.seed(n)` in a test seeds the worker too, before its next call: seeded draws repeat."""
    import mlx.core as mx

    def seed_both(value, seed=mx.random.seed) -> None:
        seed(value)
        for worker in RemoteSelection._workers.values():
            worker.endpoint.pending_seed = int(value)

    if getattr(mx.random.seed, "__name__", "") != seed_both.__name__:
        mx.random.seed = seed_both


def needs_restart() -> bool:
    """Whether a worker broke during the test that just finished (its objects are gone: start afresh)."""
    return RemoteSelection.restart_needed or any(w.endpoint.broken for w in RemoteSelection._workers.values())


def stop_workers() -> None:
    for worker in RemoteSelection._workers.values():
        worker.close_pipes()  # every worker ends at once, not one after the other
    for worker in RemoteSelection._workers.values():
        worker.stop()
    RemoteSelection._workers.clear()
    RemoteSelection.restart_needed = False


# ---------------------------------------------------------------- the worker (inside the sandbox)

def _start_ring(argv: list[str], fds: list[str]) -> None:
    """A ranks sandbox's first process: one worker per pair of pipes, in a ring on this sandbox's loopback."""
    ranks = range(len(fds) // 2)
    ports = []
    for _ in ranks:  # free on this loopback now (the sandbox's own; without bubblewrap, the machine's)
        with socket.create_server(("127.0.0.1", 0)) as probe:
            ports.append(probe.getsockname()[1])
    hostfile = Path(tempfile.mkdtemp()) / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
    workers = [subprocess.Popen([sys.executable, "-s", "-m", "course.sandbox", *argv, "rank", *fds[2 * r:2 * r + 2]],
                                env={**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(r)},
                                pass_fds=[int(fd) for fd in fds[2 * r:2 * r + 2]]) for r in ranks]
    for fd in fds:
        os.close(int(fd))
    for worker in workers:
        worker.wait()


def _defer_mlx_lm_start_up() -> None:
    """Make `import mlx_lm.models.qwen2` cost its model files alone in the worker: mlx-lm's package start-up
    (its `load`, `generate` and tokenizers: transformers, huggingface_hub, jinja2) runs on the first attribute
    read of `mlx_lm` itself, not before. The worker builds every model the judge hands over from
    `mlx_lm.models` (course/remote.py) and day 4.1's reference imports `mlx_lm.models.cache`: 2-3 s of imports
    per worker it never used (what the student's code reads of `mlx_lm` is there all the same)."""
    import importlib.util

    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None or "mlx_lm" in sys.modules:
        return
    package, lock, started = importlib.util.module_from_spec(spec), threading.RLock(), []

    def start_up(name: str):
        with lock:  # another thread asking meanwhile waits for the whole start-up
            if not started:
                started.append(True)
                spec.loader.exec_module(package)  # the package's own __init__, in the package's namespace
                del package.__getattr__
        if name not in package.__dict__:
            raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}")
        return package.__dict__[name]

    package.__getattr__ = start_up
    sys.modules["mlx_lm"] = package



def _worker_main(argv: list[str]) -> None:
    week, day, kind, role, *fds = argv  # role: "one" worker, a "ring" of workers to start, or a "rank" of one
    if os.getuid() == NOBODY:  # in bubblewrap's user namespace, where the kernel (5.14 on) counts this sandbox's
        # tasks alone (never root's): the grader's user's other processes need not be counted first
        with suppress(ValueError, OSError):  # a hard limit already lower stays
            resource.setrlimit(resource.RLIMIT_NPROC, (MAX_TASKS, MAX_TASKS))
    if role == "ring":
        return _start_ring([week, day, kind], fds)
    from course import fast_mlx

    fast_mlx.setup(quiet=True, shared_cores=True)  # the tests' process computes on the same cores between calls
    _defer_mlx_lm_start_up()
    root = selector.Choice(int(week), int(day), kind).select()
    if role == "rank":  # its rank program asks for its group too
        import mlx.core as mx

        root.rank_group = mx.distributed.init(strict=True, backend="ring")
    if os.environ.get(PRELOAD_VARIABLE):
        models.preload_tokenizer(os.environ[PRELOAD_VARIABLE])
    endpoint = remote.Endpoint(int(fds[0]), int(fds[1]), "sandbox", root=root)
    endpoint.read_forever()


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
