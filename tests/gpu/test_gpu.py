"""The GPU path against torch's, on whatever GPUs this machine has (world = GPU count for NCCL).

Skipped, with the reason, where there is no CUDA; ``scripts/gpu_check.sh``
runs it on a GPU machine with ``ddpkit doctor`` and the GPU bench. Every rank
runs deterministic algorithms (:mod:`gpu_ranks`): bitwise means bitwise. The
commands are in ``test_gpu_commands.py``, the strategies after DDP in
``test_gpu_strategies.py``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from gpu_ranks import GPUS, NCCL, ON_CPU, cpu_state, needs_cuda, needs_two, run, same
from torch import nn

pytestmark = needs_cuda
WORLD = max(GPUS, 1)
PATHS = [pytest.param(NCCL, WORLD, id=f"nccl-world{WORLD}"), pytest.param("gloo", 2, id="gloo-2-ranks-1-gpu")]
"""NCCL at the GPU count, and two ranks sharing one GPU over gloo with CUDA tensors: on a one-GPU machine the NCCL
path is a world of one (nothing reduces, nothing is uneven), so every comparison also runs at two ranks."""
needs_real_cuda = pytest.mark.skipif(ON_CPU, reason="rehearsal on the CPU: needs CUDA itself")


def _net(kind: str = "conv") -> nn.Module:
    torch.manual_seed(0)
    if kind == "branchy":
        return _Branchy()
    if kind == "deep":  # several buckets at a small cap: overlap of one bucket's all-reduce with the next backward
        layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()]
        for _ in range(6):
            layers += [nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()]
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    return nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 14 * 14, 10))


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3 * 16 * 16, 10)
        self.b = nn.Linear(3 * 16 * 16, 10)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        x = x.flatten(1)
        return self.a(x) + (self.b(x) if use_b else 0)


def _batch(step: int, rank: int, device: torch.device, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 3, 16, 16, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device)


# -- NCCL at world 1; ranks sharing one GPU over gloo; NCCL's refusal --------------------------------------------

def _all_reduce(ctx) -> dict:
    t = torch.full((1024,), float(ctx.rank + 1), device=ctx.device)
    torch.distributed.all_reduce(t)
    return {"device": str(ctx.device), "sum": t[0].item(), "backend": ctx.backend}


@needs_real_cuda
def test_nccl_at_world_1():
    [r] = run(_all_reduce, 1, "nccl")
    assert r == {"device": "cuda:0", "sum": 1.0, "backend": "nccl"}


@needs_real_cuda
def test_two_ranks_share_one_gpu_over_gloo_with_cuda_tensors():
    results = run(_all_reduce, 2, "gloo")
    assert [r["sum"] for r in results] == [3.0, 3.0] and all(r["device"].startswith("cuda") for r in results)


@needs_real_cuda
def test_nccl_refuses_two_ranks_on_one_gpu_with_the_fix():
    from ddpkit.runtime.spawn import WorkerError

    with pytest.raises(WorkerError, match="NCCL needs one GPU per rank.*--nproc-per-node.*gloo"):
        run(_all_reduce, GPUS + 1, "nccl")


# -- DDP on CUDA against torch's -------------------------------------------------------------------------------

DDP_CASES = {
    "device_ids": {"device_ids": True},
    "output_device": {"device_ids": True, "output_device": True},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "find_unused_parameters": {"find_unused_parameters": True, "model": "branchy"},
    "static_graph": {"static_graph": True},
    "no_sync": {"micro": 3},
    "join": {"join": True},
    "small_buckets": {"bucket_cap_mb": 0.05, "model": "deep", "steps": 20},
    "skip_all_reduce_unused_params": {"find_unused_parameters": True, "skip_all_reduce_unused_params": True,
                                      "bucket_cap_mb": 0, "model": "branchy"},
    "device_mesh": {"device_mesh": True},
}


def _ddp_case(ctx, case: dict, engine: str) -> dict:
    from ddpkit._reference import torch_ddp
    from ddpkit.parallel.ddp.wrapper import DistributedDataParallel

    device = ctx.device
    model = _net(case.get("model", "conv")).to(device)
    kwargs = {k: case[k] for k in ("gradient_as_bucket_view", "find_unused_parameters", "static_graph",
                                   "bucket_cap_mb", "skip_all_reduce_unused_params") if k in case}
    if case.get("device_mesh"):
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["device_mesh"] = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    if case.get("device_ids"):
        kwargs["device_ids"] = [device.index]
    if case.get("output_device"):
        kwargs["output_device"] = device.index
    wrapped = (DistributedDataParallel if engine == "ddpkit" else torch_ddp)(model, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps = case.get("steps", 5) + (ctx.rank if case.get("join") else 0)  # uneven inputs under join
    join = wrapped.join() if case.get("join") else contextlib.nullcontext()
    with join:
        for step in range(steps):
            opt.zero_grad()
            for m in range(case.get("micro", 1)):
                x, y = _batch(10 * step + m, ctx.rank, device)
                sync = wrapped.no_sync() if m < case.get("micro", 1) - 1 else contextlib.nullcontext()
                kw = {"use_b": step % 2 == 0} if case.get("model") == "branchy" else {}
                with sync:
                    nn.functional.cross_entropy(wrapped(x, **kw), y).backward()
            opt.step()
    return cpu_state(model)


@pytest.mark.parametrize("backend, world", PATHS)
@pytest.mark.parametrize("name", sorted(DDP_CASES))
def test_ddp_on_cuda_equals_torchs(name, backend, world):
    if ON_CPU and DDP_CASES[name].get("device_ids"):
        pytest.skip("rehearsal on the CPU: device_ids name a GPU")
    ours = run(_ddp_case, world, backend, DDP_CASES[name], "ddpkit")
    theirs = run(_ddp_case, world, backend, DDP_CASES[name], "torch")
    for a, b in zip(ours, theirs):
        assert same(a, b), name  # each bucket summed the same way for both (NCCL's, gloo's): bit for bit


@pytest.mark.parametrize("name", ["find_unused_parameters", "no_sync", "small_buckets"])
def test_ddp_over_mpi_with_cuda_tensors_equals_gloo(name, needs_mpi):
    # Two ranks on one GPU, on the mpi backend: CUDA tensors go to a CUDA-aware MPI as they are, through host
    # memory otherwise (doctor says which); either way the same sums as gloo's at two ranks, bit for bit.
    ours = run(_ddp_case, 2, "mpi", DDP_CASES[name], "ddpkit")
    theirs = run(_ddp_case, 2, "gloo", DDP_CASES[name], "ddpkit")
    for a, b in zip(ours, theirs):
        assert same(a, b), name


def _race(ctx, steps: int) -> dict:
    return _ddp_case(ctx, {"bucket_cap_mb": 0.05, "model": "deep", "steps": steps}, "ddpkit")


@needs_real_cuda
def test_streams_overlap_without_a_race():
    # Many steps of a model whose gradients fill many small buckets, so each bucket's all-reduce runs while the
    # next bucket's backward computes; the same run serialised by CUDA_LAUNCH_BLOCKING=1 is the reference.
    overlapped = run(_race, WORLD, "nccl", 60)
    blocking = run(_race, WORLD, "nccl", 60, env={"CUDA_LAUNCH_BLOCKING": "1"})
    reference = run(_ddp_case, WORLD, "nccl", {"bucket_cap_mb": 0.05, "model": "deep", "steps": 60}, "torch")
    for a, b, c in zip(overlapped, blocking, reference):
        assert same(a, b) and same(a, c)


# -- mixed precision, compression hooks, PowerSGD -------------------------------------------------------------

def _amp(ctx, dtype_name: str, hook: str | None, engine: str) -> dict:
    from ddpkit import hooks
    from ddpkit._reference import torch_ddp
    from ddpkit.parallel.ddp.wrapper import DistributedDataParallel

    device = ctx.device
    model = _net().to(device)
    wrapped = (DistributedDataParallel if engine == "ddpkit" else torch_ddp)(model, device_ids=[device.index])
    if hook == "fp16":
        wrapped.register_comm_hook(None, hooks.fp16_compress_hook)
    elif hook == "bf16":
        wrapped.register_comm_hook(None, hooks.bf16_compress_hook)
    elif hook == "powersgd":
        state = hooks.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        wrapped.register_comm_hook(state, hooks.powersgd_hook)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[dtype_name]
    scaler = torch.amp.GradScaler("cuda", enabled=dtype is torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(6):
        x, y = _batch(step, ctx.rank, device)
        opt.zero_grad()
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = nn.functional.cross_entropy(wrapped(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return cpu_state(model)


@needs_real_cuda
@pytest.mark.parametrize("dtype_name, hook", [("fp16", None), ("bf16", None), ("off", "fp16"), ("off", "bf16"),
                                              ("off", "powersgd")])
def test_mixed_precision_and_comm_hooks_against_torchs_ddp(dtype_name, hook):
    # ddpkit's hooks on ddpkit's DDP against the same hooks on torch's DDP (they follow torch's hook contract).
    ours = run(_amp, WORLD, "nccl", dtype_name, hook, "ddpkit")
    theirs = run(_amp, WORLD, "nccl", dtype_name, hook, "torch")
    for a, b in zip(ours, theirs):
        assert same(a, b, exact=hook != "powersgd")  # PowerSGD's random start is seeded alike; QR on GPU varies


# -- SyncBatchNorm and DataParallel ------------------------------------------------------------------------------

def _syncbn(ctx, engine: str) -> dict:
    import ddpkit
    from ddpkit._reference import torch_sync_batchnorm

    device = ctx.device
    torch.manual_seed(0)
    bn = (ddpkit.SyncBatchNorm(16) if engine == "ddpkit" else torch_sync_batchnorm(16)).to(device)
    x = torch.randn(4, 16, 8, 8, generator=torch.Generator().manual_seed(ctx.rank)).to(device).requires_grad_()
    out = bn(x)
    (out.float() ** 2).sum().backward()
    return {"out": out.detach().cpu(), "grad": x.grad.cpu(), "mean": bn.running_mean.cpu(),
            "var": bn.running_var.cpu(), "wgrad": bn.weight.grad.cpu()}


@needs_real_cuda
@pytest.mark.parametrize("backend, world", [("nccl", WORLD), ("gloo", 2)])
def test_syncbatchnorm_on_cuda_equals_torchs(backend, world):
    if backend == "gloo":
        # torch's nn.SyncBatchNorm runs on NCCL only: over gloo the reference is ddpkit's on NCCL at the same world.
        if GPUS < 2:
            pytest.skip("the gloo reference needs NCCL at world 2 (2 GPUs); this machine has 1")
    ours = run(_syncbn, world, backend, "ddpkit")
    theirs = run(_syncbn, world, "nccl", "torch")
    for a, b in zip(ours, theirs):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def _dp(devices: list[int], engine: str) -> dict:
    import ddpkit

    model = _net().to(f"cuda:{devices[0]}")
    wrapped = (ddpkit.DataParallel if engine == "ddpkit" else nn.DataParallel)(model, device_ids=devices)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        x, y = _batch(step, 0, torch.device(f"cuda:{devices[0]}"), n=8 * len(devices))
        opt.zero_grad()
        nn.functional.cross_entropy(wrapped(x), y).backward()
        opt.step()
    return cpu_state(model)


@needs_real_cuda
@pytest.mark.parametrize("devices", [[0], pytest.param(list(range(GPUS)), marks=needs_two)],
                         ids=["cuda0", "all-gpus"])
def test_dataparallel_on_cuda_equals_torchs(devices):
    assert same(_dp(devices, "ddpkit"), _dp(devices, "torch"), exact=len(devices) == 1)


@needs_real_cuda
@pytest.mark.parametrize("where", ["cuda", "dict", "callable"])
def test_checkpoints_load_onto_the_gpu_as_torch_load_puts_them(where, tmp_path):
    import ddpkit

    model = _net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(0, 0, torch.device("cuda"))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    state = {"params": list(model.parameters()), "optimizer": opt.state_dict()}
    ddpkit.save_checkpoint(tmp_path / "c", state)
    torch.save(state, tmp_path / "t.pt")
    form = {"cuda": "cuda:0", "dict": {"cpu": "cuda:0", "cuda:0": "cuda:0"},
            "callable": lambda storage, location: storage.cuda(0)}[where]
    got = ddpkit.load_checkpoint(tmp_path / "c", map_location=form)
    want = torch.load(tmp_path / "t.pt", map_location=form, weights_only=True)
    for g, w in zip(got["params"], want["params"]):
        assert type(g) is type(w) is nn.Parameter and g.device == w.device == torch.device("cuda", 0)
        assert g.requires_grad and torch.equal(g, w)
    for key, w in want["optimizer"]["state"][0].items():
        g = got["optimizer"]["state"][0][key]
        assert g.device == w.device and torch.equal(g, w), key
