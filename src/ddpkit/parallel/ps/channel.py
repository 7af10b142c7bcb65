"""The parameter servers' channel: one Gloo process group of workers and servers, beside the workers' own group.

Why point-to-point on a process group (and not ``torch.distributed.rpc``):
the workers keep their usual group (``RANK``/``WORLD_SIZE`` are the
workers', so samplers, evaluation, checkpoints and any torchrun script see
the world they expect), and the servers join a second Gloo group built on
its own store: worker ranks ``0 .. N-1``, server ``k`` rank ``N + k``. Gloo
sends CPU tensors straight from their memory, needs nothing beyond what
``torch.distributed`` always has (RPC's TensorPipe agent is an optional,
maintenance-mode part of torch), and a dead peer is a failed process the
supervisor sees, not a timeout inside an RPC future. Servers hold the
parameters on CPU, so the channel is Gloo under an NCCL job too.

Environment (set by ``ddpkit train`` and ``ddpkit launch --num-servers K``):

``DDPKIT_NUM_SERVERS``   K, in every process of the job
``DDPKIT_ROLE``          ``server`` in a server process (workers: unset or ``worker``)
``DDPKIT_SERVER_RANK``   the server's index ``0 .. K-1``
``DDPKIT_PS_REPLICATION`` R, the servers each key range lives on (default 1; see
                         :mod:`ddpkit.parallel.ps.keyrange`)
``DDPKIT_PS_PORT``       the port of the channel's store on ``MASTER_ADDR`` (default ``MASTER_PORT + 1``);
                         worker rank 0 serves it, on loopback alone when ``MASTER_ADDR`` is a loopback
                         address, and its keys live under the prefix of the job's secret
                         (``DDPKIT_JOB_TOKEN``), as the rendezvous's do
``WORLD_SIZE``           the number of workers, in servers as in workers

Wire format: every request is a header (:data:`HEADER` int64 values; the
last one names the key range) and, when the header says so, its payload;
every reply likewise. Servers hand updates down a key range's chain on a
tag of that range (:func:`forward_tag`), one message at a time, each
acknowledged (:func:`ack_tag`). Objects
(optimizer settings and state) travel as ``torch.save`` bytes and are read
back with ``weights_only=True``: nothing is unpickled.
"""

from __future__ import annotations

import io
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.runtime.discovery import JOB_TOKEN_ENV
from ddpkit.runtime.network import loopback_listener
from ddpkit.runtime.process import NUM_SERVERS_ENV, PS_REPLICATION_ENV, ROLE_ENV, SERVER_RANK_ENV, key_range_chain
from ddpkit.runtime.process import PS_PORT_ENV as PORT_ENV
from ddpkit.runtime.rendezvous import job_keys, wait_for_listener
from ddpkit.runtime.sealed_store import seal

__all__ = [
    "HEADER", "TAG_HEADER", "TAG_TO_SERVER", "TAG_TO_WORKER", "Op", "PSPlace", "ack_tag", "connect", "forward_tag",
    "from_bytes", "header", "lost_peer", "ps_place", "request", "to_bytes", "wait_for", "workers_lost",
]

HEADER = 8
"""int64 values in every header: ``[op, a, b, c, d, e, f, k]`` (the op's fields; a request's key range ``k``)."""


TAG_HEADER, TAG_TO_SERVER, TAG_TO_WORKER = 11, 12, 13
_TAG_CHAINS = 100


def forward_tag(k: int) -> int:
    """The tag of key range ``k``'s updates handed down its chain."""
    return _TAG_CHAINS + 2 * k


def ack_tag(k: int) -> int:
    """The tag of their acknowledgements."""
    return _TAG_CHAINS + 2 * k + 1


_POLL_S = 0.002


def wait_for(work: Any, gone: Callable[[], bool] | None = None, peer: str = "the peer") -> None:
    """Wait for ``work`` (a send or receive). With ``gone``, stop waiting once it says the peer died (raised as a
    lost peer, see :func:`lost_peer`): Gloo does not always fail a send or receive whose peer died in the middle
    of a message (measured: a worker waited for a dead server's parameters, a server for its send to a dead
    successor, until the test's timeout), so the launcher's word decides."""
    if gone is None:
        work.wait()
        return
    done, failure = threading.Event(), []

    def run() -> None:
        try:
            work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            failure.append(e)
        done.set()

    threading.Thread(target=run, name="ps-wait", daemon=True).start()
    while not done.wait(_POLL_S):
        if gone():
            raise RuntimeError(f"{peer}: connection closed (its launcher saw it die)")
    if failure:
        raise failure[0]


