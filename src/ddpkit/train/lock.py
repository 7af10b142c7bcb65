"""Who is writing a run directory: one job at a time, a crashed job's lock taken over by the next.

``<output-dir>/lock.json`` names the job that holds the directory: host,
process id and its start time, the job (a digest of its secret, so restarts
of one job recognise each other), the command, and a heartbeat the holder
refreshes every :data:`HEARTBEAT_S`.

A lock is *live* while its holder runs: on this host, a process with that id
and that start time exists; on another host (a shared file system), its
heartbeat is younger than :data:`STALE_S`. A live lock of another job refuses
the directory with an error naming the job; a lock of the same job (a
restarted attempt) or a stale one (its holder crashed) is taken over, and the
take-over is said. The holder removes the lock when the run ends, also on an
error; a ``kill -9`` leaves it, stale.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ddpkit.runtime.discovery import JOB_TOKEN_ENV, job_key
from ddpkit.runtime.options import ConfigError

__all__ = ["HEARTBEAT_S", "LOCK_FILE", "STALE_S", "RunLock"]

LOCK_FILE = "lock.json"
HEARTBEAT_S = 5.0
"""How often the holder refreshes the lock."""
STALE_S = 30.0
"""A lock of another host whose heartbeat is older than this is stale."""


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, from /proc), None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _job_digest() -> str | None:
    """Which job holds the lock, as a digest of the key derived from its secret (slowly: a lock file on shared
    storage must not let a dictionary check guesses at a plain hash's speed)."""
    token = os.environ.get(JOB_TOKEN_ENV)
    return hmac.new(job_key(token), b"ddpkit run lock", "sha256").hexdigest()[:16] if token else None


class RunLock:
    """The lock of the run directory ``out`` (see the module notes)."""

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / LOCK_FILE
        self.mine = {"host": socket.gethostname(), "pid": os.getpid(), "started": _start_time(os.getpid()),
                     "job": _job_digest(), "command": " ".join(sys.argv)[:500], "since": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> dict[str, Any] | None:
        """The lock's content, None when there is none (or it is unreadable: an interrupted write)."""
        try:
            return json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def live(self, held: dict[str, Any]) -> bool:
        """Whether the job ``held`` names is still running (see the module notes)."""
        if held.get("host") == self.mine["host"]:
            if held.get("pid") == os.getpid():
                return True
            started = _start_time(int(held.get("pid", -1)))
            return started is not None and started == held.get("started")  # not a reused process id
        with contextlib.suppress(OSError):
            return time.time() - self.path.stat().st_mtime < STALE_S
        return False

    def acquire(self) -> str | None:
        """Take the lock; return a note when a crashed or earlier attempt's lock was taken over.

        Raises:
            ConfigError: another job holds it, naming that job and what to do.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        note = None
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            with os.fdopen(fd, "w") as f:
                json.dump(self.mine, f)
        except FileExistsError:
            held = self.holder() or {}
            if held.get("host") == self.mine["host"] and held.get("pid") == os.getpid():
                return None  # this process holds it already (a restart of its own workers)
            same_job = held.get("job") is not None and held.get("job") == self.mine["job"]
            if held and not same_job and self.live(held):
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held.get("since", 0)))
                raise ConfigError(
                    f"--output-dir {str(self.path.parent)!r} is in use by another job: pid {held.get('pid')} on "
                    f"{held.get('host')}, since {since} ({held.get('command', '?')}): wait for it to end, or "
                    "choose another --output-dir"
                ) from None
            note = (f"took over the lock of {self.path.parent} from " +
                    ("an earlier attempt of this job" if same_job else
                     f"pid {held.get('pid')} on {held.get('host')}, which is no longer running"))
            tmp = self.path.with_name(f".{LOCK_FILE}.{os.getpid()}")
            tmp.write_text(json.dumps(self.mine))
            os.replace(tmp, self.path)
        self._thread = threading.Thread(target=self._beat, name="ddpkit-run-lock", daemon=True)
        self._thread.start()
        return note

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
        held = self.holder()
        if held is not None and held.get("host") == self.mine["host"] and held.get("pid") == os.getpid():
            with contextlib.suppress(OSError):
                self.path.unlink()
