"""Ranks for the GPU tests: ``ddpkit.spawn`` on a backend, each rank's result saved and returned by rank.

The CPU suite's rank pool is gloo on the CPU; these start fresh ranks per
test, on NCCL (one GPU per rank) or on gloo with CUDA tensors (ranks may
share a GPU), and skip where there is no CUDA.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
"""GPUs on this machine: the NCCL tests run at this world size (users' machines have 8)."""
NO_CUDA = "needs CUDA: this machine has no GPU (scripts/gpu_check.sh runs this suite on one)"
needs_cuda = pytest.mark.skipif(GPUS == 0, reason=NO_CUDA)
needs_two = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs or more (this machine has "
                                                f"{GPUS}): DataParallel over several GPUs")


def _rank(rank: int, fn: Callable[..., Any], out: str, args: tuple) -> None:
    import ddpkit

    ctx = ddpkit.init()
    try:
        result = fn(ctx, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        ddpkit.shutdown()


def run(fn: Callable[..., Any], world: int, backend: str, *args: Any, env: dict[str, str] | None = None) -> list:
    """``fn(ctx, *args)`` on ``world`` ranks over ``backend``; each rank's return value (tensors to the CPU)."""
    from ddpkit.runtime.process import environment
    from ddpkit.runtime.spawn import spawn

    with environment(env or {}), tempfile.TemporaryDirectory() as tmp:
        spawn(_rank, world, args=(fn, tmp, args), backend=backend)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers, detached on the CPU."""
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool = True) -> bool:
    if a.keys() != b.keys():
        return False
    if exact:
        return all(torch.equal(a[k], b[k]) for k in a)
    return all(torch.allclose(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5) for k in a)
