"""The distributed runtime: one process group per process, and helpers around it.

:func:`init` reads this process's place from the environment (see
:mod:`ddpkit.runtime.discovery` for the schemes: ddpkit/torchrun, OpenMPI, PMI, SLURM,
or nothing at all for a world of one), meets the other ranks at the
rendezvous store, checks that they agree on the world, and creates the
``torch.distributed`` process group.

Rendezvous checks: see :mod:`ddpkit.runtime.rendezvous` (each fails with an
error naming the value and the fix, within the rendezvous timeout).

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
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ddpkit.runtime import backends, events, membership, stall, variables
from ddpkit.runtime.discovery import JOB_TOKEN_ENV, Placement, discover
from ddpkit.runtime.network import route_interface
from ddpkit.runtime.rendezvous import RendezvousError, admit, census, job_keys, open_store, wait_for_listener
from ddpkit.runtime.sealed_store import ForgedValue, seal

__all__ = ["DistContext", "RendezvousError", "barrier", "choose_backend", "context", "init", "is_main",
           "local_rank", "print0", "rank", "shutdown", "world_size", "zero_first"]

DEFAULT_TIMEOUT_S = 1800.0
"""Collective timeout when none is configured (torch's own default)."""
DEFAULT_JOIN_TIMEOUT_S = 300.0
"""How long ranks wait for each other at the rendezvous when no timeout is configured."""
SURVIVING_TIMEOUT_S = 300.0
"""Collective timeout of the groups of ``--on-failure continue`` when none is configured: a death ends their waits
at once (the launcher's word), so this bounds only how long an abandoned operation holds its buffers (and a
healthy step's longest wait for a slow peer, a first compilation included: raise it with ``DDPKIT_TIMEOUT``)."""

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
_store: dist.Store | None = None
"""The default group's store while the group lives: a sealed one (runtime/sealed_store.py) is Python's to keep."""


def timeouts(timeout: float | timedelta | None = None) -> tuple[float, float]:
    """``(rendezvous, collective)`` timeouts in seconds: ``timeout`` (seconds, or a ``timedelta`` as torch's
    ``init_process_group`` takes), else ``DDPKIT_TIMEOUT``, else the defaults.

    Raises:
        ValueError: ``DDPKIT_TIMEOUT`` is not a number, or a timeout is not positive.
    """
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if timeout is None:
        timeout = variables.timeout_seconds(os.environ)
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
    backend = backend or variables.backend(os.environ)
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    given, backend = backend, str(backend).strip().lower()  # torch's spelling rule: "GLOO" is gloo
    if ":" in backend:
        raise ValueError(f"backend {given!r}: a backend per device type (torch's form) is not supported; ddpkit runs "
                         "one backend per job: backend='nccl' on GPUs, 'gloo' on CPUs")
    if backend not in ("gloo", "nccl", "mpi"):
        raise ValueError(f"backend {given!r} is not one of gloo, nccl, mpi")
    if backend == "mpi" and (why := backends.find("mpi").unavailable()):
        raise ValueError(why)
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, which is not available here: use backend='gloo'")
    return backend


def _choose_device(place: Placement, backend: str) -> torch.device:
    """``cuda:LOCAL_RANK`` with CUDA, else the CPU. Under gloo, ranks beyond the GPU count share the GPUs
    (``cuda:LOCAL_RANK % count``); NCCL refuses two ranks on one GPU, so it is refused here with the fix."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if place.local_rank >= count and backend == "nccl":
        raise ValueError(
            f"NCCL needs one GPU per rank, and local rank {place.local_rank} has none: {count} visible on this "
            f"node; start at most {count} processes per node (--nproc-per-node {count}), or use the gloo backend "
            "(DDPKIT_BACKEND=gloo), whose ranks may share a GPU"
        )
    device = torch.device("cuda", place.local_rank % count)
    torch.cuda.set_device(device)
    return device


def init(backend: str | None = None, timeout: float | timedelta | None = None) -> DistContext:
    """Join the job described by the environment and create the process group.

    Calling it again returns the same context (asking for another backend
    then is an error). With no launcher variables in
    the environment it creates a world of one process, in which every ddpkit
    feature (collectives included) still works.

    Args:
        backend: ``gloo``, ``nccl`` or ``mpi``. Default: ``DDPKIT_BACKEND``,
            else ``nccl`` with CUDA and ``gloo`` without.
        timeout: seconds (or a ``timedelta``) for the rendezvous and each collective. Default:
            ``DDPKIT_TIMEOUT``, else 300 s to meet and 1800 s per collective (300 s under
            ``--on-failure continue``, whose abandoned operations hold their buffers that long).

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
    global _ctx, _store
    if dist.is_initialized():
        _check_same_backend(backend)
    if _ctx is not None and (dist.is_initialized() or membership.current() is not None):
        return _ctx
    join_timeout, collective_timeout = timeouts(timeout)
    if dist.is_initialized():
        # Someone (the user, a test harness) created the group already: adopt it.
        backend = _ddpkit_name(str(dist.get_backend()))
    elif os.environ.get(membership.FD_ENV) and backend is None and variables.backend(os.environ) is None:
        # --on-failure continue rebuilds gloo groups: its default, on a GPU machine too (CUDA tensors go through it).
        backend = "gloo"
        if torch.cuda.is_available() and os.environ.get("RANK", "0") == "0":
            print("ddpkit: --on-failure continue: the collectives go over gloo (the mode rebuilds gloo groups after "
                  "a death; NCCL's abort path is not built), CUDA tensors included", file=sys.stderr, flush=True)
    else:
        backend = choose_backend(backend)
    # A backend of ddpkit's own (mpi) meets over its own library: it needs no rendezvous address.
    plugin = backends.find(backend) if backend in backends.names() else None
    place = discover(os.environ, master_needed=plugin is None and not dist.is_initialized())
    if dist.is_initialized():
        place = _adopted(place)
    if plugin is not None and not dist.is_initialized():
        place = _init_plugin(plugin, place, join_timeout, collective_timeout)
    device = _choose_device(place, backend)
    if not dist.is_initialized() and os.environ.get(membership.FD_ENV):
        configured = timeout is not None or variables.timeout_seconds(os.environ) is not None
        _init_surviving(place, backend, join_timeout, collective_timeout if configured else SURVIVING_TIMEOUT_S)
    elif not dist.is_initialized():
        if place.world_size == 1:
            store: dist.Store = dist.HashStore()
        else:
            # One deadline for the whole rendezvous: reaching the store and the census.
            deadline = time.monotonic() + join_timeout
            store = open_store(place, join_timeout, deadline)
            token = os.environ.get(JOB_TOKEN_ENV) or None
            admit(store, place, token)
            # Keys live under a per-attempt prefix: a store that outlives one
            # attempt (torchrun's agent store) must not see the last one's census.
            # Under an elastic launcher a membership change starts a new round
            # without counting a restart, so the round names the attempt there.
            attempt = str(variables.count(os.environ, "TORCHELASTIC_RESTART_COUNT"))
            if os.environ.get("DDPKIT_RDZV_ROUND"):
                attempt = f"round{variables.count(os.environ, 'DDPKIT_RDZV_ROUND')}"
            prefix = f"{job_keys(token)[1]}{attempt}/"
            store = seal(dist.PrefixStore(prefix, store), token, prefix)  # (the prefix alone hides nothing)
            census(store, place, join_timeout, deadline)
        if backend == "gloo" and place.world_size > 1 and not os.environ.get("GLOO_SOCKET_IFNAME"):
            # Advertise the address peers can reach: the one on the route to the store.
            if interface := route_interface(place.master_addr, place.master_port):
                os.environ["GLOO_SOCKET_IFNAME"] = interface
        if place.world_size > 1:
            # Its own connection to the store, made before the process group: rank 0 serves the store and cannot
            # finish init_process_group (and exit, in a short job) before every rank has reached it.
            stall.start(place.master_addr, place.master_port, prefix, place.rank, place.world_size, collective_timeout)
        _store = store
        try:
            dist.init_process_group(
                backend, store=store, rank=place.rank, world_size=place.world_size,
                timeout=timedelta(seconds=collective_timeout),
            )
        except ForgedValue as e:  # (gloo's rendezvous read an address that the job's secret did not seal)
            raise RendezvousError(f"rank {place.rank}: {e}") from None
    if place.world_size > 1:
        finish_backend_at_exit()
    _ctx = DistContext(
        rank=place.rank, world_size=place.world_size, local_rank=place.local_rank,
        local_world_size=place.local_world_size, node_rank=place.node_rank,
        device=device, backend=backend, scheme=place.scheme,
    )
    return _ctx


def _init_surviving(place: Placement, backend: str, join_timeout: float, collective_timeout: float) -> None:
    """Under ``ddpkit launch --on-failure continue``: the job's membership, and no default group.

    A world that loses members cannot be torch's default group (a death during its rendezvous would hang every
    survivor there, and it could never shrink). The job's collectives run on the groups of
    :mod:`ddpkit.runtime.membership`, rebuilt at each change (:class:`ddpkit.FaultTolerance` holds them); code
    that needs the default group (torch's DDP, ``dist.all_reduce``) fails at once, saying it is not initialised,
    instead of training alone.
    """
    if backend != "gloo":
        raise ValueError(f"backend {backend!r} under --on-failure continue: the survivors rebuild gloo groups "
                         "(NCCL's abort path is not built yet); use backend='gloo'")
    deadline = time.monotonic() + join_timeout
    store = open_store(place, join_timeout, deadline) if place.world_size > 1 else dist.HashStore()
    token = os.environ.get(JOB_TOKEN_ENV) or None
    prefix = f"{job_keys(token)[1]}ft/"

    def reach(where: str) -> dist.Store:  # across nodes, the store moves when its node is lost
        host, port = where.rsplit(":", 1) if where else (place.master_addr, str(place.master_port))
        if unreachable := wait_for_listener(host, int(port), time.monotonic() + join_timeout):
            raise unreachable  # (torch's client would log a C++ stack trace at every try)
        return seal(dist.PrefixStore(prefix, dist.TCPStore(host, int(port), None, False, timeout=timedelta(
            seconds=join_timeout), wait_for_workers=False)), token, prefix)

    membership.current(seal(dist.PrefixStore(prefix, store), token, prefix), collective_timeout,
                       reach if place.world_size > 1 else None)
    if place.world_size > 1 and not os.environ.get("GLOO_SOCKET_IFNAME"):
        if interface := route_interface(place.master_addr, place.master_port):
            os.environ["GLOO_SOCKET_IFNAME"] = interface


def _init_plugin(plugin: backends.Plugin, place: Placement, join_timeout: float,
                 collective_timeout: float) -> Placement:
    """Meet through the plugin's own rendezvous, create its process group, and return the place it gave."""
    joined = plugin.join(place, join_timeout)
    place = joined.place
    prefix = f"ddpkit/{plugin.name}/"
    if place.world_size > 1:
        stall.start(joined.store_addr, joined.store_port, prefix, place.rank, place.world_size, collective_timeout)
    dist.init_process_group(
        plugin.torch_name, store=dist.PrefixStore(prefix, joined.store), rank=place.rank,
        world_size=place.world_size, timeout=timedelta(seconds=collective_timeout),
    )
    return place


def _ddpkit_name(torch_name: str) -> str:
    """ddpkit's name of a backend torch knows by ``torch_name`` (``mpi4py`` is ddpkit's ``mpi``)."""
    if torch_name in ("gloo", "nccl"):
        return torch_name
    return backends.torch_names().get(torch_name, torch_name)


def _check_same_backend(asked: str | None) -> None:
    """A process group exists: a different backend asked for now would be silently ignored."""
    asked = asked or os.environ.get("DDPKIT_BACKEND") or None
    have = _ddpkit_name(str(dist.get_backend()))
    if asked is not None and str(asked).strip().lower() != have:  # (torch's spelling rule: "GLOO" is gloo)
        raise ValueError(
            f"ddpkit.init(backend={asked!r}): the process group already exists with backend {have!r}; "
            "a process has one group: call ddpkit.shutdown() first to start over with another backend"
        )


def shutdown() -> None:
    """Destroy the process group. Harmless when :func:`init` was never called."""
    global _ctx, _store
    stall.stop("left the job (ddpkit.shutdown())")
    if dist.is_initialized():
        dist.destroy_process_group()
        _let_backend_threads_finish()
    _ctx = _store = None


def _let_backend_threads_finish() -> None:
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


def finish_backend_at_exit() -> None:
    """Let the backend's threads finish at interpreter exit (see :func:`_let_backend_threads_finish`); once per process.

    :func:`init` calls it, and so does every engine that issues its own
    collectives (DDP's reducer): a process group made by someone else
    (Accelerate, a plain ``init_process_group``) and torn down with
    ``destroy_process_group()`` right before exit needs it as much.
    """
    global _finishing
    if not _finishing:
        _finishing = True
        atexit.register(_at_exit)


_finishing = False


def _at_exit() -> None:
    """At interpreter exit: stop the stall inspector, then the same wait as :func:`shutdown`."""
    stall.stop_at_exit()
    _let_backend_threads_finish()


def context() -> DistContext | None:
    """The current context, or ``None`` before :func:`init`."""
    return _ctx if dist.is_initialized() else None


def _placement() -> DistContext | Placement:
    # Before init() the environment still answers "who am I", so scripts may
    # ask is_main() early (e.g. to set up logging) without a process group;
    # a group the user made (init_process_group) answers first.
    ctx = context()
    if ctx is not None:
        return ctx
    place = discover(os.environ, master_needed=False)
    return _adopted(place) if dist.is_available() and dist.is_initialized() else place


def _adopted(place: Placement) -> Placement:
    """``place`` with the rank and world size of the default group someone else made: what the group says goes
    (``init_process_group(init_method="tcp://...", rank=r, world_size=n)`` in ``torch.multiprocessing.spawn``'s
    children sets no variable). Without ``LOCAL_RANK`` the job is taken for one node."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if (place.rank, place.world_size) == (rank, world):
        return place
    local = "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ
    return dataclasses.replace(place, rank=rank, world_size=world,
                               local_rank=place.local_rank if local else rank,
                               local_world_size=place.local_world_size if local else world,
                               node_rank=place.node_rank if local else 0)


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
    if membership.current() is not None:
        raise RuntimeError("ddpkit.barrier() under --on-failure continue: the job's world changes with its "
                           "membership; use ft.barrier() of your ddpkit.FaultTolerance")
    events.collective("barrier")
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