def lost_peer(error: BaseException) -> bool:
    """Whether a send or receive failed because the process at the other end is gone (Gloo: its connection
    closed or was reset)."""
    text = str(error).lower()
    return any(word in text for word in ("connection closed", "reset by peer", "broken pipe"))


class Op:
    """Request kinds (the first value of a header)."""

    SETUP = 1     # worker 0: [op, bytes]; blob: the optimizer, its groups and one key range's parameters
    PUSH = 2      # [op, clock, version computed on, with mask]; mask (uint8) + gradients; reply: parameters
    PULL = 3      # reply: header + parameters
    STATE = 4     # reply: header + blob of this server's optimizer state
    LOAD = 5      # [op, bytes]; every worker, worker 0 with the blob: replaces the optimizer state
    SETTINGS = 6  # [op, bytes]; blob: the groups' hyperparameters (a scheduler changed them)
    STOP = 7      # this worker is done
    FORWARD = 8   # server to server: [op, kind, worker, clock, bytes]; an update handed down a chain

@dataclass(frozen=True)
class PSPlace:
    """This process's place in the channel."""

    role: str
    """``worker`` or ``server``."""
    index: int
    """The worker's rank, or the server's index."""
    workers: int
    servers: int
    master_addr: str
    port: int
    replication: int = 1
    """On how many servers each key range lives."""

    @property
    def rank(self) -> int:
        """Rank in the channel's group: workers first, then servers."""
        return self.index if self.role == "worker" else self.workers + self.index

    def server_rank(self, k: int) -> int:
        return self.workers + k

    def chain(self, k: int) -> list[int]:
        """The servers holding key range ``k``, head first: ``k, k+1, ..., k+R-1`` (mod K)."""
        return key_range_chain(k, self.servers, self.replication)

    def ranges_of(self, server: int) -> list[int]:
        """The key ranges server ``server`` holds: its own, then the ones it keeps a copy of."""
        return [(server - i) % self.servers for i in range(self.replication)]


def ps_place(environ: Mapping[str, str] = os.environ) -> PSPlace | None:
    """This process's place from the environment, or None when the job has no servers.

    Raises:
        ValueError: a malformed variable, naming it and the fix.
    """
    raw = environ.get(NUM_SERVERS_ENV, "")
    if not raw or raw == "0":
        if environ.get(ROLE_ENV, "worker") == "server":
            raise ValueError(f"{ROLE_ENV}=server without {NUM_SERVERS_ENV}: start servers with ddpkit launch "
                             "--num-servers K or ddpkit train --num-servers K")
        return None

    def whole(name: str, value: str, low: int) -> int:
        try:
            n = int(value)
        except ValueError:
            n = low - 1
        if n < low:
            raise ValueError(f"{name}={value!r} must be a whole number >= {low}")
        return n

    servers = whole(NUM_SERVERS_ENV, raw, 1)
    workers = whole("WORLD_SIZE", environ.get("WORLD_SIZE", "1"), 1)
    role = environ.get(ROLE_ENV, "worker") or "worker"
    if role not in ("worker", "server"):
        raise ValueError(f"{ROLE_ENV}={role!r} is not a role: worker or server")
    if role == "server":
        index = whole(SERVER_RANK_ENV, environ.get(SERVER_RANK_ENV, ""), 0)
        if index >= servers:
            raise ValueError(f"{SERVER_RANK_ENV}={index} is not below {NUM_SERVERS_ENV}={servers}")
    else:
        index = whole("RANK", environ.get("RANK", "0"), 0)
    replication = whole(PS_REPLICATION_ENV, environ.get(PS_REPLICATION_ENV) or "1", 1)
    if replication > servers:
        raise ValueError(f"{PS_REPLICATION_ENV}={replication} is more than the {servers} server(s): a key range "
                         f"cannot live on more servers than there are; give at most {servers}")
    master_port = whole("MASTER_PORT", environ.get("MASTER_PORT", "29500"), 1)
    port = whole(PORT_ENV, environ.get(PORT_ENV) or str(master_port + 1), 1)
    return PSPlace(role=role, index=index, workers=workers, servers=servers,
                   master_addr=environ.get("MASTER_ADDR", "127.0.0.1"), port=port, replication=replication)


