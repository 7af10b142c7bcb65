"""The ``mpi`` backend: torch.distributed process groups on MPI, through mpi4py, on torch's stock wheels.

torch's own MPI backend exists only in a torch built from source ("Distributed
package doesn't have MPI built in"). This one is registered with torch's
documented extension point for third-party backends
(``torch.distributed.Backend.register_backend``) under the name ``mpi4py``
(torch reserves ``mpi`` for its built-in one), so ``ddpkit.init(backend="mpi")``
gives a real ``ProcessGroup`` that ``dist.all_reduce(..., group=...)``, every
torch collective and every ddpkit engine use unchanged.

- :mod:`~ddpkit.comm.mpi.library`: loading mpi4py and MPI, what the library is;
- :mod:`~ddpkit.comm.mpi.datatypes`: torch dtypes and reduce ops in MPI's terms;
- :mod:`~ddpkit.comm.mpi.progress`: the progress threads and the work handles;
- :mod:`~ddpkit.comm.mpi.process_group`: the process group;
- :mod:`~ddpkit.comm.mpi.world`: the rendezvous over ``MPI_COMM_WORLD``.

The runtime finds this package through the entry point ``mpi`` of the group
``ddpkit.backends`` (see :mod:`ddpkit.runtime.backends`), as :data:`BACKEND`.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

__all__ = ["BACKEND", "TORCH_NAME", "MPIBackend"]

TORCH_NAME = "mpi4py"
"""The name torch knows these process groups by (``dist.get_backend()``)."""


class MPIBackend:
    """The plugin :mod:`ddpkit.runtime.backends` loads: availability, the rendezvous, torch's registration."""

    name = "mpi"
    torch_name = TORCH_NAME

    def __init__(self) -> None:
        self._registered = False
        self._lock = threading.Lock()
        self._groups = 0

    def unavailable(self) -> str | None:
        """Why the backend cannot run here, or ``None``; does not start MPI (the launcher asks it too)."""
        try:
            found = importlib.util.find_spec("mpi4py") is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return ("backend 'mpi' needs mpi4py, which is not installed: pip install 'ddpkit[mpi]' (and an MPI "
                    "library: apt-get install openmpi-bin, or mpich)")
        return None

    def join(self, place: Any, timeout_s: float) -> Any:
        """Meet the other ranks over ``MPI_COMM_WORLD`` (:func:`ddpkit.comm.mpi.world.join`) and register with torch."""
        from ddpkit.comm.mpi.world import join

        joined = join(place, timeout_s)
        self.register()
        return joined

    def register(self) -> None:
        """Register the backend with torch.distributed (once per process)."""
        import torch.distributed as dist

        with self._lock:
            if self._registered:
                return
            dist.Backend.register_backend(TORCH_NAME, self._create, extended_api=True, devices=["cpu", "cuda"])
            self._registered = True

    def _create(self, options: Any, _backend_options: Any) -> Any:
        """torch's call for each new group: its communicator (the world's duplicated, or a subgroup's)."""
        from ddpkit.comm.mpi.process_group import MPIProcessGroup, group_tag
        from ddpkit.comm.mpi.library import load, require_threads

        MPI = load()
        world = MPI.COMM_WORLD
        ranks = list(options.global_ranks_in_group) or list(range(world.Get_size()))
        if options.group_size != len(ranks) or not 0 <= options.group_rank < len(ranks):
            raise ValueError(f"backend 'mpi': torch asks for rank {options.group_rank} of a group of "
                             f"{options.group_size}, and the group's ranks are {ranks}")
        if ranks == list(range(world.Get_size())):
            if options.group_size != world.Get_size():
                raise ValueError(f"backend 'mpi': the world size given to init_process_group "
                                 f"({options.group_size}) is not MPI's ({world.Get_size()}): let MPI decide "
                                 "(ddpkit.init(backend='mpi'))")
            if options.group_rank != world.Get_rank():
                raise ValueError(f"backend 'mpi': the rank given to init_process_group ({options.group_rank}) is "
                                 f"not MPI's ({world.Get_rank()}): let MPI decide (ddpkit.init(backend='mpi'))")
        with self._lock:
            self._groups += 1
            require_threads(self._groups)
        if ranks == list(range(world.Get_size())):
            comm = world.Dup()
        else:
            comm = world.Create_group(world.Get_group().Incl(ranks), group_tag(str(options.group_id)))
        return MPIProcessGroup(comm, options.timeout, on_shutdown=self._forget)

    def _forget(self) -> None:
        with self._lock:
            self._groups = max(0, self._groups - 1)


BACKEND = MPIBackend()
"""The ``mpi`` backend, as the entry point names it."""
