"""Meeting the other ranks through MPI: who is who, and a store address nobody had to export.

Under ``mpirun`` (or ``srun --mpi=pmix``) the MPI library already knows the
job: ``MPI_COMM_WORLD`` gives rank and size, a split by shared memory gives
each node's local ranks. This rendezvous needs no ``MASTER_ADDR``, no port
and no census: rank 0 opens a store on a free port of every interface and
broadcasts its addresses over ``MPI_COMM_WORLD``; each rank keeps the first
it can connect to (its own loopback when it shares rank 0's node). Where the
nodes reach each other by one address only, ``MASTER_ADDR`` in rank 0's
environment (``mpirun -x MASTER_ADDR=node0``) is offered first.

What goes wrong here, each said in one line with the fix:

- the launcher is not MPI's (``torchrun``, ``ddpkit launch`` without
  ``--backend mpi``): every process is an MPI world of its own;
- ``mpirun`` belongs to another MPI than the one mpi4py loaded (the same
  symptom: each process a world of one, while ``mpirun``'s variables say more);
- a rank or world size in the environment that the communicator contradicts.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.comm.mpi.library import library_name, load
from ddpkit.runtime.backends import Joined
from ddpkit.runtime.discovery import LOOPBACK, Placement

__all__ = ["join"]

_SIOCGIFADDR = 0x8915
_CONNECT_S = 2.0


def join(place: Placement, timeout_s: float) -> Joined:
    """This process's place from ``MPI_COMM_WORLD`` and a store every rank reaches.

    Args:
        place: what the environment says (checked against the communicator).
        timeout_s: how long the store waits for a rank.

    Raises:
        ValueError: the environment and the communicator disagree (see the module docstring).
    """
    MPI = load()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    _check(place, rank, size, MPI)
    local_rank, local_size, node_rank = _node(place, world, MPI)
    server = rank == 0
    store = None
    if server:
        store = dist.TCPStore("0.0.0.0", 0, size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        offer = (store.port, _offered(os.environ.get("MASTER_ADDR", ""), _addresses()))
    else:
        offer = None
    port, addresses = world.bcast(offer, root=0)
    host = LOOPBACK if server else _reachable(addresses, port, node_rank == 0)
    if store is None:
        store = dist.TCPStore(host, port, size, False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    # Every rank connected before anyone goes on: rank 0 must not tear the store down under a slow peer.
    world.Barrier()
    scheme = place.scheme if place.world_size == size and place.scheme != "single" else "mpi"
    return Joined(
        place=Placement(rank=rank, world_size=size, local_rank=local_rank, local_world_size=local_size,
                        node_rank=node_rank, master_addr=host, master_port=port, scheme=scheme),
        store=store, store_addr=host, store_port=port,
    )


def _check(place: Placement, rank: int, size: int, MPI: Any) -> None:
    if place.world_size == size and place.rank == rank:
        return
    library = library_name(MPI)
    if size == 1 and place.scheme in ("openmpi", "pmi", "slurm"):
        launcher = {"openmpi": "Open MPI's mpirun", "pmi": "a PMI launcher (MPICH's or Intel MPI's mpiexec)",
                    "slurm": "srun"}[place.scheme]
        raise ValueError(
            f"backend 'mpi': {launcher} started {place.world_size} ranks, but the MPI library mpi4py loaded "
            f"({library}) sees a world of one: it is not the MPI that launched the job; run the mpirun of that "
            "library, or point mpi4py at the launcher's library (MPI4PY_LIBMPI=/path/to/libmpi.so; srun: "
            "--mpi=pmix)"
        )
    if size == 1:
        raise ValueError(
            f"backend 'mpi' needs MPI's launcher: this process is rank {place.rank} of {place.world_size} by its "
            f"environment ({place.scheme}: torchrun, ddpkit launch or hand-set variables), and MPI sees a world of "
            "one, since processes that MPI did not start cannot form a communicator; start the job with "
            f"`mpirun -np {place.world_size} ...` or `ddpkit launch --backend mpi ...` (which runs mpirun)"
        )
    if place.scheme == "single":
        return
    raise ValueError(
        f"backend 'mpi': the environment ({place.scheme}) says rank {place.rank} of {place.world_size} and the MPI "
        f"communicator rank {rank} of {size}: remove the stale RANK/WORLD_SIZE variables (MPI decides) or launch "
        "with a matching process count"
    )


def _node(place: Placement, world: Any, MPI: Any) -> tuple[int, int, int]:
    """(local rank, local world size, node rank): from the launcher's variables, else from shared memory."""
    size = world.Get_size()
    if place.world_size == size and place.scheme in ("openmpi", "pmi", "slurm"):
        return place.local_rank, place.local_world_size, place.node_rank
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    local_rank, local_size = local.Get_rank(), local.Get_size()
    leaders = world.Split(0 if local_rank == 0 else MPI.UNDEFINED, world.Get_rank())
    node = leaders.Get_rank() if leaders != MPI.COMM_NULL else -1
    node = local.bcast(node, root=0)
    if leaders != MPI.COMM_NULL:
        leaders.Free()
    local.Free()
    return local_rank, local_size, node


def _addresses() -> list[str]:
    """This machine's IPv4 addresses, loopback last."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            found.append(socket.inet_ntoa(raw[20:24]))
    return sorted(set(found), key=lambda a: (a.startswith("127."), a))


def _offered(master_addr: str, addresses: list[str]) -> list[str]:
    """Rank 0's addresses for the others to try, ``MASTER_ADDR`` first when the user named one off loopback."""
    if not master_addr or master_addr.startswith("127.") or master_addr == "localhost":
        return addresses
    return [master_addr] + [a for a in addresses if a != master_addr]


def _reachable(addresses: list[str], port: int, same_node: bool) -> str:
    """The first of rank 0's addresses this rank can connect to (loopback first when on rank 0's node)."""
    order = sorted(addresses, key=lambda a: not a.startswith("127.")) if same_node else addresses
    deadline = time.monotonic() + 30.0
    while True:
        for address in order:
            try:
                with socket.create_connection((address, port), timeout=_CONNECT_S):
                    return address
            except OSError:
                continue
        if time.monotonic() > deadline:
            raise ValueError(
                f"backend 'mpi': none of rank 0's addresses ({', '.join(addresses)}) accepts a connection on port "
                f"{port} from this node: open the port range between the nodes, or set MASTER_ADDR to an address "
                "of rank 0 that the other nodes reach"
            )
        time.sleep(0.5)
