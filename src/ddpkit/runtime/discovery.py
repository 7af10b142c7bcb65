"""Where am I? Rank, world size and rendezvous address from the environment.

Pure functions over an environment mapping, so every launcher scheme is
unit-tested without starting a process. Schemes are tried in this order; the
first whose variables are present wins:

============  ==============================================================
scheme        variables
============  ==============================================================
``env``       ``RANK`` ``WORLD_SIZE`` ``LOCAL_RANK`` ``LOCAL_WORLD_SIZE``
              ``GROUP_RANK`` ``MASTER_ADDR`` ``MASTER_PORT`` (ddpkit launch,
              torchrun, ``ddpkit.spawn``, hand-set)
``openmpi``   ``OMPI_COMM_WORLD_RANK`` ``OMPI_COMM_WORLD_SIZE``
              ``OMPI_COMM_WORLD_LOCAL_RANK`` ``OMPI_COMM_WORLD_LOCAL_SIZE``
``pmi``       ``PMI_RANK`` ``PMI_SIZE`` (MPICH, Intel MPI; local rank from
              ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS`` when present)
``slurm``     ``SLURM_PROCID`` ``SLURM_NTASKS`` ``SLURM_LOCALID``
              ``SLURM_NTASKS_PER_NODE``/``SLURM_TASKS_PER_NODE``
              ``SLURM_NODEID`` ``SLURM_JOB_NODELIST``, inside an ``srun`` step
``single``    none of the above: a world of one process
============  ==============================================================

Under MPI and SLURM, ``MASTER_ADDR``/``MASTER_PORT`` still win when set. With
no ``MASTER_PORT`` the rendezvous uses :data:`DEFAULT_PORT`. Under SLURM the
master host is the first host of the job's node list (compressed ranges such
as ``node[01-04,07]`` are expanded); under MPI on a single node it is
loopback, and a multi-node MPI job must export ``MASTER_ADDR``
(``mpirun -x MASTER_ADDR=host0 ...``) because MPI's environment does not name
rank 0's host.
"""

from __future__ import annotations

import functools
import hashlib
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_PORT = 29500
"""Rendezvous port used under MPI/SLURM when ``MASTER_PORT`` is not set."""

LOOPBACK = "127.0.0.1"

JOB_TOKEN_ENV = "DDPKIT_JOB_TOKEN"
"""The job's secret, the same in every rank: only processes that present it may join the rendezvous (set by
``ddpkit launch`` and ``ddpkit.spawn``; give every rank the same one when you start ranks by hand)."""


def mint_job_token() -> str:
    """A fresh job secret (128 random bits, hex): for a job whose ranks all start from this process."""
    return secrets.token_hex(16)


@dataclass(frozen=True, kw_only=True)
class Placement:
    """One process's place in the job, as read from its environment."""

    rank: int
    """Global rank, ``0 <= rank < world_size``."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank among the processes on this node; selects the GPU."""
    local_world_size: int
    """Number of processes on this node."""
    node_rank: int
    """Index of this node (``GROUP_RANK`` in torchrun's terms)."""
    master_addr: str
    """Host of the rendezvous store (rank 0's node)."""
    master_port: int
    """TCP port of the rendezvous store."""
    scheme: str
    """Which scheme found it: env, openmpi, pmi, slurm or single."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size {self.world_size} must be at least 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} is outside the world of {self.world_size} processes "
                f"(found by the {self.scheme!r} scheme): ranks run 0..{self.world_size - 1}; "
                "fix RANK/WORLD_SIZE or the launcher's process count"
            )
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            raise ValueError(
                f"local rank {self.local_rank} is outside the node's {self.local_world_size} "
                f"processes: local ranks run 0..{self.local_world_size - 1}; "
                "fix LOCAL_RANK/LOCAL_WORLD_SIZE"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"MASTER_PORT {self.master_port} is not a TCP port: use 1..65535")


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _port(env: Mapping[str, str]) -> int:
    return _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else DEFAULT_PORT


def _from_torchrun(env: Mapping[str, str]) -> Placement:
    if "WORLD_SIZE" not in env:
        raise ValueError(
            f"RANK={env['RANK']} is set but WORLD_SIZE is not: set both "
            "(or neither, for a single process), or start the script with `ddpkit launch`"
        )
    rank = _int(env, "RANK")
    world = _int(env, "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
    local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
    node_rank = _int(env, "GROUP_RANK") if "GROUP_RANK" in env else (rank // max(local_world, 1))
    if world > 1 and "MASTER_ADDR" not in env:
        raise ValueError(
            f"RANK={rank} WORLD_SIZE={world} is set but MASTER_ADDR is not: set MASTER_ADDR "
            "(and MASTER_PORT) to rank 0's host, or start the script with `ddpkit launch`"
        )
    return Placement(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
        node_rank=node_rank, master_addr=env.get("MASTER_ADDR", LOOPBACK),
        master_port=_port(env), scheme="env",
    )


def _mpi_master(env: Mapping[str, str], world: int, local_world: int, scheme: str, needed: bool) -> str:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if world == local_world or not needed:
        return LOOPBACK
    raise ValueError(
        f"this {scheme} job spans several nodes ({world} ranks, {local_world} on this node) "
        "but MASTER_ADDR is not set: export rank 0's host, e.g. `mpirun -x MASTER_ADDR=host0 ...`"
    )


def _from_openmpi(env: Mapping[str, str], master_needed: bool) -> Placement:
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    world = _int(env, "OMPI_COMM_WORLD_SIZE")
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else rank
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else world
    # Not OMPI_COMM_WORLD_NODE_RANK: Open MPI means by it a process's rank on its node across all jobs (a local
    # rank), not the node's index. mpirun fills nodes slot by slot unless told otherwise.
    node_rank = rank // local_world
    return Placement(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
        node_rank=node_rank, master_addr=_mpi_master(env, world, local_world, "OpenMPI", master_needed),
        master_port=_port(env), scheme="openmpi",
    )


def _from_pmi(env: Mapping[str, str], master_needed: bool) -> Placement:
    rank = _int(env, "PMI_RANK")
    world = _int(env, "PMI_SIZE")
    # Hydra (MPICH, Intel MPI) exports the node-local rank under these names;
    # without them we can only assume a single node.
    local_rank = _int(env, "MPI_LOCALRANKID") if "MPI_LOCALRANKID" in env else rank
    local_world = _int(env, "MPI_LOCALNRANKS") if "MPI_LOCALNRANKS" in env else world
    return Placement(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
        node_rank=rank // local_world, master_addr=_mpi_master(env, world, local_world, "PMI", master_needed),
        master_port=_port(env), scheme="pmi",
    )


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list: ``"a[01-03,07],b"`` -> ``a01 a02 a03 a07 b``.

    Several bracket groups in one name (``rack[1-2]-n[1-2]``) expand as a
    cartesian product, in SLURM's order. Zero padding is kept.
    """
    hosts: list[str] = []
    for name in _split_top_level(nodelist):
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", name):
            parts = [literal + item for item in _expand_ranges(ranges)] if ranges else [literal]
            expanded = [head + part for head in expanded for part in parts]
        hosts.extend(h for h in expanded if h)
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    names, depth, current = [], 0, ""
    for char in nodelist:
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            names.append(current)
            current = ""
        else:
            current += char
    names.append(current)
    return [n.strip() for n in names if n.strip()]


