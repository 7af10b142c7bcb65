"""Every strategy after DDP on CUDA, against its reference: ZeRO 1, 2 and 3, parameter servers, SSP, local SGD,
Horovod's optimizer, PowerSGD.

Each runs on NCCL at the GPU count of the machine and on gloo with two ranks
sharing one GPU (the path of a machine with fewer GPUs than ranks), under
deterministic algorithms, bitwise wherever the CPU suite is bitwise. The one
exception is said where it is: parameter servers step on the CPU, which
rounds a fused multiply-add otherwise than a GPU kernel.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from gpu_ranks import GPUS, NCCL, ON_CPU, cpu_state, differences, needs_cuda, run
from torch import nn

pytestmark = needs_cuda
WORLD = max(GPUS, 1)
PATHS = [pytest.param(NCCL, WORLD, id=f"nccl-world{WORLD}"), pytest.param("gloo", 2, id="gloo-2-ranks-1-gpu")]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 32),
                         nn.ReLU(), nn.Linear(32, 10))


def _batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 3, 16, 16, generator=g).to(device), torch.randint(0, 10, (8,), generator=g).to(device)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, ctx, steps: int, after=lambda: None) -> None:
    for step in range(steps):
        x, y = _batch(step, ctx.rank, ctx.device)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        after()


def _assert_same(results: list, exact: bool = True) -> None:
    for rank, (ours, theirs) in enumerate(results):
        if exact:
            assert not differences(ours, theirs), f"rank {rank}: {differences(ours, theirs)}"
        else:
            assert ours and sorted(ours) == sorted(theirs), f"rank {rank}: {differences(ours, theirs)}"
            for k in ours:
                torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{rank} {k}: {m}")


def test_the_comparison_fails_on_a_dropped_key_or_an_empty_state():
    # A planted fault in each: the comparison must see it (it once looped over one side's keys only).
    state = {"w": torch.ones(2), "b": torch.zeros(1)}
    assert not differences(state, dict(state))
    assert differences(state, {"w": torch.ones(2)}) == {"b": "missing on one side"}
    assert differences({"w": torch.ones(2)}, state) == {"b": "missing on one side"}
    assert differences({}, {}) and differences(state, {})
    with pytest.raises(AssertionError):
        _assert_same([(state, {"w": torch.ones(2)})], exact=False)
    with pytest.raises(AssertionError):
        _assert_same([({}, {})])


# -- ZeRO -----------------------------------------------------------------------------------------------------

def _zero1(ctx) -> tuple[dict, dict]:
    import ddpkit
    from ddpkit._reference import torch_ddp, torch_zero

    out = []
    for engine in ("ddpkit", "torch"):
        model = _net().to(ctx.device)
        wrapped = ddpkit.DDP(model) if engine == "ddpkit" else torch_ddp(model)
        zero = (ddpkit.ZeroRedundancyOptimizer if engine == "ddpkit" else torch_zero)(
            model.parameters(), torch.optim.AdamW, lr=0.01, weight_decay=0.1)
        _steps(wrapped, zero, ctx, 5)
        zero.consolidate_state_dict(to=0)
        state = zero.state_dict() if ctx.rank == 0 else None
        out.append({**cpu_state(model), **({f"exp_avg.{i}": s["exp_avg"].cpu() for i, s in state["state"].items()}
                                           if state else {})})
    return out[0], out[1]


@pytest.mark.parametrize("backend, world", PATHS)
def test_zero1_equals_torchs_zero(backend, world):
    # Each owner steps its shard with the same AdamW code on the same averages; broadcasts copy bits.
    _assert_same(run(_zero1, world, backend))


def _zero2(ctx) -> tuple[dict, dict]:
    import ddpkit
    from ddpkit._reference import torch_ddp

    out = []
    for stage in (2, 0):
        model = _net().to(ctx.device)
        wrapped = ddpkit.DDP(model, zero_stage=2) if stage == 2 else torch_ddp(model)
        opt = ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9) \
            if stage == 2 else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        _steps(wrapped, opt, ctx, 5)
        out.append(cpu_state(model))
    return out[0], out[1]


@pytest.mark.parametrize("backend, world", PATHS)
def test_zero2_equals_torchs_ddp(backend, world):
    # Sharded gradients (reduce-scatter on NCCL) and all-gathered parameters: DDP's update. On NCCL with several
    # GPUs the reduce-scatter may add in another order than the all-reduce: equal within float32's rounding there.
    _assert_same(run(_zero2, world, backend), exact=backend == "gloo" or world == 1)


def _zero3(ctx, frozen: bool) -> tuple[dict, dict]:
    import ddpkit
    from ddpkit._reference import torch_ddp

    out = []
    for stage in (3, 0):
        model = _net().to(ctx.device)
        if frozen:  # a frozen weight beside a trained bias in one unit, and a whole frozen unit
            model[0].weight.requires_grad_(False)
            model[4].requires_grad_(False)
        wrapped = ddpkit.DDP(model, zero_stage=3) if stage == 3 else torch_ddp(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01, weight_decay=0.1)
        _steps(wrapped, opt, ctx, 5)
        out.append(cpu_state(model))  # stage 3's state dict is gathered whole (a collective on every rank)
    return out[0], out[1]


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
@pytest.mark.parametrize("backend, world", PATHS)
def test_zero3_equals_torchs_ddp(backend, world, frozen):
    # Sharded parameters gathered layer by layer (NCCL's all-gather and reduce-scatter; gloo through the CPU), any
    # torch optimizer on the shards: DDP's update, bitwise where the sum's order is DDP's (gloo, or one GPU).
    _assert_same(run(_zero3, world, backend, frozen), exact=backend == "gloo" or world == 1)


def _zero3_sequence(ctx, case: str) -> tuple[dict, dict]:
    """One call sequence of the CPU suite's parity table (tests/parallel/test_zero3_sequences.py) on CUDA, against
    torch's DDP, or FSDP2 for clipping (see the test)."""
    import ddpkit
    from ddpkit._reference import torch_ddp, torch_fsdp2
    from ddpkit.parallel.zero.units import find_units

    out = []
    bf16 = case == "bf16, fp32 reduction, accumulated"
    dtypes = (torch.bfloat16, torch.float32) if bf16 else (None, None)
    for stage in (3, 0):
        model = _net().to(ctx.device)
        if bf16:  # batch norm's kernel takes no bf16 weight beside fp32 statistics (FSDP2's fails alike)
            model[1] = nn.Identity()
        if stage == 3:
            wrapped = ddpkit.DDP(model, zero_stage=3, zero_param_dtype=dtypes[0], zero_reduce_dtype=dtypes[1])
        elif case == "clip_grad_norm_" or bf16:
            wrapped = torch_fsdp2(model, [unit for _, unit in find_units(model)], *dtypes)
        else:
            wrapped = torch_ddp(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10, enabled=case == "fp16 GradScaler")
        for step in range(3):
            x, y = _batch(step, ctx.rank, ctx.device)
            opt.zero_grad()
            if case == "two forwards":
                (nn.functional.cross_entropy(wrapped(x[:4]), y[:4]) +
                 nn.functional.cross_entropy(wrapped(x[4:]), y[4:])).backward()
            elif case == "no_grad forward between":
                loss = nn.functional.cross_entropy(wrapped(x), y)
                with torch.no_grad():
                    wrapped(x * 2)
                loss.backward()
            elif case == "clip_grad_norm_":
                if stage == 0:  # DDP's buffers, as stage 3's: rank 0's batch-norm statistics (FSDP2 keeps each rank's)
                    for buffer in model.buffers():
                        dist.broadcast(buffer, 0)
                nn.functional.cross_entropy(wrapped(x), y).backward()
                torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 0.05)
            elif bf16:  # FSDP2's switch off for two micro-batches (their gradients add up in fp32), on for the third
                for k, part in enumerate((slice(0, 3), slice(3, 6), slice(6, 8))):
                    wrapped.set_requires_gradient_sync(k == 2)
                    nn.functional.cross_entropy(wrapped(x[part]), y[part]).backward()
            else:  # fp16 under autocast, torch's GradScaler; an overflow on rank 1 in step 1 skips every rank's step
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(wrapped(x), y)
                if step == 1 and ctx.rank == 1:
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
            if case == "fp16 GradScaler":
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        out.append(_whole_state(model))
    return out[0], out[1]


