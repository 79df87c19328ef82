"""The submission's code runs here: a worker process in an OS sandbox (bubblewrap), reached through course/remote.py.
What it sees, and each bound: book/src/grading.md, "Where your code runs" and "The bounds, and where each holds"."""

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
import types
from contextlib import suppress
from pathlib import Path

from course import cgroup, models, remote, selector

BWRAP = "/usr/bin/bwrap"
NOBODY = 65534
SANDBOX_ROOT_VARIABLE = "TINY_LLM_SANDBOX_ROOT"  # set by the grader in the trusted test process
LIMITS_VARIABLE = "TINY_LLM_SANDBOX_LIMITS"  # "cpu_seconds,memory_mb" for the worker
RANK_PIPES_VARIABLE = "TINY_LLM_RANK_PIPES"  # "read_fd,write_fd": a rank program's pipes to its worker
LOGS_VARIABLE = "TINY_LLM_SANDBOX_LOGS"  # the folder of the workers' output files (unnamed: gone with them)
UNSANDBOXED_VARIABLE = "TINY_LLM_UNSANDBOXED"  # why bubblewrap cannot be used (set once, inherited)
CGROUP_PREFIX_VARIABLE = "TINY_LLM_CGROUP_PREFIX"  # how the grading run names its cgroups (it removes them all)
WORKER_FILES = ("__init__.py", "remote.py", "sandbox.py", "cgroup.py", "selector.py", "course_map.py", "fast_mlx.py",
                "models.py", "tasks.json")
SERVER_SOCKETS_VARIABLE = "TINY_LLM_SERVER_SOCKETS"  # "fd:port,...": the worker's listening sockets (see Worker)
PRELOAD_VARIABLE = "TINY_LLM_PRELOAD_TOKENIZER"  # the tests' tokenizer, for a worker to begin loading at start
SERVER_SOCKETS = 4  # a test's servers at once in one worker (module-scoped ones stay up beside a test's own)
ACTOR_FAKES = "tests/actor_fakes"  # the one package of tests/ the worker holds (see its docstring)
MAX_OUTPUT_BYTES = 16 << 20
PIPE_BYTES = 1 << 20  # a model's logits (1.5 MB for a chunk of tests' tiny model) cross in one or two writes
# Threads and processes of one sandbox: the cgroup's pids.max, and RLIMIT_NPROC set inside the sandbox's user
# namespace (`_worker_main`). Day 3.5's server, its client and MLX's pools run many: at 64 an honest 3.5 hung.
MAX_TASKS = 512
MAX_OPEN_FILES = 4096  # mlx_lm sets its own limit to (2048, 4096) at import, and may not raise the hard one
SCRATCH_BYTES = 256 << 20
INSIDE = "/grade"
BLAS_THREADS = ("MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")
CACHES = shutil.ignore_patterns("__pycache__")
HIDDEN = "not available while this day is graded"  # what a stripped task body of the reference raises


@functools.cache  # probed once per process; a failure is remembered for its children too
def bwrap_path() -> str | None:
    """bubblewrap, where it is installed and can start a sandbox (a container may forbid namespaces)."""
    found = shutil.which("bwrap") or (BWRAP if os.path.exists(BWRAP) else None)
    if os.environ.get(UNSANDBOXED_VARIABLE) or not sys.platform.startswith("linux") or not found:
        return None
    probe = subprocess.run([found, "--ro-bind", "/", "/", "--unshare-all", "--uid", str(NOBODY), "--gid",
                            str(NOBODY), "true"], capture_output=True)
    if probe.returncode != 0:
        broken = (probe.stderr.decode(errors="replace").strip() or "bwrap failed").splitlines()[0]
        os.environ[UNSANDBOXED_VARIABLE] = (f"bubblewrap cannot start a sandbox here ({broken}): user namespaces may "
                                            "be disabled")
        return None
    return found


