"""The submission's code runs here: a worker process in an OS sandbox, reached through course/remote.py.

For each day the grader (scripts/grade.py) prepares a sandbox root (`prepare_root`): the package being graded,
a copy of the reference with the graded day's task bodies removed (the selector fills the other days' tasks from
it, function by function) and the few tooling files the worker runs; never the grader, the tests or their
expected values. One task's tests (`solution(week, day, task=N)`) get a worker of their own on a root whose
reference lacks only Task N's bodies (`task_root`). In the trusted pytest process, `solution(week, day)`
(tests/harness.py) returns `RemoteSelection`, which starts the worker (`Worker`) under bubblewrap: user
"nobody", no network, its own PID namespace, the system, Python and the root read-only, a private /tmp, limits
on CPU time, address space, file size and open files, and a cgroup bounding its processes and memory where the
machine lets one be made (course/cgroup.py; elsewhere RLIMIT_NPROC, which the kernel does not apply to root,
and the PID namespace, which dies with its init). Its output goes to a file of the trusted side.

Days 4.3 and 4.4 run one sandbox of N workers (`start_ranks`) in an `mx.distributed` ring on the sandbox's own
loopback; the rank programs run outside, each reaching its rank's worker through its pipes (`RankLink`).
Without bubblewrap (macOS) the worker is a plain child process with the same protocol and the limits the
platform has (`unsandboxed_warning()` says what that means); the verdict is still the trusted side's.
"""

from __future__ import annotations

import ast
import atexit
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from course import cgroup, remote, selector

BWRAP = "/usr/bin/bwrap"
NOBODY = 65534
SANDBOX_ROOT_VARIABLE = "TINY_LLM_SANDBOX_ROOT"  # set by the grader in the trusted test process
LIMITS_VARIABLE = "TINY_LLM_SANDBOX_LIMITS"  # "cpu_seconds,memory_mb" for the worker
RANK_PIPES_VARIABLE = "TINY_LLM_RANK_PIPES"  # "read_fd,write_fd": a rank program's pipes to its worker
LOGS_VARIABLE = "TINY_LLM_SANDBOX_LOGS"  # where the workers' output goes (the grader removes it)
UNSANDBOXED_VARIABLE = "TINY_LLM_UNSANDBOXED"  # why bubblewrap cannot be used (set once, inherited)
CGROUP_PREFIX_VARIABLE = "TINY_LLM_CGROUP_PREFIX"  # how the grading run names its cgroups (it removes them all)
WORKER_FILES = ("__init__.py", "remote.py", "sandbox.py", "cgroup.py", "selector.py", "course_map.py", "fast_mlx.py", "tasks.json")
SERVER_SOCKETS_VARIABLE = "TINY_LLM_SERVER_SOCKETS"  # "fd:port,...": the worker's listening sockets (see Worker)
SERVER_SOCKETS = 4  # a test's servers at once in one worker (module-scoped ones stay up beside a test's own)
ACTOR_FAKES = "tests/actor_fakes"  # the one package of tests/ the worker holds (see its docstring)
MAX_OUTPUT_BYTES = 16 << 20
MAX_PROCESSES = 64  # without a cgroup, for a grader that is not root: RLIMIT_NPROC beyond this user's processes
# With a cgroup: its pids.max, which counts threads as well as processes (day 3.5's server, its client and MLX's
# pools run many; at 64, an honest day 3.5 hung in a thread that could not start).
MAX_TASKS = 512
MAX_OPEN_FILES = 4096  # mlx_lm sets its own limit to (2048, 4096) at import, and may not raise the hard one
SCRATCH_BYTES = 256 << 20
INSIDE = "/grade"


