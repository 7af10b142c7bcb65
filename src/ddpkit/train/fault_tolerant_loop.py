"""``ddpkit train --on-failure continue``: the training command on
:class:`~ddpkit.parallel.fault_tolerance.steps.FaultTolerance`.

With ``--strategy ps-sync|ps-async|ssp|diloco`` the workers are those of
:mod:`ddpkit.train.fault_tolerant_async` (the servers step, SSP's all-reduces in flight, or DiLoCo's outer steps);
otherwise the engine's.
Two ways in, as for the default mode:

* ``ddpkit train --on-failure continue`` alone claims the run directory and
  starts its workers through ``ddpkit launch --on-failure continue`` in this
  process (``--max-restarts`` replacements; and when no worker holding the
  state is left, up to ``--max-restarts`` restarts of every worker from the
  newest checkpoint);
* inside ``ddpkit launch --on-failure continue`` each process is one worker
  (give ``--output-dir``: workers whose first rank may die cannot agree on a
  new name).

Each worker builds the model and optimizer of the default mode (seeded by
``seed``, the learning rate scaled by the *starting* world size, which the
global batch keeps), then trains each step's virtual shards. After the last
step of each epoch the first member of the view evaluates on the test split
alone and rewrites ``metrics.jsonl``; its ``min_seen``/``max_seen`` count, per
sample, how often it reached an applied step's gradient, from the sample
counts each step reduces with its gradients (so a shard lost or trained twice
shows). ``membership.jsonl`` lists every change as the worker that wrote it
lived it: when the launcher's word arrived, when the group was rebuilt, when
the first step after it was applied, the state received. At the end the
first member writes ``model.safetensors`` and ``summary.json``. The epoch's
record holds the default mode's keys, made by the default mode's code
(:mod:`ddpkit.train.records`: ``lr``; ``epoch_time_s`` and ``samples_per_s``
as the writer timed them), and the world size; with
``--tensorboard`` the first member writes the default mode's points, and one
that becomes first after a death takes over
(:class:`~ddpkit.integrations.tensorboard.MemberBoard`).

Its state lives in the surviving processes, and also on disk, as a floor:
the first member writes a checkpoint (``<output-dir>/checkpoints``, atomic,
a digest per tensor, ``--keep-checkpoints`` kept) at every epoch's end and
every ``--checkpoint-every`` steps, holding what a state transfer holds (the
model, the optimizer, the step, the loop's own sums). When every worker (or
the launcher) dies, the same command with ``--resume`` continues from the
newest valid one, at any number of workers: the starting world, which sets
the global batch, the learning rate and the shards, is the checkpoint's.
Each step's randomness is seeded by its shard, so no generator state is
saved; with ``--deterministic-shards`` the resumed run ends bitwise equal to
the run that never stopped.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ddpkit.integrations.tensorboard import MemberBoard
from ddpkit.parallel.ddp.wrapper import DistributedDataParallel
from ddpkit.runtime import membership
from ddpkit.runtime.discovery import discover
from ddpkit.runtime.durable import write_or_warn
from ddpkit.runtime.group import shutdown
from ddpkit.runtime.options import ConfigError, RunError
from ddpkit.train import rundir
from ddpkit.train.restart import check_servers
from ddpkit.train.checkpoint import CheckpointError, save_checkpoint, save_weights
from ddpkit.train.train_config import SERVER_STRATEGIES, TrainConfig
from ddpkit.train.preload import FAULT_TOLERANT_PRELOAD
from ddpkit.train.curves import write_curves
from ddpkit.train.evaluate import evaluate_alone
from ddpkit.train.records import epoch_line, epoch_record, micro_batch_loss, result_line, summary_of
from ddpkit.train.recipe import autocast_for, build_state, set_lr, start_survivor, warmup_lr
from ddpkit.train.state import checkpoint_name, newest_valid_checkpoint, prune_checkpoints
from ddpkit.parallel.fault_tolerance.steps import FaultTolerance, Step
from ddpkit.train.fault_tolerant_async import worker as async_worker

__all__ = ["train"]

CONFIG_ENV = "DDPKIT_TRAIN_CONFIG"
"""The run's settings (JSON) for the workers ``ddpkit train --on-failure continue`` starts."""


