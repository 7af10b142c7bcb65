"""The workloads ``ddpkit bench`` times: a model, a batch per rank, and one SGD step.

Workloads:

* ``convnet``: the tutorial's MNIST ConvNet (:class:`ddpkit.models.ConvNet`),
  ``samples_per_rank`` 28x28 images per rank and step; compute-bound;
* ``mlp``: :class:`ddpkit.models.MLP` with ``mlp_hidden`` 4640 (about 25 M
  parameters, 100 MB of float32 gradients) on ``mlp_batch`` images per rank;
  communication-bound;
* ``resnet``: :class:`ddpkit.models.ResNet` (ResNet-8, BatchNorm after every
  convolution, 16/32/64 channels) on ``resnet_batch`` 28x28 images per rank: both
  engines broadcast its BatchNorm buffers from rank 0 before every forward;
* ``transformer``: a 6-layer ``nn.TransformerEncoder`` (d_model 256, 8 heads,
  feed-forward 1024, no dropout) and a linear head over the mean token, on
  ``transformer_batch`` (8) sequences of 32 tokens per rank (74 parameters, 4.7 M);
* ``linear200``: 200 ``Linear(16, 16)`` layers with tanh between them, on
  ``mlp_batch`` rows per rank: 400 tiny parameters, so the step is dominated
  by what the engine does per parameter.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.bench.bench_config import BenchConfig
from ddpkit.models import MLP, ConvNet, DeepLinear, ResNet, TransformerClassifier

__all__ = ["BATCH_FIELD", "stepper", "sync_device", "workload"]

BATCH_FIELD = {"convnet": "samples_per_rank", "mlp": "mlp_batch", "linear200": "mlp_batch",
               "transformer": "transformer_batch", "resnet": "resnet_batch"}
"""The setting that holds each workload's batch per rank."""


def workload(name: str, cfg: BenchConfig) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model of workload ``name`` (seeded alike on every rank) and this rank's batch of it."""
    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    batch = getattr(cfg, BATCH_FIELD[name])
    shape = {"transformer": (batch, 32, 256), "linear200": (batch, 16)}.get(name, (batch, 1, 28, 28))
    x = torch.randn(*shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    torch.manual_seed(0)
    models = {"convnet": ConvNet, "mlp": lambda: MLP(hidden=cfg.mlp_hidden), "transformer": TransformerClassifier,
              "linear200": DeepLinear, "resnet": ResNet}
    device = bench_device(cfg)
    return models[name]().to(device), x.to(device), y.to(device)


def bench_device(cfg: BenchConfig) -> torch.device:
    """Where this rank's models and batches live: the CPU, or under ``--device cuda`` the rank's GPU."""
    return torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")


def sync_device(x: torch.Tensor) -> None:
    """Wait for the GPU's queued work (a CUDA step is timed to its end, not to its launch); nothing on the CPU."""
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def stepper(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], float]:
    """One SGD training step of ``model`` on ``(x, y)`` per call (momentum 0.9); returns its time in seconds."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> float:
        sync_device(x)
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sync_device(x)
        return time.perf_counter() - start

    return step
