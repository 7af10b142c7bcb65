"""``skip_all_reduce_unused_params=True``: buckets of unused parameters are not reduced, as under torch's DDP."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddpkit


class Branches(nn.Module):
    """``b`` is used every other step, ``c`` in two steps of three, ``never`` never."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.never = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor, use_b: bool = True, use_c: bool = True) -> torch.Tensor:
        x = self.a(x)
        if use_b:
            x = torch.tanh(self.b(x))
        if use_c:
            x = self.c(x)
        return x


def _run(engine: str, steps: int, kwargs: dict, accumulate: bool, skip: bool = True) -> dict:
    torch.manual_seed(0)
    model = (ddpkit.DDP if engine == "ddpkit" else TorchDDP)(Branches(), skip_all_reduce_unused_params=skip, **kwargs)
    reduced: list[int] = []

    def hook(state, bucket):  # unannotated: torch checks a comm hook's annotations
        reduced.append(bucket.index())
        tensor = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])

    model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    buckets, grads = [], []
    for step in range(steps):
        reduced.clear()
        opt.zero_grad()
        g = torch.Generator().manual_seed(10 * step + dist.get_rank())
        x = torch.randn(3, 4, generator=g)
        if accumulate:
            with model.no_sync():
                model(x).pow(2).mean().backward()  # every parameter but "never" used here
        model(x, use_b=step % 2 == 0, use_c=step % 3 != 1).pow(2).mean().backward()
        buckets.append(sorted(reduced))
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.module.named_parameters()})
        opt.step()
    return {"buckets": buckets, "grads": grads}


@pytest.mark.parametrize("kwargs", [{"find_unused_parameters": True, "bucket_cap_mb": 0},
                                    {"find_unused_parameters": True}])
def test_the_same_buckets_are_left_unreduced_as_under_torch(dist2, kwargs):
    ours, theirs = dist2.run(_run, "ddpkit", 8, kwargs, False), dist2.run(_run, "torch", 8, kwargs, False)
    for rank in range(2):
        assert ours[rank]["buckets"] == theirs[rank]["buckets"]
        for step, (a, b) in enumerate(zip(ours[rank]["grads"], theirs[rank]["grads"])):
            assert a.keys() == b.keys()
            for name in a:
                assert (a[name] is None) == (b[name] is None), (rank, step, name)
                if a[name] is not None:
                    assert torch.equal(a[name], b[name]), (rank, step, name)
    if "bucket_cap_mb" in kwargs:  # one parameter per bucket: steps skip different buckets (else this proves nothing)
        assert len({len(b) for b in ours[0]["buckets"]}) > 2


def _static_branches(steps: int, engine: str) -> list:
    torch.manual_seed(0)
    model = (ddpkit.DDP if engine == "ddpkit" else TorchDDP)(Branches(), skip_all_reduce_unused_params=True,
                                                             static_graph=True, bucket_cap_mb=0)
    launched = []

    def hook(state, bucket):  # unannotated: torch checks a comm hook's annotations
        launched.append(bucket.index())
        tensor = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])

    model.register_comm_hook(None, hook)
    out = []
    for step in range(steps):
        launched.clear()
        model.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        out.append((sorted(launched), [p.grad is None for p in model.parameters()]))
    return out


def test_a_static_graph_skips_the_buckets_no_rank_used(dist2):
    ours, theirs = dist2.run(_static_branches, 5, "ddpkit"), dist2.run(_static_branches, 5, "torch")
    assert ours == theirs
    # From the rebuild on, "never"'s two buckets are not reduced, and it keeps no gradient.
    assert len(ours[0][-1][0]) == 6 and ours[0][-1][1][-2:] == [True, True]


def test_what_no_sync_accumulated_is_still_averaged(dist2):
    # A parameter unused in the synchronised backward but used in the no_sync() one before it holds a
    # gradient: ddpkit reduces its bucket, so the replicas stay equal. (torch 2.13 skips it on its graph
    # search alone and leaves each rank its own gradient: the replicas drift apart.)
    kwargs = {"find_unused_parameters": True, "bucket_cap_mb": 0}
    ours, unskipped = dist2.run(_run, "ddpkit", 4, kwargs, True), dist2.run(_run, "ddpkit", 4, kwargs, True, False)
    for step in range(4):
        for name, g in ours[0]["grads"][step].items():
            for other in (ours[1]["grads"][step][name], unskipped[0]["grads"][step][name]):
                assert (g is None) == (other is None)
                if g is not None:
                    assert torch.equal(g, other), (step, name)


def _refusals() -> list[str]:
    errors = []
    for make in (lambda: ddpkit.DDP(nn.Linear(2, 2), skip_all_reduce_unused_params=True, zero_stage=2),
                 lambda: ddpkit.DDP(nn.Linear(2, 2), skip_all_reduce_unused_params=True).join()):
        try:
            make()
        except (ValueError, RuntimeError) as e:
            errors.append(str(e))
    return errors


def test_zero_stages_and_join_are_refused_with_it(dist2):
    errors = dist2.run(_refusals)[0]
    assert len(errors) == 2
    assert "zero_stage=2 with skip_all_reduce_unused_params=True" in errors[0]
    assert "join() with skip_all_reduce_unused_params=True" in errors[1]
