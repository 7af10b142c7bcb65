"""A memory limit for a few processes: a memory cgroup (v1 or v2), as a cluster's scheduler gives each job one.

A process that joins a :class:`MemoryCap` is charged for the pages it touches
from then on (neither cgroup version moves the charges of pages it touched
before: the interpreter, torch and the process group stay outside), and the
kernel kills it (SIGKILL, the OOM killer) when they pass the limit: what
happens to a rank whose model does not fit. Swap is capped too, so the pages
cannot escape the limit there. :meth:`MemoryCap.peak` reads the most the
group ever held.

Needs a writable memory cgroup hierarchy (root in a container, or a
delegated subtree); :func:`unavailable` says why not where there is none.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["MemoryCap", "unavailable"]

_V1 = Path("/sys/fs/cgroup/memory")
_V2_CANDIDATES = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))


def _v2_root() -> Path | None:
    for root in _V2_CANDIDATES:
        controllers = root / "cgroup.controllers"
        subtree = root / "cgroup.subtree_control"
        if controllers.exists() and "memory" in controllers.read_text().split() and subtree.exists():
            return root
    return None


def unavailable() -> str | None:
    """Why no memory cap can be made here (``None``: it can)."""
    if (_V1 / "memory.limit_in_bytes").exists():
        return None if os.access(_V1, os.W_OK) else f"{_V1} is not writable (run as root)"
    root = _v2_root()
    if root is None:
        return "no memory cgroup controller is mounted (neither cgroup v1's memory hierarchy nor v2's)"
    if "memory" not in (root / "cgroup.subtree_control").read_text().split():
        return f"cgroup v2 at {root} does not delegate its memory controller to its children"
    return None if os.access(root, os.W_OK) else f"{root} is not writable (run as root)"


class MemoryCap:
    """A memory cgroup named ``name`` that lets its processes touch ``limit_bytes`` of new memory.

    Raises:
        OSError: no memory cgroup can be made here (see :func:`unavailable`).
    """

    def __init__(self, name: str, limit_bytes: int) -> None:
        why = unavailable()
        if why is not None:
            raise OSError(f"cannot cap memory: {why}")
        self.v1 = (_V1 / "memory.limit_in_bytes").exists()
        self.parent = _V1 if self.v1 else _v2_root()  # type: ignore[assignment]
        self.path = self.parent / name
        self.path.mkdir(exist_ok=True)
        self.limit = int(limit_bytes)
        if self.v1:
            (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(self.limit))  # memory and swap together: no escape to swap
        else:
            (self.path / "memory.max").write_text(str(self.limit))
            swap = self.path / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")

    def enter(self, pid: int | None = None) -> None:
        """Move process ``pid`` (default: this one) into the cap: its new pages count from now on."""
        (self.path / "cgroup.procs").write_text(str(pid or os.getpid()))

    def leave(self, pid: int | None = None) -> None:
        """Move process ``pid`` (default: this one) back to the parent group."""
        (self.parent / "cgroup.procs").write_text(str(pid or os.getpid()))

    @contextlib.contextmanager
    def entered(self) -> Iterator[MemoryCap]:
        """This process inside the cap for the block."""
        self.enter()
        try:
            yield self
        finally:
            self.leave()

    def peak(self) -> int:
        """The most memory the group has held, in bytes (0 where the kernel does not say)."""
        name = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        path = self.path / name
        return int(path.read_text()) if path.exists() else 0

    def oom_kills(self) -> int:
        """Processes the kernel killed in this group for passing the limit."""
        path = self.path / ("memory.oom_control" if self.v1 else "memory.events")
        for line in path.read_text().splitlines() if path.exists() else []:
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def close(self) -> None:
        """Remove the group (once no process is in it)."""
        with contextlib.suppress(OSError):
            self.path.rmdir()

    @staticmethod
    def remove(name: str) -> None:
        """Remove the group ``name`` if it is there and empty (one whose process was killed in it)."""
        if unavailable() is not None:
            return
        parent = _V1 if (_V1 / "memory.limit_in_bytes").exists() else _v2_root()
        if parent is not None:
            with contextlib.suppress(OSError):
                (parent / name).rmdir()
