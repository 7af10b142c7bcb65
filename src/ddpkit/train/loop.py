"""The training loop behind ``ddpkit train``: a model, data-parallel, in one command.

:func:`train` takes a :class:`TrainConfig` and either starts its own workers
(``nproc_per_node`` of them, through :func:`ddpkit.spawn`) or, when it runs
inside a launcher (``ddpkit launch``, ``torchrun``, ``mpirun``, ``srun``),
trains on the ranks it was given. Each worker:

1. joins the process group, loads the dataset, builds the model with
   ``seed``, restores the checkpoint it continues from (if any) and wraps the
   model in the chosen engine (ddpkit's DDP, torch's DDP for comparison, or
   nothing for ``single``);
2. trains with the learning rate scaled linearly by the world size, each rank
   on its own shard (:class:`ddpkit.DistributedSampler`, ``set_epoch`` each
   epoch), with ``grad_accum`` micro-batches per step (all but the last under
   ``no_sync``) and optional autocast (bf16 on CPU or CUDA, fp16 with loss
   scaling on CUDA), checkpointing every ``checkpoint_every`` steps;
3. after every epoch evaluates on the test split, each sample counted exactly
   once (an unpadded sampler, sums reduced across ranks in float64), rewrites
   ``metrics.jsonl`` and writes a checkpoint;
4. at the end writes ``model.safetensors`` (plain module names) and
   ``summary.json``.

Resuming (``resume=True``, or any restarted attempt) restores model,
optimizer, grad scaler, sampler position (mid-epoch too), step, the partial
loss sums of the epoch and every rank's RNG state from the newest valid
checkpoint, so a run stopped anywhere and resumed ends bit-identical to an
uninterrupted run. The learning rate is constant for that reason: a schedule
that depended on the total number of epochs would change when ``epochs``
grows on resume.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from ddpkit.runtime.events import ByteCounter
from ddpkit.data.datasets import TensorDataset, load_dataset
from ddpkit.data.sampler import DistributedSampler
from ddpkit.runtime.discovery import discover
from ddpkit.runtime.group import barrier, choose_backend, init, print0, shutdown, zero_first
from ddpkit.runtime.options import ConfigError
from ddpkit.runtime.spawn import WorkerError, spawn
from ddpkit.train import rundir
from ddpkit.train.checkpoint import load_checkpoint, save_weights
from ddpkit.train.config import TrainConfig
from ddpkit.train.recipe import autocast_for, build_state, replicas, strategy, wrap
from ddpkit.train.state import TrainState

__all__ = ["TrainConfig", "train"]

# ---------------------------------------------------------------- entry point


def train(config: TrainConfig) -> dict[str, Any]:
    """Train as ``config`` says and return the summary (also in ``summary.json``).

    Raises:
        ConfigError: bad settings, data or output directory (checked before any
            worker starts, so nothing is left half-done).
        ddpkit.WorkerError: a worker failed during training (its rank and
            traceback), and no restart was left.
    """
    if config.amp == "fp16" and not torch.cuda.is_available():
        raise ConfigError("--amp fp16 needs CUDA (loss scaling on GPU): use --amp bf16 on CPU")
    try:
        choose_backend(config.backend)  # before any worker starts, not as a worker's traceback
    except ValueError as e:
        raise ConfigError(f"--backend / DDPKIT_BACKEND: {e}") from None
    place = discover(os.environ)
    if place.scheme != "single":
        # Inside a launcher: this process is one rank of the job, and the
        # launcher restarts it (TORCHELASTIC_RESTART_COUNT counts the attempts).
        if config.engine in ("single", "dp") and place.world_size > 1:
            raise ConfigError(
                f"--engine {config.engine} trains in one process, but the launcher started "
                f"{place.world_size}: run it without a launcher"
            )
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        # An elastic launcher's new round (nodes came or went) is not counted
        # as a restart, but continues the run all the same.
        restart = max(restart, int(os.environ.get("DDPKIT_RDZV_ROUND") or 0))
        try:
            return _worker(place.rank, config, None, restart)
        finally:
            # Destroy the group before the interpreter exits, also on an error:
            # a gloo group torn down during interpreter exit aborts the process.
            shutdown()
    nproc = 1 if config.engine in ("single", "dp") else config.nproc_per_node or (
        torch.cuda.device_count() if torch.cuda.is_available() else 2
    )
    # Fail on bad data before any worker starts: the error then reads as a
    # usage error, not as a worker's traceback.
    _load_data(config)
    claim = rundir.claim(config.to_dict(), nproc)
    for attempt in range(config.max_restarts + 1):
        if attempt:
            claim = rundir.claim({**config.to_dict(), "output_dir": str(claim.out)}, nproc, restart=True)
        try:
            if nproc == 1 and not config.max_restarts:
                try:
                    _worker(0, config, claim, attempt)
                finally:
                    shutdown()
            else:
                spawn(_worker, nproc, args=(config, claim, attempt), backend=config.backend)
            break
        except WorkerError as e:
            if attempt == config.max_restarts:
                raise
            print(f"ddpkit train: rank {e.rank} failed; restarting the workers "
                  f"(restart {attempt + 1} of {config.max_restarts})", flush=True)
    return json.loads((claim.out / "summary.json").read_text())


# ---------------------------------------------------------------- one rank


def _load_data(config: TrainConfig):
    return load_dataset(
        config.dataset, data_dir=config.data_dir, download=config.download,
        synthetic_samples=config.synthetic_samples,
    )


def _agree_on_claim(config: TrainConfig, claim: rundir.Claim | None, world: int, restart: int) -> rundir.Claim:
    """Under a launcher, rank 0 claims the directory and tells the others (or its error)."""
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


@dataclass
class _Run:
    """What one worker trains with: the saved state, its live objects, and the data."""

    state: TrainState
    config: TrainConfig
    device: torch.device
    world: int
    out: Path
    train_data: tuple[torch.Tensor, torch.Tensor]
    test: TensorDataset
    autocast: Callable[[], contextlib.AbstractContextManager]
    evaluation: tuple[float, float, int] = (float("nan"), float("nan"), 0)
    trained: int = 0
    """Samples trained in this attempt, summed over ranks."""
    recorder: Any = None
    """``--trace``: the spans of this rank (:class:`ddpkit.parallel.trace.Recorder`)."""
    traced_until: int = 0
    """``--trace``: the optimizer step after the last one recorded."""
    local_sgd: Any = None
    """``--strategy local-sgd``: the :class:`ddpkit.LocalSGD` driving the model."""
    sent_per_step: float | None = None
    """Bytes this rank handed to all-reduces and broadcasts per optimizer step (evaluations and checkpoints
    included), in this attempt."""

    @property
    def progress(self) -> dict[str, Any]:
        """Where the run stands (saved in every checkpoint as ``extra``)."""
        return self.state.extra

    @property
    def lr(self) -> float:
        return self.config.lr * self.scale

    @property
    def scale(self) -> int:
        """Model replicas in the job: processes, times DataParallel's replicas in each."""
        return self.world * replicas(self.config)

    @property
    def batch(self) -> int:
        """Samples one process takes per micro-batch (all its replicas together)."""
        return self.config.batch_size * replicas(self.config)


