"""runtime.objects: gather, gather_for_metrics, reduce_value, object helpers at world sizes 1, 2 and 3."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import ddpkit


def _helpers(n: int, shuffle: bool, pad: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = ddpkit.DistributedSampler(range(n), shuffle=shuffle, seed=5, pad=pad)
    idx = torch.tensor(list(sampler))
    # "Predictions": the sample's own index, twice, and a label per row.
    out = {"idx": idx, "pair": torch.stack([idx, 2 * idx], 1).float()}
    ragged = torch.arange(rank + 1)  # rank r holds r + 1 rows
    return {
        "metrics": ddpkit.gather_for_metrics(out, sampler=sampler),
        "order": list(ddpkit.DistributedSampler(range(n), shuffle=shuffle, seed=5, num_replicas=1, rank=0)),
        "gather": ddpkit.gather([ragged, torch.tensor(float(rank))]),
        "objects": ddpkit.all_gather_object({"rank": rank}),
        "broadcast": ddpkit.broadcast_object(f"from {rank}", src=world - 1),
        "mean": ddpkit.reduce_value(rank + 1),
        "max": ddpkit.reduce_value(torch.tensor([rank], dtype=torch.int32), op="max"),
        "complex": (ddpkit.reduce_value(torch.tensor([rank + 1j]), op="sum"), ddpkit.reduce_value(1j * rank)),
        "world": world,
    }


def _check(results: list[dict], n: int) -> None:
    world = results[0]["world"]
    for r in results:
        # Every sample once, in the epoch's order (the sampler's order over the
        # whole dataset, which is that of a one-rank sampler).
        assert r["metrics"]["idx"].tolist() == r["order"][:n], r["metrics"]["idx"].tolist()
        assert torch.equal(r["metrics"]["pair"][:, 1], 2 * r["metrics"]["pair"][:, 0])
        assert r["gather"][0].tolist() == [i for k in range(world) for i in range(k + 1)]
        assert r["gather"][1].tolist() == [float(k) for k in range(world)]
        assert r["objects"] == [{"rank": k} for k in range(world)]
        assert r["broadcast"] == f"from {world - 1}"
        assert r["mean"] == pytest.approx((world + 1) / 2)
        assert r["max"].dtype == torch.int32 and r["max"].tolist() == [world - 1]
        # a complex value keeps its imaginary part (cast to float64 it was dropped, with only a warning)
        tensor, number = r["complex"]
        assert tensor.dtype == torch.complex64 and tensor.tolist() == [complex(world * (world - 1) / 2, world)]
        assert number == pytest.approx(1j * (world - 1) / 2)


@pytest.mark.parametrize("n, shuffle, pad", [(10, True, True), (11, False, False), (7, True, True)])
def test_helpers_on_three_ranks(dist3, n, shuffle, pad) -> None:
    _check(dist3.run(_helpers, n, shuffle, pad), n)


def test_helpers_on_two_ranks(dist2) -> None:
    _check(dist2.run(_helpers, 9, True, True), 9)


def test_helpers_on_two_mpi_ranks(mpi2) -> None:
    _check(mpi2.run(_helpers, 9, True, True), 9)


def test_helpers_in_a_world_of_one() -> None:
    ddpkit.init()
    _check([_helpers(5, True, True)], 5)


def _torch_sampler_and_errors() -> tuple:
    sampler = TorchSampler(range(5), shuffle=False)
    mine = torch.tensor(list(sampler))
    got = ddpkit.gather_for_metrics(mine, sampler=sampler).tolist()
    loader = torch.utils.data.DataLoader(range(5), sampler=sampler)  # the loader holding it (an AttributeError)
    assert ddpkit.gather_for_metrics(mine, sampler=loader).tolist() == got
    errors = []
    deep = ddpkit.gather(torch.zeros(1, 1, 1, 1, 1, 1, 1, 2))  # 8 dimensions (6 at most before)
    assert deep.shape == (2, 1, 1, 1, 1, 1, 1, 2)
    for bad in (
        lambda: ddpkit.gather_for_metrics(mine[:1], sampler=sampler),
        lambda: ddpkit.gather_for_metrics(mine, sampler=range(5)),
        # The keys in another order on each rank: joined by position before (rank 0's a with rank 1's b).
        lambda: ddpkit.gather({"a": torch.zeros(1), "b": torch.ones(1)} if dist.get_rank() == 0
                              else {"b": torch.ones(1), "a": torch.zeros(1)}),
        lambda: ddpkit.gather(torch.zeros(2, dist.get_rank() + 1)),
        lambda: ddpkit.reduce_value(1.0, op="median"),
        lambda: ddpkit.reduce_value(torch.tensor([1j]), op="max"),
        lambda: ddpkit.reduce_value(torch.tensor([dist.get_rank()]), op="mean"),  # 0.5, truncated to 0 before
    ):
        try:
            bad()
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    return got, errors


def test_torch_samplers_and_bad_input(dist2) -> None:
    for got, errors in dist2.run(_torch_sampler_and_errors):
        assert got == [0, 1, 2, 3, 4]
        assert "run the whole epoch before gathering" in errors[0]
        assert "gather_for_metrics(sampler=range): pass the epoch's DistributedSampler" in errors[1]
        assert "value is nested otherwise than this rank's (other keys, or keys in another order" in errors[2]
        assert "only the first dimension may differ" in errors[3]
        assert "choose one of sum, mean, min, max" in errors[4]
        assert "reduce_value(op='max') of a complex value: complex numbers have no order" in errors[5]
        assert "reduce_value(op='mean') of a torch.int64 tensor: the mean would be truncated" in errors[6]


def _outside_the_group() -> list[str]:
    group = dist.new_group([0])  # every rank takes part in making it
    said = []
    for call in (lambda: ddpkit.all_gather_object(5, group=group),
                 lambda: ddpkit.gather(torch.tensor([5]), group=group),
                 lambda: ddpkit.reduce_value(5.0, group=group),
                 lambda: ddpkit.broadcast_object(5, group=group)):
        try:
            said.append(repr(call()))
        except ValueError as e:
            said.append(str(e))
    return said


def test_a_rank_outside_the_group_is_refused_by_every_helper(dist2) -> None:
    # It got its own value back from reduce_value, [] from all_gather_object, torch's "Invalid process group" from
    # gather: as if the group had answered.
    member, outsider = dist2.run(_outside_the_group)
    assert member == ["[5]", "tensor([5])", "5.0", "5"]
    assert all(s == "this rank (1) is not in the group it was given: call only on its members" for s in outsider)
