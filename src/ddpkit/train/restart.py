"""Attempts of a ``ddpkit train`` run: the workers started, restarted after a failure, resumed where they stopped.

Two ways a run is started:

* ``ddpkit train`` on its own starts ``nproc_per_node`` workers (one process
  when that is 1 and no restarts are asked for) and, after a worker fails,
  restarts all of them up to ``--max-restarts`` times. Every attempt claims
  the output directory again (:func:`ddpkit.train.rundir.claim`) and resumes
  from its newest valid checkpoint.
* Inside a launcher (``ddpkit launch``, ``torchrun``, ``mpirun``, ``srun``)
  this process is one rank of the job; the launcher restarts it, and
  ``TORCHELASTIC_RESTART_COUNT`` (or, for an elastic launcher's new round,
  ``DDPKIT_RDZV_ROUND``) says which attempt this is. Rank 0 claims the
  directory and tells the others.

A checkpoint written at another world size (an elastic job that lost or
gained ranks) is continued by :func:`rescale`: not bit-identical to an
uninterrupted run, and said so.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.runtime import variables
from ddpkit.runtime.discovery import discover
from ddpkit.runtime.group import choose_backend, print0, shutdown
from ddpkit.runtime.options import ConfigError, RunError
from ddpkit.runtime.process import NUM_SERVERS_ENV, PS_REPLICATION_ENV
from ddpkit.runtime.spawn import WorkerError, spawn, start_forkserver
from ddpkit.train import rundir
from ddpkit.train.train_config import SERVER_STRATEGIES, TrainConfig
from ddpkit.train.preload import PRELOAD
from ddpkit.train.state import TrainState

__all__ = ["Worker", "agree_on_claim", "attempts", "rescale"]

Worker = Callable[[int, TrainConfig, "rundir.Claim | None", int], dict[str, Any]]
"""``worker(rank, config, claim, restart)``: one rank's training; returns the summary."""


def attempts(config: TrainConfig, worker: Worker, check: Callable[[], Any] = lambda: None) -> dict[str, Any]:
    """Run ``worker`` on every rank until the run ends, restarting it as the module notes say.

    ``check`` runs before this process starts workers of its own (not under a launcher), so bad data reads
    as a usage error, not as a worker's traceback.

    Raises:
        ConfigError: ``--engine single`` or ``dp`` under a launcher with several processes.
        RunError: the workers stopped for a reason they name in one line (the final weights could not be
            written), and no restart was left.
        ddpkit.WorkerError: a worker failed and no restart was left.
    """
    place = discover(os.environ, master_needed=False)  # the rendezvous address is init's concern
    if place.scheme != "single":
        if config.engine in ("single", "dp") and place.world_size > 1:
            raise ConfigError(
                f"--engine {config.engine} trains in one process, but the launcher started "
                f"{place.world_size}: run it without a launcher"
            )
        # An elastic launcher's new round (nodes came or went) is not counted
        # as a restart, but continues the run all the same.
        restart = max(variables.count(os.environ, "TORCHELASTIC_RESTART_COUNT"),
                      variables.count(os.environ, "DDPKIT_RDZV_ROUND"))
        check_servers(config, os.environ)
        config.check_world(place.world_size)
        try:
            return worker(place.rank, config, None, restart)
        finally:
            # Destroy the group before the interpreter exits, also on an error:
            # a gloo group torn down during interpreter exit aborts the process.
            shutdown()
    nproc = 1 if config.engine in ("single", "dp") else config.nproc_per_node or (
        torch.cuda.device_count() if torch.cuda.is_available() else 2
    )
    config.check_world(nproc)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nproc > gpus and choose_backend(config.backend) == "nccl":
        raise ConfigError(f"--nproc-per-node {nproc}: NCCL needs one GPU per process, and this machine has {gpus}: "
                          f"start at most {gpus} (--nproc-per-node {gpus}), or use --backend gloo, whose processes "
                          "may share a GPU")
    check()
    claim = rundir.claim(config.to_dict(), nproc)
    try:
        _own_attempts(config, worker, claim, nproc)
    finally:
        rundir.release()
    return json.loads((claim.out / "summary.json").read_text())


