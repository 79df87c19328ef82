"""The sandbox's processes as one group the kernel counts: a cgroup, where this machine lets us make one.

A cgroup's limits count every process in it however it was started (a double fork, a thread-group leader that
exited, a new session), and the whole group can be killed (v2's `cgroup.kill`; else frozen first, so that
nothing forks a replacement meanwhile). Made where it can be: cgroup v2 under the root of a cgroup2 mount that
enables the pids and memory controllers for its children (a root shell on a unified-hierarchy Linux); else
cgroup v1's pids, memory and freezer hierarchies, under this process's own cgroup in each (a root shell on a v1
Linux); else none (macOS, an unprivileged Linux user: course/sandbox.py says what bounds the worker there).
Groups are named `<prefix><random>`; `remove_all(prefix)` ends every group a grading run made, even those of a
test process killed before it could end its own.
"""

from __future__ import annotations

import os
import signal
from contextlib import suppress
import time
import uuid
from pathlib import Path

MOUNTS = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("pids", "memory", "freezer")


def _v2_root() -> Path | None:
    """The mount point of the unified (v2) hierarchy, if one exists."""
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[2] == "cgroup2":
                return Path(fields[1])
    except OSError:
        pass
    return None


def _v1_bases() -> list[Path]:
    """This process's cgroup in each v1 hierarchy the group needs (empty if one is missing)."""
    own = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(","):
                own[controller] = path
    except (OSError, ValueError):
        return []
    if not all(c in own and (MOUNTS / c).is_dir() for c in V1_CONTROLLERS):
        return []
    return [MOUNTS / c / own[c].lstrip("/") for c in V1_CONTROLLERS]


def _bases() -> tuple[list[Path], bool]:
    """Where groups are made: ([the v2 root], True), (one directory per v1 controller, False), or ([], False)."""
    root = _v2_root()
    try:
        if root is not None and {"pids", "memory"} <= set((root / "cgroup.subtree_control").read_text().split()):
            return [root], True
    except OSError:
        pass
    return _v1_bases(), False


class Group:
    """One cgroup (a directory per hierarchy) with limits on processes and memory."""

    def __init__(self, dirs: list[Path], v2: bool):
        self.dirs, self.v2 = dirs, v2

    @classmethod
    def make(cls, prefix: str, processes: int, memory_bytes: int | None) -> Group | None:
        """A new group, or None where no cgroup can be made here."""
        bases, v2 = _bases()
        if not bases:
            return None
        name = f"{prefix}{uuid.uuid4().hex[:12]}"
        group = cls([base / name for base in bases], v2)
        try:
            for directory in group.dirs:
                directory.mkdir()
            group._write("pids.max", processes)
            if memory_bytes:
                group._write("memory.max" if v2 else "memory.limit_in_bytes", memory_bytes)
        except OSError:
            group.remove()
            return None
        return group

    def _file(self, name: str) -> Path:
        """The directory of the hierarchy that holds `name` (v1: pids.*, memory.*, freezer.*)."""
        if self.v2:
            return self.dirs[0] / name
        return self.dirs[V1_CONTROLLERS.index(name.split(".")[0])] / name

    def _write(self, name: str, value) -> None:
        self._file(name).write_text(str(value))

    def join(self) -> None:
        """Move the calling process into the group (in a child between fork and exec: all it starts follows)."""
        for directory in self.dirs:
            (directory / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.dirs[0] / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def hit_limit(self) -> str | None:
        """Which limit the group ran into, if any: "processes" (a fork refused) or "memory"."""
        try:
            if int(self._file("pids.events").read_text().split()[-1]):  # "max N": N forks refused
                return "processes"
            if self.v2:
                events = dict(line.split() for line in self._file("memory.events").read_text().splitlines())
                hits = int(events.get("oom_kill", 0))
            else:
                hits = int(self._file("memory.failcnt").read_text())
            return "memory" if hits else None
        except (OSError, ValueError, IndexError):
            return None

    def kill(self) -> None:
        """Kill every process in the group: at once with v2's cgroup.kill, else frozen first, then thawed to die."""
        if self.v2 and self._file("cgroup.kill").exists():
            self._write("cgroup.kill", 1)
        else:
            freeze, frozen, thawed = ("cgroup.freeze", 1, 0) if self.v2 else ("freezer.state", "FROZEN", "THAWED")
            with suppress(OSError):
                self._write(freeze, frozen)
                for pid in self.pids():
                    os.kill(pid, signal.SIGKILL)
            with suppress(OSError):
                self._write(freeze, thawed)
        for _ in range(200):
            if not self.pids():
                return
            time.sleep(0.02)

    def remove(self) -> None:
        """Kill what is left, and remove the group's directories."""
        self.kill()
        for directory in self.dirs:
            with suppress(OSError):
                directory.rmdir()


def remove_all(prefix: str) -> int:
    """Kill and remove every group named with `prefix`; how many there were."""
    bases, v2 = _bases()
    names = {p.name for base in bases if base.is_dir() for p in base.iterdir() if p.name.startswith(prefix)}
    for name in names:
        Group([base / name for base in bases], v2).remove()
    return len(names)
