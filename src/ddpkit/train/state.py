"""``TrainState``: everything a training run needs to continue where it stopped.

The model (plain, not wrapped), optimizer, grad scaler and sampler, plus the
position (epoch, optimizer step), the per-epoch history and, when saved,
every rank's RNG state. :meth:`TrainState.payload` turns it into one nested
structure of tensors and plain data for :func:`ddpkit.save_checkpoint`;
:meth:`TrainState.load` puts such a payload back, each rank taking its own
RNG state, so a resumed run continues bit-identically.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.data.sampler import DistributedSampler
from ddpkit.train.checkpoint import load_model_state

__all__ = ["TrainState"]


@dataclass(kw_only=True)
class TrainState:
    """The live objects of a run and where it stands."""

    model: nn.Module
    """The plain module (its state dict has no ``module.`` prefix)."""
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: DistributedSampler
    epoch: int = 0
    """Epochs finished."""
    step: int = 0
    """Optimizer steps taken."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """One record per finished epoch (what ``metrics.jsonl`` holds)."""

    def payload(self, device: torch.device, **extra: Any) -> dict[str, Any]:
        """The checkpoint contents; a collective (it gathers every rank's RNG state)."""
        return {
            "epoch": self.epoch, "step": self.step, "history": self.history,
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(), "sampler": self.sampler.state_dict(),
            "rng": _gather_rng_states(device), **extra,
        }

    def load(self, payload: dict[str, Any], rank: int, device: torch.device) -> None:
        """Restore from :meth:`payload`'s output; this rank takes its own RNG state."""
        load_model_state(self.model, payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.scaler.load_state_dict(payload["scaler"])
        self.sampler.load_state_dict(payload["sampler"])
        self.epoch, self.step, self.history = payload["epoch"], payload["step"], list(payload["history"])
        torch.set_rng_state(payload["rng"]["torch"][rank].clone())
        if "cuda" in payload["rng"]:
            torch.cuda.set_rng_state(payload["rng"]["cuda"][rank].clone(), device)


def _gather_rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """Every rank's RNG states, stacked by rank (a collective)."""
    states = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    out = {}
    for name, s in states.items():
        parts = [torch.empty_like(s) for _ in range(dist.get_world_size())]
        if dist.get_backend() == "nccl":
            # NCCL moves device tensors only.
            gathered = [p.to(device) for p in parts]
            dist.all_gather(gathered, s.to(device))
            parts = [g.cpu() for g in gathered]
        else:
            dist.all_gather(parts, s)
        out[name] = torch.stack(parts)
    return out
