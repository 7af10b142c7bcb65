"""What one run trains with, built from its TrainConfig: model, optimizer, scaler, sampler, engine.

``ddpkit train``'s engines: ddpkit's DDP, torch's DDP (for comparison), no
wrapper (``single``), or ``ddpkit.DataParallel`` (``dp``: one process whose
replicas each take ``batch_size`` samples, so the global batch and the scaled
learning rate are those of DDP at the same number of replicas).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddpkit.data.datasets import TokenDataset, load_dataset
from ddpkit.data.sampler import DistributedSampler
from ddpkit.models import build_model
from ddpkit.parallel.dp import DataParallel
from ddpkit.parallel.syncbn import SyncBatchNorm
from ddpkit.runtime.group import DistContext, init
from ddpkit.runtime.options import ConfigError
from ddpkit.train.train_config import SERVER_STRATEGIES, TrainConfig
from ddpkit.train.state import TrainState

__all__ = ["autocast_for", "build_state", "check_model", "dp_devices", "lr_scale", "make_deterministic", "model_for",
           "replicas", "set_lr", "shard_state", "sharded_params", "steps_left", "steps_per_epoch", "warmup_lr",
           "whole_epoch_steps", "with_comm_hook", "wrap"]


def wrap(model: torch.nn.Module, config: TrainConfig, device: torch.device,
         run_steps: int | None = None) -> torch.nn.Module:
    """``model`` in the engine ``config.engine`` names (``single`` and the strategies that keep the replicas
    together in the optimizer, ``optimizer``, ``ps-*`` and ``ssp``: as it is). ``run_steps``: the optimizer steps
    left to the run, which bound ``--comm-hook auto``'s trials."""
    ids = [device.index] if device.type == "cuda" else None
    if config.engine == "ddpkit" and config.strategy in SERVER_STRATEGIES:
        return model  # every worker starts from the parameters worker 0 gives the servers
    if config.engine == "ddpkit" and config.strategy in ("optimizer", "ssp"):
        from ddpkit.parallel.common.broadcast import broadcast_parameters

        broadcast_parameters(model.state_dict(), root_rank=0)  # what DDP's constructor does, Horovod's way
        return model
    if config.engine == "ddpkit":
        from ddpkit.parallel.ddp.wrapper import DistributedDataParallel

        stage = config.zero if config.zero >= 2 else 0
        return with_comm_hook(DistributedDataParallel(model, device_ids=ids, zero_stage=stage),
                              config, run_steps)
    if config.engine == "torch":
        from ddpkit._reference import torch_ddp

        return with_comm_hook(torch_ddp(model, device_ids=ids), config, run_steps)
    if config.engine == "dp":
        return DataParallel(model, device_ids=dp_devices(config))
    return model


def with_comm_hook(ddp: torch.nn.Module, config: TrainConfig, run_steps: int | None = None) -> torch.nn.Module:
    """``ddp`` (ddpkit's DDP or torch's) reducing its buckets with ``--comm-hook`` (ddpkit's hooks run on both;
    ``auto``'s trials within 2 % of ``run_steps``, where given)."""
    from ddpkit.comm import bucket_hooks as hooks, powersgd

    if config.comm_hook == "none":
        return ddp
    if config.comm_hook.startswith("auto"):
        from ddpkit.comm import auto
        from ddpkit.comm.schemes import Scheme, parse_comm

        def flags(scheme: Scheme) -> str:
            if scheme.name == "powersgd":
                return f"--comm-hook powersgd --powersgd-rank {scheme.rank}"
            return f"--comm-hook {scheme.name}"

        listed = parse_comm(config.comm_hook)  # auto: every candidate; auto:LIST: those
        assert isinstance(listed, tuple)
        candidates = list(listed)
        if config.engine == "torch":  # torch's reducer: PowerSGD's collectives of several buckets in flight can
            # go out in other orders on other ranks (as with torch's own hook), and bf16 only with CUDA and NCCL
            nccl = torch.distributed.get_backend() == "nccl"
            candidates = [s for s in candidates if s.name == "fp16" or (s.name == "bf16" and nccl)]
        # Under --amp fp16 the hook sees gradients times the loss scale, whose halving and doubling the guard would
        # take for the gradient's: no guard there.
        guard = None if config.amp == "fp16" else 0.5
        ddp.register_comm_hook(auto.AutoComm(candidates=candidates, pin=flags, guard=guard, run_steps=run_steps,
                                             say=lambda line: print(line, flush=True)), auto.auto_hook)
    elif config.comm_hook == "powersgd":
        state = powersgd.PowerSGDState(None, matrix_approximation_rank=config.powersgd_rank,
                                       start_powerSGD_iter=config.powersgd_start)
        ddp.register_comm_hook(state, powersgd.powersgd_hook)
    else:
        ddp.register_comm_hook(None, {"fp16": hooks.fp16_compress_hook, "bf16": hooks.bf16_compress_hook}[
            config.comm_hook])
    return ddp