def bwrap_path() -> str | None:
    """bubblewrap, where it is installed and can start a sandbox (a container may forbid namespaces)."""
    found = shutil.which("bwrap") or (BWRAP if os.path.exists(BWRAP) else None)
    if os.environ.get(UNSANDBOXED_VARIABLE) or not sys.platform.startswith("linux") or not found:
        return None
    if found not in _working:
        probe = subprocess.run([found, "--ro-bind", "/", "/", "--unshare-all", "--uid", str(NOBODY), "--gid",
                                str(NOBODY), "true"], capture_output=True)
        if probe.returncode != 0:  # remembered for this process and its children
            os.environ[UNSANDBOXED_VARIABLE] = probe.stderr.decode(errors="replace").strip() or "bwrap failed"
            return None
        _working.add(found)
    return found


_working: set[str] = set()


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
    from course.selector import definitions

    lines = source.splitlines(keepends=True)
    spans = []
    for name, node in definitions(ast.parse(source)).items():
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
    from course.selector import task_table

    graded = {}
    for module, names in task_table().items():
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


def _bwrap_command(root: Path, inner: list[str], servers: str) -> list[str]:
    command = [bwrap_path(), "--unshare-all", "--die-with-parent", "--new-session", "--uid", str(NOBODY),
               "--gid", str(NOBODY), "--clearenv", "--proc", "/proc", "--dev", "/dev",
               "--size", str(SCRATCH_BYTES), "--tmpfs", "/tmp"]
    for system in ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/ld.so.cache", "/etc/alternatives"):
        if os.path.exists(system):
            command += ["--ro-bind", system, system]
    for directory in _python_dirs():
        command += ["--ro-bind", directory, directory]
    command += ["--ro-bind", str(root), INSIDE]
    from course.models import EMBEDDED_MODEL_DIR  # the tests' model: the actor loads its tokenizer from its files

    if EMBEDDED_MODEL_DIR.is_dir():
        shared = os.path.realpath(EMBEDDED_MODEL_DIR)
        command += ["--ro-bind", shared, shared]
    environment = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1",
                   "PYTHONPATH": f"{INSIDE}/src:{INSIDE}/src_ref:{INSIDE}", "PYTHONHASHSEED": "0",
                   SERVER_SOCKETS_VARIABLE: servers}
    for name, value in environment.items():
        command += ["--setenv", name, value]
    return command + ["--chdir", "/tmp", *inner]


def _listener() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    return listener


def _processes_of_this_user() -> int:
    """How many processes this user runs now (RLIMIT_NPROC counts them all, so the worker's limit starts there)."""
    uid, count = os.getuid(), 0
    for entry in os.listdir("/proc"):
        try:
            count += entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid
        except OSError:
            pass
    return count


def _limits(cpu_seconds: float | None, memory_mb: int | None, processes: int | None, group: cgroup.Group | None):
    def apply() -> None:  # in the child, between fork and exec: inherited by bwrap and the worker
        import resource

        limits = [(resource.RLIMIT_FSIZE, MAX_OUTPUT_BYTES), (resource.RLIMIT_CORE, 0),
                  (resource.RLIMIT_NOFILE, MAX_OPEN_FILES)]
        if cpu_seconds:
            limits.append((resource.RLIMIT_CPU, int(cpu_seconds) + 1))
        if memory_mb:
            limits.append((resource.RLIMIT_AS, memory_mb << 20))
        if processes:
            limits.append((resource.RLIMIT_NPROC, processes))
        for which, value in limits:
            try:
                resource.setrlimit(which, (value, value))
            except (ValueError, OSError):
                pass
        os.setsid()
        if group is not None:
            group.join()

    return apply


PIPE_BYTES = 1 << 20  # a model's logits (1.5 MB for a chunk of tests' tiny model) cross in one or two writes


def _pipe() -> tuple[int, int]:
    """A pipe as large as an unprivileged process may make one (1 MiB on Linux; 64 KiB elsewhere, or if refused):
    an array crosses in few system calls, each a wake-up of the other side, not one per 64 KiB."""
    read_fd, write_fd = os.pipe()
    if hasattr(fcntl, "F_SETPIPE_SZ"):  # Linux
        try:
            fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass
    return read_fd, write_fd


