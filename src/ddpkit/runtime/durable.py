"""Files that survive a crash and say when their bytes changed: durable writes, digests, and the error of a file
that cannot be read or written.

* :func:`write_atomic` writes to a temporary name beside the target, fsyncs
  it, renames it over the target and fsyncs the folder: a crash at any point
  leaves either the old file or the new one, never a torn one. Temporaries
  that an interrupted write left behind are removed by the next write in
  that folder (:func:`remove_stale_temporaries`). Every file ddpkit writes
  (checkpoints whole and sharded, run directories, metrics) goes through it,
  so every file has the same mode (``0666`` less the umask).
* :func:`digest` and :func:`tensor_digest` (BLAKE2b, 128 bits) are what
  checkpoints store beside their tensors and check when they are read.
* :class:`CheckpointError` is the one-line error of a checkpoint that cannot
  be read (damaged, truncated, foreign) or written.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ddpkit.runtime.process import pid_alive

__all__ = ["CheckpointError", "describe_write_error", "digest", "one_line", "remove_stale_temporaries",
           "tensor_digest", "write_atomic", "write_or_warn"]


class CheckpointError(ValueError):
    """A checkpoint cannot be read (corrupt, truncated, not a checkpoint) or written.

    ``gone`` is True when the folder it was to be written in no longer exists (removed while the run was going on).
    """

    def __init__(self, message: str, gone: bool = False) -> None:
        super().__init__(message)
        self.gone = gone


_CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EFBIG: "the file is larger than this process may write (ulimit -f)",
    errno.ENOENT: "its folder no longer exists (removed while the run was going on)",
    errno.EISDIR: "a folder is in the way",
}


def describe_write_error(error: BaseException) -> str:
    """Why a write failed, in words: the cause behind an ``OSError``'s number, else the error itself."""
    if isinstance(error, OSError) and error.errno in _CAUSES:
        return _CAUSES[error.errno]
    return f"{type(error).__name__}: {error}"


def one_line(error: BaseException) -> str:
    """An error's message on one short line (a file's damage is reported in one)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def digest(data: bytes | memoryview | np.ndarray) -> str:
    """The BLAKE2b digest (128 bits, hex) of ``data``: as strong as needed against bit rot and torn writes, and
    about three times faster than sha256 here (hashlib releases the GIL)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """:func:`digest` of a CPU tensor's bytes, in its row-major order."""
    return digest(t.contiguous().reshape(-1).view(torch.uint8).numpy())


_TMP = re.compile(r"^\..+\.tmp-(?P<host>[^-]+)-(?P<pid>\d+)$")


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete the temporary files of interrupted writes in ``folder``; return them.

    A temporary is stale when the process that wrote it (named in the file
    name, with its host) is gone. Files of other hosts are left alone: their
    writer may be alive on a shared file system.
    """
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    host = socket.gethostname().replace("-", "_")
    for entry in folder.iterdir():
        m = _TMP.match(entry.name)
        if m and m["host"] == host and int(m["pid"]) != os.getpid() and not pid_alive(int(m["pid"])):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed.append(entry)
    return removed


def write_atomic(path: Path, data: bytes | memoryview | Callable[[Path], object]) -> None:
    """Write ``data`` to ``path`` durably: temporary file, fsync, rename, fsync of the folder.

    ``data``: the bytes, or a function that writes the file it is given (a safetensors writer streaming tensors to
    disk: no second copy of them in memory). Temporaries that earlier, interrupted writes left in the folder are
    removed first.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    host = socket.gethostname().replace("-", "_")
    tmp = path.with_name(f".{path.name}.tmp-{host}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:  # created here, with the mode every file gets (the umask's)
            if not callable(data):
                f.write(data)
                f.flush()
        if callable(data):
            mode = os.stat(tmp).st_mode & 0o7777
            data(tmp)
            os.chmod(tmp, mode)  # a writer's own mode may be 0600 (safetensors')
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    # The rename is durable only once the folder's entry is on disk too.
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_or_warn(path: Path, text: str) -> None:
    """:func:`write_atomic` of ``text``; a failure is a warning on stderr (training goes on)."""
    try:
        write_atomic(path, text.encode())
    except OSError as e:
        print(f"ddpkit train: warning: could not write {path}: {e}; training goes on", file=sys.stderr, flush=True)
