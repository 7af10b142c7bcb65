"""Ranks for the GPU tests: ``ddpkit.spawn`` on a backend, each rank's result saved and returned by rank.

The CPU suite's rank pool is gloo on the CPU; these start fresh ranks per
test, on NCCL (one GPU per rank) or on gloo with CUDA tensors (ranks may
share a GPU), and skip where there is no CUDA.

Every rank runs under deterministic algorithms (:func:`deterministic`):
cuDNN's default convolution backward adds in a different order from run to
run, so without them even torch against torch differs after a few steps and
a bitwise comparison proves nothing.

On a machine without a GPU the suite *rehearses* (``DDPKIT_GPU_SUITE_ON_CPU``,
on by default there; ``=0`` turns it off): it pretends one GPU is there and
runs the ``nccl`` ranks on gloo and the CPU, so that every test's own logic
runs in the CPU suite, and in CI, before a GPU machine (whose time is
scarce) runs it for real. What needs CUDA itself (NCCL, autocast on CUDA,
CUDA memory, device ids) is skipped there, saying so; the DDP cases, the
commands and the strategies run. There the gloo ranks of :func:`run` are a
pool of persistent ranks per world size (``tests/harness.py``), started once
and reused by every case, as the CPU suite's unit tests do; a case that
needs an environment of its own, parameter servers or another backend
starts fresh ranks.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

ON_CPU = os.environ.get("DDPKIT_GPU_SUITE_ON_CPU", "0" if torch.cuda.is_available() else "1") == "1"
"""A rehearsal on the CPU (see the module notes)."""
GPUS = 1 if ON_CPU else torch.cuda.device_count() if torch.cuda.is_available() else 0
"""GPUs on this machine: the NCCL tests run at this world size (users' machines have 8)."""
NCCL = "gloo" if ON_CPU else "nccl"
"""The backend of the one-GPU-per-rank tests."""
NO_CUDA = "needs CUDA: this machine has no GPU (scripts/gpu_check.sh runs this suite on one)"
needs_cuda = pytest.mark.skipif(GPUS == 0, reason=NO_CUDA)
needs_two = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs or more (this machine has "
                                                f"{GPUS}): DataParallel over several GPUs")
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""cuBLAS reads it when a process first uses it: set in the environment ranks start with."""


def deterministic() -> None:
    """Deterministic algorithms in this process (what ``ddpkit train --deterministic`` sets)."""
    os.environ.update(DETERMINISTIC_ENV)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def _rank(rank: int, fn: Callable[..., Any], out: str, args: tuple) -> None:
    import ddpkit

    deterministic()
    ctx = ddpkit.init()
    try:
        result = fn(ctx, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        ddpkit.shutdown()


_POOLS: dict[int, Any] = {}
"""The rehearsal's persistent gloo ranks, by world size."""


def _pooled(fn: Callable[..., Any], args: tuple) -> Any:
    import ddpkit

    os.environ.update(DETERMINISTIC_ENV)
    deterministic()
    return fn(ddpkit.init(), *args)


def run(fn: Callable[..., Any], world: int, backend: str, *args: Any, env: dict[str, str] | None = None,
        num_servers: int = 0) -> list:
    """``fn(ctx, *args)`` on ``world`` ranks over ``backend``; each rank's return value (tensors to the CPU)."""
    from ddpkit.runtime.process import environment
    from ddpkit.runtime.spawn import spawn

    if ON_CPU and backend == "gloo" and not env and not num_servers:
        from harness import RankPool

        pool = _POOLS.get(world) or _POOLS.setdefault(world, RankPool(world))
        return pool.run(_pooled, fn, args, timeout=300)

    with environment({**DETERMINISTIC_ENV, **(env or {})}), tempfile.TemporaryDirectory() as tmp:
        spawn(_rank, world, args=(fn, tmp, args), backend=backend, num_servers=num_servers)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers, detached on the CPU."""
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool = True) -> bool:
    if a.keys() != b.keys() or not a:
        return False
    if exact:
        return all(torch.equal(a[k], b[k]) for k in a)
    return all(torch.allclose(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5) for k in a)


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The largest absolute difference per tensor that differs, and every key one side lacks (for a failure's
    message): empty only when both hold the same keys, each equal, and hold something."""
    if not a or not b:
        return {"<empty>": f"{len(a)} tensors against {len(b)}"}
    missing = {k: "missing on one side" for k in sorted(set(a) ^ set(b))}
    return {**missing, **{k: (a[k].double() - b[k].double()).abs().max().item()
                          for k in a if k in b and not torch.equal(a[k], b[k])}}