def why_unsandboxed() -> str:
    """One line: why bubblewrap cannot start a sandbox here."""
    not_there = "macOS has no bubblewrap" if sys.platform == "darwin" else "bubblewrap is not installed"
    return os.environ.get(UNSANDBOXED_VARIABLE) or not_there


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
    bodies = [node.body for name, node in selector.definitions(ast.parse(source)).items() if name in functions]
    for first, last in sorted(((body[0], body[-1]) for body in bodies), key=lambda ends: -ends[0].lineno):
        lines[first.lineno - 1:last.end_lineno] = [" " * first.col_offset + f'raise NotImplementedError("{HIDDEN}")\n']
    return "".join(lines)


def prepare_root(dest: Path, package: Path, reference: Path, course: Path, week: int, day: int,
                 task: int | None = None) -> Path:
    """The sandbox's read-only view at `dest`: the graded package, the reference without day W.D's task bodies (or
    Task `task`'s alone), the worker's code; made whole or not at all (a process stopped half-way leaves none)."""
    graded = {module: {name for name, t in names.items() if t.day_key == (week, day) and task in (None, t.number)}
              for module, names in selector.task_table().items()}
    building = Path(tempfile.mkdtemp(prefix=f"{dest.name}-", dir=dest.parent)) / "root"
    (building / "course").mkdir(parents=True)
    for name in WORKER_FILES:
        shutil.copyfile(course / name, building / "course" / name)
    if (course.parent / ACTOR_FAKES).exists():  # fakes that need no trust: no test, no answer (a course may have none)
        shutil.copytree(course.parent / ACTOR_FAKES, building / ACTOR_FAKES, ignore=CACHES)
    shutil.copytree(package, building / "src" / "tiny_llm", ignore=CACHES)
    target = building / "src_ref" / reference.name
    target.mkdir(parents=True)
    for path in sorted(reference.glob("*.py")):
        text = path.read_text()
        (target / path.name).write_text(strip_task_bodies(text, graded[path.stem]) if graded.get(path.stem) else text)
    building.rename(dest)
    building.parent.rmdir()
    return dest


def task_root(root: Path, week: int, day: int, task: int) -> Path:
    """Task `task`'s root beside the day's `root` (made on first use): the reference lacks that task's bodies alone."""
    dest = root.parent / f"{root.name}-task{task}"
    here = Path(__file__).resolve().parent
    reference = here.parent / "src_ref" / "tiny_llm_ref"
    return dest if dest.exists() else prepare_root(dest, root / "src" / "tiny_llm", reference, here, week, day, task)


# ---------------------------------------------------------------- starting the worker (trusted side)

