"""ddpkit.SyncBatchNorm on real gloo ranks against one BatchNorm over the concatenated global batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit

BN = {3: nn.BatchNorm1d, 2: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
# Statistics are combined in float64 and the input gradient is formed from two
# global sums: against cuDNN-free float32 BatchNorm, a few float32 ulps apart.
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _global_batch(dims: int, sizes: list[int], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tail = {2: (), 3: (5,), 4: (3, 3), 5: (2, 2, 2)}[dims]
    return [torch.randn(n, 4, *tail, generator=g) * 2 + 1 for n in sizes]


def _compare(dims: int, sizes: list[int], momentum: float | None, steps: int = 2) -> list[dict]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = BN[dims](4, momentum=momentum)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    sync = ddpkit.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    assert isinstance(sync, ddpkit.SyncBatchNorm)
    out = []
    for step in range(steps):
        parts = _global_batch(dims, sizes, step)
        x = parts[rank].clone().requires_grad_(True)
        y = sync(x)
        # A loss whose gradient differs per sample; on an empty shard it is 0
        # but still runs backward, so that rank joins the backward collective.
        (y * torch.arange(y.numel()).view_as(y).float().sin()).sum().backward()
        whole = torch.cat(parts).requires_grad_(True)
        ref_y = ref(whole)
        (ref_y * torch.cat([torch.arange(p.numel()).view_as(p).float().sin() for p in parts])).sum().backward()
        out.append({
            "y": (y.detach(), ref_y.detach().split(sizes)[rank]),
            "dx": (x.grad, whole.grad.split(sizes)[rank]),
        })
    grads = torch.stack([sync.weight.grad, sync.bias.grad])
    dist.all_reduce(grads)  # the parameters' gradients summed over ranks = the global BatchNorm's
    out.append({
        "dwb": (grads, torch.stack([ref.weight.grad, ref.bias.grad])),
        "mean": (sync.running_mean, ref.running_mean), "var": (sync.running_var, ref.running_var),
    })
    assert int(sync.num_batches_tracked) == int(ref.num_batches_tracked) == steps
    sync.eval(), ref.eval()
    probe = _global_batch(dims, sizes, 99)[0]
    out.append({"eval": (sync(probe).detach(), ref(probe).detach())})
    return out


def _check(results: list) -> None:
    for rank, per_rank in enumerate(results):
        for entry in per_rank:
            for key, (ours, theirs) in entry.items():
                torch.testing.assert_close(ours, theirs, **TOL, msg=lambda m: f"rank {rank} {key}: {m}")


@pytest.mark.parametrize("dims", [2, 3, 4, 5])
def test_matches_batchnorm_over_the_global_batch_three_ranks_uneven(dist3, dims):
    _check(dist3.run(_compare, dims, [3, 0, 5], 0.1))


def test_momentum_none_two_ranks(dist2):
    _check(dist2.run(_compare, 4, [2, 6], None, 3))


def _ddp_steps() -> list[torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 2))
    ref = copy.deepcopy(net)
    model = ddpkit.DDP(ddpkit.SyncBatchNorm.convert_sync_batchnorm(net))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 1, 4, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
        opt.zero_grad()
        # DDP averages over ranks: each rank's loss is its shard's mean.
        nn.functional.cross_entropy(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    return [torch.cat([p.detach().flatten() for p in ddpkit.unwrap(model).state_dict().values() if p.is_floating_point()]),
            torch.cat([p.detach().flatten() for p in ref.state_dict().values() if p.is_floating_point()])]


def test_inside_ddp_equals_one_process_over_the_global_batch(dist2):
    for ours, theirs in dist2.run(_ddp_steps):
        torch.testing.assert_close(ours, theirs, **TOL)


def test_world_of_one_is_batchnorm_and_convert_keeps_everything():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Sequential(nn.BatchNorm1d(2, affine=False)))
    net[1].weight.requires_grad_(False)
    net.eval()
    converted = ddpkit.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(net))
    assert isinstance(converted[1], ddpkit.SyncBatchNorm) and isinstance(converted[2][0], ddpkit.SyncBatchNorm)
    assert not converted[1].weight.requires_grad and not converted.training and converted[2][0].weight is None
    x = torch.randn(4, 1, 5, 5)
    torch.testing.assert_close(converted[1](net[0](x)), net[1](net[0](x)), rtol=0, atol=0)
    bn, sync = nn.BatchNorm2d(2), ddpkit.SyncBatchNorm(2)
    for _ in range(2):
        torch.testing.assert_close(sync(x.repeat(1, 2, 1, 1)), bn(x.repeat(1, 2, 1, 1)), rtol=0, atol=0)
    torch.testing.assert_close(sync.running_var, bn.running_var, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="3 channels"):  # torch's batch norm: RuntimeError (a ValueError too)
        sync(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="number of input channels should be non-zero"):
        ddpkit.SyncBatchNorm(0)(torch.randn(2, 0, 4))
    # An existing SyncBatchNorm is rebuilt on the group given, as torch's convert does.
    again = ddpkit.SyncBatchNorm.convert_sync_batchnorm(converted, process_group="marker")
    assert again[1].process_group == "marker" and again[1].weight is converted[1].weight


def _eval_without_running_stats() -> tuple[torch.Tensor, torch.Tensor]:
    # torch's rule: eval mode never synchronises; without running statistics each rank normalises its
    # own batch. Rank 0 alone evaluating must not wait for the others.
    torch.manual_seed(0)
    sync = ddpkit.SyncBatchNorm(4, track_running_stats=False).eval()
    local = nn.BatchNorm1d(4, track_running_stats=False).eval()
    x = torch.randn(6, 4) * 3 + 5 * dist.get_rank()
    if dist.get_rank() == 0:
        sync(torch.randn(3, 4))
    return sync(x).detach(), local(x).detach()


def test_eval_without_running_stats_uses_the_local_batch_and_no_collective(dist2):
    for ours, local in dist2.run(_eval_without_running_stats, timeout=60):
        torch.testing.assert_close(ours, local, rtol=0, atol=0)


def _half_precision(dtype: torch.dtype, autocast: bool) -> dict:
    # BatchNorm's rule for a half-precision input with float32 parameters: normalised in float32, the output and
    # the input's gradient in the input's dtype, the parameters' gradients in theirs (and under autocast too).
    rank, sizes = dist.get_rank(), [3, 5]
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(4)
    sync = ddpkit.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    parts = [p.to(dtype) for p in _global_batch(4, sizes, 0)]
    x = parts[rank].clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        y = sync(x)
    (y.float() * torch.arange(y.numel()).view_as(y).float().sin()).sum().backward()
    whole = torch.cat(parts).requires_grad_(True)
    ref_y = ref(whole)
    (ref_y.float() * torch.cat([torch.arange(p.numel()).view_as(p).float().sin() for p in parts])).sum().backward()
    grads = torch.stack([sync.weight.grad, sync.bias.grad])
    dist.all_reduce(grads)
    return {"dtypes": (y.dtype, x.grad.dtype, sync.weight.grad.dtype),
            "y": (y.detach(), ref_y.detach().split(sizes)[rank]), "dx": (x.grad, whole.grad.split(sizes)[rank]),
            "dwb": (grads, torch.stack([ref.weight.grad, ref.bias.grad])),
            "mean": (sync.running_mean, ref.running_mean)}


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_half_precision_input_keeps_its_dtype_as_under_batchnorm(dist2, dtype, autocast):
    for result in dist2.run(_half_precision, dtype, autocast, timeout=60):
        assert result.pop("dtypes") == (dtype, dtype, torch.float32)
        # The statistics in float32 and the result rounded once, as BatchNorm's: equal here, an ulp allowed (another
        # CPU's kernels may round once otherwise); the statistics taken in the input's dtype, as before, put values
        # near zero many ulps off.
        eps = torch.finfo(dtype).eps
        for key, (ours, theirs) in result.items():
            torch.testing.assert_close(ours, theirs, rtol=eps, atol=eps / 16, msg=lambda m: f"{key}: {m}")


def _double_backward() -> str:
    sync = ddpkit.SyncBatchNorm(3)
    x = torch.randn(4, 3, requires_grad=True)
    (grad,) = torch.autograd.grad(sync(x).square().sum(), x, create_graph=True)  # a first backward: as before
    try:
        grad.square().sum().backward()  # a gradient penalty's: the statistics' collective has no derivative
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_double_backward_through_the_synchronised_path_raises_instead_of_coming_out_wrong(dist2):
    # (It gave wrong numbers silently before: the all-reduce in the backward has no autograd formula.)
    for said in dist2.run(_double_backward, timeout=60):
        assert "differentiate twice" in said and "once_differentiable" in said, said