def make_deterministic() -> None:
    """``--deterministic``: only kernels that give the same bits every run (cuDNN's and cuBLAS's included).

    cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` when this process first uses it,
    which is after this call: the worker has run no matrix product yet.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def start_survivor(config: TrainConfig, *, check_world: bool = True) -> tuple[DistContext, Path, Any]:
    """A worker of ``--on-failure continue`` under its launcher: joined (no default group), deterministic if asked,
    one thread share of the cores, its ``--output-dir`` made, the dataset loaded; ``(context, output dir, data)``.

    Raises:
        ConfigError: no ``--output-dir`` (workers whose first rank may die cannot agree on a new name).
    """
    ctx = init(backend=config.backend)
    if config.deterministic:
        make_deterministic()
    if config.output_dir is None:
        raise ConfigError("--on-failure continue under ddpkit launch needs --output-dir: the same folder for every "
                          "worker")
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.local_world_size))
    if check_world:  # else the caller checks it against the world the run started with (``--resume``)
        config.check_world(ctx.world_size)
    data = load_dataset(config.dataset, data_dir=config.data_dir, download=config.download,
                        synthetic_samples=config.synthetic_samples, train_samples=config.train_samples,
                        test_samples=config.test_samples)
    return ctx, out, data


def dp_devices(config: TrainConfig) -> list[int] | list[str]:
    """``--engine dp``: every GPU, else ``--nproc-per-node`` (default 2) CPU replicas."""
    if torch.cuda.is_available():
        return list(range(torch.cuda.device_count()))
    return ["cpu"] * (config.nproc_per_node or 2)


def replicas(config: TrainConfig) -> int:
    """Model replicas per process: a DataParallel step is that many per-process batches."""
    return len(dp_devices(config)) if config.engine == "dp" else 1


def lr_scale(config: TrainConfig, world: int) -> int:
    """How many times ``--lr`` the optimizer steps with at ``world`` processes (:meth:`TrainConfig.lr_scale`, with
    this process's replicas: DataParallel's devices)."""
    return config.lr_scale(world, replicas=replicas(config))


def model_for(config: TrainConfig, train_set: Any) -> torch.nn.Module:
    """``config.model`` built for ``train_set``: a text's symbols and context, or an image's shape and classes."""
    if isinstance(train_set, TokenDataset):
        return build_model(config.model, vocab_size=train_set.vocab_size, block_size=train_set.block_size)
    return build_model(config.model, in_channels=train_set.in_channels, image_size=train_set.image_size,
                       num_classes=train_set.num_classes)


def check_model(config: TrainConfig, data: Any) -> None:
    """What only the model can say of ``config``, before any worker starts (the model built without memory).

    Raises:
        ConfigError: ``--fragments`` beyond the model's trainable parameters.
    """
    if config.strategy != "diloco" or config.fragments == 1:
        return
    with torch.device("meta"):
        trainable = sum(1 for p in model_for(config, data.train).parameters() if p.requires_grad)
    if config.fragments > trainable:
        raise ConfigError(f"--fragments {config.fragments} must be at most the {trainable} trainable parameters of "
                          f"--model {config.model}: each fragment holds at least one")


def build_state(config: TrainConfig, data: Any, world: int, device: torch.device) -> TrainState:
    """A fresh run's model, optimizer, scaler and sampler; the model seeded by ``config.seed``.

    Under ``--zero 3`` the model is built on the meta device, without memory: :func:`wrap` materialises it unit
    by unit, each rank keeping its shard (the same values, drawn in the same order), and the optimizer is made
    again over the shards (:func:`shard_state`).
    """
    torch.manual_seed(config.seed)
    train_set = data.train
    sharded = sharded_params(config)
    with torch.device("meta") if sharded else contextlib.nullcontext():
        model = model_for(config, train_set)
    if not sharded:
        model = model.to(device)
    if config.sync_bn:
        model = SyncBatchNorm.convert_sync_batchnorm(model)
    lr = config.lr * lr_scale(config, world)
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
        extra={"epoch": 0, "batches_done": 0, "history": [], "partial": torch.zeros(world, 2, dtype=torch.float64),
               "world_size": world, "config": config.to_dict(),
               "seen": torch.zeros(len(train_set), dtype=torch.int32)},
        keep=config.keep_checkpoints,
        count_steps=False,  # the loop counts its steps itself (an fp16 step skipped for inf still counts)
    )


def warmup_lr(config: TrainConfig, scale: int, step: int, steps_per_epoch: int) -> float:
    """The learning rate of optimizer step ``step`` (from 0): ``--lr`` x ``scale``, reached linearly from one
    process's over ``--warmup-epochs`` (a function of the step alone, so a resumed run or a replacement takes the
    same rates)."""
    target = config.lr * scale
    ramp = config.warmup_for(scale) * steps_per_epoch
    if step >= ramp:
        return target
    return config.lr + (target - config.lr) * step / ramp


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def steps_per_epoch(config: TrainConfig, num_samples: int) -> int:
    """Optimizer steps in an epoch of a rank's shard of ``num_samples`` samples."""
    return math.ceil(math.ceil(num_samples / (config.batch_size * replicas(config))) / config.grad_accum)


