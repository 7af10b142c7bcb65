"""Supervision: start one node's workers, stream their output, tear down on failure.

Failure handling, in order:

1. The first worker to exit non-zero (or die of a signal) is the root cause.
2. Every other worker *and its children* (each worker leads its own process
   group, so a DataLoader worker goes too) gets SIGTERM, then SIGKILL after
   the grace period.
3. The root cause is printed: rank, exit code or signal, and the Python
   traceback taken from that rank's stderr, with no decorator needed in the
   user's script.
4. With restarts left, the whole group starts again with
   ``TORCHELASTIC_RESTART_COUNT`` incremented; otherwise the launcher exits 1.

SIGINT/SIGTERM to the launcher is forwarded to every worker group, then the
launcher exits ``128 + signal``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from ddpkit.launcher.config import LaunchConfig
from ddpkit.launcher.elastic import DynamicRendezvous, RendezvousClosed
from ddpkit.launcher.output import LogLayout, Pump, read_error_file, write_lock
from ddpkit.launcher.plan import NodeSlot, WorkerSpec, plan_workers
from ddpkit.launcher.rendezvous import POLL_S, STALE_S, NodeRendezvous, RemoteFailure, rendezvous_timeout
from ddpkit.runtime.discovery import LOOPBACK
from ddpkit.runtime.options import ConfigError
from ddpkit.runtime.process import Interrupted, SignalCatcher, describe_exit, die_with_parent, free_port, terminate
from ddpkit.runtime.stall import PREFIX as STALL_PREFIX

_POLL_S = 0.05
_TAIL_LINES = 400
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

    def describe(self) -> str:
        return f"rank {self.rank} (local rank {self.local_rank}) failed first: {describe_exit(self.exitcode)}"


class WorkerGroup:
    """The running workers of one attempt.

    A thread per worker waits for its exit and queues ``(exit status, worker)``
    the moment it happens, so the root cause is the failure that came first
    in time, not the first in rank order.
    """

    def __init__(self, cfg: LaunchConfig, layout: LogLayout):
        self.cfg = cfg
        self.layout = layout
        self.specs: list[WorkerSpec] = []
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[Pump] = []
        self.tails: dict[int, collections.deque] = {}
        self.exits: queue.Queue[tuple[int, int]] = queue.Queue()

    def start(self, specs: list[WorkerSpec], signals: SignalCatcher) -> None:
        """Start ``specs``; a launcher signal meanwhile stops the loop, then is raised."""
        with signals.deferred():
            for spec in specs:
                if signals.received is not None:
                    break
                self._start_one(spec)

    def _start_one(self, spec: WorkerSpec) -> None:
        # start_new_session: the worker leads a process group holding all
        # its descendants, which killpg can then take down together.
        proc = subprocess.Popen(
            spec.argv, env=spec.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent,
        )
        index = len(self.procs)
        self.specs.append(spec)
        self.procs.append(proc)
        self.tails[spec.rank] = collections.deque(maxlen=_TAIL_LINES)
        console = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}
        sources = {"stdout": proc.stdout, "stderr": proc.stderr}
        for name, dst, prefix, log, dup in self.layout.streams(spec.rank, spec.local_rank, console):
            pump = Pump(sources[name], dst, prefix, log, self.tails[spec.rank] if name == "stderr" else None, dup)
            pump.start()
            self.pumps.append(pump)
        threading.Thread(target=lambda: self.exits.put((proc.wait(), index)), daemon=True).start()

    def wait(self, watch: Callable[[], RemoteFailure | str | None] | None = None,
             ) -> Failure | RemoteFailure | str | None:
        """Block until every worker succeeded (None) or one failed (the first in time).

        ``watch`` (multi-node) is called every :data:`POLL_S`; when it returns
        another node's failure (or, elastic, why the round must end), this
        node's workers are stopped and it is returned.
        """
        done = 0
        next_look = time.monotonic() + POLL_S
        while done < len(self.procs):
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
            done += 1
            if code != 0:
                spec = self.specs[index]
                self.stop()
                failure = Failure(rank=spec.rank, local_rank=spec.local_rank, exitcode=code,
                                  traceback=extract_traceback(list(self.tails[spec.rank]))
                                  or read_error_file(spec.env.get("TORCHELASTIC_ERROR_FILE", "")),
                                  last_lines=[line for line in self.tails[spec.rank] if line.strip()][-5:])
                # The failing rank's own report first (taken as it failed), else any rank's.
                for rank in [spec.rank, *sorted(r for r in self.tails if r != spec.rank)]:
                    if stall := extract_stall_report(list(self.tails[rank])):
                        failure.stall, failure.stall_reporter = stall, rank
                        break
                return failure
        return None

    def stop(self, first_signal: int = signal.SIGTERM) -> None:
        """Stop every worker and its children (see :func:`ddpkit.runtime.process.terminate`)."""
        terminate(self.procs, self.cfg.grace_period_s, first_signal)
        for pump in self.pumps:
            pump.join(timeout=2.0)
        self.layout.close_files()


def check_rendezvous(cfg: LaunchConfig, port: int) -> None:
    """Fail fast on a master address that does not resolve or a busy port on node 0.

    Raises:
        ConfigError: with the offending value and the fix.
    """
    try:
        socket.getaddrinfo(cfg.master_addr, port)
    except socket.gaierror as e:
        raise ConfigError(
            f"--master-addr {cfg.master_addr!r} does not resolve ({e.strerror}): "
            "use a host name or IP address of node 0"
        ) from None
    if not cfg.hosts_rendezvous:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR as the store itself uses: a port in TIME_WAIT is fine,
        # only a live listener makes the bind fail.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as e:
            raise ConfigError(
                f"--master-port {port} is busy on this node ({e.strerror}): choose a free port, "
                "or use --standalone to pick one"
            ) from None


_PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "connectFullMesh")


def _share(rdzv: NodeRendezvous, attempt: int, node: int, failure: Failure) -> RemoteFailure:
    """Tell the other nodes of this failure; return the round's first failure (maybe another node's)."""
    text = failure.traceback + "\n".join(failure.last_lines)
    if any(k in text for k in _PEER_ERRORS):
        # A broken connection is the symptom; the cause is on the node that
        # went away, which its launcher (or node 0, by its heartbeat) records.
        deadline = time.monotonic() + (STALE_S + 2 * POLL_S if rdzv.serving else 2.0)
        while time.monotonic() < deadline:
            if remote := rdzv.watch(attempt):
                return remote
            time.sleep(POLL_S)
    lines = failure.stall[:1] or (failure.traceback.splitlines() or failure.last_lines or [""])[-1:]
    mine = RemoteFailure(node, failure.rank, describe_exit(failure.exitcode), lines[0])
    try:
        return rdzv.record(attempt, mine)
    except Exception:  # noqa: BLE001 - node 0 unreachable: the others learn it from its silence
        return rdzv.watch(attempt) or mine


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
    say(f"{failure.describe()}\n{rule}\nRoot cause: rank {failure.rank}\n{body}\n{rule}")


def run(cfg: LaunchConfig) -> int:
    """Start, supervise and (re)start this node's workers; return the exit code.

    Raises:
        ConfigError: the rendezvous cannot work (unresolvable address, busy port).
    """
    check_backend(os.environ.get("DDPKIT_BACKEND", ""))
    if cfg.standalone:
        port = free_port()
        cfg.master_addr = standalone_addr(cfg.local_addr)
    elif cfg.dynamic:
        port = cfg.endpoint[1]
    else:
        port = cfg.port()
        check_rendezvous(cfg, port)
    if int(cfg.nproc_per_node) > 1 and "OMP_NUM_THREADS" not in os.environ:
        say(f"setting OMP_NUM_THREADS=1 for each of the {cfg.nproc_per_node} workers so they do not "
            "oversubscribe the CPU; set it yourself to tune")
    for note in cfg.notes():
        say(note)
    token = job_token(cfg)
    # torchrun's run id: --rdzv-id, a fresh one under --standalone, else "none"
    # (never the random secret, which must not reach logs).
    run_id = cfg.rdzv_id or (uuid.uuid4().hex if cfg.standalone else "none")
    layout = LogLayout(cfg, run_id, os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"))
    if layout.shown_dir is not None:
        say(f"worker logs in {layout.shown_dir}")
    signals = SignalCatcher(cfg.signals)
    job = _Job(cfg, port, signals, token, run_id, layout)
    try:
        with signals.installed():
            try:
                with signals.deferred():
                    if cfg.dynamic:
                        job.rdzv = DynamicRendezvous(cfg, token)
                        if job.rdzv.serving:
                            say(f"serving the rendezvous at {job.rdzv.where}: the job ends if this launcher stops")
                    elif cfg.nnodes > 1:
                        job.rdzv = NodeRendezvous(host=cfg.master_addr, port=port, node=cfg.node_rank,
                                                  nnodes=cfg.nnodes, token=token, timeout_s=rendezvous_timeout())
                return job.elastic_rounds() if cfg.dynamic else job.attempts()
            except Interrupted as e:
                say(f"received {signal.Signals(e.signum).name}: stopping all workers")
                signals.deferring = True  # a second Ctrl-C must not cut the teardown short
                if job.group is not None:
                    job.group.stop(first_signal=e.signum)
                return 128 + e.signum
    finally:
        if job.rdzv is not None:
            job.rdzv.close()
        layout.close()


def check_backend(backend: str) -> None:
    """``DDPKIT_BACKEND=mpi`` needs a torch built with MPI: say so before any worker starts.

    torch is imported for this check only (the launcher otherwise needs none).

    Raises:
        ConfigError: the backend the workers would ask for does not exist here.
    """
    if backend.strip().lower() != "mpi":
        return
    import torch.distributed as dist

    if not dist.is_mpi_available():
        raise ConfigError("DDPKIT_BACKEND=mpi needs a torch built with MPI, and this one has none (the pip builds "
                          "do not): unset it or use gloo, which also runs under mpirun")


def standalone_addr(local_addr: str | None) -> str:
    """``MASTER_ADDR`` under ``--standalone``, as torchrun sets it: ``--local-addr``, else this host's FQDN.

    Falls back to loopback when that name does not resolve to an address of
    this machine (a container whose host name is in no resolver).
    """
    name = local_addr or socket.getfqdn()
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as sock:
            sock.bind((infos[0][4][0], 0))
        return name
    except OSError:
        if local_addr:
            raise ConfigError(f"--local-addr {local_addr!r} is not an address of this machine: give one of its "
                              "host names or addresses") from None
        return LOOPBACK


def job_token(cfg: LaunchConfig) -> str | None:
    """The job's secret: ``--rdzv-id``, else ``DDPKIT_JOB_TOKEN``, else a random one on a single node.

    Several nodes must share one, so none is made up for them: the job then
    runs without, and the launcher says so.
    """
    token = cfg.rdzv_id or os.environ.get("DDPKIT_JOB_TOKEN") or None
    if token is None and cfg.nnodes == 1:
        token = secrets.token_hex(16)
    if token is None:
        say("no job secret (--rdzv-id or DDPKIT_JOB_TOKEN, the same on every node): any process that reaches the "
            "rendezvous can join this job as a rank")
    return token


class _Job:
    """One launcher's run: its rounds of workers, the failures between them, and the node rendezvous."""

    def __init__(self, cfg: LaunchConfig, port: int, signals: SignalCatcher, token: str | None, run_id: str,
                 layout: LogLayout):
        self.cfg, self.port, self.signals, self.token, self.run_id, self.layout = (
            cfg, port, signals, token, run_id, layout)
        self.rdzv: NodeRendezvous | None = None
        self.group: WorkerGroup | None = None

    def _round(self, attempt: int, restart_count: int, slot: NodeSlot,
               watch: Callable[[], RemoteFailure | str | None] | None) -> Failure | RemoteFailure | str | None:
        """Run this node's workers for one round; the outcome of :meth:`WorkerGroup.wait`, reported."""
        cfg = self.cfg
        errors = self.layout.start_attempt(attempt, int(cfg.nproc_per_node))
        specs = plan_workers(cfg, master_port=slot.master_port, restart_count=restart_count, base_env=os.environ,
                             job_token=self.token, agent_store=self.rdzv is not None, run_id=self.run_id,
                             slot=slot, error_files=errors)
        self.group = WorkerGroup(cfg, self.layout)
        self.group.start(specs, self.signals)
        outcome = self.group.wait(watch=watch)
        self.group.stop()
        if isinstance(outcome, Failure) and isinstance(self.rdzv, DynamicRendezvous):
            # Another node stopped its workers for a membership change before
            # this one looked: the broken connection is that, not a failure.
            with contextlib.suppress(Exception):
                if change := self.rdzv.membership_change(attempt, declare=False):
                    return change
        if isinstance(outcome, RemoteFailure):
            say(f"{outcome.describe()}\nstopped this node's workers")
        elif isinstance(outcome, Failure):
            cause = _share(self.rdzv, attempt, slot.node_rank, outcome) if self.rdzv else None
            report(outcome)
            if cause is not None and cause.node != slot.node_rank:
                say(f"root cause on another node: {cause.describe()}")
        return outcome

    def _succeeded(self, round_: int) -> int:
        remote = self.rdzv.finish(round_, ok=True) if self.rdzv else None
        if remote is None:
            return 0
        say(f"{remote.describe()}\n(this node's workers had finished)")
        return 1

    def attempts(self) -> int:
        """Static rendezvous: every node knows its rank; all restart together."""
        cfg, rdzv, port = self.cfg, self.rdzv, self.port
        first = rdzv.current_round() if rdzv else 0
        if first:
            say(f"joining the job in progress at restart round {first}")
        for attempt in range(first, cfg.max_restarts + 1):
            if attempt and cfg.standalone:
                port = free_port()
            if rdzv:
                try:
                    rdzv.begin(attempt)
                except Exception as e:  # noqa: BLE001 - node 0 went away between rounds
                    say(f"node 0's rendezvous stopped answering ({type(e).__name__}) before restart round {attempt}: "
                        "node 0 is down, its launcher was killed, or the network to it is cut")
                    return 1
            outcome = self._round(attempt, attempt, NodeSlot.static(cfg, port),
                                  (lambda a=attempt: rdzv.watch(a)) if rdzv else None)
            if outcome is None:
                return self._succeeded(attempt)
            if attempt < cfg.max_restarts:
                say(f"restarting the worker group (restart {attempt + 1} of {cfg.max_restarts})"
                    + (", every node together" if rdzv else ""))
            elif rdzv:
                rdzv.finish(attempt, ok=False)
        return 1

    def elastic_rounds(self) -> int:
        """Dynamic rendezvous: each round's nodes agree on ranks; failures and arrivals form the next round."""
        cfg, rdzv = self.cfg, self.rdzv
        assert isinstance(rdzv, DynamicRendezvous)
        round_ = rdzv.current_round()
        while True:
            try:
                formed = rdzv.join(round_)
            except RendezvousClosed as e:
                say(str(e))
                return 0 if e.ok else 1
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - the store is gone with the node serving it
                say(rdzv.store_lost(e).describe())
                return 1
            round_, slot = formed.number, formed.slot
            say(f"rendezvous round {round_}: node {slot.node_rank} of {slot.nnodes} ("
                + ", ".join(f"{n['addr']} x{n['nproc']}" for n in formed.nodes)
                + f"), ranks {slot.rank_base}..{slot.rank_base + int(cfg.nproc_per_node) - 1} of {slot.world_size}"
                + (f", after {formed.restarts} restart(s)" if formed.restarts else ""))

            def watch(r: int = round_) -> RemoteFailure | str | None:
                try:
                    change = rdzv.membership_change(r)
                except Exception as e:  # noqa: BLE001 - the store is gone
                    return rdzv.store_lost(e)
                return change or rdzv.watch(r)

            outcome = self._round(round_, formed.restarts, slot, watch)
            if outcome is None:
                return self._succeeded(round_)
            if isinstance(outcome, str):
                say(f"membership change: {outcome}; stopped this node's workers to form rendezvous round "
                    f"{round_ + 1} (not counted as a restart)")
            elif isinstance(outcome, RemoteFailure) and outcome.node < 0:
                return 1  # the store is gone: no next round can form
            elif formed.restarts >= cfg.max_restarts:
                rdzv.finish(round_, ok=False)
                return 1
            else:
                say(f"restarting with the nodes still here (restart {formed.restarts + 1} of {cfg.max_restarts}), "
                    f"rendezvous round {round_ + 1}")
            round_ += 1


