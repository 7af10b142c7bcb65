"""The distributed runtime: one process group per process, and helpers around it.

:func:`init` reads this process's place from the environment (see
:mod:`ddpkit.runtime.discovery` for the schemes: ddpkit/torchrun, OpenMPI, PMI, SLURM,
or nothing at all for a world of one), meets the other ranks at the
rendezvous store, checks that they agree on the world, and creates the
``torch.distributed`` process group.

Rendezvous checks (each fails with an error naming the value and the fix,
bounded by the rendezvous timeout, never a silent hang):

* ``MASTER_ADDR`` does not resolve, or nothing answers there in time;
* rank 0 cannot listen on ``MASTER_PORT`` (the port is busy);
* two processes claim the same rank;
* ranks disagree on ``WORLD_SIZE``, or fewer processes than ``WORLD_SIZE``
  join in time.

Timeouts: ``timeout`` (argument, else ``DDPKIT_TIMEOUT`` in seconds) bounds both
the rendezvous and every collective. When neither is given the rendezvous
waits :data:`DEFAULT_JOIN_TIMEOUT_S` and collectives :data:`DEFAULT_TIMEOUT_S`.

Network: with gloo, unless ``GLOO_SOCKET_IFNAME`` is set, the interface on
the route to ``MASTER_ADDR`` is used (see :mod:`ddpkit.runtime.network`), so
that peers on other nodes can reach the address gloo advertises.

Backend: ``nccl`` when CUDA is available, else ``gloo``; override with the
``backend`` argument or ``DDPKIT_BACKEND``. Device: ``cuda:LOCAL_RANK`` with
CUDA, else ``cpu``.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ddpkit.runtime import stall
from ddpkit.runtime.discovery import Placement, discover
from ddpkit.runtime.network import loopback_listener, route_interface

DEFAULT_TIMEOUT_S = 1800.0
"""Collective timeout when none is configured (torch's own default)."""
DEFAULT_JOIN_TIMEOUT_S = 300.0
"""How long ranks wait for each other at the rendezvous when no timeout is configured."""

_POLL_S = 0.01


class RendezvousError(RuntimeError):
    """The ranks could not meet: unreachable store, busy port, or a world that disagrees."""


@dataclass(frozen=True, kw_only=True)
class DistContext:
    """What :func:`init` found and created; the same object on every call."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    device: torch.device
    """``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``."""
    backend: str
    """The process group's backend: ``gloo``, ``nccl`` or ``mpi``."""
    scheme: str
    """How the placement was discovered: env, openmpi, pmi, slurm or single."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_ctx: DistContext | None = None


def _timeouts(timeout: float | None) -> tuple[float, float]:
    """Return (rendezvous, collective) timeouts in seconds."""
    if timeout is None and os.environ.get("DDPKIT_TIMEOUT"):
        raw = os.environ["DDPKIT_TIMEOUT"]
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"DDPKIT_TIMEOUT={raw!r} is not a number of seconds") from None
    if timeout is None:
        return DEFAULT_JOIN_TIMEOUT_S, DEFAULT_TIMEOUT_S
    if timeout <= 0:
        raise ValueError(f"timeout {timeout} must be a positive number of seconds")
    return timeout, timeout


def choose_backend(backend: str | None) -> str:
    """The backend :func:`init` would use: ``backend``, else ``DDPKIT_BACKEND``, else by hardware.

    Raises:
        ValueError: an unknown backend, or one this torch or machine cannot run.
    """
    backend = backend or os.environ.get("DDPKIT_BACKEND") or None
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl", "mpi"):
        raise ValueError(f"backend {backend!r} is not one of gloo, nccl, mpi")
    if backend == "mpi" and not dist.is_mpi_available():
        raise ValueError(
            "backend 'mpi' needs a torch built with MPI, and this one has none (the pip builds do not): "
            "use backend 'gloo', which also runs under mpirun"
        )
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, which is not available here: use backend='gloo'")
    return backend


def _choose_device(place: Placement) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if place.local_rank >= count:
        raise ValueError(
            f"local rank {place.local_rank} has no GPU: only {count} visible on this node; "
            f"start at most {count} processes per node (--nproc-per-node {count})"
        )
    device = torch.device("cuda", place.local_rank)
    torch.cuda.set_device(device)
    return device


def _open_store(place: Placement, join_timeout: float, deadline: float) -> dist.Store:
    try:
        socket.getaddrinfo(place.master_addr, place.master_port)
    except socket.gaierror as e:
        raise RendezvousError(
            f"MASTER_ADDR={place.master_addr!r} does not resolve ({e.strerror}): "
            "set it (--master-addr) to a host name or IP address of rank 0's node"
        ) from None
    # Under torchrun the launcher already serves the store on MASTER_PORT and
    # every worker connects to it as a client.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    is_server = place.rank == 0 and not agent_store
    if not is_server:
        _wait_reachable(place, join_timeout, deadline)
    try:
        listen = {"master_listen_fd": fd} if is_server and (fd := _loopback_listener(place)) is not None else {}
        return dist.TCPStore(
            place.master_addr, place.master_port, place.world_size, is_server,
            timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())), wait_for_workers=False, **listen,
        )
    except RendezvousError:
        raise
    except Exception as e:  # noqa: BLE001 - torch raises several types here
        where = f"{place.master_addr}:{place.master_port}"
        if is_server:
            raise RendezvousError(
                f"rank 0 could not listen on {where} ({e}): the port is probably busy; "
                "choose a free one with --master-port / MASTER_PORT"
            ) from None
        if "Ping failed" in str(e) or "invalid value" in str(e):
            raise RendezvousError(
                f"rank {place.rank} found something other than a rendezvous store listening at {where}: another "
                "program uses that port, or MASTER_ADDR points at the wrong host; use rank 0's host and a port "
                "no other program uses (--master-port / MASTER_PORT)"
            ) from None
        raise RendezvousError(
            f"rank {place.rank} could not reach the rendezvous at {where} within "
            f"{join_timeout:g} s ({e}): check that rank 0 is running, that MASTER_ADDR/"
            "MASTER_PORT are the same on every node, and that the port is open"
        ) from None


def _loopback_listener(place: Placement) -> int | None:
    try:
        return loopback_listener(place.master_addr, place.master_port)
    except OSError as e:
        raise RendezvousError(
            f"rank 0 could not listen on {place.master_addr}:{place.master_port} ({e.strerror}): the port is "
            "probably busy; choose a free one with --master-port / MASTER_PORT"
        ) from None


def job_keys(token: str | None) -> tuple[str, str]:
    """``(verifier, key prefix)`` of the job whose secret is ``token`` (``DDPKIT_JOB_TOKEN``).

    The verifier is published where any client can read it, so a process
    can learn that it holds the wrong secret; the job's keys (census, process
    group, stall inspector) live under the prefix, which cannot be derived
    from the verifier, so a process without the secret cannot even address them.
    """
    if not token:
        return "none", "ddpkit/"

    def digest(purpose: str) -> str:
        return hashlib.sha256(f"ddpkit {purpose} {token}".encode()).hexdigest()

    return digest("verifier"), f"ddpkit/{digest('prefix')[:32]}/"


def _admit(store: dist.Store, place: Placement, token: str | None) -> None:
    """Rank 0 publishes the job's verifier; every other rank must present the same secret."""
    verifier, _ = job_keys(token)
    if place.rank == 0:
        store.set("ddpkit/auth", verifier)
        return
    where = f"{place.master_addr}:{place.master_port}"
    try:
        theirs = store.get("ddpkit/auth").decode()
    except Exception as e:  # noqa: BLE001 - the store's timeout error type varies by torch version
        raise RendezvousError(
            f"rank {place.rank} reached the rendezvous at {where} but rank 0 never opened the job there "
            f"({type(e).__name__}): check that rank 0 is running and that DDPKIT_TIMEOUT gives it time to start"
        ) from None
    if theirs == verifier:
        return
    n = store.add(stall.REFUSED_KEY, 1)
    store.set(f"{stall.REFUSED_KEY}/{n}", f"a process on {socket.gethostname()} (pid {os.getpid()}) claiming rank "
                                    f"{place.rank} {'without the job' if not token else 'with another job'}'s secret")
    if not token:
        why = ("the job there has a secret and this process presents none: start ranks with ddpkit launch, or "
               "give every rank the job's DDPKIT_JOB_TOKEN (--rdzv-id)")
    elif theirs == "none":
        why = ("this process presents a secret (DDPKIT_JOB_TOKEN) but the job there has none: unset it, or start "
               "rank 0 with the same one")
    else:
        why = "its DDPKIT_JOB_TOKEN is not the job's secret: give every rank the same --rdzv-id / DDPKIT_JOB_TOKEN"
    raise RendezvousError(f"rank {place.rank} was refused by the rendezvous at {where}: {why}")


