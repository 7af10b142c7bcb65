"""The MPI library under mpi4py: loading it once, at the thread level the progress threads need, and saying what it is.

mpi4py is an optional dependency (``pip install ddpkit[mpi]``); it is imported
on first use, never at ``import ddpkit``. It initialises MPI asking for
``MPI_THREAD_MULTIPLE``: every process group has a progress thread of its
own that makes MPI calls while the main thread runs the model, and two
groups' threads may call MPI at once. A library that grants less can still
run one group (``MPI_THREAD_SERIALIZED`` suffices for a single caller
thread); :func:`require_threads` refuses a second group there with the fix.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ddpkit.runtime import variables

__all__ = ["Library", "MPIUnavailable", "describe", "load", "require_threads"]


class MPIUnavailable(RuntimeError):
    """The MPI backend cannot run here; the message names the reason and the fix."""


_MPI: ModuleType | None = None
_lock = threading.Lock()

THREAD_LEVELS = {0: "single", 1: "funneled", 2: "serialized", 3: "multiple"}
"""MPI's thread levels by their values in mpi4py (MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE)."""


def load() -> Any:
    """The ``mpi4py.MPI`` module, MPI initialised (once per process) with threads.

    Raises:
        MPIUnavailable: mpi4py is not installed, or its MPI library cannot be loaded.
    """
    global _MPI
    with _lock:
        if _MPI is not None:
            return _MPI
        try:
            import mpi4py
        except ImportError as e:
            raise MPIUnavailable(
                "backend 'mpi' needs mpi4py, which is not installed: pip install 'ddpkit[mpi]' (and an MPI library: "
                "apt-get install openmpi-bin, or mpich)"
            ) from e
        mpi4py.rc.thread_level = "multiple"
        # Finalising MPI at interpreter exit is mpi4py's job (its atexit hook); ddpkit's progress threads have
        # stopped by then (shutdown() or their own atexit, registered later and so run earlier).
        try:
            from mpi4py import MPI
        except (ImportError, RuntimeError, OSError) as e:
            raise MPIUnavailable(
                f"mpi4py is installed but cannot load an MPI library ({e}): install one (apt-get install "
                "openmpi-bin, or mpich), or point mpi4py at yours with MPI4PY_LIBMPI=/path/to/libmpi.so"
            ) from e
        _MPI = MPI
        _leave_on_failure()
        return MPI


_failed = False


def _leave_on_failure() -> None:
    """A process that ends on an uncaught exception leaves without ``MPI_Finalize``.

    mpi4py finalises MPI at interpreter exit, and Open MPI's finalise waits
    for every other rank: those are blocked in the collective this rank will
    never join, so the failed rank would hang instead of exiting, and its
    launcher would never learn of the failure. Exiting at once with status 1
    (after the traceback is printed, output flushed) lets ``mpirun`` end the
    job, as it does for any rank that exits non-zero. Registered after
    mpi4py's own exit hook, so it runs first.
    """
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        global _failed
        _failed = True
        previous(kind, value, tb)

    sys.excepthook = hook

    def leave() -> None:
        if _failed:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    atexit.register(leave)


def require_threads(groups: int) -> None:
    """Refuse a second process group (a second progress thread) on a library without ``MPI_THREAD_MULTIPLE``.

    Raises:
        MPIUnavailable: the library grants less than the ``groups`` progress threads need.
    """
    MPI = load()
    level = MPI.Query_thread()
    needed = MPI.THREAD_MULTIPLE if groups > 1 else MPI.THREAD_SERIALIZED
    if level < needed:
        raise MPIUnavailable(
            f"the MPI library ({library_name(MPI)}) grants thread level {THREAD_LEVELS.get(level, level)}, and "
            f"{groups} process group(s) need {THREAD_LEVELS[needed]} (each group calls MPI from a thread of its "
            "own): use an MPI built with thread support (Debian's Open MPI and MPICH have it), or keep to one "
            "process group"
        )


@dataclass(frozen=True, kw_only=True)
class Library:
    """What ``ddpkit doctor`` says about the MPI library."""

    name: str
    """The library's own version line (``MPI_Get_library_version``), first line only."""
    standard: str
    """The MPI standard it implements, e.g. ``3.1``."""
    mpi4py: str
    thread_level: str
    """The thread level granted: single, funneled, serialized or multiple."""
    cuda_aware: bool | None
    """Whether the library takes CUDA device memory (``MPIX_Query_cuda_support``); None when it cannot say."""


def describe() -> Library:
    """The loaded library, its version, thread level and CUDA-awareness.

    Raises:
        MPIUnavailable: as :func:`load`.
    """
    MPI = load()
    import mpi4py

    major, minor = MPI.Get_version()
    return Library(
        name=library_name(MPI), standard=f"{major}.{minor}", mpi4py=mpi4py.__version__,
        thread_level=THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread())),
        cuda_aware=cuda_aware(),
    )


def cuda_aware() -> bool | None:
    """True when the MPI library reads and writes CUDA device memory itself; None when it cannot tell.

    ``DDPKIT_MPI_CUDA_AWARE=0``/``1`` overrides the library's answer (some builds answer wrongly).

    Raises:
        ValueError: ``DDPKIT_MPI_CUDA_AWARE`` is set to something else.
    """
    forced = variables.mpi_cuda_aware(os.environ)
    if forced is not None:
        return forced
    MPI = load()
    query = getattr(MPI, "Query_cuda_support", None)
    if query is None:
        return None
    try:
        return bool(query())
    except (NotImplementedError, MPI.Exception):
        return None


def library_name(MPI: Any) -> str:
    """The first line of the MPI library's own version string."""
    return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0].strip()  # Open MPI's ends in NUL
