"""ZeRO stage 3 for what it exists for: a model whose whole weights do not fit one rank's memory trains, saves,
resumes bit-identically and loads into a plain module, each rank under a kernel-enforced memory limit.

Each of four ranks joins a memory cgroup (:class:`ddpkit.bench.runners.memory_cap.MemoryCap`) that lets it touch ``BUDGET``
bytes of new memory, and the kernel kills it past that. The model's weights alone are 1.25 times the budget: a
process that builds it whole in the same cap is killed (the control). Stage 3 builds it on the meta device,
materialises each rank's rows unit by unit, and trains.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.bench.runners.memory_cap import MemoryCap, unavailable

pytestmark = [pytest.mark.skipif(unavailable() is not None, reason=f"no memory cap here: {unavailable()}"),
              pytest.mark.alone("four ranks at a time, each under a kernel memory cap")]

DEPTH, WIDTH = 96, 512
WHOLE = DEPTH * (WIDTH * WIDTH + WIDTH) * 4
"""The weights in bytes (fp32): 100.8 MB."""
BUDGET = int(WHOLE / 1.25)
"""What each rank may touch: four fifths of the weights (80.6 MB). A rank's rows of the weights and of their
gradients are half the weights (50.4 MB); with what the steps, the saves and the loads hold beside them it peaks at
65-66 MB of resident memory (measured in the cap, memory.stat's rss sampled each millisecond; the saves' page cache
fills the cap's rest, which the kernel reclaims): under a cap of two thirds of the weights (67 MB) that left a
megabyte or so, and a rank of a whole run was once killed."""


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def _steps(model: nn.Module, first: int, count: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x = torch.randn(8, WIDTH, generator=g)
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    opt.zero_grad(set_to_none=True)


def _sharded(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = _model()
    return ddpkit.DDP(model, zero_stage=3)


def _under_the_cap(root: str) -> int:
    from ddpkit.bench.sections.memory import fix_mmap_threshold

    fix_mmap_threshold()  # freed tensors go back to the kernel at once (see ddpkit.bench.sections.memory)
    _steps(ddpkit.DDP(nn.Sequential(nn.Linear(WIDTH, 4), nn.Linear(4, 4)), zero_stage=3), 0, 1)  # first-use costs
    gc.collect()
    cap = MemoryCap(f"ddpkit-test-{os.getpid()}", BUDGET)
    try:
        with cap.entered():
            # Four steps at once...
            model = _sharded(0)
            _steps(model, 0, 4)
            ddpkit.save_sharded(model, f"{root}/straight")
            del model
            gc.collect()
            # ...and two, a checkpoint, a new job's model from it, and two more.
            model = _sharded(0)
            _steps(model, 0, 2)
            ddpkit.save_sharded(model, f"{root}/half")
            del model
            gc.collect()
            model = _sharded(1)  # other initial values: the checkpoint replaces them all
            ddpkit.load_sharded(model, f"{root}/half")
            _steps(model, 2, 2)
            ddpkit.save_sharded(model, f"{root}/resumed")
            del model
            gc.collect()
        return cap.peak()
    finally:
        cap.close()


@pytest.mark.slow("four ranks train a 100 MB model six times over in 1 s steps, under a kernel memory limit")
def test_a_model_larger_than_a_ranks_memory_trains_saves_resumes_and_loads_whole(dist4, tmp_path):
    peaks = dist4.run(_under_the_cap, str(tmp_path), timeout=300)
    assert all(0 < peak <= BUDGET for peak in peaks), (peaks, BUDGET)
    straight = ddpkit.consolidate_sharded(tmp_path / "straight")["model"]
    resumed = ddpkit.consolidate_sharded(tmp_path / "resumed")["model"]
    assert list(straight) == list(resumed) and all(torch.equal(straight[k], resumed[k]) for k in straight)
    plain = _model()
    plain.load_state_dict(straight)  # the whole model, outside the cap, as a plain module
    assert sum(p.numel() * p.element_size() for p in plain.parameters()) == WHOLE > BUDGET * 1.24


def test_the_same_model_built_whole_under_the_same_cap_is_killed(tmp_path):
    cap = MemoryCap(f"ddpkit-test-control-{os.getpid()}", BUDGET)
    try:
        # As the ranks: the interpreter and torch loaded first, outside the cap; then the model, whole, inside it.
        script = (f"import os, torch; from torch import nn; open({str(cap.path / 'cgroup.procs')!r}, 'w')"
                  f".write(str(os.getpid())); m = nn.Sequential(*[nn.Linear({WIDTH}, {WIDTH}) "
                  f"for _ in range({DEPTH})]); print('built')")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert done.returncode == -9 and "built" not in done.stdout, (done.returncode, done.stdout, done.stderr)
        assert cap.oom_kills() >= 1
    finally:
        cap.close()