def _wait_reachable(place: Placement, join_timeout: float, deadline: float) -> None:
    """Wait until something listens at the rendezvous, within the one deadline of the whole rendezvous.

    Checked here, in Python, so that an unreachable store fails once, on time
    and with ddpkit's message alone (torch's client retries past its timeout
    and logs a C++ stack trace on every failed try).
    """
    where = (place.master_addr, place.master_port)
    last: OSError | None = None
    while (left := deadline - time.monotonic()) > 0:
        try:
            socket.create_connection(where, timeout=min(left, 2.0)).close()
            return
        except OSError as e:
            last = e
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    raise RendezvousError(
        f"rank {place.rank} could not reach the rendezvous at {where[0]}:{where[1]} within {join_timeout:g} s "
        f"({last.strerror or last if last else 'no time left'}): check that rank 0 is running, that MASTER_ADDR/"
        "MASTER_PORT are the same on every node, and that the port is open (DDPKIT_TIMEOUT sets the wait)"
    )


def _census(store: dist.Store, place: Placement, join_timeout: float, deadline: float) -> None:
    """Check that exactly ``world_size`` distinct ranks agreeing on it have joined."""

    def fail(message: str) -> None:
        store.set("error", message)
        raise RendezvousError(message)

    if store.add(f"claim/{place.rank}", 1) > 1:
        fail(f"rank {place.rank} is claimed by more than one process: each process needs its "
             "own RANK in 0..WORLD_SIZE-1 (are two jobs sharing MASTER_PORT?)")
    if place.rank == 0:
        store.set("world_size", str(place.world_size))
    else:
        theirs = int(store.get("world_size"))
        if theirs != place.world_size:
            fail(f"rank {place.rank} has WORLD_SIZE={place.world_size} but rank 0 has "
                 f"WORLD_SIZE={theirs}: every process must be started with the same world size")
    store.add("joined", 1)
    where = f"{place.master_addr}:{place.master_port}"
    advice = "check that WORLD_SIZE matches the number of processes started on all nodes"
    joined = 0
    try:
        while (joined := store.add("joined", 0)) < place.world_size:
            if store.check(["error"]):
                raise RendezvousError(store.get("error").decode())
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"only {joined} of WORLD_SIZE={place.world_size} processes joined the rendezvous "
                    f"at {where} within {join_timeout:g} s: {advice}"
                )
            time.sleep(_POLL_S)
    except RendezvousError:
        raise
    except Exception as e:  # noqa: BLE001 - the store's network errors vary by version
        raise RendezvousError(
            f"rank {place.rank} lost the rendezvous at {where} while {joined} of "
            f"WORLD_SIZE={place.world_size} processes had joined (rank 0 gave up or died: see its "
            f"error) ({type(e).__name__}): {advice}"
        ) from None


