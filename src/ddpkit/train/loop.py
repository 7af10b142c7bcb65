"""The training loop behind ``ddpkit train``: a model, data-parallel, in one command.

:func:`train` takes a :class:`TrainConfig` and either starts its own workers
(``nproc_per_node`` of them, through :func:`ddpkit.spawn`) or, when it runs
inside a launcher (``ddpkit launch``, ``torchrun``, ``mpirun``, ``srun``),
trains on the ranks it was given. Each worker:

1. joins the process group, loads the dataset, builds the model with
   ``seed`` and wraps it in the chosen engine (ddpkit's DDP, torch's DDP for
   comparison, or nothing for ``single``);
2. trains with the learning rate scaled linearly by the world size, each rank
   on its own shard (:class:`ddpkit.DistributedSampler`, ``set_epoch`` each
   epoch), with ``grad_accum`` micro-batches per step (all but the last under
   ``no_sync``) and optional autocast (bf16 on CPU or CUDA, fp16 with loss
   scaling on CUDA);
3. after every epoch evaluates on the test split, each sample counted exactly
   once (an unpadded sampler, sums reduced across ranks in float64), appends a
   line to ``metrics.jsonl`` and writes a checkpoint;
4. at the end writes ``model.safetensors`` (plain module names) and
   ``summary.json``.

Resuming (``resume=True``) restores model, optimizer, grad scaler, sampler,
step and every rank's RNG state from the newest checkpoint, so a run of 2
epochs resumed to 4 ends bit-identical to an uninterrupted 4-epoch run. The
learning rate is constant for that reason: a schedule that depended on the
total number of epochs would change when ``epochs`` grows on resume.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from ddpkit.data.datasets import TensorDataset, load_dataset
from ddpkit.data.sampler import DistributedSampler
from ddpkit.runtime.discovery import discover
from ddpkit.runtime.group import barrier, init, print0, shutdown, zero_first
from ddpkit.runtime.options import ConfigError
from ddpkit.runtime.spawn import spawn
from ddpkit.train import rundir
from ddpkit.train.checkpoint import load_checkpoint, save_checkpoint, save_weights
from ddpkit.train.config import TrainConfig
from ddpkit.train.models import build_model
from ddpkit.train.state import TrainState

__all__ = ["TrainConfig", "train"]

# ---------------------------------------------------------------- entry point


def train(config: TrainConfig) -> dict[str, Any]:
    """Train as ``config`` says and return the summary (also in ``summary.json``).

    Raises:
        ConfigError: bad settings, data or output directory (checked before any
            worker starts, so nothing is left half-done).
        ddpkit.WorkerError: a worker failed during training (its rank and traceback).
    """
    if config.amp == "fp16" and not torch.cuda.is_available():
        raise ConfigError("--amp fp16 needs CUDA (loss scaling on GPU): use --amp bf16 on CPU")
    place = discover(os.environ)
    if place.scheme != "single":
        # Inside a launcher: this process is one rank of the job.
        if config.engine == "single" and place.world_size > 1:
            raise ConfigError(
                f"--engine single trains in one process, but the launcher started "
                f"{place.world_size}: run it without a launcher"
            )
        return _worker(place.rank, config, None)
    nproc = 1 if config.engine == "single" else config.nproc_per_node or (
        torch.cuda.device_count() if torch.cuda.is_available() else 2
    )
    # Fail on bad data before any worker starts: the error then reads as a
    # usage error, not as a worker's traceback.
    _load_data(config)
    out, state = rundir.claim(config.to_dict(), nproc)
    del state  # the workers read the checkpoint themselves
    if nproc == 1:
        try:
            _worker(0, config, str(out))
        finally:
            shutdown()
    else:
        spawn(_worker, nproc, args=(config, str(out)), backend=config.backend)
    return json.loads((out / "summary.json").read_text())


# ---------------------------------------------------------------- one rank


def _load_data(config: TrainConfig):
    return load_dataset(
        config.dataset, data_dir=config.data_dir, download=config.download,
        synthetic_samples=config.synthetic_samples,
    )


def _agree_on_output_dir(config: TrainConfig, out: str | None, world: int) -> str:
    """Under a launcher, rank 0 claims the directory and tells the others (or its error)."""
    if out is not None:
        return out
    msg: list[Any] = [None, None]
    if dist.get_rank() == 0:
        try:
            path, _ = rundir.claim(config.to_dict(), world)
            msg = [str(path), None]
        except ConfigError as e:
            msg = [None, str(e)]
    # Every rank reaches this broadcast, rank 0 even after a failed claim,
    # so an error is raised everywhere instead of leaving ranks waiting.
    dist.broadcast_object_list(msg, src=0)
    if msg[1] is not None:
        raise ConfigError(msg[1])
    return msg[0]


def _wrap(model: torch.nn.Module, config: TrainConfig, device: torch.device) -> torch.nn.Module:
    ids = [device.index] if device.type == "cuda" else None
    if config.engine == "ddpkit":
        from ddpkit.parallel.ddp import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=ids)
    if config.engine == "torch":
        from ddpkit._reference import torch_ddp

        return torch_ddp(model, device_ids=ids)
    return model


def _build_state(config: TrainConfig, data: Any, world: int, device: torch.device) -> TrainState:
    """A fresh run's model, optimizer, scaler and sampler; the model seeded by ``config.seed``."""
    torch.manual_seed(config.seed)
    train_set = data.train
    model = build_model(
        config.model, in_channels=train_set.in_channels, image_size=train_set.image_size,
        num_classes=train_set.num_classes,
    ).to(device)
    lr = config.lr * world
    if config.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=config.weight_decay)
    return TrainState(
        model=model, optimizer=opt,
        scaler=torch.amp.GradScaler("cuda", enabled=config.amp == "fp16"),
        sampler=DistributedSampler(train_set, shuffle=True, seed=config.seed),
    )


