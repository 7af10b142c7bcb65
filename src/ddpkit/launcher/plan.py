"""Pure launch planning: which ranks this node runs, with which command and environment.

Nothing here starts a process, so the whole env contract is unit-tested.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from string import Template

from ddpkit.launcher.settings import LaunchSettings
from ddpkit.runtime.discovery import JOB_TOKEN_ENV
from ddpkit.runtime.process import (
    NUM_SERVERS_ENV,
    PS_PORT_ENV,
    PS_REPLICATION_ENV,
    SERVER_MODULE,
    free_ports,
    server_env,
    worker_env,
)


@dataclass(frozen=True, kw_only=True)
class NodeSlot:
    """This node's place in one round of the job: fixed (static) or agreed at the rendezvous (c10d)."""

    node_rank: int
    nnodes: int
    rank_base: int
    """Global rank of this node's local rank 0."""
    world_size: int
    master_addr: str
    master_port: int
    round: int | None = None
    """The rendezvous round (c10d): the workers' keys live under it, since a
    membership change starts a new round without counting a restart."""

    @classmethod
    def static(cls, launch: LaunchSettings, master_port: int, master_addr: str | None = None) -> NodeSlot:
        """This node's slot in a static job (``master_addr``: the launch's unless given)."""
        node = launch.config.node_rank
        return cls(node_rank=node, nnodes=launch.nnodes, rank_base=node * launch.nproc,
                   world_size=launch.world_size, master_addr=master_addr or launch.master_addr,
                   master_port=master_port)

    @classmethod
    def spare(cls, launch: LaunchSettings, store: str) -> NodeSlot:
        """A spare node's slot under ``--on-failure continue``: its workers join the running job as replacements
        do, on the store of the moment (``host:port``), each standing in for a rank of node 0's (its ``RANK``,
        below the starting world since every node runs as many workers; the job knows it by its member id)."""
        host, port = store.rsplit(":", 1)
        return cls(node_rank=launch.config.node_rank, nnodes=launch.nnodes, rank_base=0,
                   world_size=launch.world_size, master_addr=host, master_port=int(port))


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """One worker process to start."""

    rank: int
    """The worker's global rank; a parameter server's is the world size + its index."""
    local_rank: int
    argv: list[str]
    env: dict[str, str]
    server: int | None = None
    """The parameter server's index, None for a worker."""


def worker_argv(launch: LaunchSettings, local_rank: int) -> list[str]:
    """The command line of one worker (``-u``: unbuffered, so output streams live).

    As torchrun's: ``--local-rank-arg`` passes ``--local-rank=N`` (torch 2's
    spelling), ``${local_rank}`` in the arguments becomes the local rank (and
    ``$$`` a ``$``), and ``PYTHON_EXEC`` names the interpreter when set.
    """
    cfg = launch.config
    extra = [f"--local-rank={local_rank}"] if cfg.local_rank_arg else []
    args = [Template(a).safe_substitute(local_rank=str(local_rank)) for a in [*extra, *cfg.args]]
    if launch.no_python:
        return [cfg.program, *args]
    target = ["-m", cfg.program] if cfg.module else [cfg.program]
    return [os.environ.get("PYTHON_EXEC") or cfg.python, "-u", *target, *args]


def plan_workers(
    launch: LaunchSettings, *, master_port: int, restart_count: int, base_env: Mapping[str, str],
    job_token: str | None = None, agent_store: bool = False, run_id: str = "none",
    slot: NodeSlot | None = None, error_files: Mapping[int, str] | None = None,
) -> list[WorkerSpec]:
    """The workers of this node for one attempt (and, on node 0, ``--num-servers`` parameter servers after them).

    Global rank = the node's first rank + local_rank (static: node_rank x
    nproc_per_node). Each worker gets torchrun's variables, so torchrun
    scripts run unchanged.

    Args:
        launch: the launch's settings (:func:`ddpkit.launcher.settings.resolve`).
        master_port: the rendezvous port of this attempt (when no ``slot``).
        restart_count: how many times the group was restarted before.
        base_env: the environment to extend (usually ``os.environ``).
        job_token: the job's secret, given to every worker as ``DDPKIT_JOB_TOKEN``.
        agent_store: the launchers serve the store (multi-node), so rank 0
            connects to it like every other worker (torchrun's contract).
        run_id: ``TORCHELASTIC_RUN_ID`` (torchrun: ``--rdzv-id``, default ``none``).
        slot: this node's place in the round (default: the static one from ``launch``).
        error_files: ``TORCHELASTIC_ERROR_FILE`` per local rank (torch's ``@record`` writes there).
    """
    cfg, nproc = launch.config, launch.nproc
    slot = slot or NodeSlot.static(launch, master_port)
    # On one node the servers' channel gets a port of its own that is free now (MASTER_PORT + 1 may not be);
    # across nodes every node must name the same one, so MASTER_PORT + 1 stays the rule there.
    # (Found beside the rendezvous port, which rank 0 may not serve yet: one call alone could return it again.)
    ps_port = None
    if cfg.num_servers and slot.nnodes == 1 and not base_env.get(PS_PORT_ENV):
        ps_port = str(next(p for p in free_ports(2) if p != slot.master_port))
    workers = []
    for local_rank in range(nproc):
        rank = slot.rank_base + local_rank
        env = worker_env(
            rank=rank, local_rank=local_rank, world_size=slot.world_size, local_world_size=nproc,
            master_addr=slot.master_addr, master_port=slot.master_port, node_rank=slot.node_rank,
            nnodes=slot.nnodes, restart_count=restart_count, max_restarts=cfg.max_restarts, base=base_env,
        )
        env["ROLE_NAME"] = cfg.role
        if slot.round is not None:
            env["DDPKIT_RDZV_ROUND"] = str(slot.round)
        if error_files is not None:
            env["TORCHELASTIC_ERROR_FILE"] = error_files[local_rank]
        if cfg.virtual_local_rank:
            # torchrun: LOCAL_RANK 0 everywhere, each worker sees only its own GPU.
            visible = base_env.get("CUDA_VISIBLE_DEVICES")
            devices = [d for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(nproc)]
            env["LOCAL_RANK"] = "0"
            env["CUDA_VISIBLE_DEVICES"] = devices[local_rank % len(devices)]
        if job_token:
            env[JOB_TOKEN_ENV] = job_token
        # As torchrun sets them, so that torch.distributed.is_torchelastic_launched()
        # is true and libraries (Lightning) pick their torchelastic environment.
        env["TORCHELASTIC_USE_AGENT_STORE"] = str(agent_store)
        env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = cfg.signals_to_handle
        env["TORCHELASTIC_RUN_ID"] = run_id
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if cfg.num_servers:
            env[NUM_SERVERS_ENV] = str(cfg.num_servers)
            if ps_port:
                env[PS_PORT_ENV] = ps_port
            if cfg.ps_replication > 1:
                env[PS_REPLICATION_ENV] = str(cfg.ps_replication)
        workers.append(WorkerSpec(rank=rank, local_rank=local_rank, argv=worker_argv(launch, local_rank), env=env))
    if cfg.num_servers and slot.node_rank == 0:
        python = os.environ.get("PYTHON_EXEC") or cfg.python
        for k in range(cfg.num_servers):
            env = server_env(workers[0].env, k)
            if cfg.virtual_local_rank:
                env.pop("CUDA_VISIBLE_DEVICES", None)  # worker 0's one GPU is not the server's
            workers.append(WorkerSpec(rank=slot.world_size + k, local_rank=nproc + k, server=k, env=env,
                                      argv=[python, "-u", "-m", SERVER_MODULE]))
    return workers
