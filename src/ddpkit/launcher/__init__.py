"""``ddpkit launch``: start one node's share of a data-parallel job, torchrun-compatible.

Definitions:
    node: one machine, running one launcher. nnodes: how many.
    nproc_per_node: workers this launcher starts (``cpu``, ``gpu``, ``auto`` count as torchrun's).
    rank: a worker's global index, ``node_rank * nproc_per_node + local_rank``.
    world size: ``nnodes * nproc_per_node``.

Worker environment (the torchrun contract, so scripts written for torchrun
run unchanged, and ddpkit scripts run under torchrun):
    ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK`` (node rank), ``GROUP_WORLD_SIZE``, ``ROLE_RANK``,
    ``ROLE_WORLD_SIZE``, ``ROLE_NAME``, ``MASTER_ADDR``, ``MASTER_PORT``,
    ``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``, and
    ``OMP_NUM_THREADS=1`` when unset and more than one worker runs here.

Rendezvous: a TCP store on ``MASTER_ADDR:MASTER_PORT`` (default port 29500;
``--standalone`` picks a free one on loopback). On a single node rank 0
serves it, on loopback only when ``MASTER_ADDR`` is a loopback address; with
several nodes node 0's launcher serves it for the whole job (see
:mod:`ddpkit.launcher.node_rendezvous`: restart rounds, the first failure,
heartbeats). The other nodes' launchers are started with the same address,
port, ``--nnodes`` and ``--rdzv-id``. Every job has a secret
(``--job-secret-file``, ``DDPKIT_JOB_TOKEN``, or a random one on a single
node; a job across nodes must be given one of at least 32 characters, and
``--rdzv-id`` is only its name) that a process must present to join as a
rank. With ``--rdzv-backend c10d`` every node runs the
same command and the nodes agree on their ranks and the world size at
``--rdzv-endpoint``, elastically with ``--nnodes MIN:MAX`` (see
:mod:`ddpkit.launcher.elastic`). Where worker output goes (console, log
files, torch's error files): :mod:`ddpkit.launcher.output`.

Failure modes: see :mod:`ddpkit.launcher.supervise` (one round of workers) and
:mod:`ddpkit.launcher.job` (rounds, restarts, signals). Bad arguments (zero
processes, a node rank outside ``--nnodes``, a missing script, a busy port on
node 0, an address that does not resolve) are reported before any worker starts.
"""

from ddpkit.launcher.launch_config import LaunchConfig
from ddpkit.launcher.job import run
from ddpkit.launcher.plan import WorkerSpec, plan_workers
from ddpkit.launcher.settings import LaunchSettings, resolve

__all__ = ["LaunchConfig", "LaunchSettings", "WorkerSpec", "plan_workers", "resolve", "run"]
