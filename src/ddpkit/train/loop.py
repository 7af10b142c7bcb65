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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddpkit.data.datasets import TensorDataset, load_dataset
from ddpkit.data.sampler import DistributedSampler
from ddpkit.runtime.discovery import discover
from ddpkit.runtime.group import barrier, init, print0, shutdown, zero_first
from ddpkit.runtime.options import ConfigError
from ddpkit.runtime.spawn import spawn
from ddpkit.train import rundir
from ddpkit.train.checkpoint import load_checkpoint, load_model_state, save_checkpoint, save_weights
from ddpkit.train.config import TrainConfig
from ddpkit.train.models import build_model

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


def _rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """Every rank's RNG states, stacked by rank (a collective)."""
    states = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    out = {}
    for name, s in states.items():
        parts = [torch.empty_like(s) for _ in range(dist.get_world_size())]
        if dist.get_backend() == "nccl":
            gathered = [p.to(device) for p in parts]
            dist.all_gather(gathered, s.to(device))
            parts = [g.cpu() for g in gathered]
        else:
            dist.all_gather(parts, s)
        out[name] = torch.stack(parts)
    return out


def _evaluate(model: torch.nn.Module, test: TensorDataset, device: torch.device, autocast) -> tuple[float, float, int]:
    """Loss and accuracy over the whole test split, each sample once across ranks."""
    sampler = DistributedSampler(test, shuffle=False, pad=False)
    idx = torch.tensor(list(sampler), dtype=torch.long)
    totals = torch.zeros(3, dtype=torch.float64)
    model.eval()
    # The plain module: shards differ in length by one, so no per-batch
    # collective (DDP's buffer broadcast) may run here.
    with torch.no_grad():
        for start in range(0, len(idx), 256):
            b = idx[start : start + 256]
            x, y = test.images[b].to(device), test.labels[b].to(device)
            with autocast():
                out = model(x)
            totals[0] += F.cross_entropy(out.float(), y, reduction="sum").item()
            totals[1] += (out.argmax(1) == y).sum().item()
            totals[2] += len(b)
    model.train()
    dist.all_reduce(totals)
    loss_sum, correct, n = totals.tolist()
    return loss_sum / n, correct / n, int(n)


