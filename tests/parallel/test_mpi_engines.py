"""Every engine over the mpi backend, against the same engine over gloo.

Each case trains a few steps on per-rank data and returns the final
parameters, buffers (and for DDP the gradients). At world 2 every reduction
adds two numbers, whatever the library, so the mpi run must equal the gloo
run bit for bit; at world 3 MPI may add in another order than gloo's ring,
so results agree within 1e-6 relative (float32 rounding of a few additions
per step, over a few steps), and the compression hooks within their own
dtype's rounding (see HALF_WORLD3).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ddp_models import batch, make, pair, state, train
from torch import nn

import ddpkit

pytestmark = pytest.mark.slow("trains every engine over mpirun ranks and gloo ranks, about a minute")

EXACT = {"rtol": 0.0, "atol": 0.0}
WORLD3 = {"rtol": 1e-6, "atol": 1e-7}
HALF_WORLD3 = {"fp16_hook": {"rtol": 0.0, "atol": 1.5e-4}, "bf16_hook": {"rtol": 0.0, "atol": 2e-3},
               # Sparse gradients: each backend coalesces the duplicate rows of three ranks in its own order, and
               # the rows hold sums of many terms (seen: 1.2e-6 relative, about ten float32 ulps, on a loaded machine)
               "sparse": {"rtol": 1e-5, "atol": 1e-6}}
"""The compression hooks sum in float16/bfloat16: three gradients added in another order differ by a unit in the
last place of that dtype (1e-3 and 8e-3 relative), and four steps of lr 0.1 carry that into the parameters."""


def _plain(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ddpkit.unwrap(model).state_dict().items()}


def run_case(case: str) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    if case == "ddp":
        ours, _ = pair("convbn")
        return state(train(ours, "convbn", 3, 0.9))
    if case == "ddp_static_graph":
        ours, _ = pair("convbn", static_graph=True)
        return state(train(ours, "convbn", 3, 0.9))
    if case == "torch_ddp":  # torch's own DDP (its C++ reducer) over this process group
        _, theirs = pair("convbn")
        return state(train(theirs, "convbn", 3, 0.9))
    if case == "no_sync":
        ours, _ = pair("convbn")
        return state(train(ours, "convbn", 2, 0.9, micro=3))
    if case == "unused":
        ours, _ = pair("branchy", find_unused_parameters=True)
        return state(train(ours, "branchy", 3, 0.9, lambda step: {"branch": step % 2 == 0 or rank == 0}))
    if case in ("fp16_hook", "bf16_hook", "powersgd"):
        ours, _ = pair("convbn")
        if case == "powersgd":
            ours.register_comm_hook(ddpkit.hooks.PowerSGDState(None, matrix_approximation_rank=1,
                                                               start_powerSGD_iter=2), ddpkit.hooks.powersgd_hook)
        else:
            ours.register_comm_hook(None, getattr(ddpkit.hooks, f"{case[:4]}_compress_hook"))
        return state(train(ours, "convbn", 4, 0.9))
    if case == "syncbn":
        model = ddpkit.DDP(ddpkit.SyncBatchNorm.convert_sync_batchnorm(make("convbn")))
        return state(train(model, "convbn", 3, 0.9))
    if case == "join":
        model = ddpkit.DDP(make("convbn"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for step in range(2 + 2 * rank):  # uneven inputs: 2, 4, 6 batches
                x, y = batch("convbn", 500 + 10 * step + rank)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        return _plain(model)
    if case in ("zero1", "zero2", "zero3"):
        module = make("convbn")
        # Adam at world 2 (its state is what ZeRO shards); SGD at world 3, where Adam would blow the summation
        # order's last-bit noise up to a step of lr in conv1.bias, whose true gradient is zero (BatchNorm follows).
        kind, hyper = (torch.optim.Adam, {"lr": 0.01}) if dist.get_world_size() == 2 else \
            (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
        if case == "zero1":
            model = ddpkit.DDP(module)
            opt = ddpkit.ZeroRedundancyOptimizer(model.parameters(), kind, **hyper)
        else:
            model = ddpkit.DDP(module, zero_stage=int(case[-1]))
            opt = kind(model.parameters(), **hyper)
        for step in range(3):
            x, y = batch("convbn", 700 + 10 * step + rank)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    if case == "local_sgd":
        model = ddpkit.DDP(make("convbn"))
        local = ddpkit.LocalSGD(model, period=2, warmup_steps=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(5):
            x, y = batch("convbn", 900 + 10 * step + rank)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            local.step()
        return _plain(model)
    if case in ("diloco", "diloco_streaming_int8"):
        model = ddpkit.DDP(make("convbn"))
        streaming = {"fragments": 2, "delay": 1, "mixing": 0.5, "codec": "int8"} if case != "diloco" else {}
        diloco = ddpkit.DiLoCo(model, sync_every=2, **streaming)
        # Inner SGD: Adam's normalisation turns the last bit of a three-rank sum (each backend adds in its own
        # order) into a step of lr on a near-zero gradient.
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(5):
            x, y = batch("convbn", 1300 + 10 * step + rank)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            diloco.step()
        return _plain(model)
    if case == "distributed_optimizer":
        module = make("convbn")
        ddpkit.broadcast_parameters(module.state_dict(), root_rank=0)
        opt = ddpkit.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=0.1),
                                          named_parameters=module.named_parameters())
        for step in range(3):
            x, y = batch("convbn", 1100 + 10 * step + rank)
            opt.zero_grad()
            nn.functional.cross_entropy(module(x), y).backward()
            opt.step()
        return _plain(module)
    if case == "sparse":
        from ddp_models import SparseEmbeddings

        torch.manual_seed(0)
        module = SparseEmbeddings()
        model = ddpkit.DDP(module)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randint(0, 50, (4, 5), generator=g), torch.randint(0, 30, (4, 3), generator=g)
            opt.zero_grad()
            model(x, y).square().sum().backward()
            opt.step()
        return _plain(model)
    raise ValueError(case)


CASES = ["ddp", "ddp_static_graph", "torch_ddp", "no_sync", "unused", "fp16_hook", "bf16_hook", "powersgd",
         "syncbn", "join", "zero1", "zero2", "zero3", "local_sgd", "diloco", "diloco_streaming_int8", "distributed_optimizer",
         "sparse"]


def _compare(ours: list[dict], theirs: list[dict], tol: dict) -> list[str]:
    wrong = []
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        if a.keys() != b.keys():
            wrong.append(f"rank {rank}: keys differ: {sorted(a.keys() ^ b.keys())}")
            continue
        for key in a:
            try:
                torch.testing.assert_close(a[key], b[key], **tol)
            except AssertionError as e:
                lines = [line.strip() for line in str(e).splitlines() if "difference" in line]
                wrong.append(f"rank {rank} {key}: {'; '.join(lines)}")
    return wrong


@pytest.mark.parametrize("world", [2, 3])
def test_every_engine_trains_over_mpi_as_over_gloo(world, request):
    gloo_pool, mpi_pool = request.getfixturevalue(f"dist{world}"), request.getfixturevalue(f"mpi{world}")
    tol = EXACT if world == 2 else WORLD3
    wrong = []
    for case in CASES:
        ours = mpi_pool.run(run_case, case)
        theirs = gloo_pool.run(run_case, case)
        wrong += [f"{case}: {line}" for line in _compare(ours, theirs, HALF_WORLD3.get(case, tol) if world == 3
                                                         else tol)]
    assert not wrong, "\n".join(wrong)

