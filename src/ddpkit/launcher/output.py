"""Where the workers' output goes: the console, log files, torch's error files.

The console shows each worker's stdout and stderr as they come, line by
line and unprefixed, as torchrun does (so log parsers anchored at the line
start keep working); ``--prefix-output`` prefixes every line with
``[rankN]: ``. Files, per launch:

``--log-dir DIR`` alone
    both streams of rank N in ``DIR/attempt_K/rankN.log``, and the console; the error files (below) in
    torchrun's layout, ``DIR/RUN_ID_xxxx/attempt_K/LOCAL_RANK/error.json``.
``--redirects`` / ``--tee`` (with or without ``--log-dir``)
    torchrun's layout: ``DIR/RUN_ID_xxxx/attempt_K/LOCAL_RANK/stdout.log``
    and ``stderr.log`` for the streams named (``DIR``: a new temporary
    directory when not given, which the launcher names). Redirected streams
    leave the console; teed ones stay, prefixed ``[ROLE LOCAL_RANK]:`` (or
    ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` with ``${role_name}``,
    ``${rank}``, ``${local_rank}``), as torchrun's.
``--duplicate-stdout-filters``, ``--duplicate-stderr-filters``
    lines holding one of the words also go to the attempt's
    ``filtered_stdout.log`` / ``filtered_stderr.log``.

Every worker gets ``TORCHELASTIC_ERROR_FILE``, where torch's ``@record``
writes the exception that ended it; the launcher reads it when the worker's
stderr holds no traceback, and when the job fails copies the first failed
worker's to the launcher's own ``TORCHELASTIC_ERROR_FILE``, if it has one
(as torchrun's ``@record`` does). Without ``--log-dir`` or redirection those
files live in a private temporary directory removed when the launcher exits.
"""

from __future__ import annotations

import collections
import json
import re
import shutil
import string
import tempfile
import threading
from pathlib import Path
from typing import BinaryIO

from ddpkit.launcher.settings import LaunchSettings

SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")
write_lock = threading.Lock()
"""Held for every write to the launcher's own stdout/stderr, so lines never interleave."""


class Pump(threading.Thread):
    """Copy one worker stream, whole segments at a time: to the console (with a prefix), files and a tail.

    ``\\r`` ends a segment too, so progress bars redraw in place with their prefix.
    """

    def __init__(self, src: BinaryIO, dst: BinaryIO | None, prefix: bytes, log: BinaryIO | None,
                 tail: collections.deque | None, duplicate: tuple[BinaryIO, list[bytes]] | None = None):
        super().__init__(daemon=True)
        self.src, self.dst, self.prefix, self.log, self.tail = src, dst, prefix, log, tail
        self.duplicate = duplicate

    def run(self) -> None:
        pending = b""
        try:
            while chunk := self.src.read1(65536):
                pending += chunk
                end = 0
                for match in SEGMENT.finditer(pending):
                    self._emit(match.group())
                    end = match.end()
                pending = pending[end:]
            if pending:
                self._emit(pending + b"\n")
        except _ConsoleGone:
            # The reader of the console went away (``ddpkit launch ... | head``). Under torchrun the worker
            # writes to that pipe itself and fails there; closing its pipe here does the same to it, rather
            # than leave it blocked on a full pipe while the launcher waits forever.
            self.src.close()

    def _emit(self, segment: bytes) -> None:
        if self.dst is not None:
            prefix = b"" if segment.startswith(self.prefix) else self.prefix
            with write_lock:
                try:
                    self.dst.write(prefix + segment)
                    self.dst.flush()
                except BrokenPipeError:
                    _silence(self.dst)
                    raise _ConsoleGone from None
        if self.log is not None:
            self.log.write(segment)
            self.log.flush()
        if self.duplicate is not None and any(word in segment for word in self.duplicate[1]):
            with write_lock:
                self.duplicate[0].write(segment)
                self.duplicate[0].flush()
        if self.tail is not None:
            self.tail.append(segment.decode("utf-8", "replace").rstrip("\r\n"))


class _ConsoleGone(Exception):
    """The console stream a pump writes to was closed by its reader."""


def _silence(stream: BinaryIO) -> None:
    """Point a closed console stream at /dev/null, so later writes (and the exit-time flush) don't fail."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _filters(text: str) -> list[bytes]:
    """torchrun's filter list: comma-separated, ``,,`` for a literal comma."""
    return [w.replace("\0", ",").encode() for w in text.replace(",,", "\0").split(",") if w]