def _worker(rank: int, config: TrainConfig, out: str | None) -> dict[str, Any]:
    from tqdm import tqdm

    del rank
    ctx = init(backend=config.backend)
    world = ctx.world_size
    if "OMP_NUM_THREADS" not in os.environ:
        # Ranks that share a node's cores must not each spin up a thread per
        # core: oversubscribed, a step runs several times slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.local_world_size))
    out_dir = Path(_agree_on_output_dir(config, out, world))
    device = ctx.device

    with zero_first():  # a --download happens once per node
        data = _load_data(config)
    train_set = data.train
    train_x, train_y = train_set.images.to(device), train_set.labels.to(device)

    torch.manual_seed(config.seed)
    plain = build_model(
        config.model, in_channels=train_set.in_channels, image_size=train_set.image_size,
        num_classes=train_set.num_classes,
    ).to(device)
    lr = config.lr * world
    if config.optimizer == "sgd":
        opt = torch.optim.SGD(plain.parameters(), lr=lr, momentum=config.momentum, weight_decay=config.weight_decay)
    else:
        opt = torch.optim.AdamW(plain.parameters(), lr=lr, weight_decay=config.weight_decay)
    scaler = torch.amp.GradScaler("cuda", enabled=config.amp == "fp16")
    sampler = DistributedSampler(train_set, shuffle=True, seed=config.seed)
    history: list[dict[str, Any]] = []
    first_epoch, step = 0, 0

    latest = rundir.latest_checkpoint(out_dir) if config.resume else None
    if latest is not None:
        state = load_checkpoint(latest[1])
        load_model_state(plain, state["model"])
        opt.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        sampler.load_state_dict(state["sampler"])
        first_epoch, step, history = state["epoch"], state["step"], state["history"]
        torch.set_rng_state(state["rng"]["torch"][ctx.rank].clone())
        if "cuda" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"]["cuda"][ctx.rank].clone(), device)
        if ctx.rank == 0:
            # Epochs after the checkpoint are trained again: their old lines go.
            _write_metrics(out_dir, history)
    model = _wrap(plain, config, device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.amp)
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext

    batches_per_epoch = math.ceil(len(sampler) / config.batch_size)
    steps_per_epoch = math.ceil(batches_per_epoch / config.grad_accum)
    bar = tqdm(
        total=steps_per_epoch * (config.epochs - first_epoch), disable=ctx.rank != 0 or not config.progress,
        unit="step", dynamic_ncols=True, leave=False,
    )
    print0(
        f"ddpkit train: {config.model} on {config.dataset} ({len(train_set)} train / {len(data.test)} test), "
        f"engine {config.engine}, {world} process(es), global batch "
        f"{config.batch_size * world * config.grad_accum}, lr {config.lr:g} x {world} = {lr:g}, "
        f"output {out_dir}"
    )
    start = time.perf_counter()
    trained_samples = 0
    summary_eval = (float("nan"), float("nan"), 0)
    for epoch in range(first_epoch, config.epochs):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        idx = torch.tensor(list(sampler), dtype=torch.long, device=device)
        batches = [idx[i : i + config.batch_size] for i in range(0, len(idx), config.batch_size)]
        loss_sum = torch.zeros(2, dtype=torch.float64)
        for s in range(0, len(batches), config.grad_accum):
            group = batches[s : s + config.grad_accum]
            opt.zero_grad(set_to_none=True)
            for j, b in enumerate(group):
                last = j == len(group) - 1
                sync = contextlib.nullcontext() if last or config.engine == "single" else model.no_sync()
                with sync:
                    with autocast():
                        out_logits = model(train_x[b])
                    loss = F.cross_entropy(out_logits.float(), train_y[b])
                    scaler.scale(loss / len(group)).backward()
                loss_sum[0] += loss.item() * len(b)
                loss_sum[1] += len(b)
            scaler.step(opt)
            scaler.update()
            step += 1
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.4f}", refresh=False)
        trained_samples += int(loss_sum[1].item())
        dist.all_reduce(loss_sum)
        # BatchNorm statistics drift apart per rank after the last forward:
        # evaluate (and checkpoint) rank 0's, the ones DDP broadcasts anyway.
        for buf in plain.buffers():
            dist.broadcast(buf, src=0)
        summary_eval = _evaluate(plain, data.test, device, autocast)
        epoch_time = time.perf_counter() - t0
        record = {
            "epoch": epoch + 1, "step": step,
            "train_loss": loss_sum[0].item() / loss_sum[1].item(),
            "test_loss": summary_eval[0], "test_accuracy": summary_eval[1],
            "lr": lr, "epoch_time_s": round(epoch_time, 4),
            "samples_per_s": round(loss_sum[1].item() / epoch_time, 1),
        }
        history.append(record)
        state = {
            "format": 1, "epoch": epoch + 1, "step": step, "world_size": world,
            "config": config.to_dict(), "history": history,
            "model": plain.state_dict(), "optimizer": opt.state_dict(),
            "scaler": scaler.state_dict(), "sampler": sampler.state_dict(),
            "rng": _rng_states(device),
        }
        save_checkpoint(out_dir / rundir.CHECKPOINT_DIR / f"epoch-{epoch + 1:04d}.safetensors", state)
        if ctx.rank == 0:
            with open(out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            bar.write(
                f"epoch {epoch + 1}/{config.epochs}: train loss {record['train_loss']:.4f}, "
                f"test loss {record['test_loss']:.4f}, test accuracy {100 * record['test_accuracy']:.2f}%"
            )
    bar.close()
    wall = time.perf_counter() - start
    save_weights(out_dir / "model.safetensors", plain.state_dict())
    test_loss, test_acc, n_test = summary_eval
    summary = {
        "test_accuracy": test_acc, "test_loss": test_loss, "test_samples": n_test,
        "epochs": config.epochs, "world_size": world,
        "global_batch_size": config.batch_size * world * config.grad_accum,
        "lr": lr, "base_lr": config.lr, "wall_time_s": round(wall, 3),
        "samples_per_s": round(trained_samples * world / wall, 1) if wall > 0 else None,
        "engine": config.engine, "model": config.model, "dataset": config.dataset,
        "amp": config.amp, "grad_accum": config.grad_accum, "resumed_from_epoch": first_epoch,
    }
    if ctx.rank == 0:
        rundir.write_json_atomic(out_dir / "summary.json", summary)
        print(
            f"test accuracy: {100 * test_acc:.2f}% on {n_test} images "
            f"(test loss {test_loss:.4f}), {config.epochs} epochs in {wall:.1f} s "
            f"on {world} process(es); weights in {out_dir / 'model.safetensors'}",
            flush=True,
        )
    barrier()
    return summary


def _write_metrics(out_dir: Path, history: list[dict[str, Any]]) -> None:
    tmp = out_dir / ".metrics.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in history))
    os.replace(tmp, out_dir / "metrics.jsonl")