def _checkpoint(run: _Run, consumed: int, loss_sum: torch.Tensor, count: int) -> None:
    """Save the whole state now (a collective), with each rank's partial loss sums of the epoch."""
    _consensus(run)
    mine = torch.stack([loss_sum.detach().cpu(), torch.tensor(float(count), dtype=torch.float64)])
    parts = [torch.empty_like(mine) for _ in range(run.world)]
    dist.all_gather(parts, mine)
    run.progress["partial"] = torch.stack(parts)
    run.state.save(run.out / rundir.CHECKPOINT_DIR, run.state.step, sampler_consumed=consumed)


def _train_epoch(model: torch.nn.Module, run: _Run, bar: Any) -> tuple[float, int, int]:
    """The rest of the current epoch on this rank's shard.

    Returns:
        The epoch's loss sum and sample count, and the samples trained in this
        attempt, each summed over all ranks.
    """
    state, config, progress = run.state, run.config, run.progress
    sampler = state.sampler
    if progress["batches_done"] == 0:
        sampler.set_epoch(progress["epoch"])
    # else: the sampler was restored mid-epoch and continues from there.
    consumed = sampler.state_dict()["consumed"] if progress["batches_done"] else 0
    rank = dist.get_rank()
    # Summed on the device: reading a loss back (.item()) would make every
    # step wait for the device, so it happens once per epoch.
    loss_sum = progress["partial"][rank][0].clone().to(run.device)
    count = int(progress["partial"][rank][1].item())
    resumed_with = count
    idx = torch.tensor(list(sampler), dtype=torch.long, device=run.device)
    batches = [idx[i : i + run.batch] for i in range(0, len(idx), run.batch)]
    x, y = run.train_data
    for s in range(0, len(batches), config.grad_accum):
        group = batches[s : s + config.grad_accum]
        state.optimizer.zero_grad(set_to_none=True)
        trace = run.recorder if run.recorder is not None and state.step < run.traced_until else None
        if run.recorder is not None:
            run.recorder.enabled = trace is not None
        for j, b in enumerate(group):
            last = j == len(group) - 1
            local = config.engine in ("single", "dp") or config.strategy == "optimizer"  # no DDP wrapper
            sync = contextlib.nullcontext() if last or local else model.no_sync()
            with sync:
                with _phase(trace, "data"):
                    xb, yb = x[b], y[b]
                with _phase(trace, "forward"):
                    with run.autocast():
                        logits = model(xb)
                    loss = F.cross_entropy(logits.float(), yb)
                scaled = state.scaler.scale(loss / len(group))
                if trace is not None:
                    trace.backward(scaled.backward)
                else:
                    scaled.backward()
            loss_sum += loss.detach().double() * len(b)
            count += len(b)
            consumed += len(b)
        with _phase(trace, "optimizer"):
            if config.engine == "ddpkit" and config.strategy == "optimizer":
                # Horovod's recipe with a grad scaler: the averages first, then unscale and step.
                state.optimizer.synchronize()
                with state.optimizer.skip_synchronize():
                    state.scaler.step(state.optimizer)
            else:
                state.scaler.step(state.optimizer)
            state.scaler.update()
            if run.local_sgd is not None:
                run.local_sgd.step()
        state.step += 1
        progress["batches_done"] += 1
        bar.update(1)
        more_this_epoch = s + config.grad_accum < len(batches)
        if config.checkpoint_every and state.step % config.checkpoint_every == 0 and more_this_epoch:
            _checkpoint(run, consumed, loss_sum, count)
    totals = torch.tensor([0.0, count, count - resumed_with], dtype=torch.float64)
    totals[0] = loss_sum.cpu()
    dist.all_reduce(totals)
    return totals[0].item(), int(totals[1].item()), int(totals[2].item())