def _autocast(config: TrainConfig, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.amp)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def _train_epoch(
    model: torch.nn.Module, state: TrainState, config: TrainConfig, data: Any,
    device: torch.device, autocast: Callable, bar: Any,
) -> tuple[float, int]:
    """One epoch of this rank's shard; returns (sum of sample losses, samples), summed over ranks."""
    train_x, train_y = data
    state.sampler.set_epoch(state.epoch)
    idx = torch.tensor(list(state.sampler), dtype=torch.long, device=device)
    batches = [idx[i : i + config.batch_size] for i in range(0, len(idx), config.batch_size)]
    # Summed on the device: reading a loss back (.item()) would make every
    # step wait for the device, so it happens once per epoch.
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for s in range(0, len(batches), config.grad_accum):
        group = batches[s : s + config.grad_accum]
        state.optimizer.zero_grad(set_to_none=True)
        for j, b in enumerate(group):
            last = j == len(group) - 1
            sync = contextlib.nullcontext() if last or config.engine == "single" else model.no_sync()
            with sync:
                with autocast():
                    logits = model(train_x[b])
                loss = F.cross_entropy(logits.float(), train_y[b])
                state.scaler.scale(loss / len(group)).backward()
            loss_sum += loss.detach().double() * len(b)
        state.scaler.step(state.optimizer)
        state.scaler.update()
        state.step += 1
        bar.update(1)
    totals = torch.stack([loss_sum.cpu(), torch.tensor(float(len(idx)), dtype=torch.float64)])
    dist.all_reduce(totals)
    return totals[0].item(), int(totals[1].item())


def _evaluate(model: torch.nn.Module, test: TensorDataset, device: torch.device, autocast) -> tuple[float, float, int]:
    """Loss and accuracy over the whole test split, each sample once across ranks."""
    sampler = DistributedSampler(test, shuffle=False, pad=False)
    idx = torch.tensor(list(sampler), dtype=torch.long)
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    model.eval()
    # The plain module: shards differ in length by one, so no per-batch
    # collective (DDP's buffer broadcast) may run here.
    with torch.no_grad():
        for start in range(0, len(idx), 256):
            b = idx[start : start + 256]
            x, y = test.images[b].to(device), test.labels[b].to(device)
            with autocast():
                out = model(x)
            totals[0] += F.cross_entropy(out.float(), y, reduction="sum").double()
            totals[1] += (out.argmax(1) == y).sum()
            totals[2] += len(b)
    model.train()
    totals = totals.cpu()
    dist.all_reduce(totals)
    loss_sum, correct, n = totals.tolist()
    return loss_sum / n, correct / n, int(n)


def _end_epoch(state: TrainState, record: dict[str, Any], config: TrainConfig, out_dir: Path,
               world: int, device: torch.device) -> None:
    """Record the epoch, then checkpoint and rewrite ``metrics.jsonl`` (both durable and atomic)."""
    state.epoch += 1
    state.history.append(record)
    path = out_dir / rundir.CHECKPOINT_DIR / f"epoch-{state.epoch:04d}.safetensors"
    save_checkpoint(path, state.payload(device, world_size=world, config=config.to_dict()))
    if dist.get_rank() == 0:
        rundir.write_metrics(out_dir, state.history)


