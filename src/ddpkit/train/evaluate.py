"""Loss and accuracy over the whole test split: each sample counted exactly once across ranks, or on one rank
alone (``--on-failure continue``, where members may die)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddpkit.data.datasets import TensorDataset
from ddpkit.data.sampler import DistributedSampler
from ddpkit.parallel.zero.stage3 import engine_of
from ddpkit.runtime import events
from ddpkit.runtime.devices import comm_tensor

__all__ = ["evaluate", "evaluate_alone"]


def evaluate(model: torch.nn.Module, test: TensorDataset, device: torch.device,
             autocast: Callable[[], contextlib.AbstractContextManager]) -> tuple[float, float, int]:
    """``(loss, accuracy, samples)`` of the plain ``model`` over ``test`` (a collective); for a text's samples, per
    symbol: the mean loss and accuracy of predicting each next one, and the number of symbols.

    An unpadded sampler gives every sample to exactly one rank, so the shards
    differ in length by one: no per-batch collective (DDP's buffer broadcast)
    may run here, hence the plain module. The sums are reduced across ranks in
    float64.
    """
    sampler = DistributedSampler(test, shuffle=False, pad=False)
    idx = torch.tensor(list(sampler), dtype=torch.long)
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    # A model whose parameters are sharded (ZeRO-3) gathers them in every forward, a collective: every rank then
    # runs as many forwards as the longest shard needs (the last of a shorter one maybe empty).
    longest = len(range(0, len(test), dist.get_world_size())) if engine_of(model) is not None else len(idx)
    model.eval()
    with torch.no_grad():
        for start in range(0, longest, 256):
            b = idx[start : start + 256]
            xb, yb = test.images[b].to(device), test.labels[b].to(device)
            with autocast():
                out = model(xb)
            totals[0] += F.cross_entropy(out.float().flatten(0, -2), yb.flatten(), reduction="sum").double()
            totals[1] += (out.argmax(-1) == yb).sum()
            totals[2] += yb.numel()  # a sample, or each symbol of a text's sample
    model.train()
    totals = comm_tensor(totals)
    events.collective("train: sum the evaluation's loss and accuracy", nbytes=totals.numel() * totals.element_size())
    dist.all_reduce(totals)
    loss_sum, correct, n = totals.tolist()
    return loss_sum / n, correct / n, int(n)


def evaluate_alone(model: torch.nn.Module, test: TensorDataset, device: torch.device,
                   autocast: Callable[[], contextlib.AbstractContextManager]) -> tuple[float, float, int]:
    """``(loss, accuracy, samples)`` of ``model`` over the whole ``test`` split on this rank alone (no collective:
    under ``--on-failure continue`` members may die)."""
    loss, correct, n = 0.0, 0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(test), 256):
            xb, yb = test.images[start : start + 256].to(device), test.labels[start : start + 256].to(device)
            with autocast():
                out = model(xb)
            loss += float(F.cross_entropy(out.float().flatten(0, -2), yb.flatten(), reduction="sum"))
            correct += int((out.argmax(-1) == yb).sum())
            n += yb.numel()
    model.train()
    return loss / n, correct / n, n
