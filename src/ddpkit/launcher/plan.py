"""Pure launch planning: which ranks this node runs, with which command and environment.

Nothing here starts a process, so the whole env contract is unit-tested.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ddpkit.launcher.config import LaunchConfig
from ddpkit.runtime.process import worker_env


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """One worker process to start."""

    rank: int
    local_rank: int
    argv: list[str]
    env: dict[str, str]


def worker_argv(cfg: LaunchConfig, local_rank: int) -> list[str]:
    """The command line of one worker (``-u``: unbuffered, so output streams live)."""
    extra = [f"--local_rank={local_rank}"] if cfg.local_rank_arg else []
    if cfg.no_python:
        return [cfg.program, *extra, *cfg.args]
    target = ["-m", cfg.program] if cfg.module else [cfg.program]
    return [cfg.python, "-u", *target, *extra, *cfg.args]


def plan_workers(
    cfg: LaunchConfig, *, master_port: int, restart_count: int, base_env: Mapping[str, str],
    job_token: str | None = None, agent_store: bool = False, run_id: str = "none",
) -> list[WorkerSpec]:
    """The workers of this node for one attempt.

    Global rank = node_rank x nproc_per_node + local_rank. Each worker gets
    torchrun's variables, so torchrun scripts run unchanged.

    Args:
        cfg: the validated launch configuration.
        master_port: the rendezvous port of this attempt.
        restart_count: how many times the group was restarted before.
        base_env: the environment to extend (usually ``os.environ``).
        job_token: the job's secret, given to every worker as ``DDPKIT_JOB_TOKEN``.
        agent_store: the launchers serve the store (multi-node), so rank 0
            connects to it like every other worker (torchrun's contract).
        run_id: ``TORCHELASTIC_RUN_ID`` (torchrun: ``--rdzv-id``, default ``none``).
    """
    nproc = int(cfg.nproc_per_node)
    workers = []
    for local_rank in range(nproc):
        rank = cfg.node_rank * nproc + local_rank
        env = worker_env(
            rank=rank, local_rank=local_rank, world_size=cfg.world_size, local_world_size=nproc,
            master_addr=cfg.master_addr, master_port=master_port, node_rank=cfg.node_rank,
            nnodes=cfg.nnodes, restart_count=restart_count, max_restarts=cfg.max_restarts, base=base_env,
        )
        env["ROLE_NAME"] = cfg.role
        if job_token:
            env["DDPKIT_JOB_TOKEN"] = job_token
        # As torchrun sets them, so that torch.distributed.is_torchelastic_launched()
        # is true and libraries (Lightning) pick their torchelastic environment.
        env["TORCHELASTIC_USE_AGENT_STORE"] = str(agent_store)
        env["TORCHELASTIC_RUN_ID"] = run_id
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        workers.append(WorkerSpec(rank=rank, local_rank=local_rank, argv=worker_argv(cfg, local_rank), env=env))
    return workers