class Worker:
    """One sandbox and the pipes to its worker process(es): one worker and the endpoint that talks to it, or
    (`ranks` N) N workers in an `mx.distributed` ring, each reached by the rank program the pipes go to."""

    def __init__(self, root: Path, week: int, day: int, kind: str, cpu_seconds: float | None, memory_mb: int | None,
                 ranks: int = 0, threads_per_rank: int | None = None):
        pipes = [(_pipe(), _pipe()) for _ in range(max(ranks, 1))]  # (to the worker, from the worker) each
        inside = [str(fd) for (to_r, _), (_, from_w) in pipes for fd in (to_r, from_w)]
        inner_python = os.path.join(os.path.realpath(sys.prefix), "bin", "python")
        kind = "ranks" if ranks else kind
        inner = [inner_python, "-s", "-m", "course.sandbox", str(week), str(day), kind, str(threads_per_rank or 0),
                 *inside]
        # Without a cgroup, RLIMIT_NPROC bounds a non-root grader's processes (it counts all of this user's); the
        # kernel exempts root's, even in a user namespace: there the PID namespace's end is the bound.
        counted = sys.platform.startswith("linux") and os.getuid() != 0
        processes = _processes_of_this_user() + MAX_PROCESSES if counted else None
        memory = (memory_mb << 20) if memory_mb else None
        self.group = cgroup.Group.make(os.environ.get(CGROUP_PREFIX_VARIABLE, "tiny-llm-"), MAX_TASKS, memory)
        # A server the tests start in the worker (day 3.5's, 4.5's) listens on one of these: made here, on this
        # machine's loopback, and handed over open, so the tests talk HTTP to it while the worker, with no network
        # of its own, can only accept on them (bytes cross; no object of either side does).
        listeners = [] if ranks else [_listener() for _ in range(SERVER_SOCKETS)]
        self.server_ports = [listener.getsockname()[1] for listener in listeners]
        servers = ",".join(f"{listener.fileno()}:{port}" for listener, port in zip(listeners, self.server_ports))
        self.log = tempfile.NamedTemporaryFile(prefix="tiny-llm-worker-", suffix=".log", delete=False,
                                               dir=os.environ.get(LOGS_VARIABLE) or None)
        if bwrap_path():
            command, cwd, env = _bwrap_command(root, inner, servers), "/", {}
        else:
            command, cwd = inner, str(root)
            env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(["src", "src_ref", "."]),
                   "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(root), SERVER_SOCKETS_VARIABLE: servers}
        self.process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=self.log,
                                        stderr=subprocess.STDOUT,
                                        pass_fds=[int(fd) for fd in inside] + [s.fileno() for s in listeners],
                                        preexec_fn=_limits(cpu_seconds, memory_mb, processes, self.group))
        for fd in inside:
            os.close(int(fd))
        for listener in listeners:
            listener.close()  # the worker's now
        # This side's ends: (read, write) per worker.
        self.ends = [(from_r, to_w) for (_, to_w), (from_r, _) in pipes]
        self.fds = tuple(fd for pair in self.ends for fd in pair)
        self.endpoint = None
        self.modules: dict[str, remote.Handle] = {}  # the selection's modules read so far (RemoteSelection)
        if not ranks:
            self.endpoint = remote.Endpoint(*self.ends[0], "trusted").start()
            self.endpoint.explain_loss = self._why_it_ended

    def _why_it_ended(self) -> str:
        try:
            status = self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return ""
        how = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
        limit = self.group.hit_limit() if self.group is not None else None
        if limit:
            how += f"; it reached the sandbox's limit on {limit}"
        return (f": the submission's process ended ({how}: a crash, an abort, an exit of the interpreter, or a "
                f"limit on memory, CPU time or output). The end of its output:\n{self.output_tail(1500)}")

    def output_tail(self, limit: int = 3000) -> str:
        try:
            with open(self.log.name, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - limit))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def close_pipes(self) -> None:
        """The worker's pipes closed: it ends on its own (and is counted in CPU time)."""
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = ()  # closed once: the numbers may belong to other files by now

    def stop(self, wait: float = 2, keep_log: bool = False) -> None:
        """Close the pipes so the worker ends on its own; kill it if it does not."""
        self.close_pipes()
        try:
            self.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.process.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
            self.process.wait()
        if self.group is not None:
            self.group.remove()  # whatever it left behind, however detached
        if not keep_log:
            self.remove_log()

    def remove_log(self) -> None:
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