def connect(place: PSPlace, timeout: float = 300.0, gone: Callable[[], str | None] | None = None,
            ) -> dist.ProcessGroup:
    """The channel's Gloo group (see the module notes); worker 0 serves its store.

    ``gone`` (under ``ddpkit launch --on-failure continue``) says why the channel can no longer be built (a
    worker or a server died before it was), and the wait stops then instead of at the timeout.

    Raises:
        RuntimeError: the channel's members did not meet within ``timeout`` s (naming the address), or ``gone``
            said why they never will.
    """
    built: dict[str, Any] = {}

    # The job's keys: under the prefix its secret makes (as the rendezvous's), each value sealed with the secret
    # (runtime/sealed_store.py: a process without it cannot put its address among the members'), and on loopback
    # alone where the job's address is loopback.
    token = os.environ.get(JOB_TOKEN_ENV) or None
    prefix = f"{job_keys(token)[1]}ps/"
    serving = place.role == "worker" and place.index == 0

    def build() -> None:
        built["stage"] = "store"
        try:
            fd = loopback_listener(place.master_addr, place.port) if serving else None
            if not serving and (unreachable := wait_for_listener(place.master_addr, place.port,
                                                                 time.monotonic() + timeout)):
                raise unreachable  # (torch's client would log a C++ stack trace at every try)
            store = dist.TCPStore(place.master_addr, place.port, place.workers + place.servers + 1, serving,
                                  timeout=timedelta(seconds=timeout), wait_for_workers=False,
                                  **({"master_listen_fd": fd} if fd is not None else {}))
            sealed = seal(dist.PrefixStore(prefix, store), token, prefix)
            built["stage"] = "group"
            built["group"] = dist.ProcessGroupGloo(sealed, place.rank, place.workers + place.servers,
                                                   timedelta(seconds=timeout))
            _STORES[built["group"]] = sealed
        except Exception as e:  # noqa: BLE001 - torch raises several types here
            built["error"] = e

    if gone is None:
        build()
    else:
        thread = threading.Thread(target=build, name="ps-connect", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(timeout=0.01)
            if thread.is_alive() and (why := gone()):
                raise RuntimeError(f"{place.role} {place.index} could not join the parameter servers' channel: "
                                   f"{why}")
    if "error" in built and built["stage"] == "group":  # the store answered: a member did not come
        raise RuntimeError(
            f"{place.role} {place.index} reached the parameter servers' channel at {place.master_addr}:{place.port}, "
            f"but its {place.workers} worker(s) and {place.servers} server(s) did not all meet there within "
            f"{timeout:g} s ({built['error']}): one of them died, was stopped or never started (the lines of the "
            "others say which)"
        ) from None
    if "error" in built:
        raise RuntimeError(
            f"{place.role} {place.index} could not join the parameter servers' channel at "
            f"{place.master_addr}:{place.port} ({built['error']}): worker rank 0 serves it there ({PORT_ENV}, default "
            "MASTER_PORT + 1); check that the port is free and the same for every process"
        ) from None
    return built["group"]


_STORES: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.Store] = weakref.WeakKeyDictionary()
"""Each channel's store while its group lives (a sealed store is Python's to keep: runtime/sealed_store.py)."""


def workers_lost(left: list[int], servers: Sequence[int] = ()) -> str | None:
    """Why the channel cannot be built once the workers ``left`` or the parameter servers ``servers`` died (None
    when none did): it is one group of every worker and server, made once, so no replica of a server's key
    ranges stands in for it there."""
    lost = ([f"worker(s) {', '.join(map(str, left))}"] if left else []) + (
        [f"parameter server(s) {', '.join(map(str, servers))}"] if servers else [])
    if not lost:
        return None
    return (f"{' and '.join(lost)} died before it was built (the channel is one group of every worker and server, "
            "made once), so this job cannot go on; see the first failure above")


def header(op: int, *fields: int) -> torch.Tensor:
    out = torch.zeros(HEADER, dtype=torch.int64)
    out[0] = op
    for i, v in enumerate(fields):
        out[1 + i] = int(v)
    return out


def request(op: int, k: int, *fields: int) -> torch.Tensor:
    """A worker's request about key range ``k``."""
    out = header(op, *fields)
    out[HEADER - 1] = k
    return out


def to_bytes(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def from_bytes(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
