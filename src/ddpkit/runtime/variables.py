"""ddpkit's environment variables: the rule for each, in one place (torch-free).

The workers read these when they start; ``ddpkit launch`` and ``ddpkit train``
check them first (:func:`check_environment`), so a bad value is one line
before any worker starts instead of a traceback from every rank.

==============================  =============================================
variable                        value
==============================  =============================================
``DDPKIT_BACKEND``              ``gloo``, ``nccl`` or ``mpi``
``DDPKIT_TIMEOUT``              seconds for the rendezvous and each collective, > 0
``DDPKIT_STALL_WARN``           seconds before a stall report, >= 0 (0: off)
``DDPKIT_JOB_TOKEN``            the job's secret (any text)
``DDPKIT_RDZV_ROUND``           set by ``ddpkit launch``: a whole number >= 0
``TORCHELASTIC_RESTART_COUNT``  set by a launcher: a whole number >= 0
``GLOO_SOCKET_IFNAME``          network interfaces of this machine, comma-separated
``DDPKIT_FT_FD``                set by ``ddpkit launch --on-failure continue``: the membership pipe
``DDPKIT_FT_REPLY_FD``          set by it too: the pipe back to the launcher
``DDPKIT_FT_MEMBER``            set by it too: this worker's member id
``DDPKIT_FT_KEEP_ALIVE``        set by it too: ``INTERVAL,TIMEOUT`` seconds of its failure detector
``DDPKIT_MPI_CUDA_AWARE``       ``0`` or ``1``: overrides the MPI library's answer
``DDPKIT_MPIRUN``               the MPI launcher to use: a program on ``PATH``, or a path
==============================  =============================================
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Mapping

from ddpkit.runtime.options import ConfigError

__all__ = ["BACKENDS", "FT_FD", "FT_KEEP_ALIVE", "FT_MEMBER", "FT_REPLY_FD", "backend", "check_environment", "count",
           "mpi_cuda_aware", "mpirun_program", "refuse_bad_environment", "stall_warn_seconds", "timeout_seconds"]

BACKENDS = ("gloo", "nccl", "mpi")
FT_FD = "DDPKIT_FT_FD"
"""The read end of the launcher's membership pipe (see :mod:`ddpkit.runtime.membership`)."""
FT_REPLY_FD = "DDPKIT_FT_REPLY_FD"
"""The write end of a worker's pipe back to the launcher."""
FT_MEMBER = "DDPKIT_FT_MEMBER"
"""A worker's member id under ``--on-failure continue``."""
FT_KEEP_ALIVE = "DDPKIT_FT_KEEP_ALIVE"
"""``INTERVAL,TIMEOUT``: a worker under ``--on-failure continue`` beats to its launcher twice every INTERVAL seconds
(a worker silent for TIMEOUT is stalled, and killed), and waits TIMEOUT for the launcher's word after a failed
operation (``--rdzv-conf``'s keep-alive)."""


def timeout_seconds(environ: Mapping[str, str]) -> float | None:
    """``DDPKIT_TIMEOUT`` in seconds (None when unset).

    Raises:
        ValueError: not a positive number.
    """
    raw = environ.get("DDPKIT_TIMEOUT", "")
    if not raw.strip():
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"DDPKIT_TIMEOUT={raw!r} is not a number of seconds: unset it or give e.g. 600") from None
    if not value > 0:
        raise ValueError(f"DDPKIT_TIMEOUT={raw!r} must be a positive number of seconds: unset it or give e.g. 600")
    return value


def stall_warn_seconds(environ: Mapping[str, str], default: float) -> float:
    """``DDPKIT_STALL_WARN`` in seconds (``default`` when unset; 0: the stall inspector is off).

    Raises:
        ValueError: not a number, or negative.
    """
    raw = environ.get("DDPKIT_STALL_WARN", "")
    if not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"DDPKIT_STALL_WARN={raw!r} is not a number of seconds (0 turns the stall report off): "
                         "unset it or give e.g. 60") from None
    if not value >= 0:
        raise ValueError(f"DDPKIT_STALL_WARN={raw!r} must be 0 (off) or a positive number of seconds")
    return value