class RemoteSelection:
    """`solution(week, day)` while grading: the day's package, in the sandboxed worker.

    `sol.basics` asks the current worker for its module; a worker that died or was stopped at a time
    limit is replaced on the next use, so a module-level `sol = solution(...)` survives it. In a rank
    program started by `course.ranks.launch` while grading, the worker is this rank's, in the ring of
    the launch's sandbox (`RankLink`).
    """

    _workers: dict[tuple, Worker] = {}
    _restart_needed = {"flag": False}

    def __init__(self, week: int, day: int, kind: str = "day"):
        """`kind` "day": the day's tasks from the student (`selector.for_day`); "taskN": Task N alone
        (`selector.for_task`); "stack": the student's week so far (`selector.for_stack`, the "your stack so
        far" tests). Each kind has a worker of its own."""
        self._key = (week, day, kind)
        _forward_seeds()
        if not os.environ.get(RANK_PIPES_VARIABLE):
            # Started now, while this process is still importing and collecting the tests: on two cores the
            # worker's own start-up (Python, MLX, the package) runs beside this process's, not after it.
            self._worker()

    def _worker(self) -> Worker:
        worker = self._workers.get(self._key)
        if worker is not None and worker.endpoint.broken:
            RemoteSelection._restart_needed["flag"] = True
            worker.stop()
            worker = None
        if worker is None:
            cpu, memory = (os.environ.get(LIMITS_VARIABLE, ",").split(",") + [""])[:2]
            if not self._workers:
                atexit.register(stop_workers)  # the workers' output files go with them
            root, (week, day, kind) = Path(os.environ[SANDBOX_ROOT_VARIABLE]), self._key
            if kind.startswith("task"):
                root = task_root(root, week, day, int(kind.removeprefix("task")))
            worker = Worker(root, week, day, kind, float(cpu or 0) or None, int(memory or 0) or None)
            self._workers[self._key] = worker
        return worker

    def __getattr__(self, module: str):
        if module.startswith("_"):
            raise AttributeError(module)
        if os.environ.get(RANK_PIPES_VARIABLE):
            return getattr(RankLink.get().selection(*self._key), module)
        worker = self._worker()
        found = worker.modules.get(module)
        if found is None:
            found = worker.endpoint.request("getattr", 0, module)
            if type(found) is remote.Handle:  # a module stays one object: `sol.engine` in a loop is one round trip
                worker.modules[module] = found
        return found


class RankLink:
    """A rank program's pipe to its worker in the launch's sandbox (course/ranks.py starts both)."""

    _link: "RankLink | None" = None

    def __init__(self):
        read_fd, write_fd = (int(fd) for fd in os.environ[RANK_PIPES_VARIABLE].split(","))
        self.endpoint = remote.Endpoint(read_fd, write_fd, "trusted").start()
        self.root = self.endpoint._proxy(0, "course.sandbox:RankRoot")
        self.selections: dict[tuple, object] = {}

    @classmethod
    def get(cls) -> "RankLink":
        if cls._link is None:
            cls._link = RankLink()
        return cls._link

    def selection(self, week: int, day: int, kind: str):
        key = (week, day, kind)
        if key not in self.selections:
            self.selections[key] = self.root.select(week, day, kind)
        return self.selections[key]


def rank_group():
    """In a rank program while grading: this rank's `mx.distributed` group, in its worker; None otherwise."""
    return RankLink.get().root.group if os.environ.get(RANK_PIPES_VARIABLE) else None


