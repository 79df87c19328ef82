"""Running a program on N ranks with `mlx.launch`, bounded and cleaned up (tests, benchmarks, serve).

The parent side:
- `launch_command(...)` is the one place an `mlx.launch --backend ring` command line is written, for
  N ranks of this machine or for the hosts of a hostfile (`read_hostfile` checks one first);
- `launch(...)` (tests, benchmarks) runs it in a process group of its own, waits at most `timeout`
  seconds, and then kills the whole group, whatever happened: no rank outlives the call; a test's launch
  names whose code its ranks run (`code`, a `selector.Choice`: the student's Task N alone, day or stack),
  which they read with `launched_code()` (tests/harness.py's `launched()`);
- `LaunchWatch` reads `mlx.launch`'s output as it goes (serve): `mlx.launch` stops the other ranks
  when one exits with an error, but its own exit status stays 0, so the watch finds the first rank
  it reported failing, and that rank's last line, to make the failure one line and a non-zero status.

The rank side, `join()`, is `mx.distributed.init(strict=True)` with a one-line error when the
program was not started by `mlx.launch`; from then on every line the rank writes to stderr starts
with `[rank R] ` (torchrun does the same), so a line in the launcher's mixed output names its rank.
`write_result` leaves the rank's JSON where the parent reads it.
"""

from __future__ import annotations

import ipaddress
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from course.selector import Choice

RESULT_NAME = "rank{rank}.json"
CODE_VARIABLE = "TINY_LLM_RANK_CODE"  # whose code a rank program runs: a `selector.Choice` as text ("4 3 task2")
GROUP_EXIT_WAIT = 5.0  # seconds
RANK_TAG = "[rank {rank}] "  # the start of every stderr line of a rank (after `join()`)
TAGGED_LINE = re.compile(r"^\[rank (\d+)\] (.*)$")
# What mlx.launch prints (in colour) when a rank ends badly: "exited with code C" for the rank that failed
# (C < 0: killed by signal -C), "was killed" for the ranks it then terminated itself.
EXIT_LINE = re.compile(r"Node with rank (\d+) exited with code (-?\d+)")
COLOUR = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class RankRun:
    """What a launch left: each rank's result (None for a rank that did not finish) and the output."""

    results: list[dict | None]
    output: str  # every rank's stdout and stderr, and mlx.launch's own warnings
    timed_out: bool

    def failure(self) -> str | None:
        """One paragraph saying which ranks did not finish and why, or None when all did."""
        missing = [rank for rank, result in enumerate(self.results) if result is None]
        if not missing:
            return None
        why = "killed after the time limit" if self.timed_out else "exited without a result"
        watch = LaunchWatch()
        for line in self.output.splitlines():
            watch.read(line)
        first = f" ({watch.failure()})" if watch.failure() else ""
        tail = "\n".join(self.output.strip().splitlines()[-15:])
        return f"rank(s) {', '.join(map(str, missing))} {why}{first}; the ranks' last output:\n{tail}"


def mlx_launch_command() -> list[str]:
    """The `mlx.launch` of this Python environment (installed with MLX beside the interpreter)."""
    launcher = Path(sys.executable).with_name("mlx.launch")
    if not launcher.exists():
        raise FileNotFoundError(f"mlx.launch is not installed beside {sys.executable} (it comes with the mlx package)")
    return [str(launcher)]


def read_hostfile(path: str) -> list[dict]:
    """The hosts of an mlx.launch hostfile the ring backend can use; ValueError (one line) for any other file.

    The format is mlx.launch's own JSON: a list of hosts, or an object whose "hosts" is that list, each
    host `{"ssh": "name or address to ssh to", "ips": ["address the ranks connect to", ...]}`. A host
    whose "ssh" is 127.0.0.1 is started here, without ssh.
    """
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"hostfile {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"hostfile {path} is not a JSON file ({error})") from None
    hosts = data.get("hosts") if isinstance(data, dict) else data
    if not isinstance(hosts, list) or len(hosts) < 2:
        raise ValueError(f"hostfile {path}: expected a list of at least 2 hosts (or {{\"hosts\": [...]}}), "
                         "each {\"ssh\": NAME, \"ips\": [ADDRESS]}")
    for index, host in enumerate(hosts):
        if not (isinstance(host, dict) and isinstance(host.get("ssh"), str) and host["ssh"]
                and isinstance(host.get("ips"), list) and host["ips"]):
            raise ValueError(f"hostfile {path}: host {index} must be {{\"ssh\": NAME, \"ips\": [ADDRESS, ...]}}, "
                             f"got {json.dumps(host)[:80]}")
        for address in host["ips"]:
            try:
                ipaddress.ip_address(address)
            except (ValueError, TypeError):
                raise ValueError(f"hostfile {path}: host {index}'s ip {address!r} is not an IP address "
                                 "(the ring backend connects to addresses, not names)") from None
    return hosts


