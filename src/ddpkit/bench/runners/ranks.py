"""The benchmarks' ranks: forked from one server that imported torch once per ``ddpkit bench`` command.

Every measurement of the bench runs in processes of its own (``--memory``
and ``--zero`` one group per engine and repeat, ``--scaling`` and
``collectives`` one per world size). Started fresh, each rank would spend
seconds importing torch and the ``torch._dynamo`` the first optimizer pulls
in, 5 s of CPU a rank here, more than many a measurement takes. Instead
:func:`start_early` starts a forkserver first thing (torch-free, from the
CLI) that does those imports once, beside the command's own; every group of
ranks is then forked from it. A forked rank is as fresh as a spawned one for
what the bench measures: nothing has run in the server but imports (no
thread, no CUDA context, no process group), and the memory figures are taken
above each rank's own baseline after the same imports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ddpkit.bench import RANKS_IMPORT
from ddpkit.runtime.spawn import spawn, start_forkserver

__all__ = ["spawn_ranks", "start_early"]


def start_early() -> None:
    """Start the server the ranks will be forked from, its imports beside the caller's (later calls do nothing)."""
    start_forkserver(RANKS_IMPORT)


def spawn_ranks(fn: Callable[..., Any], nprocs: int, args: Sequence[Any], backend: str = "gloo") -> None:
    """:func:`ddpkit.spawn` of ``fn`` on ``nprocs`` ranks forked from the server (started now if not yet); on the
    ``mpi`` backend the ranks of one mpirun job instead (MPI's launcher must start them)."""
    if backend == "mpi":
        spawn(fn, nprocs, args=args, backend=backend)
        return
    start_early()
    spawn(fn, nprocs, args=args, backend=backend, start_method="forkserver")