def start_ranks(world_size: int, threads_per_rank: int | None, code) -> Worker:
    """One sandbox of `world_size` workers in an `mx.distributed` ring on its own loopback, for the rank programs
    of a launch that runs `code` (a `selector.Choice`): on Task N's own root (the reference without Task N's
    bodies, `task_root`) for Task N's code, so its ranks run the day's other tasks of the reference and never
    Task N's answer; on the day's root otherwise. `.ends[r]` are the pipes of rank r's program (pass them on
    with `RANK_PIPES_VARIABLE`)."""
    root = Path(os.environ[SANDBOX_ROOT_VARIABLE])
    if code.task is not None:
        root = task_root(root, code.week, code.day, code.task)
    cpu, memory = (os.environ.get(LIMITS_VARIABLE, ",").split(",") + [""])[:2]
    return Worker(root, code.week, code.day, "ranks", float(cpu or 0) or None, int(memory or 0) or None,
                  ranks=world_size, threads_per_rank=threads_per_rank)


def _forward_seeds() -> None:
    """`mx.random.seed(n)` in a test seeds the worker too, before its next call: seeded draws repeat."""
    import mlx.core as mx

    seed = mx.random.seed
    if getattr(seed, "forwards_to_the_worker", False):
        return

    def seed_both(value) -> None:
        seed(value)
        for worker in RemoteSelection._workers.values():
            worker.endpoint.pending_seed = int(value)

    seed_both.forwards_to_the_worker = True
    mx.random.seed = seed_both


def needs_restart() -> bool:
    """Whether a worker broke during the test that just finished (its objects are gone: start afresh)."""
    return RemoteSelection._restart_needed["flag"] or any(w.endpoint.broken for w in RemoteSelection._workers.values())


def stop_workers() -> None:
    for worker in RemoteSelection._workers.values():
        worker.close_pipes()  # every worker ends at once, not one after the other
    for worker in RemoteSelection._workers.values():
        worker.stop()
    RemoteSelection._workers.clear()
    RemoteSelection._restart_needed["flag"] = False


# ---------------------------------------------------------------- the worker (inside the sandbox)

class RankRoot:
    """What a rank's worker serves its rank program: its group of the ring, and the selections it asks for."""

    def __init__(self, group):
        self.group = group
        self.selections: dict[tuple, object] = {}

    def select(self, week: int, day: int, kind: str):
        key = (week, day, kind)
        if key not in self.selections:
            self.selections[key] = selector.Choice(week, day, kind).select()
        return self.selections[key]


def _free_port() -> int:
    """A port free on this loopback now (the sandbox's own; without bubblewrap, the machine's)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start_ring(week: str, day: str, threads: str, fds: list[str]) -> None:
    """The launcher of a ranks sandbox: one worker per pair of pipes, in a ring on this sandbox's loopback."""
    count = len(fds) // 2
    hostfile = Path(tempfile.mkdtemp()) / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{_free_port()}"] for _ in range(count)]))
    environment = {**os.environ, "MLX_HOSTFILE": str(hostfile)}
    if int(threads):
        environment.update({name: threads for name in ("MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")})
    workers = []
    for rank in range(count):
        pair = fds[2 * rank: 2 * rank + 2]
        workers.append(subprocess.Popen([sys.executable, "-s", "-m", "course.sandbox", week, day, "rank", threads, *pair],
                                        env={**environment, "MLX_RANK": str(rank)}, pass_fds=[int(fd) for fd in pair]))
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
    week, day, kind, threads, *fds = argv
    if kind == "ranks":
        return _start_ring(week, day, threads, fds)
    from course import fast_mlx

    fast_mlx.setup(quiet=True, shared_cores=True)  # the tests' process computes on the same cores between calls
    _defer_mlx_lm_start_up()
    if kind == "rank":
        import mlx.core as mx

        root = RankRoot(mx.distributed.init(strict=True, backend="ring"))
    else:
        root = selector.Choice(int(week), int(day), kind).select()
    endpoint = remote.Endpoint(int(fds[0]), int(fds[1]), "sandbox", root=root)
    endpoint.read_forever()


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