class LogLayout:
    """The files of one launch: per attempt and rank, as described in the module docstring."""

    def __init__(self, launch: LaunchSettings, run_id: str, prefix_template: str | None = None):
        self.launch = launch
        self.template = prefix_template
        self.torchrun_layout = any(launch.redirect_map.values()) or any(launch.tee_map.values())
        self.filters = {"stdout": _filters(launch.config.duplicate_stdout_filters),
                        "stderr": _filters(launch.config.duplicate_stderr_filters)}
        self._private: Path | None = None
        log_dir = launch.config.log_dir
        self._shown = self.torchrun_layout or any(self.filters.values())
        if self._shown or log_dir:  # --log-dir alone: the error files in torchrun's layout there too
            base = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="ddpkit_logs_"))
            base.mkdir(parents=True, exist_ok=True)
            self.run_dir = Path(tempfile.mkdtemp(prefix=f"{run_id}_", dir=base))
        else:
            self._private = self.run_dir = Path(tempfile.mkdtemp(prefix="ddpkit_errors_"))
        self._open: list[BinaryIO] = []

    @property
    def shown_dir(self) -> Path | None:
        """The directory the user should be told about (None: nothing but error files is written there; with
        ``--log-dir`` alone, ddpkit's own ``attempt_K/rankN.log`` are beside it)."""
        return self.run_dir if self._shown else None

    def start_attempt(self, attempt: int, nproc: int) -> dict[int, str]:
        """Make the attempt's directories; return each local rank's ``TORCHELASTIC_ERROR_FILE``."""
        self.close_files()
        attempt_dir = self.run_dir / f"attempt_{attempt}"
        shutil.rmtree(attempt_dir, ignore_errors=True)  # a round number seen before (elastic): start it clean
        files = {}
        for local_rank in range(nproc):
            (attempt_dir / str(local_rank)).mkdir(parents=True, exist_ok=True)
            files[local_rank] = str(attempt_dir / str(local_rank) / "error.json")
        self._attempt_dir = attempt_dir
        self._duplicates = {name: self._file(attempt_dir / f"filtered_{name}.log")
                            for name, words in self.filters.items() if words}
        if self.launch.config.log_dir and not self.torchrun_layout:
            (Path(self.launch.config.log_dir) / f"attempt_{attempt}").mkdir(parents=True, exist_ok=True)
        self._attempt = attempt
        return files

    def streams(self, rank: int, local_rank: int, console: dict[str, BinaryIO]) -> list[tuple]:
        """For each stream of one worker: ``(name, console or None, prefix, log file or None, duplicate)``."""
        launch = self.launch
        shown = launch.shown_ranks is None or local_rank in launch.shown_ranks
        combined = None
        if launch.config.log_dir and not self.torchrun_layout:
            combined = self._file(Path(launch.config.log_dir) / f"attempt_{self._attempt}" / f"rank{rank}.log")
        out = []
        for name in ("stdout", "stderr"):
            teed = name in launch.tee_map[local_rank]
            redirected = teed or name in launch.redirect_map[local_rank]
            log = self._file(self._attempt_dir / str(local_rank) / f"{name}.log") if redirected else combined
            to_console = shown and (teed or not redirected)
            if launch.config.prefix_output:
                prefix = f"[rank{rank}]: "
            elif teed:
                prefix = self._tee_prefix(rank, local_rank)
            else:
                prefix = ""
            dup = (self._duplicates[name], self.filters[name]) if name in self._duplicates else None
            out.append((name, console[name] if to_console else None, prefix.encode(), log, dup))
        return out

    def server_streams(self, server: int, console: dict[str, BinaryIO]) -> list[tuple]:
        """A parameter server's streams, as :meth:`streams`: the console, marked ``[serverK]: `` (a server has no
        local rank to filter or redirect by), and with ``--log-dir`` a file of its own beside the ranks'
        (``attempt_K/serverK.log``)."""
        log = None
        if self.launch.config.log_dir:
            folder = self._attempt_dir if self.torchrun_layout else \
                Path(self.launch.config.log_dir) / f"attempt_{self._attempt}"
            log = self._file(folder / f"server{server}.log")
        return [(name, console[name], f"[server{server}]: ".encode(), log, None) for name in ("stdout", "stderr")]

    def _tee_prefix(self, rank: int, local_rank: int) -> str:
        if self.template:
            return string.Template(self.template).safe_substitute(
                role_name=self.launch.config.role, rank=rank, local_rank=local_rank)
        return f"[{self.launch.config.role}{local_rank}]:"

    def _file(self, path: Path) -> BinaryIO:
        f = open(path, "ab")  # noqa: SIM115 - closed by close_files()
        self._open.append(f)
        return f

    def close_files(self) -> None:
        for f in self._open:
            f.close()
        self._open = []

    def close(self) -> None:
        """Close every file; remove the private directory of error files."""
        self.close_files()
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)


def read_error_file(path: str) -> str:
    """The traceback torch's ``@record`` wrote to ``TORCHELASTIC_ERROR_FILE`` (empty when none)."""
    try:
        data = json.loads(Path(path).read_text())
        message = data["message"]
        if isinstance(message, str):
            return message
        return (message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")).rstrip()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""
