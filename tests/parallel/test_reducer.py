"""The reducer: bucket assignment, launch order, rebuild in arrival order, overlap."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.parallel.reducer import assign_buckets

MIB = 1024 * 1024


def _t(numel: int, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype)


def test_assign_first_bucket_small_then_cap():
    params = [_t(MIB // 4)] * 8  # 1 MiB each in float32
    buckets = assign_buckets(params, list(reversed(range(8))), cap_bytes=3 * MIB, first_cap_bytes=MIB)
    assert buckets == [[7], [6, 5, 4], [3, 2, 1], [0]]


def test_assign_groups_by_dtype():
    params = [_t(10), _t(10, torch.float64), _t(10), _t(10, torch.float64)]
    buckets = assign_buckets(params, [3, 2, 1, 0], cap_bytes=MIB, first_cap_bytes=MIB)
    assert buckets == [[3, 1], [2, 0]]


def test_assign_single_oversized_tensor_gets_its_own_bucket():
    params = [_t(10), _t(4 * MIB), _t(10)]
    assert assign_buckets(params, [2, 1, 0], cap_bytes=MIB, first_cap_bytes=MIB) == [[2], [1], [0]]


def test_default_ddp_buckets_are_reverse_order_with_small_first():
    # 7 tensors: weights of 0.5 MiB, biases tiny; a parameter that would
    # overflow the open bucket starts the next one.
    net = nn.Sequential(*[nn.Linear(512, 256) for _ in range(3)], nn.Linear(256, 4, bias=False))
    model = ddpkit.DDP(net, bucket_cap_mb=1.5)
    names = [n for n, _ in net.named_parameters()]
    buckets = [[names[i] for i in b] for b in model.reducer.bucket_indices()]
    assert buckets == [["3.weight", "2.bias", "2.weight", "1.bias"], ["1.weight", "0.bias", "0.weight"]]


class _Crossed(nn.Module):
    """Registration order a, b, c; the forward order depends on the rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        layers = [self.a, self.b, self.c] if dist.get_rank() == 0 else [self.c, self.b, self.a]
        for layer in layers:
            x = torch.tanh(layer(x))
        return x.sum()


def _rebuild() -> list:
    torch.manual_seed(0)
    model = ddpkit.DDP(_Crossed(), bucket_cap_mb=1e-6)  # one parameter per bucket
    names = [n for n, _ in model.module.named_parameters()]
    before = model.reducer.bucket_indices()
    launched: list[int] = []

    def spy(state, bucket):
        launched.append(sum(model.reducer._ready))  # how many gradients were ready at launch
        return ddpkit.hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, spy)
    for _ in range(3):
        model(torch.ones(2, 4)).backward()
    after = [names[b[0]] for b in model.reducer.bucket_indices()]
    return [[names[b[0]] for b in before], after, launched[-6:]]


def test_rebuild_follows_rank0_arrival_order_and_overlaps(dist2):
    (before0, after0, launched0), (before1, after1, launched1) = dist2.run(_rebuild)
    assert before0 == before1 == ["c.bias", "c.weight", "b.bias", "b.weight", "a.bias", "a.weight"]
    # Rank 0 runs a, b, c forward, so backward produces c's gradients first.
    assert after0 == after1 and after0[:2] in (["c.weight", "c.bias"], ["c.bias", "c.weight"])
    # After the rebuild on rank 0, bucket k is launched as soon as k+1
    # gradients are ready: communication starts during backward.
    assert launched0 == [1, 2, 3, 4, 5, 6]


class _TwiceThroughCheckpoint(nn.Module):
    """One Linear used inside a reentrant checkpoint and outside it: its gradient arrives twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.lin, x, use_reentrant=True) + self.lin(x)


def test_a_gradient_twice_in_one_backward_is_an_error():
    ddpkit.init()
    model = ddpkit.DDP(_TwiceThroughCheckpoint())
    with pytest.raises(RuntimeError, match="received a gradient twice in one synchronised backward"):
        model(torch.randn(2, 3, requires_grad=True)).sum().backward()


def test_a_sparse_gradient_is_an_error_naming_the_parameter():
    # torch's DDP reduces sparse gradients; ddpkit's refuses them by name (a known gap).
    ddpkit.init()
    model = ddpkit.DDP(nn.Embedding(5, 2, sparse=True))
    with pytest.raises(RuntimeError, match="parameter 'weight' has a sparse gradient"):
        model(torch.tensor([1, 2])).sum().backward()