def backend(environ: Mapping[str, str]) -> str | None:
    """``DDPKIT_BACKEND`` (None when unset).

    Raises:
        ValueError: not one of :data:`BACKENDS`.
    """
    raw = environ.get("DDPKIT_BACKEND", "")
    if not raw.strip():
        return None
    if raw not in BACKENDS:
        raise ValueError(f"DDPKIT_BACKEND={raw!r} is not a backend: use one of {', '.join(BACKENDS)}, or unset it")
    return raw


def count(environ: Mapping[str, str], name: str) -> int:
    """A whole number >= 0 a launcher sets (``TORCHELASTIC_RESTART_COUNT``, ``DDPKIT_RDZV_ROUND``); 0 when unset.

    Raises:
        ValueError: not a whole number >= 0.
    """
    raw = environ.get(name, "")
    if not raw.strip():
        return 0
    if not raw.strip().isdigit():
        raise ValueError(f"{name}={raw!r} is not a whole number >= 0: it is set by the launcher; unset it")
    return int(raw)


def mpi_cuda_aware(environ: Mapping[str, str]) -> bool | None:
    """``DDPKIT_MPI_CUDA_AWARE`` (None when unset: the MPI library's own answer counts).

    Raises:
        ValueError: not 0 or 1.
    """
    raw = environ.get("DDPKIT_MPI_CUDA_AWARE", "")
    if not raw.strip():
        return None
    if raw.strip() not in ("0", "1"):
        raise ValueError(f"DDPKIT_MPI_CUDA_AWARE={raw!r} is neither 0 nor 1: 1 says the MPI library reads CUDA "
                         "memory itself, 0 that it does not; unset it to take the library's own answer")
    return raw.strip() == "1"


def mpirun_program(environ: Mapping[str, str]) -> str | None:
    """``DDPKIT_MPIRUN`` (None when unset): a program found on ``PATH``, or a path to one.

    Raises:
        ValueError: no such program.
    """
    raw = environ.get("DDPKIT_MPIRUN", "")
    if not raw.strip():
        return None
    if shutil.which(raw) is None:
        raise ValueError(f"DDPKIT_MPIRUN={raw!r} is not a program on PATH nor an executable file: name the MPI "
                         "launcher (e.g. DDPKIT_MPIRUN=/usr/bin/mpirun), or unset it to use mpirun on PATH")
    return raw


def _interfaces(environ: Mapping[str, str]) -> None:
    raw = environ.get("GLOO_SOCKET_IFNAME", "")
    if not raw.strip():
        return
    have = {name for _, name in socket.if_nameindex()}
    missing = [n for n in (n.strip() for n in raw.split(",")) if n and n not in have]
    if missing:
        raise ValueError(f"GLOO_SOCKET_IFNAME={raw!r}: this machine has no interface {', '.join(missing)} "
                         f"(it has {', '.join(sorted(have))}): unset it to let ddpkit choose, or name one of those")


def refuse_bad_environment(environ: Mapping[str, str]) -> None:
    """:func:`check_environment` as a command's usage error: what ``ddpkit launch`` and ``ddpkit train`` check
    before they start anything (or import the training code, 2.5 s: a bad value is one line at once).

    Raises:
        ConfigError: the first bad variable, its value and the fix.
    """
    try:
        check_environment(environ)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_environment(environ: Mapping[str, str], stall_default: float = 60.0) -> None:
    """Check every variable of the module's table that is set.

    Raises:
        ValueError: the first bad one, naming the variable, its value and the fix.
    """
    backend(environ)
    timeout_seconds(environ)
    stall_warn_seconds(environ, stall_default)
    count(environ, "DDPKIT_RDZV_ROUND")
    count(environ, "TORCHELASTIC_RESTART_COUNT")
    mpi_cuda_aware(environ)
    mpirun_program(environ)
    _interfaces(environ)