def whole_epoch_steps(config: TrainConfig, sampler: DistributedSampler) -> int:
    """Optimizer steps in a whole epoch of ``sampler``'s world: ``ceil(len / world)`` samples a rank (padded), also
    while the sampler finishes an epoch re-sharded after a resume at another world (its ``num_samples`` then the
    rest's)."""
    return steps_per_epoch(config, math.ceil(len(sampler.dataset) / sampler.num_replicas))


def steps_left(config: TrainConfig, sampler: DistributedSampler, epoch: int, mid_epoch: bool) -> int:
    """Optimizer steps from ``sampler``'s position in epoch ``epoch`` (from 0) to the run's end: where the run stands
    ``mid_epoch``, the rest of this epoch (``len(sampler)``: re-sharded after a resume at another world), then
    whole epochs (an epoch's start is a whole one, whatever offset the sampler kept from the epoch before)."""
    if epoch >= config.epochs:
        return 0
    whole = whole_epoch_steps(config, sampler)
    first = steps_per_epoch(config, len(sampler)) if mid_epoch else whole
    return first + whole * (config.epochs - epoch - 1)


def sharded_params(config: TrainConfig) -> bool:
    """Whether the run shards its parameters (ddpkit's engine with ``--zero 3``)."""
    return config.engine == "ddpkit" and config.zero == 3 and config.strategy == "ddp"


def shard_state(state: TrainState, config: TrainConfig, device: torch.device) -> torch.nn.Module:
    """``--zero 3``: the model wrapped (materialised and sharded) and the optimizer made again over its shards,
    before any checkpoint is loaded (so that the random draws of the initialisation come first, as when the
    model is built whole, and the checkpoint's RNG states last). Returns the wrapped model."""
    from ddpkit.parallel.zero.stage3 import optimizer_over_shards

    model = wrap(state.model, config, device)
    state.optimizer = optimizer_over_shards(state.optimizer, model)
    return model


def autocast_for(config: TrainConfig, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.amp)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)