def _expand_ranges(ranges: str) -> list[str]:
    items = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not high:
            items.append(low)
            continue
        width = len(low)
        items.extend(str(i).zfill(width) for i in range(int(low), int(high) + 1))
    return items


def _slurm_local_world(env: Mapping[str, str], node_rank: int, world: int) -> int:
    # SLURM_TASKS_PER_NODE looks like "4(x2),3": node i's count is found by
    # walking the run-length encoded list.
    spec = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
    if not spec:
        return world
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise ValueError(f"SLURM_TASKS_PER_NODE={spec!r} is not in SLURM's 'N(xM),K' form")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts[min(node_rank, len(counts) - 1)]


def _from_slurm(env: Mapping[str, str]) -> Placement:
    rank = _int(env, "SLURM_PROCID")
    world = _int(env, "SLURM_NTASKS")
    node_rank = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else rank
    local_world = _slurm_local_world(env, node_rank, world)
    master = env.get("MASTER_ADDR")
    if not master:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        hosts = expand_nodelist(nodelist)
        if not hosts:
            raise ValueError("SLURM_JOB_NODELIST is empty: set MASTER_ADDR to rank 0's host")
        master = hosts[0]
    return Placement(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
        node_rank=node_rank, master_addr=master, master_port=_port(env), scheme="slurm",
    )


def discover(env: Mapping[str, str], *, master_needed: bool = True) -> Placement:
    """Read this process's :class:`Placement` from ``env`` (usually ``os.environ``).

    Args:
        env: the environment.
        master_needed: whether a multi-node MPI job must name rank 0's host (``MASTER_ADDR``); the ``mpi``
            backend meets over MPI itself and does not need it (loopback then stands in).

    Raises:
        ValueError: the variables are incomplete or inconsistent (``RANK``
            without ``WORLD_SIZE``, a rank outside the world, a non-integer).
    """
    if "RANK" in env:
        return _from_torchrun(env)
    if "WORLD_SIZE" in env and "OMPI_COMM_WORLD_RANK" not in env and "PMI_RANK" not in env:
        raise ValueError(
            f"WORLD_SIZE={env['WORLD_SIZE']} is set but RANK is not: set both, "
            "or start the script with `ddpkit launch`"
        )
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        return _from_openmpi(env, master_needed)
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return _from_pmi(env, master_needed)
    # Inside an sbatch/salloc shell SLURM_PROCID is set too, but only an srun
    # step (which has a step id) actually started SLURM_NTASKS processes.
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    if in_step and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from_slurm(env)
    return Placement(
        rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
        master_addr=LOOPBACK, master_port=_port(env), scheme="single",
    )


@functools.lru_cache(maxsize=8)
def job_key(token: str) -> bytes:
    """The key every other one of the job is derived from: scrypt of its secret (a slow, memory-hard function,
    about 0.1 s and 16 MB here, once per process), so that what the store shows of it cannot be checked against
    a dictionary of guesses at the speed of a plain hash."""
    return hashlib.scrypt(token.encode(), salt=b"ddpkit job secret v1", n=1 << 14, r=8, p=1, dklen=32)