def train(config: TrainConfig, check: Callable[[], Any] = lambda: None) -> dict[str, Any]:
    """Train in the mode (see the module notes); the summary.

    ``check`` runs before this process starts workers of its own (bad data is then a usage error).

    Raises:
        ConfigError: settings the mode cannot run, or a launcher other than ``ddpkit launch --on-failure continue``.
        RunError: every worker died.
    """
    servers = config.strategy in SERVER_STRATEGIES
    if os.environ.get(membership.FD_ENV):
        check_servers(config, os.environ)  # (a usage error: the launcher ends the job, replacing no one)
        try:
            return async_worker(config) if servers or config.strategy in ("ssp", "diloco") else worker(config)
        finally:
            shutdown()
    place = discover(os.environ, master_needed=False)
    if place.scheme != "single":
        raise ConfigError("--on-failure continue under a launcher other than ddpkit launch --on-failure continue: "
                          "only that launcher tells the survivors of a death; run ddpkit train --on-failure "
                          "continue alone, or under ddpkit launch --on-failure continue")
    from ddpkit.launcher import LaunchConfig, run  # the launcher runs here, in this process

    nproc = config.nproc_per_node or 2
    if not config.resume:  # a resumed run: against the world it started with, once the claim found it
        config.check_world(nproc)
    check()
    claim = rundir.claim(config.to_dict(), nproc, any_world=True)
    try:
        if claim.world_size is not None:
            config.check_world(nproc, start=claim.world_size)
        settings = {**config.to_dict(), "output_dir": str(claim.out)}
        for attempt in range(config.max_restarts + 1):
            os.environ[CONFIG_ENV] = json.dumps(settings)
            code = run(LaunchConfig(program="ddpkit.train.fault_tolerant_loop", module=True, nproc_per_node=nproc,
                                    standalone=True, on_failure="continue", max_restarts=config.max_restarts,
                                    backend=config.backend, num_servers=config.num_servers if servers else 0,
                                    ps_replication=config.ps_replication, preload=FAULT_TOLERANT_PRELOAD))
            if code == 0:
                break
            found = newest_valid_checkpoint(claim.out / rundir.CHECKPOINT_DIR)  # (ps and ssp: no restarts, no files)
            if found is None or attempt == config.max_restarts:
                break
            print(f"ddpkit train: no worker holding the training state is left; restart {attempt + 1} of "
                  f"{config.max_restarts} (--max-restarts): every worker starts again from {found[0]}, the newest "
                  "checkpoint", flush=True)
            settings["resume"] = True
    finally:
        os.environ.pop(CONFIG_ENV, None)
        rundir.release()
    if code != 0:
        raise RunError(f"--on-failure continue: every worker died (ddpkit launch exited {code}; its lines above say "
                       f"how); the run directory {claim.out} has no final weights")
    summary = claim.out / "summary.json"
    if not summary.is_file():  # every worker exited 0, the one chosen to write died first (at the very end)
        raise RunError(f"--on-failure continue: the workers ended, but the one chosen to write died before it wrote "
                       f"{summary} and the final weights; the epochs' metrics are in {claim.out / 'metrics.jsonl'}")
    return json.loads(summary.read_text())