def _own_attempts(config: TrainConfig, worker: Worker, claim: rundir.Claim, nproc: int) -> None:
    """This process's workers, restarted after a failure up to ``--max-restarts`` times."""
    for attempt in range(config.max_restarts + 1):
        if attempt:
            claim = rundir.claim({**config.to_dict(), "output_dir": str(claim.out)}, nproc, restart=True)
        try:
            servers = config.num_servers if config.strategy in SERVER_STRATEGIES else 0
            if nproc == 1 and not config.max_restarts and not servers:
                try:
                    worker(0, config, claim, attempt)
                finally:
                    shutdown()
            elif choose_backend(config.backend) == "mpi":
                # One mpirun job: MPI's launcher must start the ranks for them to share a communicator.
                spawn(worker, nproc, args=(config, claim, attempt), backend="mpi", num_servers=servers)
            else:
                start_forkserver(PRELOAD)  # started already by the CLI, else now
                spawn(worker, nproc, args=(config, claim, attempt), start_method="forkserver", num_servers=servers)
            break
        except WorkerError as e:
            if attempt == config.max_restarts:
                if isinstance(e.__cause__, RunError):
                    raise e.__cause__ from None  # said in one line by every rank: no traceback
                raise
            print(f"ddpkit train: {e.who} failed; restarting the workers "
                  f"(restart {attempt + 1} of {config.max_restarts})", flush=True)


def check_servers(config: TrainConfig, environ: Any) -> None:
    """Under a launcher: the parameter servers ``--strategy ps-*`` needs are the ones the launcher started, each
    key range on as many of them (``--ps-replication``, under ``--on-failure continue``)."""
    started = environ.get(NUM_SERVERS_ENV, "")
    if config.strategy in SERVER_STRATEGIES:
        if not started or started == "0":
            raise ConfigError(
                f"--strategy {config.strategy} under a launcher needs parameter servers the launcher starts: "
                f"ddpkit launch --num-servers {config.num_servers} ... (or run ddpkit train on its own, which "
                "starts them)"
            )
        if started != str(config.num_servers):
            raise ConfigError(f"--num-servers {config.num_servers} but the launcher started {started} "
                              f"({NUM_SERVERS_ENV}={started}): give the same number to both")
        kept = environ.get(PS_REPLICATION_ENV) or "1"
        if kept != str(config.ps_replication):
            raise ConfigError(f"--ps-replication {config.ps_replication} but the launcher keeps each key range on "
                              f"{kept} server(s) ({PS_REPLICATION_ENV}={kept}): give the same number to both")


def agree_on_claim(config: TrainConfig, claim: rundir.Claim | None, world: int, restart: int) -> rundir.Claim:
    """Under a launcher, rank 0 claims the directory and tells the others (or its error); else ``claim``."""
    if claim is not None:
        return claim
    msg: list[Any] = [None, None]
    if dist.get_rank() == 0:
        try:
            msg = [rundir.claim(config.to_dict(), world, restart=restart > 0), None]
        except ConfigError as e:
            msg = [None, str(e)]
    # Every rank reaches this broadcast, rank 0 even after a failed claim,
    # so an error is raised everywhere instead of leaving ranks waiting.
    dist.broadcast_object_list(msg, src=0)
    if msg[1] is not None:
        raise ConfigError(msg[1])
    return msg[0]


def rescale(state: TrainState, world: int, lr: float) -> None:
    """Continue a run saved at another world size (an elastic job that lost or gained ranks).

    The sampler re-shards the rest of the epoch (it restored the saved
    position); the epoch's partial loss sums move to rank 0's row, so the
    epoch's mean stays right; the learning rate becomes ``lr`` (the linear
    scaling rule at the new world size); ranks the checkpoint had no RNG state
    for got fresh ones (see :meth:`TrainState.load`).
    """
    before = state.extra["world_size"]
    partial = state.extra["partial"]
    state.extra["partial"] = torch.zeros(world, 2, dtype=torch.float64)
    state.extra["partial"][0] = partial.sum(0)
    state.extra["world_size"] = world
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    rest = (f"the rest of epoch {state.extra['epoch'] + 1} is re-sharded over {world}, "
            if state.extra["batches_done"] else "")
    print0(f"ddpkit train: the checkpoint was written by {before} process(es), this attempt has {world}: {rest}"
           f"lr is now {lr:g} (the learning-rate rule at this world size; not bit-identical to an uninterrupted run)")