def _worker(rank: int, config: TrainConfig, out: str | None) -> dict[str, Any]:
    del rank  # the process group says which rank this is
    ctx = init(backend=config.backend)
    world, device = ctx.world_size, ctx.device
    if "OMP_NUM_THREADS" not in os.environ:
        # Ranks that share a node's cores must not each spin up a thread per
        # core: oversubscribed, a step runs several times slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.local_world_size))
    out_dir = Path(_agree_on_output_dir(config, out, world))
    with zero_first():  # a --download happens once per node
        data = _load_data(config)
    train_data = (data.train.images.to(device), data.train.labels.to(device))

    state = _build_state(config, data, world, device)
    latest = rundir.latest_checkpoint(out_dir) if config.resume else None
    if latest is not None:
        state.load(load_checkpoint(latest[1]), ctx.rank, device)
        if ctx.rank == 0:
            # Epochs after the checkpoint are trained again: their old lines go.
            rundir.write_metrics(out_dir, state.history)
    first_epoch = state.epoch
    model = _wrap(state.model, config, device)
    autocast = _autocast(config, device)
    lr = config.lr * world
    steps_per_epoch = math.ceil(math.ceil(len(state.sampler) / config.batch_size) / config.grad_accum)
    print0(
        f"ddpkit train: {config.model} on {config.dataset} ({len(data.train)} train / {len(data.test)} test), "
        f"engine {config.engine}, {world} process(es), global batch "
        f"{config.batch_size * world * config.grad_accum}, lr {config.lr:g} x {world} = {lr:g}, "
        f"output {out_dir}"
    )
    bar = tqdm(total=steps_per_epoch * (config.epochs - first_epoch), unit="step", dynamic_ncols=True,
               leave=False, disable=ctx.rank != 0 or not config.progress)
    start = time.perf_counter()
    trained = 0
    evaluation = (float("nan"), float("nan"), 0)
    while state.epoch < config.epochs:
        t0 = time.perf_counter()
        loss_sum, samples = _train_epoch(model, state, config, train_data, device, autocast, bar)
        trained += samples
        # BatchNorm statistics drift apart per rank after the last forward:
        # evaluate (and checkpoint) rank 0's, the ones DDP broadcasts anyway.
        for buf in state.model.buffers():
            dist.broadcast(buf, src=0)
        evaluation = _evaluate(state.model, data.test, device, autocast)
        epoch_time = time.perf_counter() - t0
        record = {
            "epoch": state.epoch + 1, "step": state.step, "train_loss": loss_sum / samples,
            "test_loss": evaluation[0], "test_accuracy": evaluation[1], "lr": lr,
            "epoch_time_s": round(epoch_time, 4), "samples_per_s": round(samples / epoch_time, 1),
        }
        _end_epoch(state, record, config, out_dir, world, device)
        bar.set_postfix(epoch=state.epoch, loss=f"{record['train_loss']:.4f}", refresh=False)
        if ctx.rank == 0:
            bar.write(
                f"epoch {state.epoch}/{config.epochs}: train loss {record['train_loss']:.4f}, "
                f"test loss {record['test_loss']:.4f}, test accuracy {100 * record['test_accuracy']:.2f}%"
            )
    bar.close()
    wall = time.perf_counter() - start
    return _finish(state, config, evaluation, wall, trained, first_epoch, out_dir, world)


def _finish(state: TrainState, config: TrainConfig, evaluation: tuple[float, float, int], wall: float,
            trained: int, first_epoch: int, out_dir: Path, world: int) -> dict[str, Any]:
    """Final weights and ``summary.json``; every rank returns once they are on disk."""
    save_weights(out_dir / "model.safetensors", state.model.state_dict())
    test_loss, test_acc, n_test = evaluation
    summary = {
        "test_accuracy": test_acc, "test_loss": test_loss, "test_samples": n_test,
        "epochs": config.epochs, "world_size": world,
        "global_batch_size": config.batch_size * world * config.grad_accum,
        "lr": config.lr * world, "base_lr": config.lr, "wall_time_s": round(wall, 3),
        "samples_per_s": round(trained / wall, 1) if wall > 0 else None,
        "engine": config.engine, "model": config.model, "dataset": config.dataset,
        "amp": config.amp, "grad_accum": config.grad_accum, "resumed_from_epoch": first_epoch,
    }
    if dist.get_rank() == 0:
        rundir.write_json_atomic(out_dir / "summary.json", summary)
        print(
            f"test accuracy: {100 * test_acc:.2f}% on {n_test} images "
            f"(test loss {test_loss:.4f}), {config.epochs} epochs in {wall:.1f} s "
            f"on {world} process(es); weights in {out_dir / 'model.safetensors'}",
            flush=True,
        )
    barrier()
    return summary
