"""Starting ranks with MPI's own launcher: the ``mpirun`` command line, and whose ``mpirun`` it is.

Pure planning (torch-free): :func:`command` returns the argv that starts
``nproc`` copies of a program under ``mpirun`` (Open MPI's or MPICH's Hydra,
told apart by ``mpirun --version``), with the variables ddpkit's workers
need passed through, each under the flag its launcher spells. ``ddpkit launch
--backend mpi`` and the test suite's MPI rank pools use it.

An ``mpirun`` of one MPI library starting programs whose mpi4py loaded
another gives every process a world of its own; :func:`check` compares the
two before anything starts and says which is which.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ddpkit.runtime.options import ConfigError

__all__ = ["Launcher", "MpirunError", "check", "command", "find", "library_of_mpi4py"]


class MpirunError(ConfigError):
    """No usable ``mpirun``, or one that does not match mpi4py's MPI; the message says which and the fix (a
    setting of this machine: the command line shows it in one line, as any :class:`ConfigError`)."""


@dataclass(frozen=True, kw_only=True)
class Launcher:
    """An ``mpirun`` on this machine."""

    path: str
    vendor: str
    """``openmpi`` or ``mpich`` (Hydra: MPICH, Intel MPI, MVAPICH)."""
    version: str
    """The first line of ``mpirun --version``."""


def find(mpirun: str | None = None) -> Launcher:
    """The ``mpirun`` to use (``mpirun``, else ``DDPKIT_MPIRUN``, else ``mpirun`` on ``PATH``) and its vendor.

    Raises:
        MpirunError: none found, or it does not answer ``--version`` as Open MPI's or Hydra's does.
    """
    name = mpirun or os.environ.get("DDPKIT_MPIRUN") or "mpirun"  # checked by variables.mpirun_program first
    path = shutil.which(name)
    if path is None:
        raise MpirunError(f"{name} is not on PATH: install an MPI (apt-get install openmpi-bin, or mpich) or name "
                          "its launcher with DDPKIT_MPIRUN=/path/to/mpirun")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MpirunError(f"{path} --version failed ({e}): is it an MPI launcher?") from None
    text = (out.stdout + out.stderr).strip()
    first = text.splitlines()[0] if text else ""
    if "Open MPI" in text or "OpenRTE" in text:
        vendor = "openmpi"
    elif "HYDRA" in text.upper() or "MPICH" in text.upper() or "Intel" in text:
        vendor = "mpich"
    else:
        raise MpirunError(f"{path} --version says {first!r}: not Open MPI's mpirun nor a Hydra mpiexec (MPICH, "
                          "Intel MPI); name the right one with DDPKIT_MPIRUN")
    return Launcher(path=path, vendor=vendor, version=first)


def library_of_mpi4py(python: str = sys.executable) -> str:
    """The version line of the MPI library mpi4py loads in ``python`` (read without starting MPI).

    Raises:
        MpirunError: mpi4py is missing or cannot load a library there.
    """
    probe = ("import mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False; "
             "from mpi4py import MPI; print(MPI.Get_library_version().replace(chr(0), '').strip().splitlines()[0])")
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise MpirunError(f"mpi4py cannot load an MPI library in {python} ({last}): pip install 'ddpkit[mpi]' "
                          "and an MPI (apt-get install openmpi-bin, or mpich)")
    return out.stdout.strip()


def check(launcher: Launcher, library: str) -> None:
    """Refuse an ``mpirun`` of another MPI than mpi4py's library (each process would be a world of one).

    Raises:
        MpirunError: the vendors differ.
    """
    is_openmpi = "Open MPI" in library
    if (launcher.vendor == "openmpi") != is_openmpi:
        raise MpirunError(
            f"{launcher.path} is {launcher.version!r} and mpi4py loads {library!r}: an mpirun starts the ranks "
            "of its own MPI only; use the launcher of mpi4py's library (DDPKIT_MPIRUN=/path/to/its/mpirun) or "
            "point mpi4py at the launcher's (MPI4PY_LIBMPI=/path/to/libmpi.so)"
        )


def command(launcher: Launcher, nproc: int, program: Sequence[str], *, env: Sequence[str] = (),
            hosts: Sequence[str] = (), extra: Sequence[str] = ()) -> list[str]:
    """The argv that starts ``nproc`` copies of ``program`` under ``launcher``.

    Args:
        launcher: from :func:`find`.
        nproc: processes in all.
        program: the argv of each process.
        env: names of variables to pass to every process (taken from the launcher's environment).
        hosts: hosts to place them on (``host`` or ``host:slots``); none: this machine.
        extra: more flags for ``mpirun``, verbatim.
    """
    if nproc < 1:
        raise ValueError(f"nproc {nproc} must be at least 1")
    argv = [launcher.path, "-np", str(nproc)]
    if launcher.vendor == "openmpi":
        # More ranks than cores is the normal case on a laptop or CI machine; Open MPI refuses it by default.
        # Binding each rank to one core would also pin its progress thread there, beside the model's.
        argv += ["--oversubscribe", "--bind-to", "none"]
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        for name in env:
            argv += ["-x", name]
        if hosts:
            argv += ["--host", ",".join(hosts)]
    else:
        if env:
            argv += ["-genvlist", ",".join(env)]
        if hosts:
            argv += ["-hosts", ",".join(hosts)]
    return [*argv, *extra, *program]
