"""Supervision of one round's workers: start them, stream their output, tear down and explain a failure.

Failure handling, in order:

1. The first worker to exit non-zero (or die of a signal) is the root cause.
2. Every other worker *and its children* (each worker leads its own process
   group, so a DataLoader worker goes too) gets SIGTERM, then SIGKILL after
   the grace period.
3. The root cause is printed: rank, exit code or signal, and the Python
   traceback taken from that rank's stderr, with no decorator needed in the
   user's script.
4. With restarts left, the whole group starts again with
   ``TORCHELASTIC_RESTART_COUNT`` incremented; otherwise the launcher exits 1
   (the rounds, restarts and signals: :mod:`ddpkit.launcher.job`).
"""

from __future__ import annotations

import collections
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ddpkit.launcher.launch_config import LaunchConfig
from ddpkit.launcher.output import LogLayout, Pump, read_error_file, write_lock
from ddpkit.launcher.plan import WorkerSpec
from ddpkit.launcher.node_rendezvous import POLL_S, RemoteFailure
from ddpkit.launcher.settings import LaunchSettings
from ddpkit.runtime.preloaded import PreloadedProcess, start_module
from ddpkit.runtime.process import (
    PS_REPLICATION_ENV,
    SignalCatcher,
    describe_exit,
    die_with_parent,
    lost_key_ranges,
    terminate,
)
from ddpkit.runtime.stall import PREFIX as STALL_PREFIX

_POLL_S = 0.05
TAIL_LINES = 400
# torch itself prefixes an uncaught exception's lines with "[rankN]: " once
# the process group exists; we neither double it nor let it hide a traceback.
_TORCH_PREFIX = re.compile(r"^\[rank\d+\]: ?")


def say(message: str) -> None:
    """The launcher's own voice, on stderr, so it never mixes into a worker's stdout."""
    with write_lock:
        sys.stderr.write(f"ddpkit launch: {message}\n")
        sys.stderr.flush()


def extract_traceback(lines: list[str]) -> str:
    """The last Python traceback (with the exceptions chained to it) in ``lines``."""
    lines = [_TORCH_PREFIX.sub("", line) for line in lines]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return ""
    chain_markers = ("During handling of the above exception", "The above exception was the direct cause")
    first = starts[-1]
    for start in reversed(starts[:-1]):
        between = "\n".join(lines[start:first])
        if not any(marker in between for marker in chain_markers):
            break
        first = start
    return "\n".join(lines[first:]).rstrip()


def extract_stall_report(lines: list[str]) -> list[str]:
    """The last stall inspector report in ``lines`` (see :mod:`ddpkit.runtime.stall`), without its prefix."""
    lines = [_TORCH_PREFIX.sub("", line) for line in lines]
    ends = [i for i, line in enumerate(lines) if line.startswith(STALL_PREFIX)]
    if not ends:
        return []
    start = end = ends[-1]
    while start > 0 and lines[start - 1].startswith(STALL_PREFIX):
        start -= 1
    report = [line[len(STALL_PREFIX):] for line in lines[start : end + 1]]
    # Reports printed back to back: keep the last, which begins after the
    # previous one's closing line (the only indented lines that end a report).
    closers = [i for i, line in enumerate(report[:-1]) if line.startswith("  ") and _is_closer(line)]
    return report[closers[-1] + 1 :] if closers else report


def _is_closer(line: str) -> bool:
    return line.startswith("  still waiting") or line.endswith("collective failed; the error follows")


@dataclass
class Failure:
    """The root cause of a failed attempt."""

    rank: int
    local_rank: int
    exitcode: int
    traceback: str
    last_lines: list[str] = field(default_factory=list)
    """The end of its stderr, shown when there is no traceback (a usage error, a C++ abort)."""
    stall: list[str] = field(default_factory=list)
    """A stall report some rank printed (naming the ranks that stalled): the real root cause then."""
    stall_reporter: int | None = None

    server: int | None = None
    """The parameter server's index when a server failed."""
    error_file: str = ""
    """Where the worker's ``TORCHELASTIC_ERROR_FILE`` was (torch's ``@record`` writes its traceback there)."""
    earlier: int = 0
    """Under ``--on-failure continue``: deaths before this failure's that the job went on from."""

    def describe(self) -> str:
        went_on = (f" (of the deaths that ended the job; it went on from {self.earlier} earlier death(s), each in a "
                   "line above)") if self.earlier else ""
        if self.server is not None:
            return f"parameter server {self.server} failed first{went_on}: {describe_exit(self.exitcode)}"
        return (f"rank {self.rank} (local rank {self.local_rank}) failed first{went_on}: "
                f"{describe_exit(self.exitcode)}")