def launch_command(program: list[str], world_size: int, hostfile: str | None = None,
                   env: dict | None = None) -> list[str]:
    """The `mlx.launch` command running `program` on `world_size` ranks of this machine, or on `hostfile`'s hosts.

    Ranks started through ssh get only the variables of `env` (passed as `--env`); local ones inherit
    the launcher's environment. The ring listens on consecutive ports from one free here.
    """
    if hostfile:
        forwarded = [arg for name, value in (env or {}).items() for arg in ("--env", f"{name}={value}")]
        hosts = ["--hostfile", hostfile, *forwarded]
    else:
        hosts = ["-n", str(world_size)]
    return [*mlx_launch_command(), "--backend", "ring", *hosts, "--starting-port", str(free_ports(world_size)),
            "--", *program]


def free_ports(count: int, attempts: int = 20) -> int:
    """A port p such that p .. p + count - 1 are free now (the ring backend listens on one port per rank)."""
    for _ in range(attempts):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            start = probe.getsockname()[1]
        if start + count < 65536 and all(_port_is_free(start + i) for i in range(count)):
            return start
    raise RuntimeError(f"found no {count} consecutive free ports on 127.0.0.1")


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launch(program: list[str], world_size: int, out_dir: Path, timeout: float, env: dict | None = None,
           hostfile: str | None = None, threads_per_rank: int | None = 1, code: Choice | None = None) -> RankRun:
    """Run `program` (an executable and its arguments) on `world_size` local ranks, or on `hostfile`'s hosts.

    With a hostfile, launch from its first host: rank 0 writes its result there.

    The ranks find `out_dir` in `TINY_LLM_RANK_DIR`, and `code`, whose code they run (a test's: the student's
    Task N alone, their day or their stack), in `CODE_VARIABLE` (`launched_code()`); while grading, it also
    decides which sandbox root their workers see. `threads_per_rank` caps each rank's BLAS threads (two ranks
    on two cores with two threads each would fight over them); None leaves them alone.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    # The ranks import what this process imports (pytest, for one, sets its import paths in sys.path only).
    import_paths = os.pathsep.join(path for path in sys.path if path)
    rank_env = {**(env or {}), "TINY_LLM_RANK_DIR": str(out_dir), "PYTHONPATH": import_paths}
    if code is not None:
        rank_env[CODE_VARIABLE] = str(code)
    if threads_per_rank is not None:
        for name in ("MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            rank_env[name] = str(threads_per_rank)
    if _grading() and not hostfile:
        if code is None:
            raise ValueError("a launch while grading names the code its ranks run (code=Choice(...))")
        return _launch_sandboxed(program, world_size, out_dir, timeout, rank_env, threads_per_rank, code)
    if world_size == 1 and not hostfile:
        command = program  # one rank needs no launcher (mlx.launch would hand it an empty hostfile)
    else:
        command = launch_command(program, world_size, hostfile, rank_env)
    child_env = {**os.environ, **rank_env}
    with tempfile.TemporaryFile() as log:
        # stdin a pipe we never write to: mlx.launch polls its stdin, and /dev/null would make it spin.
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                   env=child_env, start_new_session=True)
        timed_out = False
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_group(process)
        log.seek(0)
        output = log.read().decode(errors="replace")
    return RankRun([read_result(out_dir, rank) for rank in range(world_size)], output, timed_out)


def _grading() -> bool:
    """Whether the grader runs this process's tests: the student's code then runs in its sandbox."""
    from course import sandbox

    return bool(os.environ.get(sandbox.SANDBOX_ROOT_VARIABLE))


def _launch_sandboxed(program: list[str], world_size: int, out_dir: Path, timeout: float, rank_env: dict,
                      threads_per_rank: int | None, code: Choice) -> RankRun:
    """`launch` while grading: the student's code of every rank runs in one sandbox (course/sandbox.py), its
    workers in an `mx.distributed` ring on the sandbox's own loopback; the rank programs run here, outside,
    each reaching its rank's worker through a pipe (`solution(...)`, `join()`), so every check a rank
    program makes is made where the student's code cannot reach. A rank program that ends badly is
    reported in mlx.launch's words ("Node with rank R exited with code C")."""
    from course import sandbox

    ring = sandbox.start(code.week, code.day, code.kind, world_size, threads_per_rank)
    import_paths = os.pathsep.join(path for path in sys.path if path)
    ranks, timed_out = [], False
    with tempfile.TemporaryFile() as log:
        try:
            for rank, (read_fd, write_fd) in enumerate(ring.ends):
                env = {**os.environ, "PYTHONPATH": import_paths, **rank_env,
                       sandbox.RANK_PIPES_VARIABLE: f"{read_fd},{write_fd}"}
                ranks.append(subprocess.Popen(program, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                              env=env, pass_fds=(read_fd, write_fd), start_new_session=True))
            for fd in ring.fds:  # the rank programs hold them now: a rank that ends closes its worker's pipes
                os.close(fd)
            deadline, running = time.monotonic() + timeout, dict(enumerate(ranks))
            while running and not timed_out:
                for rank, process in list(running.items()):
                    status = process.poll()
                    if status is None:
                        continue
                    del running[rank]
                    if status != 0:  # as mlx.launch does: report it, and ask the other ranks to stop
                        log.write(f"Node with rank {rank} exited with code {status}\n".encode())
                        log.flush()
                        for other in running.values():
                            other.terminate()
                timed_out = bool(running) and time.monotonic() > deadline
                time.sleep(0.02)
        finally:
            for process in ranks:
                kill_group(process)
            ring.fds = ()
            ring.stop(wait=GROUP_EXIT_WAIT)
        log.seek(0)
        output = log.read().decode(errors="replace") + ring.output_tail()
    return RankRun([read_result(out_dir, rank) for rank in range(world_size)], output, timed_out)