def init(backend: str | None = None, timeout: float | None = None) -> DistContext:
    """Join the job described by the environment and create the process group.

    Calling it again returns the same context (asking for another backend
    then is an error). With no launcher variables in
    the environment it creates a world of one process, in which every ddpkit
    feature (collectives included) still works.

    Args:
        backend: ``gloo``, ``nccl`` or ``mpi``. Default: ``DDPKIT_BACKEND``,
            else ``nccl`` with CUDA and ``gloo`` without.
        timeout: seconds for the rendezvous and each collective. Default:
            ``DDPKIT_TIMEOUT``, else 300 s to meet and 1800 s per collective.

    Returns:
        The :class:`DistContext` of this process.

    Raises:
        ValueError: inconsistent environment (``RANK`` without ``WORLD_SIZE``,
            a rank outside the world, an unknown backend), or a backend other
            than that of the process group that already exists.
        RendezvousError: the ranks could not meet or disagree on the world.

    Example::

        ctx = ddpkit.init()
        model = ddpkit.DDP(model.to(ctx.device))
    """
    global _ctx
    if dist.is_initialized():
        _check_same_backend(backend)
    if _ctx is not None and dist.is_initialized():
        return _ctx
    place = discover(os.environ)
    join_timeout, collective_timeout = _timeouts(timeout)
    if dist.is_initialized():
        # Someone (the user, a test harness) created the group already: adopt it.
        backend = str(dist.get_backend())
    else:
        backend = choose_backend(backend)
    device = _choose_device(place)
    if not dist.is_initialized():
        if place.world_size == 1:
            store: dist.Store = dist.HashStore()
        else:
            # One deadline for the whole rendezvous: reaching the store and the census.
            deadline = time.monotonic() + join_timeout
            store = _open_store(place, join_timeout, deadline)
            token = os.environ.get("DDPKIT_JOB_TOKEN") or None
            _admit(store, place, token)
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            # Keys live under a per-restart prefix: a store that outlives one
            # attempt (torchrun's agent store) must not see the last one's census.
            prefix = f"{job_keys(token)[1]}{restart}/"
            store = dist.PrefixStore(prefix, store)
            _census(store, place, join_timeout, deadline)
        if backend == "gloo" and place.world_size > 1 and not os.environ.get("GLOO_SOCKET_IFNAME"):
            # Advertise the address peers can reach: the one on the route to the store.
            if interface := route_interface(place.master_addr, place.master_port):
                os.environ["GLOO_SOCKET_IFNAME"] = interface
        dist.init_process_group(
            backend, store=store, rank=place.rank, world_size=place.world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        if place.world_size > 1:
            stall.start(place.master_addr, place.master_port, prefix, place.rank, place.world_size, collective_timeout)
    if place.world_size > 1:
        atexit.unregister(_at_exit)
        atexit.register(_at_exit)
    _ctx = DistContext(
        rank=place.rank, world_size=place.world_size, local_rank=place.local_rank,
        local_world_size=place.local_world_size, node_rank=place.node_rank,
        device=device, backend=backend, scheme=place.scheme,
    )
    return _ctx


def _check_same_backend(asked: str | None) -> None:
    """A process group exists: a different backend asked for now would be silently ignored."""
    asked = asked or os.environ.get("DDPKIT_BACKEND") or None
    have = str(dist.get_backend())
    if asked is not None and asked != have:
        raise ValueError(
            f"ddpkit.init(backend={asked!r}): the process group already exists with backend {have!r}; "
            "a process has one group: call ddpkit.shutdown() first to start over with another backend"
        )


def shutdown() -> None:
    """Destroy the process group. Harmless when :func:`init` was never called."""
    global _ctx
    stall.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
        _let_backend_threads_settle()
    _ctx = None


def _let_backend_threads_settle() -> None:
    """Give the backend's threads the GIL for a moment before the interpreter may finalize.

    A gloo worker thread destroys each finished work object after the caller
    has already returned from ``wait()``, and that needs the GIL (the work
    holds Python state). If the interpreter is finalizing by then, the
    thread is killed inside a destructor and the process aborts
    ("terminate called without an active exception") after a job that
    succeeded. Seen about once in six exits of a two-node job; sleeping
    releases the GIL so the thread finishes first.
    """
    time.sleep(0.05)


def _at_exit() -> None:
    """At interpreter exit, with the process group still up: the same settling as :func:`shutdown`."""
    if dist.is_initialized():
        stall.stop()
        _let_backend_threads_settle()


def context() -> DistContext | None:
    """The current context, or ``None`` before :func:`init`."""
    return _ctx if dist.is_initialized() else None


def _placement() -> DistContext | Placement:
    # Before init() the environment still answers "who am I", so scripts may
    # ask is_main() early (e.g. to set up logging) without a process group.
    return context() or discover(os.environ)


def rank() -> int:
    """Global rank of this process (0 without a launcher)."""
    return _placement().rank


def world_size() -> int:
    """Number of processes in the job (1 without a launcher)."""
    return _placement().world_size


def local_rank() -> int:
    """Rank of this process on its node (0 without a launcher)."""
    return _placement().local_rank


def is_main() -> bool:
    """True on global rank 0."""
    return rank() == 0


def barrier() -> None:
    """Block until every rank reaches this call. A no-op in a world of one.

    Raises:
        RuntimeError: called before :func:`init` in a multi-process job.
    """
    ctx = context()
    if ctx is None:
        if world_size() == 1:
            return
        raise RuntimeError("ddpkit.barrier() needs the process group: call ddpkit.init() first")
    if ctx.world_size == 1:
        return
    stall.enter("barrier")
    if ctx.backend == "nccl":
        dist.barrier(device_ids=[ctx.device.index])
    else:
        dist.barrier()


@contextlib.contextmanager
def zero_first(local: bool = True) -> Iterator[None]:
    """Run the block on rank 0 first, then on all other ranks.

    The usual use is a download or a cache build that rank 0 does while the
    others wait, after which they read the result. Every rank must enter the
    block (it holds one barrier per rank).

    Args:
        local: True (default): rank 0 of each node goes first, so each node
            fills its own cache. False: only global rank 0 goes first.

    Example::

        with ddpkit.zero_first():
            dataset = load_or_download(root)
    """
    first = (local_rank() if local else rank()) == 0
    if not first:
        barrier()
    try:
        yield
    finally:
        # The first ranks release the others even when the block raised, so an
        # error surfaces as that rank's traceback instead of a hang elsewhere.
        if first:
            barrier()


def print0(*args: object, **kwargs: object) -> None:
    """``print`` on global rank 0 only (flushed, so it shows through a pipe at once)."""
    if is_main():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)  # type: ignore[call-overload]