def _phase(recorder: Any, name: str) -> contextlib.AbstractContextManager[None]:
    """``recorder.phase(name)`` while tracing (``--trace``), else nothing."""
    return recorder.phase(name) if recorder is not None else contextlib.nullcontext()


def _evaluate(model: torch.nn.Module, run: _Run) -> tuple[float, float, int]:
    """Loss and accuracy over the whole test split, each sample once across ranks."""
    test, device = run.test, run.device
    sampler = DistributedSampler(test, shuffle=False, pad=False)
    idx = torch.tensor(list(sampler), dtype=torch.long)
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    model.eval()
    # The plain module: shards differ in length by one, so no per-batch
    # collective (DDP's buffer broadcast) may run here.
    with torch.no_grad():
        for start in range(0, len(idx), 256):
            b = idx[start : start + 256]
            xb, yb = test.images[b].to(device), test.labels[b].to(device)
            with run.autocast():
                out = model(xb)
            totals[0] += F.cross_entropy(out.float(), yb, reduction="sum").double()
            totals[1] += (out.argmax(1) == yb).sum()
            totals[2] += len(b)
    model.train()
    totals = totals.cpu()
    dist.all_reduce(totals)
    loss_sum, correct, n = totals.tolist()
    return loss_sum / n, correct / n, int(n)


def _consensus(run: _Run) -> None:
    """Local SGD: average the replicas' parameters and optimizer state before a checkpoint or an evaluation,
    so both see one model, and a resumed run continues exactly as the uninterrupted one."""
    if run.local_sgd is not None:
        run.local_sgd.average(run.state.optimizer)