def _whole_state(model: nn.Module) -> dict:
    """The state dict on the CPU; FSDP2's DTensors gathered whole first, on their own device (a collective)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
            for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", ["two forwards", "no_grad forward between", "clip_grad_norm_", "fp16 GradScaler",
                                  "bf16, fp32 reduction, accumulated"])
@pytest.mark.parametrize("backend, world", PATHS)
def test_zero3_call_sequences_equal_torchs(backend, world, case):
    # The CPU suite's parity table, four of its rows on CUDA: bitwise where the sum's order is DDP's. Clipping is
    # FSDP2's: the norm adds its squares per shard, then over the ranks, which may round the norm by an ulp from
    # DDP's; AdamW turns that into a visible step on this model's convolution bias, whose gradient is rounding noise
    # (a bias before batch norm has none in exact arithmetic): 1.2e-4 off DDP's after 3 steps on 2 gloo ranks, as
    # FSDP2 itself is, and bitwise equal to FSDP2. bf16 compute with an fp32 reduction, accumulated with FSDP2's
    # switch: FSDP2 with the same MixedPrecisionPolicy is the reference.
    if ON_CPU and case == "fp16 GradScaler":
        pytest.skip("autocast on CUDA: not in a rehearsal on the CPU")
    _assert_same(run(_zero3_sequence, world, backend, case), exact=backend == "gloo" or world == 1)


def _zero3_memory(ctx, stage: int) -> float:
    """Peak CUDA memory of a few AdamW steps of an 8-layer MLP (33.6 MB of weights), in MB, this rank."""
    import ddpkit
    from ddpkit._reference import torch_ddp

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(ctx.device)
    wrapped = ddpkit.DDP(model, zero_stage=3) if stage == 3 else torch_ddp(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        wrapped(torch.randn(16, 1024, device=ctx.device)).square().mean().backward()
        opt.step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e6


@pytest.mark.skipif(ON_CPU, reason="CUDA memory: not in a rehearsal on the CPU")
@pytest.mark.parametrize("backend, world", PATHS)
def test_zero3_holds_a_shard_of_the_model_state_in_cuda_memory(backend, world):
    # DDP keeps the whole model, its gradients and AdamW's two moments (4 x 33.6 MB) on every rank, plus buckets;
    # stage 3 keeps 1/W of each plus a few units gathered at a time.
    if world < 2:
        pytest.skip("one rank: nothing to shard (the gloo path shares one GPU between two ranks)")
    sharded = max(run(_zero3_memory, world, backend, 3))
    whole = max(run(_zero3_memory, world, backend, 0))
    assert sharded < whole / world * 1.25, (sharded, whole)


# -- Horovod's optimizer, SSP, local SGD ------------------------------------------------------------------------

def _against_ddp(ctx, strategy: str) -> tuple[dict, dict]:
    import ddpkit
    from ddpkit._reference import torch_ddp

    model = _net().to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if strategy == "optimizer":
        ddpkit.broadcast_parameters(model.state_dict(), root_rank=0)
        wrapped, opt = model, ddpkit.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    elif strategy == "ssp0":
        wrapped, opt = model, ddpkit.StaleSynchronousOptimizer(opt, staleness=0)
    else:
        raise ValueError(strategy)
    _steps(wrapped, opt, ctx, 6)
    reference = _net().to(ctx.device)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    _steps(torch_ddp(reference), ref_opt, ctx, 6)
    ours, theirs = cpu_state(model), cpu_state(reference)
    # Neither strategy broadcasts BatchNorm's statistics: compare what they share, the parameters.
    names = {n for n, _ in model.named_parameters()}
    return {k: v for k, v in ours.items() if k in names}, {k: v for k, v in theirs.items() if k in names}


@pytest.mark.parametrize("backend, world", PATHS)
@pytest.mark.parametrize("strategy", ["optimizer", "ssp0"])
def test_horovod_optimizer_and_ssp_at_staleness_0_make_ddps_update(backend, world, strategy):
    _assert_same(run(_against_ddp, world, backend, strategy))


def _local_sgd(ctx) -> tuple[dict, dict]:
    from torch.distributed.algorithms import model_averaging
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
    from torch.distributed.algorithms.model_averaging import averagers  # noqa: F401 - loads the submodule

    import ddpkit
    from ddpkit._reference import torch_ddp

    model = _net().to(ctx.device)
    ddp = ddpkit.DDP(model)
    local = ddpkit.LocalSGD(ddp, period=2, warmup_steps=2)
    _steps(ddp, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), ctx, 7, local.step)
    reference = _net().to(ctx.device)
    theirs = torch_ddp(reference)
    theirs.register_comm_hook(post_local.PostLocalSGDState(None, None, 2, post_local_gradient_allreduce=False),
                              post_local.post_localSGD_hook)
    averager = model_averaging.averagers.PeriodicModelAverager(period=2, warmup_steps=2)
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    _steps(theirs, opt, ctx, 7, lambda: averager.average_parameters(reference.parameters()))
    return cpu_state(model), cpu_state(reference)


@pytest.mark.parametrize("backend, world", PATHS)
def test_local_sgd_equals_torchs_post_local_sgd(backend, world):
    _assert_same(run(_local_sgd, world, backend))


# -- parameter servers: CUDA workers, servers on the CPU -------------------------------------------------------

def _servers(ctx, mode: str) -> tuple[dict, dict]:
    import ddpkit

    model = _net().to(ctx.device)
    reference = copy.deepcopy(model)
    ps = ddpkit.ParameterServerOptimizer(model.parameters(), torch.optim.SGD, mode=mode, lr=0.05, momentum=0.9)
    ddp = ddpkit.DDP(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(6):
        x, y = _batch(step, ctx.rank, ctx.device)
        for m, o in ((model, ps), (ddp, ref_opt)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    stats = ps.stats.as_dict()
    ps.close()
    assert all(p.device == ctx.device for p in model.parameters())  # the workers' parameters stay on their GPU
    names = {n for n, _ in model.named_parameters()}
    ours = {k: v for k, v in cpu_state(model).items() if k in names}
    theirs = {k: v for k, v in cpu_state(reference).items() if k in names}
    return ours, theirs, stats


@pytest.mark.parametrize("backend, world", PATHS)
def test_sync_parameter_servers_with_cuda_workers_make_ddps_update(backend, world):
    results = run(_servers, world, backend, "sync", num_servers=1)
    assert all(stats["steps"] == 6 and stats["staleness_max"] == 0 for _, _, stats in results)
    # The servers step on the CPU, DDP's optimizer on the GPU: the same update, rounded by another FMA.
    _assert_same([(a, b) for a, b, _ in results], exact=False)


def test_async_parameter_servers_with_cuda_workers_train():
    results = run(_servers, 2, "gloo", "async", num_servers=2)
    start = {k: v for k, v in cpu_state(_net()).items() if k in results[0][0]}
    for ours, _, stats in results:
        # Asynchronous: not DDP's update (tests/parallel/test_ps.py bounds it); here the CUDA path ran its steps.
        assert stats["steps"] == 6 and all(torch.isfinite(v).all() for v in ours.values())
        assert all(not torch.equal(ours[k], start[k]) for k in ours)


# -- PowerSGD --------------------------------------------------------------------------------------------------

def _powersgd(ctx, engine: str) -> dict:
    from ddpkit import hooks
    from ddpkit._reference import torch_ddp
    from ddpkit.parallel.ddp.wrapper import DistributedDataParallel

    model = _net().to(ctx.device)
    wrapped = (DistributedDataParallel if engine == "ddpkit" else torch_ddp)(model)
    wrapped.register_comm_hook(hooks.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2),
                               hooks.powersgd_hook)
    _steps(wrapped, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), ctx, 6)
    return cpu_state(model)


@pytest.mark.parametrize("backend, world", PATHS)
def test_powersgd_hook_on_both_engines(backend, world):
    ours, theirs = run(_powersgd, world, backend, "ddpkit"), run(_powersgd, world, backend, "torch")
    # One bucket on each engine, the same hook, deterministic kernels: the same bits.
    _assert_same(list(zip(ours, theirs)))


def _algorithms(ctx) -> dict:
    import ddpkit

    out = {}
    for algorithm in ("native", "naive", "ring", "tree", "hierarchical"):
        t = torch.arange(1000, dtype=torch.float32, device=ctx.device) * (ctx.rank + 1)
        ddpkit.collectives.all_reduce(t, op="sum", algorithm=algorithm)
        out[algorithm] = (t.device.type, t.cpu())
    gathered = torch.empty(1000 * dist.get_world_size(), device=ctx.device)
    ddpkit.collectives.all_gather(gathered, torch.full((1000,), float(ctx.rank), device=ctx.device))
    out["all_gather"] = (gathered.device.type, gathered.cpu())
    return out


@pytest.mark.parametrize("backend, world", PATHS)
def test_every_all_reduce_algorithm_moves_cuda_tensors(backend, world):
    # The point-to-point algorithms (ring, tree, ...) on gloo stage CUDA tensors through the CPU, whose messages
    # gloo takes only from there; on NCCL they go GPU to GPU.
    expected = torch.arange(1000, dtype=torch.float32) * sum(range(1, world + 1))
    for got in run(_algorithms, world, backend):
        for algorithm, (device, t) in got.items():
            assert device == ("cpu" if ON_CPU else "cuda"), algorithm
            if algorithm == "all_gather":
                assert torch.equal(t, torch.arange(world).repeat_interleave(1000).float())
            else:
                assert torch.equal(t, expected), algorithm


def _dist_state(ctx) -> dict:
    return {"backend": dist.get_backend(), "device": str(ctx.device)}


def test_two_ranks_share_the_gpu_over_gloo():
    got = run(_dist_state, 2, "gloo")
    assert [g["backend"] for g in got] == ["gloo", "gloo"]
    assert all(g["device"].startswith("cuda") for g in got) or ON_CPU