def preloaded_module(argv: list[str], cfg: LaunchConfig) -> tuple[str, list[str]] | None:
    """``(module, args)`` where ``argv`` runs ``python -u -m module args`` with this launcher's interpreter and the
    launch preloads (``cfg.preload``: ``ddpkit train``'s own workers), else None: a fresh interpreter."""
    if not cfg.preload or len(argv) < 4 or argv[:3] != [sys.executable, "-u", "-m"]:
        return None
    return argv[3], argv[4:]


class WorkerGroup:
    """The running workers of one attempt.

    A thread per worker waits for its exit and queues ``(exit status, worker)``
    the moment it happens, so the root cause is the failure that came first
    in time, not the first in rank order.
    """

    def __init__(self, launch: LaunchSettings, layout: LogLayout):
        self.launch = launch
        self.layout = layout
        self.specs: list[WorkerSpec] = []
        self.procs: list[subprocess.Popen | PreloadedProcess] = []
        self.pumps: list[Pump] = []
        self.tails: dict[int, collections.deque] = {}
        self.exits: queue.Queue[tuple[int, int]] = queue.Queue()
        self.dead_servers: set[int] = set()

    def start(self, specs: list[WorkerSpec], signals: SignalCatcher) -> None:
        """Start ``specs``; a launcher signal meanwhile stops the loop, then is raised."""
        with signals.deferred():
            for spec in specs:
                if signals.received is not None:
                    break
                self._start_one(spec)

    def _start_one(self, spec: WorkerSpec, fds: Mapping[str, int] | None = None) -> int:
        """Start one worker; ``fds``: environment variables naming a file descriptor of this process that the
        worker inherits."""
        preloaded = preloaded_module(spec.argv, self.launch.config)
        if preloaded is not None:
            module, args = preloaded
            name = f"ddpkit-rank{spec.rank}" if spec.server is None else f"ddpkit-server{spec.server}"
            proc: subprocess.Popen | PreloadedProcess = start_module(module, args, spec.env, fds=fds, name=name,
                                                                     preload=self.launch.config.preload)
        else:
            spec.env.update({name: str(fd) for name, fd in (fds or {}).items()})
            # start_new_session: the worker leads a process group holding all
            # its descendants, which killpg can then take down together. stdin is
            # the launcher's, as under torchrun (piped input reaches the workers).
            proc = subprocess.Popen(
                spec.argv, env=spec.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, preexec_fn=die_with_parent, pass_fds=tuple((fds or {}).values()),
            )
        index = len(self.procs)
        self.specs.append(spec)
        self.procs.append(proc)
        self.tails[spec.rank] = collections.deque(maxlen=TAIL_LINES)
        console = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}
        sources = {"stdout": proc.stdout, "stderr": proc.stderr}
        streams = self.layout.streams(spec.rank, spec.local_rank, console) if spec.server is None else \
            self.layout.server_streams(spec.server, console)
        for name, dst, prefix, log, dup in streams:
            pump = Pump(sources[name], dst, prefix, log, self.tails[spec.rank] if name == "stderr" else None, dup)
            pump.start()
            self.pumps.append(pump)
        threading.Thread(target=lambda: self.exits.put((proc.wait(), index)), daemon=True).start()
        return index

    def wait(self, watch: Callable[[], RemoteFailure | str | None] | None = None,
             ) -> Failure | RemoteFailure | str | None:
        """Block until every worker succeeded (None) or one failed (the first in time).

        ``watch`` (multi-node) is called every :data:`POLL_S`; when it returns
        another node's failure (or, elastic, why the round must end), this
        node's workers are stopped and it is returned.
        """
        done = 0
        next_look = time.monotonic() + POLL_S
        workers = sum(spec.server is None for spec in self.specs)
        while done < workers:
            if watch is not None and time.monotonic() >= next_look:
                next_look = time.monotonic() + POLL_S
                if remote := watch():
                    self.stop()
                    return remote
            try:
                # A timeout, so the main thread still runs signal handlers.
                code, index = self.exits.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            done += self.specs[index].server is None
            if code != 0:
                self.stop()
                return self.failure(index, code)
        self.stop_servers()
        return None

    def stop_servers(self) -> None:
        """Every worker finished: the parameter servers have nobody left to serve."""
        servers = [p for p, spec in zip(self.procs, self.specs) if spec.server is not None]
        if servers:
            terminate(servers, self.launch.grace_period_s, signal.SIGTERM)

    def server_replaced(self, index: int, code: int) -> bool:
        """Process ``index`` died with ``code``: whether it is a parameter server killed by a signal whose key
        ranges all live on another server still (``--ps-replication``), so that the job goes on without it
        (said here). Only
        ``--on-failure continue`` asks: its launcher tells the workers, whose requests to the dead server
        would otherwise wait for an answer (Gloo does not always fail a receive from a dead peer)."""
        spec = self.specs[index]
        if spec.server is None or code > 0:
            return False  # a server that raised (and said why) fails the job: its replica would raise the same
        self.dead_servers.add(spec.server)
        replication = int(spec.env.get(PS_REPLICATION_ENV, "1"))
        servers = sum(s.server is not None for s in self.specs)
        if lost_key_ranges(self.dead_servers, servers, replication):
            return False
        say(f"parameter server {spec.server} died: {describe_exit(code)}; its key ranges are served by the next "
            f"server of their chains (--ps-replication {replication}), the job goes on with "
            f"{servers - len(self.dead_servers)} server(s)")
        return True

    def failure(self, index: int, code: int) -> Failure:
        """The :class:`Failure` of worker ``index``, which exited with ``code``, from its output."""
        spec = self.specs[index]
        failure = Failure(rank=spec.rank, local_rank=spec.local_rank, exitcode=code, server=spec.server,
                          error_file=spec.env.get("TORCHELASTIC_ERROR_FILE", "") if spec.server is None else "",
                          traceback=extract_traceback(list(self.tails[spec.rank]))
                          or read_error_file(spec.env.get("TORCHELASTIC_ERROR_FILE", "")),
                          last_lines=[line for line in self.tails[spec.rank] if line.strip()][-5:])
        # The failing rank's own report first (taken as it failed), else any rank's.
        for rank in [spec.rank, *sorted(r for r in self.tails if r != spec.rank)]:
            if stall := extract_stall_report(list(self.tails[rank])):
                failure.stall, failure.stall_reporter = stall, rank
                break
        return failure

    def stop(self, first_signal: int = signal.SIGTERM) -> None:
        """Stop every worker and its children (see :func:`ddpkit.runtime.process.terminate`)."""
        terminate(self.procs, self.launch.grace_period_s, first_signal)
        self.finish()

    def finish(self) -> None:
        """After every worker exited 0: collect the rest of their output. Processes a worker left running in
        the background are left alone, as torchrun leaves them."""
        for pump in self.pumps:
            pump.join(timeout=2.0)
        self.layout.close_files()