def _bwrap_command(root: Path, inner: list[str]) -> list[str]:
    """`inner` in a sandbox that reads, besides `root` (at `INSIDE`), only the system's libraries, the interpreter's
    installation and virtual environment, and the tests' model (the actor loads its tokenizer from its files);
    its environment is bubblewrap's own, which `Worker` sets whole."""
    command = [bwrap_path(), "--unshare-all", "--die-with-parent", "--new-session", "--uid", str(NOBODY), "--gid",
               str(NOBODY), "--proc", "/proc", "--dev", "/dev", "--size", str(SCRATCH_BYTES), "--tmpfs", "/tmp"]
    system = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/ld.so.cache", "/etc/alternatives")
    python = [sys.prefix, sys.base_prefix, sys.exec_prefix, *(p for p in sys.path if p and "site-packages" in p)]
    shared = {os.path.realpath(p) for p in (*python, models.EMBEDDED_MODEL_DIR) if os.path.exists(p)}
    for directory in [*(p for p in system if os.path.exists(p)), *sorted(shared)]:
        command += ["--ro-bind", directory, directory]
    return command + ["--ro-bind", str(root), INSIDE, "--chdir", "/tmp", *inner]


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
        top = INSIDE if bwrap_path() else str(root)  # where the worker finds its root
        environment = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
                       "PYTHONPATH": os.pathsep.join([f"{top}/src", f"{top}/src_ref", top]),
                       SERVER_SOCKETS_VARIABLE: ",".join(f"{s.fileno()}:{s.getsockname()[1]}" for s in listeners)}
        if threads_per_rank:
            environment.update(dict.fromkeys(BLAS_THREADS, str(threads_per_rank)))
        if reads_text:  # its tests read text: it begins loading its own tokenizer while the judge starts up
            environment[PRELOAD_VARIABLE] = str(models.EMBEDDED_MODEL_DIR.resolve())
        # Its output, in a file without a name: gone with the last process holding it, however this one ends.
        self.log = tempfile.TemporaryFile(prefix="tiny-llm-worker-", dir=os.environ.get(LOGS_VARIABLE) or None)
        command = _bwrap_command(root, inner) if bwrap_path() else inner
        self.process = subprocess.Popen(command, cwd=root, env=environment, stdin=subprocess.DEVNULL, stdout=self.log,
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
        self.endpoint = None if ranks else remote.Endpoint(*self.ends[0], "trusted")  # (a ring's: its rank programs')
        if self.endpoint is not None:
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
        """The end of what the worker(s) wrote; read in place (the workers may share the file's offset)."""
        size = os.fstat(self.log.fileno()).st_size
        return os.pread(self.log.fileno(), limit, max(0, size - limit)).decode(errors="replace")

    def close_pipes(self) -> None:
        """The worker's pipes closed: it ends on its own (and is counted in CPU time)."""
        for fd in self.fds:
            with suppress(OSError):
                os.close(fd)
        self.fds = ()  # closed once: the numbers may belong to other files by now

    def stop(self, wait: float = 2) -> None:
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


def start(week: int, day: int, kind: str, ranks: int = 0, threads_per_rank: int | None = None,
          reads_text: bool = False) -> Worker:
    """A sandbox for `kind`'s code of day W.D (a `selector.Choice`) with the grader's limits: `RemoteSelection`'s
    worker, or (`ranks` N) a launch's ring (course/ranks.py: rank r's program on `.ends[r]`). Task N's code runs on
    Task N's own root (`task_root`): the day's other tasks of the reference are there, never Task N's answer."""
    root = Path(os.environ[SANDBOX_ROOT_VARIABLE])
    if kind.startswith("task"):
        root = task_root(root, week, day, int(kind.removeprefix("task")))
    cpu, memory = (float(limit or 0) for limit in os.environ.get(LIMITS_VARIABLE, ",").split(","))
    return Worker(root, week, day, kind, cpu or None, int(memory) or None, ranks, threads_per_rank, reads_text)


class RemoteSelection:
    """`solution(week, day)` while grading: the day's package (`kind` "day", "taskN" or "stack", each with a worker
    of its own), in a sandboxed worker; in a rank program, in its rank's. A worker that died or was stopped at a
    time limit is replaced on the next use, so a module-level `sol = solution(...)` survives it."""

    _workers: dict[tuple, Worker] = {}  # by (week, day, kind)
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

    def _worker(self) -> Worker | types.SimpleNamespace:
        """This code's worker (in a rank program, its link to its rank's), started or replaced where needed."""
        if os.environ.get(RANK_PIPES_VARIABLE):
            return _rank_link()
        worker = self._workers.get(self._key)
        if worker is not None and worker.endpoint.broken:
            RemoteSelection.restart_needed = True
            worker.stop()
            worker = None
        if worker is None:
            if not self._workers:
                atexit.register(stop_workers)  # no worker outlives this process
            worker = self._workers[self._key] = start(*self._key, reads_text=self._key in self._reading_text)
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


@functools.cache
def _rank_link() -> types.SimpleNamespace:
    """A rank program's pipe to its worker (the launch's code, this rank's group: `rank_group`), as a Worker has it."""
    read_fd, write_fd = (int(fd) for fd in os.environ[RANK_PIPES_VARIABLE].split(","))
    return types.SimpleNamespace(endpoint=remote.Endpoint(read_fd, write_fd, "trusted"), modules={})


def rank_group():
    """In a rank program while grading: this rank's `mx.distributed` group, in its worker; None otherwise."""
    return _rank_link().endpoint.request("getattr", 0, "rank_group") if os.environ.get(RANK_PIPES_VARIABLE) else None


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
    (transformers, huggingface_hub, jinja2: 2-3 s a worker) waits for the first attribute read of `mlx_lm` itself
    (book/src/grading.md, "Why a stand-in over a pipe, and what it costs")."""
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