def _end_epoch(run: _Run, loss_sum: float, samples: int, trained: int, epoch_time: float) -> dict[str, Any]:
    """Evaluate, record the epoch, checkpoint and rewrite ``metrics.jsonl``."""
    _consensus(run)
    # BatchNorm statistics drift apart per rank after the last forward:
    # evaluate (and checkpoint) rank 0's, the ones DDP broadcasts anyway.
    for buf in run.state.model.buffers():
        dist.broadcast(buf, src=0)
    run.evaluation = _evaluate(run.state.model, run)
    progress = run.progress
    record = {
        "epoch": progress["epoch"] + 1, "step": run.state.step, "train_loss": loss_sum / samples,
        "test_loss": run.evaluation[0], "test_accuracy": run.evaluation[1], "lr": run.lr,
        "epoch_time_s": round(epoch_time, 4), "samples_per_s": round(trained / epoch_time, 1),
    }
    progress["history"].append(record)
    progress["epoch"] += 1
    progress["batches_done"] = 0
    progress["partial"] = torch.zeros(run.world, 2, dtype=torch.float64)
    run.state.save(run.out / rundir.CHECKPOINT_DIR, run.state.step, sampler_consumed=0)
    if dist.get_rank() == 0:
        rundir.write_metrics(run.out, progress["history"])
    return record


def _start(config: TrainConfig, claim: rundir.Claim | None, restart: int) -> tuple[_Run, torch.nn.Module]:
    """Join the group, load the data, build or restore the state, wrap the model."""
    ctx = init(backend=config.backend)
    if "OMP_NUM_THREADS" not in os.environ:
        # Ranks that share a node's cores must not each spin up a thread per
        # core: oversubscribed, a step runs several times slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.local_world_size))
    claim = _agree_on_claim(config, claim, ctx.world_size, restart)
    with zero_first():  # a --download happens once per node
        data = _load_data(config)
    state = build_state(config, data, ctx.world_size, ctx.device)
    if claim.checkpoint is not None:
        state.load(load_checkpoint(claim.checkpoint))
        print0(f"ddpkit train: {'restart ' + str(restart) + ': ' if restart else ''}resuming from "
               f"{claim.checkpoint} (epoch {state.extra['epoch']}, step {state.step})")
        if state.extra["world_size"] != ctx.world_size:
            _rescale(state, ctx.world_size, config)
    elif restart:
        print0(f"ddpkit train: restart {restart}: no checkpoint yet, starting again in {claim.out}")
    run = _Run(
        state=state, config=config, device=ctx.device, world=ctx.world_size, out=claim.out,
        train_data=(data.train.images.to(ctx.device), data.train.labels.to(ctx.device)), test=data.test,
        autocast=autocast_for(config, ctx.device),
    )
    if ctx.rank == 0 and claim.checkpoint is not None:
        # Epochs after the checkpoint are trained again: their old lines go.
        rundir.write_metrics(run.out, run.progress["history"])
    print0(
        f"ddpkit train: {config.model} on {config.dataset} ({len(data.train)} train / {len(data.test)} test), "
        f"engine {config.engine}, {run.world} process(es) x {run.scale // run.world} replica(s), global batch "
        f"{run.batch * run.world * config.grad_accum}, lr {config.lr:g} x {run.scale} = {run.lr:g}, "
        f"output {run.out}"
    )
    model = wrap(state.model, config, ctx.device)
    run.local_sgd = strategy(state, model, config)
    if config.trace is not None:
        from ddpkit.parallel.trace import instrument

        owner = state.optimizer if config.engine == "ddpkit" and config.strategy == "optimizer" else model
        run.recorder = instrument(model, config.engine, ctx.rank, reducer_owner=owner)
        run.traced_until = state.step + config.trace_steps
    return run, model


def _rescale(state: TrainState, world: int, config: TrainConfig) -> None:
    """Continue a run saved at another world size (an elastic job that lost or gained ranks).

    The sampler re-shards the rest of the epoch (it restored the saved
    position); the epoch's partial loss sums move to rank 0's row, so the
    epoch's mean stays right; the learning rate follows the linear scaling
    rule at the new world size; ranks the checkpoint had no RNG state for got
    fresh ones (see :meth:`TrainState.load`).
    """
    before = state.extra["world_size"]
    partial = state.extra["partial"]
    state.extra["partial"] = torch.zeros(world, 2, dtype=torch.float64)
    state.extra["partial"][0] = partial.sum(0)
    state.extra["world_size"] = world
    lr = config.lr * world * replicas(config)
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    rest = (f"the rest of epoch {state.extra['epoch'] + 1} is re-sharded over {world}, "
            if state.extra["batches_done"] else "")
    print0(f"ddpkit train: the checkpoint was written by {before} process(es), this attempt has {world}: {rest}"
           f"lr is now {lr:g} (linear scaling; not bit-identical to an uninterrupted run)")


