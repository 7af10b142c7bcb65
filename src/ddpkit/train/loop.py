"""The training loop behind ``ddpkit train``: a model, data-parallel, in one command.

:func:`train` takes a :class:`TrainConfig` and runs :func:`worker` on every
rank (:mod:`ddpkit.train.restart` starts, restarts and resumes them). Each
worker:

1. joins the process group, loads the dataset, builds the model with
   ``seed``, restores the checkpoint it continues from (if any), wraps the
   model in the chosen engine and sets up the strategy
   (:mod:`ddpkit.train.strategy`);
2. trains with the learning rate scaled linearly by the world size (DiLoCo's
   inner rate not: :func:`~ddpkit.train.recipe.lr_scale`), each rank
   on its own shard (:class:`ddpkit.DistributedSampler`, ``set_epoch`` each
   epoch), with ``grad_accum`` micro-batches per step and optional autocast
   (bf16 on CPU or CUDA, fp16 with loss scaling on CUDA), checkpointing every
   ``checkpoint_every`` steps;
3. after every epoch evaluates on the test split (:mod:`ddpkit.train.evaluate`),
   rewrites ``metrics.jsonl`` and writes a checkpoint;
   ``metrics.jsonl`` also says how often the epoch trained each sample
   (``min_seen``, ``max_seen``: counted per sample, across ranks, restarts
   included, so a run stopped and resumed anywhere shows every sample once);
4. at the end writes ``model.safetensors`` (plain module names) and
   ``summary.json``.

A checkpoint that cannot be written (no space left, a read-only file system)
is a warning naming the file and the cause, and training goes on: the newest
good checkpoint stays where it was, and a restart resumes from it. Only the
first of a run of such failures warns; the run says at its end how many were
skipped. The final weights and summary must be written: failing there fails
the run with one line (a :class:`~ddpkit.runtime.options.RunError`) naming
the file, the cause and the newest checkpoint. A run directory removed while
the run goes on stops it.

Resuming (``resume=True``, or any restarted attempt) restores model,
optimizer, grad scaler, sampler position (mid-epoch too), step, the partial
loss sums of the epoch and every rank's RNG state from the newest valid
checkpoint, so a run stopped anywhere and resumed ends bit-identical to an
uninterrupted run. The learning rate depends on the step alone for that
reason (the ``--warmup-epochs`` ramp, then constant; see
:class:`~ddpkit.train.run.Run`): a schedule that depended on the total number
of epochs would change when ``epochs`` grows on resume.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.data.datasets import load_dataset
from ddpkit.integrations.tensorboard import STEP_EVERY, EpochBoard
from ddpkit.parallel.common.trace import instrument, write
from ddpkit.runtime import events, variables
from ddpkit.runtime.devices import comm_tensor
from ddpkit.runtime.events import ByteCounter
from ddpkit.runtime.group import barrier, choose_backend, init, print0, zero_first
from ddpkit.runtime.options import ConfigError, RunError
from ddpkit.runtime.process import rank_bar
from ddpkit.train import restart, rundir, fault_tolerant_loop
from ddpkit.train.checkpoint import CheckpointError, load_checkpoint, save_json, save_weights
from ddpkit.train.train_config import TrainConfig
from ddpkit.train.curves import write_curves
from ddpkit.train.evaluate import evaluate
from ddpkit.train.recipe import (
    autocast_for,
    build_state,
    check_model,
    lr_scale,
    make_deterministic,
    set_lr,
    shard_state,
    sharded_params,
    steps_left,
    wrap,
)
from ddpkit.train.records import epoch_line, epoch_record, micro_batch_loss, result_line, summary_of
from ddpkit.train.run import Run
from ddpkit.train.strategy import make_strategy

__all__ = ["TrainConfig", "train", "worker"]


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
    variables.refuse_bad_environment(os.environ)  # what every worker reads first: one line now, not N tracebacks
    try:
        choose_backend(config.backend)
    except ValueError as e:
        raise ConfigError(f"--backend / DDPKIT_BACKEND: {e}") from None
    nccl_build = torch.version.cuda is not None and dist.is_nccl_available()
    if config.engine == "torch" and config.comm_hook == "bf16" and not nccl_build:
        raise ConfigError("--engine torch --comm-hook bf16: torch's DDP takes the bf16 hook only from a torch built "
                          "with CUDA and NCCL, and this one has neither: use --engine ddpkit, which runs it on gloo "
                          "too, or --comm-hook fp16")
    if os.environ.get(variables.FT_FD) and config.on_failure != "continue":
        # A worker of `ddpkit launch --on-failure continue`: the launcher's mode is the run's (and a flag the mode
        # cannot keep is a usage error, exit 2, which the launcher does not take for a death to replace).
        config = dataclasses.replace(config, on_failure="continue")
        if os.environ.get("RANK", "0") == "0":
            print("ddpkit train: started by ddpkit launch --on-failure continue: training in that mode, as with "
                  "--on-failure continue", flush=True)
    if config.on_failure == "continue":
        return fault_tolerant_loop.train(config, check=lambda: _load_data(config))
    return restart.attempts(config, worker, check=lambda: check_model(config, _load_data(config)))


def _load_data(config: TrainConfig) -> Any:
    return load_dataset(config.dataset, data_dir=config.data_dir, download=config.download,
                        synthetic_samples=config.synthetic_samples, train_samples=config.train_samples,
                        test_samples=config.test_samples)


def _train_epoch(run: Run, bar: Any) -> tuple[float, int, int]:
    """The rest of the current epoch on this rank's shard.

    Returns:
        The epoch's loss sum and sample count, and the samples trained in this
        attempt, each summed over all ranks.
    """
    state, config, progress = run.state, run.config, run.progress
    if progress["batches_done"] == 0:
        state.sampler.set_epoch(progress["epoch"])  # else it was restored mid-epoch and continues from there
    consumed = state.sampler.state_dict()["consumed"] if progress["batches_done"] else 0
    rank = dist.get_rank()
    # Summed on the device: reading a loss back (.item()) would make every step wait for the device.
    loss_sum = progress["partial"][rank][0].clone().to(run.device)
    count = resumed_with = int(progress["partial"][rank][1].item())
    idx = torch.tensor(list(state.sampler), dtype=torch.long, device=run.device)
    batches = [idx[i : i + run.batch] for i in range(0, len(idx), run.batch)]
    x, y = run.train_data
    ones = torch.ones(run.batch, dtype=torch.int32, device=run.device)
    autocast = autocast_for(config, run.device)
    slow = config.slow[1] if config.slow is not None and config.slow[0] == rank else None
    for s in range(0, len(batches), config.grad_accum):
        group = batches[s : s + config.grad_accum]
        tracer = run.tracer()
        began = time.perf_counter()
        state.optimizer.zero_grad(set_to_none=True)
        step_sum = torch.zeros((), dtype=torch.float64, device=run.device)
        for j, b in enumerate(group):
            with run.strategy.micro_batch(last=j == len(group) - 1):
                with tracer.phase("data"):
                    xb, yb = x[b], y[b]
                with tracer.phase("forward"):
                    loss = micro_batch_loss(run.forward, xb, yb, autocast)
                tracer.backward(state.scaler.scale(loss / len(group)).backward)
            loss_sum += loss.detach().double() * len(b)
            step_sum += loss.detach().double() * len(b)
            run.seen.index_add_(0, b, ones[: len(b)])
            count += len(b)
            consumed += len(b)
        if slow is not None:  # --straggler: this rank's forward and backward take `slow` times as long
            if run.device.type == "cuda":
                torch.cuda.synchronize(run.device)
            time.sleep((slow - 1) * (time.perf_counter() - began))
        if config.warmup_for(run.lr_scale):
            set_lr(state.optimizer, run.lr_at(state.step))
        with tracer.phase("optimizer"):
            run.strategy.step(state.scaler, state.optimizer)
        state.step += 1
        if run.board is not None and state.step % STEP_EVERY == 0:  # read back only then (rank 0)
            run.publish_step(state.step, step_sum.item() / sum(len(b) for b in group))
        progress["batches_done"] += 1
        bar.update(1)
        more_this_epoch = s + config.grad_accum < len(batches)
        if config.checkpoint_every and state.step % config.checkpoint_every == 0 and more_this_epoch:
            run.checkpoint(consumed, loss_sum, count)
    totals = comm_tensor([loss_sum.item(), count, count - resumed_with], torch.float64)
    events.collective("train: sum the epoch's loss and samples", nbytes=totals.numel() * totals.element_size())
    start = time.perf_counter()
    dist.all_reduce(totals)  # where every rank waits for the last to finish its shard
    run.strategy.epoch_end_s += time.perf_counter() - start
    return totals[0].item(), int(totals[1].item()), int(totals[2].item())


def _end_epoch(run: Run, loss_sum: float, samples: int, trained: int, epoch_time: float) -> dict[str, Any]:
    """Evaluate, record the epoch, checkpoint and rewrite ``metrics.jsonl``."""
    run.strategy.consensus(run.state.optimizer, final=run.progress["epoch"] + 1 >= run.config.epochs)
    # BatchNorm statistics drift apart per rank after the last forward:
    # evaluate (and checkpoint) rank 0's, the ones DDP broadcasts anyway.
    for buf in run.state.model.buffers():
        events.collective("train: broadcast rank 0's buffers", nbytes=buf.numel() * buf.element_size())
        dist.broadcast(buf, src=0)
    run.evaluation = evaluate(run.state.model, run.test, run.device, autocast_for(run.config, run.device))
    progress = run.progress
    run.sum_seen()
    seen = progress["seen"]
    record = epoch_record(epoch=progress["epoch"] + 1, step=run.state.step, train_loss=loss_sum / samples,
                          evaluation=run.evaluation, lr=run.lr_at(run.state.step - 1), elapsed=epoch_time,
                          trained=trained, seen=seen)
    progress["history"].append(record)
    progress["epoch"] += 1
    progress["batches_done"] = 0
    progress["partial"] = torch.zeros(run.world, 2, dtype=torch.float64)
    progress["seen"] = torch.zeros_like(seen)
    run.publish(record)  # before the checkpoint (Run.save flushes it): a resume from it keeps this epoch's points
    run.save(0)
    if progress["epoch"] < run.config.epochs:  # after the last epoch the model stays the replicas' consensus
        run.strategy.after_consensus(run.state.optimizer)
    run.write_metrics()
    return record


def _start(config: TrainConfig, claim: rundir.Claim | None, attempt: int) -> Run:
    """Join the group, load the data, build or restore the state, wrap the model."""
    try:
        ctx = init(backend=config.backend)
    except ValueError as e:  # the environment makes no job of this backend (--backend mpi under torchrun, ...)
        raise ConfigError(str(e)) from None
    if config.deterministic:
        make_deterministic()
    if "OMP_NUM_THREADS" not in os.environ:
        # Ranks that share a node's cores must not each spin up a thread per
        # core: oversubscribed, a step runs several times slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.local_world_size))
    claim = restart.agree_on_claim(config, claim, ctx.world_size, attempt)
    with zero_first():  # a --download happens once per node
        data = _load_data(config)
    state = build_state(config, data, ctx.world_size, ctx.device)
    model = shard_state(state, config, ctx.device) if sharded_params(config) else None
    if claim.checkpoint is not None:
        state.load(load_checkpoint(claim.checkpoint), source=claim.checkpoint)
        print0(f"ddpkit train: {'restart ' + str(attempt) + ': ' if attempt else ''}resuming from "
               f"{claim.checkpoint} (epoch {state.extra['epoch']}, step {state.step})")
        if state.extra["world_size"] != ctx.world_size:
            restart.rescale(state, ctx.world_size, config.lr * lr_scale(config, ctx.world_size))
        scale = lr_scale(config, ctx.world_size)
        saved = {group["lr"] for group in state.optimizer.param_groups}
        if not config.warmup_for(scale) and saved != {config.lr * scale}:  # (a warm-up sets each step's rate)
            # The checkpoint's rate predates the rule (DiLoCo's inner rate was scaled by the world size until
            # 2026-11-30), or DataParallel's replicas changed with the devices.
            print0(f"ddpkit train: the checkpoint's learning rate {', '.join(f'{lr:g}' for lr in sorted(saved))} "
                   f"is not this run's, {config.lr:g} x {scale} = {config.lr * scale:g}: going on at "
                   f"{config.lr * scale:g}")
            set_lr(state.optimizer, config.lr * scale)
    elif attempt:
        print0(f"ddpkit train: restart {attempt}: no checkpoint yet, starting again in {claim.out}")
    if model is None:
        # (--comm-hook auto's trials keep to a share of the steps left)
        left = steps_left(config, state.sampler, state.extra["epoch"], mid_epoch=state.extra["batches_done"] > 0)
        model = wrap(state.model, config, ctx.device, left or None)
    run = Run(state=state, config=config, model=model, strategy=make_strategy(state, model, config),
              device=ctx.device, world=ctx.world_size, out=claim.out,
              train_data=(data.train.images.to(ctx.device), data.train.labels.to(ctx.device)), test=data.test)
    run.seen = torch.zeros(len(data.train), dtype=torch.int32, device=ctx.device)
    run.forward = torch.compile(model, dynamic=False) if config.compile else model  # a kernel per shape (config)
    if claim.checkpoint is not None:
        run.write_metrics()  # epochs after the checkpoint are trained again
    if config.tensorboard is not None and ctx.rank == 0:
        run.board = EpochBoard(config.tensorboard)
        if claim.checkpoint is not None or attempt:
            # Hides what an attempt before wrote from the resumed step on, and writes those epochs again.
            run.board.rewrite(run.progress["history"], claim.step if claim.checkpoint is not None else 0)
    how = [f"backend {dist.get_backend()}", f"strategy {config.strategy}"]
    how += [f"ZeRO stage {config.zero}"] if config.zero else []
    how += [f"comm hook {config.comm_hook}"] if config.comm_hook != "none" else []
    if config.on_failure == "continue":
        how.append(f"on failure: continue ({config.max_restarts} replacement(s))")
    else:
        how.append(f"on failure: restart (up to {config.max_restarts})" if config.max_restarts
                   else "on failure: the job stops (--max-restarts 0)")
    print0(
        f"ddpkit train: {config.model} on {config.dataset} ({len(data.train)} train / {len(data.test)} test), "
        f"engine {config.engine}, {', '.join(how)}, {run.world} process(es) x {run.scale // run.world} replica(s), "
        "global batch "
        f"{run.batch * run.world * config.grad_accum}, lr {config.lr:g} x {run.lr_scale} = {run.lr:g}"
        f"{f' (reached over {warmup:g} epochs of warm-up)' if (warmup := config.warmup_for(run.lr_scale)) else ''}, "
        f"output {run.out}"
    )
    if config.trace is not None:
        owner = state.optimizer if config.engine == "ddpkit" and config.strategy == "optimizer" else model
        run.recorder = instrument(model, config.engine, ctx.rank, reducer_owner=owner)
        run.traced_until = state.step + config.trace_steps
    return run


def worker(rank: int, config: TrainConfig, claim: rundir.Claim | None, attempt: int = 0) -> dict[str, Any]:
    """One rank of the run (see the module notes); returns the summary once every rank has finished."""
    del rank  # the process group says which rank this is
    try:
        return _train(config, claim, attempt)
    finally:
        if claim is None:
            rundir.release()  # under a launcher rank 0 claimed the run directory (its lock) itself


def _train(config: TrainConfig, claim: rundir.Claim | None, attempt: int) -> dict[str, Any]:
    run = _start(config, claim, attempt)
    progress = run.progress
    first_epoch = progress["epoch"]
    left = steps_left(config, run.state.sampler, first_epoch, mid_epoch=progress["batches_done"] > 0)
    bar = rank_bar(total=max(left, 0), unit="step", dynamic_ncols=True, leave=False,
                   # A bar redraws with carriage returns: on a terminal only, never
                   # into a redirected log (the epoch lines are printed either way).
                   disable=dist.get_rank() != 0 or not config.progress or not sys.stderr.isatty())
    start = time.perf_counter()
    sent, first_step = ByteCounter(), run.state.step
    while progress["epoch"] < config.epochs:
        t0 = time.perf_counter()
        with sent.counting():
            loss_sum, samples, trained = _train_epoch(run, bar)
            run.trained += trained
            record = _end_epoch(run, loss_sum, samples, trained, time.perf_counter() - t0)
        bar.set_postfix(epoch=record["epoch"], loss=f"{record['train_loss']:.4f}", refresh=False)
        if dist.get_rank() == 0:
            bar.write(epoch_line(record, config.epochs))
    bar.close()
    if run.recorder is not None:
        write(config.trace, [run.recorder])
        print0(f"ddpkit train: trace of {len(run.recorder.overlaps)} backward passes in {config.trace}")
    steps = run.state.step - first_step
    summary = _finish(run, time.perf_counter() - start, first_epoch, sent.total / steps if steps else None)
    run.strategy.close()
    return summary


def _finish(run: Run, wall: float, first_epoch: int, sent_per_step: float | None) -> dict[str, Any]:
    """Final weights and ``summary.json``; every rank returns once they are on disk."""
    config, world = run.config, run.world
    if run.unwritten:
        print0(f"ddpkit train: {run.unwritten} checkpoint(s) of this run could not be written; the newest on disk "
               f"is {run.last_good()}")
    try:
        save_weights(run.out / "model.safetensors", run.state.model.state_dict())  # must be written
    except CheckpointError as e:
        if e.gone:
            raise
        raise RunError(f"{e}; the newest checkpoint is {run.last_good()}: make room, then the same command with "
                       "--resume finishes the run from it") from e
    if run.board is not None:
        run.board.close()
    if run.evaluation[2] == 0 and run.progress["history"]:
        # A restart after the last epoch's checkpoint: nothing left to train.
        last = run.progress["history"][-1]
        run.evaluation = (last["test_loss"], last["test_accuracy"], run.test.labels.numel())
    test_loss, test_acc, n_test = run.evaluation
    summary = {
        **summary_of(config, evaluation=run.evaluation, world=world, global_batch=run.batch * world * config.grad_accum,
                     wall=wall, steps=run.state.step),
        "replicas": run.scale, "lr": run.lr, "base_lr": config.lr,
        "samples_per_s": round(run.trained / wall, 1) if wall > 0 else None, "resumed_from_epoch": first_epoch,
        "sent_mb_per_step": None if sent_per_step is None else round(sent_per_step / 1e6, 6),
        **run.strategy.summary(),
    }
    try:
        save_json(run.out / "summary.json", summary)  # a collective: a failure raises on every rank
    except CheckpointError as e:
        if e.gone:
            raise
        raise RunError(f"{e}; the final weights are in {run.out / 'model.safetensors'}") from e
    if dist.get_rank() == 0:
        ran = config.epochs - first_epoch
        epochs = f"{ran} epoch{'s' if ran != 1 else ''}" + (
            f" (epochs {first_epoch + 1}-{config.epochs}, resumed)" if first_epoch else "")
        print(f"{result_line(config, test_acc, test_loss, n_test)}, {epochs} in {wall:.1f} s on {world} process(es); "
              f"weights in {run.out / 'model.safetensors'}", flush=True)
    barrier()
    if dist.get_rank() == 0:  # after the others' last wait: drawing (a first matplotlib import) holds no one up
        write_curves(run.out, run.progress["history"])
    return summary