class Progress:
    """The loop's own state, moved with the model by a state transfer: the epoch's sums, history, seen counts."""

    def __init__(self, samples: int) -> None:
        self.seen = torch.zeros(samples, dtype=torch.int32)
        self.loss_sum = 0.0
        self.count = 0
        self.history: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "loss_sum": torch.tensor(self.loss_sum, dtype=torch.float64),
                "count": torch.tensor(self.count), "history": json.dumps(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"].clone()
        self.loss_sum, self.count = float(state["loss_sum"]), int(state["count"])
        self.history = json.loads(state["history"])

    def account(self, step: Step, shards: Any) -> None:
        """Count the samples of each shard by how many times the step's reduction says it was trained."""
        for shard, trained in enumerate(step.trained):
            indices = shards.shard(step.index, shard)
            if indices:
                self.seen[indices] += round(trained / len(indices))


def worker(config: TrainConfig) -> dict[str, Any]:
    """One worker of the mode (see the module notes)."""
    ctx, out, data = start_survivor(config, check_world=not config.resume)
    resumed = _newest(out, ctx.rank) if config.resume else None
    # The starting world: the global batch, the learning rate and the shards keep it (a resumed run: the first's).
    world = int(resumed[1]["extra"]["world_size"]) if resumed else ctx.world_size
    if config.resume:
        config.check_world(ctx.world_size, start=world)
    state = build_state(config, data, world, ctx.device)
    model, optimizer = state.model, state.optimizer
    x, y = data.train.images.to(ctx.device), data.train.labels.to(ctx.device)
    progress = Progress(len(data.train))
    # --comm-hook fp16|bf16: the hook rides on a DDP wrapper built with no group (as a DDP script's is under the
    # mode); FaultTolerance hands it each step's gradients. The forwards below go to the plain module.
    engine = model if config.comm_hook == "none" else DistributedDataParallel(model, comm=config.comm_hook)
    # --grad-accum N: the default mode's global batch, each worker's share of a step in N micro-batches of
    # --batch-size (the summed mode; the deterministic mode's micro-batches are its shards).
    ft = FaultTolerance(engine, optimizer, data.train, config.batch_size * world * config.grad_accum,
                        virtual_shards=config.deterministic_shards or world * config.grad_accum,
                        deterministic=config.deterministic_shards is not None, seed=config.seed,
                        fetch=lambda idx: (x[idx], y[idx]), state={"progress": progress},
                        resume=resumed[1]["ft"] if resumed else None, accumulation=config.grad_accum)
    if ft.committed > config.epochs * ft.steps_per_epoch:
        raise ConfigError(f"--resume --epochs {config.epochs}: the run is at step {ft.committed}, past the end of "
                          f"epoch {config.epochs} (step {config.epochs * ft.steps_per_epoch}): give --epochs "
                          f"{-(-ft.committed // ft.steps_per_epoch)} or more")
    if ft.rank == 0 and not ft.changes:
        print(f"ddpkit train: {config.model} on {config.dataset} ({len(data.train)} train / {len(data.test)} test), "
              f"--on-failure continue with {ctx.world_size} worker(s), global batch {ft.shards.batch_size} in "
              f"{ft.shards.virtual_shards} shards ({'deterministic' if ft.deterministic else 'all-reduced'}"
              f"{'' if config.comm_hook == 'none' else ' in ' + config.comm_hook}), "
              f"lr {config.lr:g} x {world} = {config.lr * world:g}, output {out}"
              + (f", resumed from {resumed[0].name} (step {ft.committed})" if resumed else ""), flush=True)
    saver = Saver(config, out, world, ft.steps_per_epoch)
    board = MemberBoard(config.tensorboard)
    autocast = autocast_for(config, ctx.device)
    # dynamic=False: one kernel per shape, whatever shapes a process saw before, so a replacement computes a shard's
    # bits as the others do (automatic dynamic shapes would give it a static kernel where they use a dynamic one).
    forward = torch.compile(model, dynamic=False) if config.compile else model  # FaultTolerance keeps the plain module
    start = time.perf_counter()
    first_step, trained = ft.committed, 0  # (the samples of the steps this process saw applied)
    epoch_start, epoch_samples = start, 0  # this process's timing of the epoch
    for step in ft.steps(epochs=config.epochs):
        loss_sum = torch.zeros(1, dtype=torch.float64)
        mine = 0
        for xb, yb in step:
            loss = micro_batch_loss(forward, xb, yb, autocast)
            loss.backward()
            loss_sum += loss.detach().double().cpu() * len(yb)
            mine += len(yb)
        own = float(loss_sum)  # this worker's (step.values will hold the step's sum)
        if step.sync(values=loss_sum.float()):  # (summed in float32, as the step's buffer holds it)
            if config.warmup_for(world):  # the starting world's scaled rate: the global batch keeps its size
                set_lr(optimizer, warmup_lr(config, world, step.index, ft.steps_per_epoch))
            optimizer.step()
            progress.account(step, ft.shards)
            progress.loss_sum += float(step.values[0])
            progress.count += step.samples
            epoch_samples += step.samples
            trained += step.samples
            board.applied(step.index + 1, own / mine if mine else None)  # as the default mode's rank 0: its own
        optimizer.zero_grad(set_to_none=True)
        if step.synced and (step.index + 1) % ft.steps_per_epoch == 0:
            elapsed = time.perf_counter() - epoch_start
            _end_epoch(config, ft, step, progress, data.test, out, autocast, elapsed, epoch_samples)
            epoch_start, epoch_samples = time.perf_counter(), 0
        if step.synced:
            board.write(ft.rank == 0, progress.history)
        if step.synced and ft.rank == 0 and saver.due(step.index + 1):
            board.flush()  # (its events so far: a resume from this checkpoint keeps its step's)
            saver.save(ft)
    board.write(ft.rank == 0, progress.history)  # (the first member now: the one before may have died at the end)
    board.close()
    _write_changes(out, ft)
    wall = time.perf_counter() - start
    return _finish(config, ft, progress, data.test.labels.numel(), out, wall, {
        "replicas": world, "lr": config.lr * world, "base_lr": config.lr,
        "samples_per_s": round(trained / wall, 1) if wall > 0 else None,
        "resumed_from_epoch": first_step // ft.steps_per_epoch if resumed else 0})


def _newest(out: Path, rank: int) -> tuple[Path, dict[str, Any]] | None:
    """``--resume``: the newest valid checkpoint of the run (damaged newer ones skipped with a warning), or None:
    the run stopped before its first (rank 0 says so)."""
    found = newest_valid_checkpoint(out / rundir.CHECKPOINT_DIR)
    if found is None:
        if rank == 0:
            print(f"ddpkit train: --resume: no checkpoint in {out / rundir.CHECKPOINT_DIR} yet: starting the run "
                  "from the start", flush=True)
        return None
    if "ft" not in found[1]:
        raise ConfigError(f"--resume: {found[0]} was written by --on-failure restart, not by this mode: resume it "
                          "with --on-failure restart")
    return found


class Saver:
    """The first member's checkpoints (see the module notes): one that cannot be written warns once, training goes
    on (the state still lives in the workers)."""

    def __init__(self, config: TrainConfig, out: Path, world: int, steps_per_epoch: int) -> None:
        self.config = config
        self.folder = out / rundir.CHECKPOINT_DIR
        self.world = world
        self.steps_per_epoch = steps_per_epoch
        self.failing = False

    def due(self, committed: int) -> bool:
        every = self.config.checkpoint_every
        return committed % self.steps_per_epoch == 0 or bool(every and committed % every == 0)

    def save(self, ft: FaultTolerance) -> None:
        """After the step's ``optimizer.step()``: the state as of the next step."""
        state = ft.state_dict()
        done = state["committed"]
        extra = {"config": self.config.to_dict(), "world_size": self.world, "epoch": done // self.steps_per_epoch}
        try:
            save_checkpoint(self.folder / checkpoint_name(done), {"step": done, "extra": extra, "ft": state})
        except CheckpointError as e:
            if not self.failing:
                print(f"ddpkit train: warning: {e}; training goes on (the state lives in the workers; a --resume "
                      "after every worker died would take an older checkpoint)", flush=True)
            self.failing = True
            return
        self.failing = False
        prune_checkpoints(self.folder, self.config.keep_checkpoints, self.folder / checkpoint_name(done))


def _end_epoch(config: TrainConfig, ft: FaultTolerance, step: Step, progress: Progress, test: Any, out: Path,
               autocast: Any, elapsed: float, samples: int) -> None:
    """Evaluate, and append the epoch's record (the default mode's keys, and the world size) to the history.

    ``elapsed`` and ``samples``: the seconds this process timed the epoch and the samples of the steps applied
    meanwhile (a replacement's first epoch: since it started)."""
    epoch = step.epoch + 1
    # Every member evaluates (the replicas are equal), so that every one holds the same history to hand on.
    evaluation = evaluate_alone(ft.model, test, ft.device, autocast)
    record = epoch_record(epoch=epoch, step=step.index + 1, train_loss=progress.loss_sum / max(progress.count, 1),
                          evaluation=evaluation, lr=ft.optimizer.param_groups[0]["lr"], elapsed=elapsed,
                          trained=samples, seen=progress.seen, world_size=ft.world_size)
    if ft.rank == 0:
        print(f"{epoch_line(record, config.epochs)}, {ft.world_size} worker(s)", flush=True)
    progress.history.append(record)
    progress.seen.zero_()
    progress.loss_sum, progress.count = 0.0, 0
    if ft.rank == 0:
        rundir.write_metrics(out, progress.history, warn=True)


def _write_changes(out: Path, ft: FaultTolerance) -> None:
    """This worker's account of each membership change, appended to ``membership.jsonl``."""
    member = ft.membership.member if ft.membership else 0
    lines = "".join(json.dumps({"member": member, **asdict(c)}) + "\n" for c in ft.changes)
    if lines:
        with open(out / "membership.jsonl", "a") as f:
            f.write(lines)


def _finish(config: TrainConfig, ft: FaultTolerance, progress: Progress, n: int, out: Path, wall: float,
            timing: dict[str, Any]) -> dict[str, Any]:
    """The final weights and ``summary.json`` (the default mode's keys, ``timing`` among them, and the mode's),
    written by the first member still alive (:meth:`~ddpkit.runtime.membership.Membership.by_the_first`): the
    members it counts are the last step's that are still in the job, and each one lost after that step is one more
    membership change."""
    last = progress.history[-1]  # the last step ends the last epoch, which evaluated the final weights
    evaluation = (last["test_loss"], last["test_accuracy"], n)

    def write(alive: list[int]) -> None:
        # Again: the member first at the last epoch's end may have died before it wrote them.
        changes = len(ft.changes) + ft.world_size - len(alive)
        summary.update(world_size=len(alive), membership_changes=changes)
        rundir.write_metrics(out, progress.history, warn=True)
        save_weights(out / "model.safetensors", ft.model.state_dict())
        write_or_warn(out / "summary.json", json.dumps(summary, indent=2, sort_keys=True) + "\n")
        write_curves(out, progress.history)
        print(f"{result_line(config, evaluation[1], evaluation[0], n)}, {config.epochs} epoch(s) in {wall:.1f} s, "
              f"{len(alive)} worker(s) at the end after {changes} membership change(s); weights in "
              f"{out / 'model.safetensors'}", flush=True)

    summary = {**summary_of(config, evaluation=evaluation, world=ft.world_size, global_batch=ft.shards.batch_size,
                            wall=wall, steps=ft.committed), **timing,
               "virtual_shards": ft.shards.virtual_shards, "deterministic": ft.deterministic,
               "membership_changes": len(ft.changes), "on_failure": "continue"}
    if ft.membership is None:
        if ft.rank == 0:
            write(list(range(ft.world_size)))
    else:  # a writer that dies before it wrote leaves it to the next first member, who holds the same state
        ft.membership.by_the_first(ft.view, write)
    return summary


def main() -> None:
    """A worker started by ``ddpkit train --on-failure continue`` (its settings in ``DDPKIT_TRAIN_CONFIG``)."""
    train(TrainConfig(**json.loads(os.environ[CONFIG_ENV])))


if __name__ == "__main__":
    main()
