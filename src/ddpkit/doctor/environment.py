"""The machine as data-parallel training sees it: Python, torch, CUDA and NCCL, GPUs, backends, network, env.

:func:`collect` returns plain data (it goes into ``--json`` as it is);
:func:`problems` names what will not work, each with its fix.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
from typing import Any

from ddpkit.runtime.discovery import DEFAULT_PORT, LOOPBACK
from ddpkit.runtime.network import route_interface

__all__ = ["ENV_PREFIXES", "collect", "problems"]

ENV_PREFIXES = ("MASTER_", "GLOO_", "NCCL_", "CUDA_VISIBLE_DEVICES", "SLURM_", "TORCHELASTIC_", "PET_", "DDPKIT_",
                "OMPI_COMM_WORLD_", "PMI_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS",
                "TORCH_NCCL_", "TORCH_DISTRIBUTED_")
"""The variables the report lists (``DDPKIT_JOB_TOKEN`` is shown as set, never its value)."""


def _gpus(torch: Any) -> list[dict[str, Any]]:
    found = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        found.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                      "capability": f"{p.major}.{p.minor}"})
    return found


def _nccl_version(torch: Any) -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - no NCCL in this build
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _backends(dist: Any, cuda: bool) -> dict[str, dict[str, Any]]:
    out = {"gloo": {"available": dist.is_gloo_available(), "why": "" if dist.is_gloo_available() else
                    "this torch was built without gloo"}}
    nccl = dist.is_nccl_available()
    out["nccl"] = {"available": nccl and cuda,
                   "why": "" if nccl and cuda else ("no CUDA device here" if nccl else "this torch has no NCCL")}
    out["mpi"] = _mpi()
    return out


_PROBE = ("import json, dataclasses; from ddpkit.comm.mpi.library import describe; "
          "print(json.dumps(dataclasses.asdict(describe())))")


def _mpi() -> dict[str, Any]:
    """The ``mpi`` backend (mpi4py, ddpkit's own; torch's pip builds have no MPI): its library, version, thread
    level and CUDA-awareness, read in a process of its own (starting MPI here would make this one an MPI job),
    and the ``mpirun`` that would start its ranks."""
    import subprocess
    from importlib.util import find_spec

    from ddpkit.runtime import mpirun

    if find_spec("mpi4py") is None:
        return {"available": False, "why": "mpi4py is not installed: pip install 'ddpkit[mpi]' (and an MPI: "
                                           "apt-get install openmpi-bin, or mpich)"}
    probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                           check=False, env={k: v for k, v in os.environ.items() if not k.startswith("OMPI_")})
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return {"available": False, "why": f"mpi4py cannot start MPI: {last}"}
    library = json.loads(probe.stdout.strip().splitlines()[-1])
    try:
        launcher = mpirun.find()
        mpirun.check(launcher, library["name"])
    except mpirun.MpirunError as e:
        return {"available": False, "why": str(e), **library}
    why = "" if library["thread_level"] in ("serialized", "multiple") else (
        f"the MPI library grants thread level {library['thread_level']}: the backend's progress thread needs "
        "serialized at least (multiple for several groups); use a library built with thread support")
    return {"available": not why, "why": why, **library, "mpirun": f"{launcher.path} ({launcher.version})"}


def _network(environ: dict[str, str]) -> dict[str, Any]:
    master = environ.get("MASTER_ADDR", LOOPBACK)
    port = int(environ["MASTER_PORT"]) if environ.get("MASTER_PORT", "").isdigit() else DEFAULT_PORT
    given = environ.get("GLOO_SOCKET_IFNAME")
    names = [name for _, name in socket.if_nameindex()]
    if given:
        missing = [n for n in given.split(",") if n not in names]
        return {"interface": given, "why": "GLOO_SOCKET_IFNAME", "interfaces": names,
                "missing": missing, "master_addr": master}
    chosen = route_interface(master, port)
    return {"interface": chosen, "why": f"the route to MASTER_ADDR={master}" if chosen else
            f"no route to MASTER_ADDR={master}", "interfaces": names, "missing": [], "master_addr": master}


def _variables(environ: dict[str, str]) -> dict[str, str]:
    shown = {}
    for key in sorted(environ):
        if key.startswith(ENV_PREFIXES):
            shown[key] = "(set)" if key == "DDPKIT_JOB_TOKEN" else environ[key]
    return shown


def collect(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything the report shows (see the module notes)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import torch.distributed as dist

    try:
        ddpkit_version = version("ddpkit")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        ddpkit_version = "0+unknown"
    environ = dict(os.environ if environ is None else environ)
    cuda = torch.cuda.is_available()
    return {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": platform.platform(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda,
                  "cudnn": torch.backends.cudnn.version() if cuda else None,
                  "nccl": _nccl_version(torch) if cuda else None},
        "ddpkit": ddpkit_version,
        "gpus": _gpus(torch) if cuda else [],
        "backends": _backends(dist, cuda),
        "network": _network(environ),
        "env": _variables(environ),
    }


def problems(report: dict[str, Any]) -> list[str]:
    """What in the environment will not work, each with its fix (empty: nothing found)."""
    from ddpkit.runtime import variables

    found = []
    env = {k: v for k, v in report["env"].items() if k != "DDPKIT_JOB_TOKEN"}
    try:
        variables.check_environment(env)
    except ValueError as e:
        found.append(str(e))
    net = report["network"]
    if net["missing"] and not any("GLOO_SOCKET_IFNAME" in p for p in found):
        found.append(f"GLOO_SOCKET_IFNAME={net['interface']}: {', '.join(net['missing'])} is not an interface of "
                     f"this machine (it has {', '.join(net['interfaces'])}): name one of them, or unset it")
    if report["torch"]["cuda_available"] is False and os.environ.get("CUDA_VISIBLE_DEVICES") not in (None, ""):
        found.append(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} is set, but torch sees no CUDA "
                     "device: check the driver (nvidia-smi) and that this torch is a CUDA build "
                     f"({report['torch']['version']})")
    return found