def copy_root_cause(failure_file: str, exitcode: int, target: str | None) -> None:
    """What torchrun's ``@record`` does with the root cause of a failed job: the failed worker's error file (torch's
    ``@record`` wrote it), its ``errorCode`` set to the exit code, copied to ``target``, the launcher's own
    ``TORCHELASTIC_ERROR_FILE`` (a scheduler such as TorchX reads it). Nothing when either is missing."""
    if not target or not failure_file:
        return
    try:
        data = json.loads(Path(failure_file).read_text())
    except (OSError, ValueError):
        return  # the worker wrote none (no @record): torchrun copies nothing either
    if isinstance(data, dict) and isinstance(data.get("message"), dict) and exitcode:
        data["message"]["errorCode"] = exitcode
    try:
        Path(target).write_text(json.dumps(data))
    except OSError as e:
        say(f"could not write the root cause to TORCHELASTIC_ERROR_FILE={target}: {e.strerror or e}")


def report(failure: Failure) -> None:
    """Print the root cause of a failed attempt: a stall report when a rank printed one, else the first failure."""
    rule = "-" * 72
    body = failure.traceback or "\n".join(
        ["(no Python traceback on its stderr; its last lines:)", *failure.last_lines]
        if failure.last_lines else ["(no Python traceback and nothing on its stderr)"]
    )
    if failure.stall:
        error = (failure.traceback.splitlines() or failure.last_lines or ["(nothing on its stderr)"])[-1]
        say(f"{failure.stall[0]}\n{rule}\nRoot cause (stall inspector, reported by rank {failure.stall_reporter}):\n"
            + "\n".join(failure.stall)
            + f"\n\nrank {failure.rank} (local rank {failure.local_rank}) then failed first: "
            f"{describe_exit(failure.exitcode)}\n  {error}\n{rule}")
        return
    who = f"parameter server {failure.server}" if failure.server is not None else f"rank {failure.rank}"
    say(f"{failure.describe()}\n{rule}\nRoot cause: {who}\n{body}\n{rule}")