def _worker(rank: int, config: TrainConfig, claim: rundir.Claim | None, restart: int = 0) -> dict[str, Any]:
    del rank  # the process group says which rank this is
    run, model = _start(config, claim, restart)
    progress = run.progress
    first_epoch = progress["epoch"]
    steps_per_epoch = math.ceil(math.ceil(run.state.sampler.num_samples / run.batch) / config.grad_accum)
    left = steps_per_epoch * (config.epochs - first_epoch) - progress["batches_done"]
    bar = tqdm(total=max(left, 0), unit="step", dynamic_ncols=True, leave=False,
               # A bar redraws with carriage returns: on a terminal only, never
               # into a redirected log (the epoch lines are printed either way).
               disable=dist.get_rank() != 0 or not config.progress or not sys.stderr.isatty())
    start = time.perf_counter()
    sent, first_step = ByteCounter(), run.state.step
    while progress["epoch"] < config.epochs:
        t0 = time.perf_counter()
        with sent.counting():
            loss_sum, samples, trained = _train_epoch(model, run, bar)
            run.trained += trained
            record = _end_epoch(run, loss_sum, samples, trained, time.perf_counter() - t0)
        bar.set_postfix(epoch=record["epoch"], loss=f"{record['train_loss']:.4f}", refresh=False)
        if dist.get_rank() == 0:
            bar.write(
                f"epoch {record['epoch']}/{config.epochs}: train loss {record['train_loss']:.4f}, "
                f"test loss {record['test_loss']:.4f}, test accuracy {100 * record['test_accuracy']:.2f}%"
            )
    bar.close()
    if run.recorder is not None:
        from ddpkit.parallel.trace import write

        write(config.trace, [run.recorder])
        print0(f"ddpkit train: trace of {len(run.recorder.overlaps)} backward passes in {config.trace}")
    steps = run.state.step - first_step
    run.sent_per_step = sent.total / steps if steps else None
    return _finish(run, time.perf_counter() - start, first_epoch)


def _epochs_ran(epochs: int, first_epoch: int) -> str:
    ran = epochs - first_epoch
    text = f"{ran} epoch{'s' if ran != 1 else ''}"
    return text if not first_epoch else f"{text} (epochs {first_epoch + 1}-{epochs}, resumed)"


def _finish(run: _Run, wall: float, first_epoch: int) -> dict[str, Any]:
    """Final weights and ``summary.json``; every rank returns once they are on disk."""
    config, world = run.config, run.world
    save_weights(run.out / "model.safetensors", run.state.model.state_dict())
    if run.evaluation[2] == 0 and run.progress["history"]:
        # A restart after the last epoch's checkpoint: nothing left to train.
        last = run.progress["history"][-1]
        run.evaluation = (last["test_loss"], last["test_accuracy"], len(run.test))
    test_loss, test_acc, n_test = run.evaluation
    summary = {
        "test_accuracy": test_acc, "test_loss": test_loss, "test_samples": n_test,
        "epochs": config.epochs, "world_size": world,
        "global_batch_size": run.batch * world * config.grad_accum, "replicas": run.scale,
        "lr": run.lr, "base_lr": config.lr, "wall_time_s": round(wall, 3),
        "samples_per_s": round(run.trained / wall, 1) if wall > 0 else None,
        "engine": config.engine, "strategy": config.strategy if config.engine == "ddpkit" else None,
        "model": config.model, "dataset": config.dataset,
        "amp": config.amp, "grad_accum": config.grad_accum, "resumed_from_epoch": first_epoch,
        "steps": run.state.step,
        "sent_mb_per_step": None if run.sent_per_step is None else round(run.sent_per_step / 1e6, 6),
    }
    if run.local_sgd is not None:
        summary.update(local_sgd_period=config.local_sgd, local_sgd_warmup=config.local_sgd_warmup,
                       parameter_averages=run.local_sgd.averages)
    if dist.get_rank() == 0:
        rundir.write_json_atomic(run.out / "summary.json", summary)
        print(
            f"test accuracy: {100 * test_acc:.2f}% on {n_test} images "
            f"(test loss {test_loss:.4f}), {_epochs_ran(config.epochs, first_epoch)} in {wall:.1f} s "
            f"on {world} process(es); weights in {run.out / 'model.safetensors'}",
            flush=True,
        )
    barrier()
    return summary
