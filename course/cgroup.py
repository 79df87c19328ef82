"""A sandbox's processes as one group the kernel counts and can kill whole: a cgroup, where one can be made here
(v2, else v1; either needs root: book/src/grading.md, "The bounds, and where each holds"). Groups are named
`<prefix><random>`: `remove_all(prefix)` ends every group of a grading run, even a killed test process's."""

from __future__ import annotations

import os
import signal
import time
import uuid
from contextlib import suppress
from pathlib import Path

MOUNTS = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("pids", "memory", "freezer")
V1_NAMES = {"memory.max": "memory.limit_in_bytes", "cgroup.freeze": "freezer.state"}  # v2's file -> v1's


def _v2_root() -> Path | None:
    """The unified (v2) hierarchy, where it is mounted at its usual place (as systemd and Docker mount it)."""
    return MOUNTS if (MOUNTS / "cgroup.controllers").exists() else None


def _bases() -> list[Path]:
    """Where groups are made: [the root of a v2 mount that gives its children the pids and memory controllers],
    this process's own cgroup in each v1 hierarchy (`V1_CONTROLLERS`), or none."""
    root = _v2_root()
    with suppress(OSError):
        if root is not None and {"pids", "memory"} <= set((root / "cgroup.subtree_control").read_text().split()):
            return [root]
    own = {}  # controller -> this process's cgroup in its v1 hierarchy
    with suppress(OSError, ValueError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            own.update(dict.fromkeys(controllers.split(","), path))
    if not all(c in own and (MOUNTS / c).is_dir() for c in V1_CONTROLLERS):
        return []
    return [MOUNTS / c / own[c].lstrip("/") for c in V1_CONTROLLERS]


class Group:
    """One cgroup limiting processes and memory: a directory of the v2 hierarchy, or one per v1 controller."""

    def __init__(self, dirs: list[Path]):
        self.dirs, self.v2 = dirs, len(dirs) == 1

    @classmethod
    def make(cls, prefix: str, processes: int, memory_bytes: int | None) -> Group | None:
        """A new group, or None where no cgroup can be made here."""
        name = f"{prefix}{uuid.uuid4().hex[:12]}"
        group = cls([base / name for base in _bases()])
        if not group.dirs:
            return None
        try:
            for directory in group.dirs:
                directory.mkdir()
            group._file("pids.max").write_text(str(processes))
            if memory_bytes:
                group._file("memory.max").write_text(str(memory_bytes))
        except OSError:
            group.remove()
            return None
        return group

    def _file(self, name: str) -> Path:
        """A file of the group by its v2 name; for v1, its v1 name in its controller's hierarchy."""
        if self.v2:
            return self.dirs[0] / name
        name = V1_NAMES.get(name, name)
        return self.dirs[V1_CONTROLLERS.index(name.split(".")[0])] / name

    def join(self) -> None:
        """Move the calling process into the group (in a child between fork and exec: all it starts follows)."""
        for directory in self.dirs:
            (directory / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        with suppress(OSError):
            return [int(p) for p in (self.dirs[0] / "cgroup.procs").read_text().split()]
        return []

    def hit_limit(self) -> str | None:
        """Which limit the group ran into, if any: "processes" (a fork refused) or "memory"."""
        with suppress(OSError, ValueError, IndexError):
            if int(self._file("pids.events").read_text().split()[-1]):  # "max N": N forks refused
                return "processes"
            if self.v2:
                events = dict(line.split() for line in self._file("memory.events").read_text().splitlines())
                return "memory" if int(events.get("oom_kill", 0)) else None
            return "memory" if int(self._file("memory.failcnt").read_text()) else None
        return None

    def kill(self) -> None:
        """Kill every process in the group: at once with v2's cgroup.kill, else frozen first (nothing forks a
        replacement meanwhile), killed, then thawed to die."""
        if self.v2 and self._file("cgroup.kill").exists():
            self._file("cgroup.kill").write_text("1")
        else:
            frozen, thawed = ("1", "0") if self.v2 else ("FROZEN", "THAWED")
            with suppress(OSError):
                self._file("cgroup.freeze").write_text(frozen)
                for pid in self.pids():
                    os.kill(pid, signal.SIGKILL)
            with suppress(OSError):
                self._file("cgroup.freeze").write_text(thawed)
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


def remove_all(prefix: str) -> None:
    """Kill and remove every group named with `prefix`."""
    bases = _bases()
    names = {p.name for base in bases if base.is_dir() for p in base.iterdir() if p.name.startswith(prefix)}
    for name in names:
        Group([base / name for base in bases]).remove()