def kill_group(process: subprocess.Popen) -> None:
    """Kill the launcher and every rank it started (they share its process group), and reap the launcher."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if process.stdin:
        process.stdin.close()
    process.wait()
    # The ranks die a moment after the signal; wait (a few seconds at most) until none of the group is left.
    deadline = time.monotonic() + GROUP_EXIT_WAIT
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)


def read_result(out_dir: Path, rank: int) -> dict | None:
    path = out_dir / RESULT_NAME.format(rank=rank)
    return json.loads(path.read_text()) if path.exists() else None


class LaunchWatch:
    """What mlx.launch's output says, line by line: each rank's last line, and the first rank that failed."""

    def __init__(self):
        self.last_lines: dict[int, str] = {}
        self.failed: tuple[int, int] | None = None  # (rank, exit code) of the first failure reported

    def read(self, line: str) -> None:
        plain = COLOUR.sub("", line).strip()
        tagged = TAGGED_LINE.match(plain)
        if tagged and tagged[2].strip():
            self.last_lines[int(tagged[1])] = tagged[2].strip()
        ended = EXIT_LINE.search(plain)
        if ended and self.failed is None:
            self.failed = (int(ended[1]), int(ended[2]))

    def follow(self, stream, echo) -> None:
        """Read `stream` (bytes) to its end, writing each line on to `echo` (text) as it comes."""
        for raw in stream:
            line = raw.decode(errors="replace")
            echo.write(line)
            echo.flush()
            self.read(line)

    def failure(self) -> str | None:
        """'rank R exited with code C: its last line', or None when no rank failed."""
        if self.failed is None:
            return None
        rank, code = self.failed
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        last = self.last_lines.get(rank)
        return f"rank {rank} {how}" + (f": {last}" if last else " (it wrote no error line)")

    @property
    def exit_status(self) -> int:
        """The status to exit with after a failure: the failed rank's own, when it is one (2, a user error), else 1."""
        return self.failed[1] if self.failed and self.failed[1] > 0 else 1


# ---------------------------------------------------------------------------------------- rank side


def launched_code() -> Choice:
    """In a rank program: whose code to run, as its launch named it (`launch(..., code=...)`)."""
    text = os.environ.get(CODE_VARIABLE)
    if not text:
        raise SystemExit(f"{Path(sys.argv[0]).name}: error: no code to run ({CODE_VARIABLE} is unset); "
                         "start the ranks with course.ranks.launch(..., code=Choice(...))")
    return Choice.parse(text)


def join():
    """This rank's `mx.distributed` group; exits with one line when not started by `mlx.launch`.

    From here on, every line this rank writes to `sys.stderr` starts with `[rank R] `.
    """
    import mlx.core as mx

    from course import sandbox

    graded = sandbox.rank_group()  # started by the grader's launch: the group is the worker's, in its sandbox
    if graded is not None:
        return graded
    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as error:
        raise SystemExit(f"{Path(sys.argv[0]).name}: error: no distributed backend ({error}); "
                         "start the ranks with mlx.launch") from None
    sys.stderr = TaggedLines(sys.stderr, RANK_TAG.format(rank=group.rank()))
    return group


class TaggedLines(io.TextIOBase):
    """A text stream that starts every line it passes on to `stream` with `tag`."""

    def __init__(self, stream, tag: str):
        self.stream, self.tag = stream, tag
        self.at_line_start = True

    def write(self, text: str) -> int:
        pieces = []
        for piece in text.splitlines(keepends=True):
            pieces.append(self.tag + piece if self.at_line_start else piece)
            self.at_line_start = piece.endswith("\n")
        self.stream.write("".join(pieces))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()


def write_result(rank: int, result: dict) -> None:
    """Leave this rank's result for the parent, whole or not at all (written aside, then renamed)."""
    out_dir = Path(os.environ["TINY_LLM_RANK_DIR"])
    path = out_dir / RESULT_NAME.format(rank=rank)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(result))
    partial.rename(path)

