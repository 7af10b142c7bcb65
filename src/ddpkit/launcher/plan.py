"""Pure launch planning: which ranks this node runs, with which command and environment.

Nothing here starts a process, so the whole env contract is unit-tested.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ddpkit.launcher.config import LaunchConfig


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """One worker process to start."""

    rank: int
    local_rank: int
    argv: list[str]
    env: dict[str, str]


def worker_argv(cfg: LaunchConfig, local_rank: int) -> list[str]:
    """The command line of one worker (``-u``: unbuffered, so output streams live)."""
    target = ["-m", cfg.program] if cfg.module else [cfg.program]
    extra = [f"--local_rank={local_rank}"] if cfg.local_rank_arg else []
    return [cfg.python, "-u", *target, *extra, *cfg.args]


def plan_workers(
    cfg: LaunchConfig, *, master_port: int, restart_count: int, base_env: Mapping[str, str]
) -> list[WorkerSpec]:
    """The workers of this node for one attempt.

    Global rank = node_rank x nproc_per_node + local_rank. Each worker gets
    torchrun's variables, so torchrun scripts run unchanged.

    Args:
        cfg: the validated launch configuration.
        master_port: the rendezvous port of this attempt.
        restart_count: how many times the group was restarted before.
        base_env: the environment to extend (usually ``os.environ``).
    """
    nproc = int(cfg.nproc_per_node)
    workers = []
    for local_rank in range(nproc):
        rank = cfg.node_rank * nproc + local_rank
        env = dict(base_env)
        env.update({
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(cfg.world_size),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": str(cfg.node_rank),
            "GROUP_WORLD_SIZE": str(cfg.nnodes),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(cfg.world_size),
            "ROLE_NAME": "default",
            "MASTER_ADDR": cfg.master_addr,
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
        })
        # Our workers serve their own store; an inherited torchrun flag would
        # send them looking for an agent store that is not there.
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        if nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        workers.append(WorkerSpec(rank=rank, local_rank=local_rank, argv=worker_argv(cfg, local_rank), env=env))
    return workers
