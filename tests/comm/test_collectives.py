"""ddpkit.collectives against torch.distributed's own collectives, on real gloo ranks (1, 2 and 3)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from ddp_models import make, state, train

import ddpkit
from ddpkit import collectives as C

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
LENGTHS = [0, 1, 5, 13]  # empty, tiny, and not divisible by the world size
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
             "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
             "bxor": dist.ReduceOp.BXOR}


def _data(n: int, dtype: torch.dtype, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * n + rank)
    if dtype.is_floating_point:
        # Values near 1 so products stay in range for 16-bit floats.
        return (torch.rand(n, generator=g) * 0.5 + 0.75).to(dtype)
    return torch.randint(-3, 4, (n,), generator=g).to(dtype)


def _tolerance(dtype: torch.dtype, op: str) -> dict:
    # Integers, min and max are exact. Float sums and products differ from
    # gloo's only by the order of operations: a few ulps of each dtype.
    if not dtype.is_floating_point or op in ("min", "max"):
        return {"rtol": 0, "atol": 0}
    eps = torch.finfo(dtype).eps
    return {"rtol": 8 * eps, "atol": 8 * eps}


def _all_algorithms(algorithm: str) -> list[str]:
    rank = dist.get_rank()
    failures = []
    for dtype in DTYPES:
        for n in LENGTHS:
            for op in ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor"):  # (bitwise ones: refused before)
                bitwise = op in ("band", "bor", "bxor")
                if (op == "avg" and not dtype.is_floating_point) or (bitwise and dtype.is_floating_point):
                    continue
                mine = _data(n, dtype, rank)
                expected = mine.clone()
                dist.all_reduce(expected, op=TORCH_OPS["sum" if op == "avg" else op])
                if op == "avg":
                    expected /= dist.get_world_size()
                # A non-contiguous view: every other element of a wider tensor.
                wide = torch.zeros(2 * n, dtype=dtype)
                view = wide[::2]
                view.copy_(mine)
                C.all_reduce(view, op=op, algorithm=algorithm, local_size=2)
                try:
                    torch.testing.assert_close(view, expected, **_tolerance(dtype, op))
                    assert wide[1::2].eq(0).all(), "wrote outside the view"
                except AssertionError as e:
                    failures.append(f"{algorithm} {op} {dtype} n={n}: {e}")
    return failures


@pytest.mark.slow("every algorithm, dtype and op at three ranks")
@pytest.mark.parametrize("algorithm", C.ALGORITHMS)
def test_all_reduce_matches_torch_three_ranks(dist3, algorithm):
    for failures in dist3.run(_all_algorithms, algorithm):
        assert not failures, "\n".join(failures[:5])


def _all_at_four() -> list[str]:
    # local_size=2: hierarchical runs as two nodes of two ranks.
    return [f for a in C.ALGORITHMS for f in _all_algorithms(a)]


@pytest.mark.slow("every algorithm, dtype and op at four ranks on two cores")
def test_all_reduce_matches_torch_four_ranks(dist4):
    for failures in dist4.run(_all_at_four, timeout=300):
        assert not failures, "\n".join(failures[:5])
    dist4.close()  # four ranks are not needed again: give the cores back


@pytest.mark.parametrize("algorithm", ["ring", "tree", "hierarchical"])
def test_all_reduce_matches_torch_two_ranks(dist2, algorithm):
    for failures in dist2.run(_all_algorithms, algorithm):
        assert not failures, "\n".join(failures[:5])


def _large_messages() -> list[str]:
    """Every algorithm on messages of several pieces (:data:`ddpkit.comm.algorithms.PIECE_ELEMENTS`), sizes not
    divisible by the world or the piece, against torch's all-reduce."""
    from ddpkit.comm.algorithms import PIECE_ELEMENTS

    failures = []
    sizes = ((torch.float32, 3 * PIECE_ELEMENTS * dist.get_world_size() + 17), (torch.int64, PIECE_ELEMENTS + 5),
             (torch.float16, 2 * PIECE_ELEMENTS + 1))
    for dtype, n in sizes:
        for algorithm in C.ALGORITHMS:
            mine = _data(n, dtype, dist.get_rank())
            expected = mine.clone()
            dist.all_reduce(expected)
            C.all_reduce(mine, op="sum", algorithm=algorithm, local_size=2)
            try:
                torch.testing.assert_close(mine, expected, **_tolerance(dtype, "sum"))
            except AssertionError as e:
                failures.append(f"{algorithm} {dtype} n={n}: {e}")
    return failures


def test_messages_of_several_pieces_arrive_whole(dist3, dist2):
    # A large message goes in pieces posted together (both ways at once between two ranks): each piece must land
    # in its place, at three ranks (the ring's chunks are pieces too) and at two (a send and a receive between the
    # same two ranks).
    for pool in (dist3, dist2):
        for failures in pool.run(_large_messages, timeout=120):
            assert not failures, "\n".join(failures[:5])


def _bitwise() -> list[str]:
    failures = []
    for algorithm in C.ALGORITHMS:
        for dtype in (torch.int32, torch.uint8, torch.bool):
            for op in ("band", "bor", "bxor"):
                mine = _data(7, dtype, dist.get_rank())
                expected = mine.clone()
                dist.all_reduce(expected, op=TORCH_OPS[op])
                C.all_reduce(mine, op=op, algorithm=algorithm, local_size=1)
                if not torch.equal(mine, expected):
                    failures.append(f"{algorithm} {op} {dtype}: {mine.tolist()} != {expected.tolist()}")
    return failures


def test_bitwise_ops_match_the_backends_on_gloo_and_mpi(dist2, mpi2):
    # Refused before ("use sum, avg, prod, min or max"), where gloo and MPI have them.
    for pool in (dist2, mpi2):
        for failures in pool.run(_bitwise, timeout=120):
            assert not failures, "\n".join(failures[:5])


def test_messages_of_several_pieces_arrive_whole_over_mpi(mpi2):
    for failures in mpi2.run(_large_messages, timeout=120):
        assert not failures, "\n".join(failures[:5])


def test_world_of_one():
    ddpkit.init()
    t = torch.arange(5.0)
    for algorithm in C.ALGORITHMS:
        C.all_reduce(t, algorithm=algorithm)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert C.all_reduce(t, async_op=True).wait()


def _building_blocks() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for algorithm in ("native", "naive", "tree"):
        t = torch.full((7,), float(rank))
        C.broadcast(t, src=world - 1, algorithm=algorithm)
        out[f"broadcast {algorithm}"] = t.tolist()
        r = torch.arange(7.0) + rank
        C.reduce(r, dst=1, algorithm=algorithm)
        out[f"reduce {algorithm}"] = r.tolist() if rank == 1 else None
    for algorithm in ("ring", "native"):
        full = torch.arange(10.0) * (rank + 1)
        part = torch.empty(len(torch.arange(10).tensor_split(world)[rank]))
        C.reduce_scatter(part, full.clone(), algorithm=algorithm)
        out[f"reduce_scatter {algorithm}"] = part.tolist()
        gathered = torch.empty(world * 3)
        C.all_gather(gathered, torch.full((3,), float(rank)), algorithm=algorithm)
        out[f"all_gather {algorithm}"] = gathered.tolist()
    handle = C.all_reduce(torch.ones(4), algorithm="ring", async_op=True)
    out["async"] = handle.get_future().wait()[0].tolist()
    native = C.all_reduce(torch.ones(4), async_op=True)
    out["async native"] = native.get_future().wait()[0].tolist()
    return out


def test_building_blocks(dist3):
    world = 3
    total = sum(range(1, world + 1))
    for rank, out in enumerate(dist3.run(_building_blocks)):
        for algorithm in ("native", "naive", "tree"):
            assert out[f"broadcast {algorithm}"] == [2.0] * 7
            if rank == 1:
                assert out[f"reduce {algorithm}"] == [3.0 * i + 3 for i in range(7)]
        chunk = torch.arange(10).tensor_split(world)[rank]
        for algorithm in ("ring", "native"):
            assert out[f"reduce_scatter {algorithm}"] == [float(i) * total for i in chunk.tolist()]
            assert out[f"all_gather {algorithm}"] == [float(r) for r in range(world) for _ in range(3)]
        assert out["async"] == [3.0] * 4 and out["async native"] == [3.0] * 4


def _building_blocks_async() -> dict:
    # async_op on every function, as torch.distributed takes it: the result is there once the handle is waited for
    # (non-contiguous tensors and avg: the copy back and the division wait for the backend's work too).
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for algorithm in ("native", "naive", "tree"):
        t = torch.full((7, 2), float(rank)).t()  # not contiguous
        handle = C.broadcast(t, src=world - 1, algorithm=algorithm, async_op=True)
        out[f"broadcast {algorithm}"] = (handle.wait(), t.tolist(), handle.get_future().wait()[0] is t)
        r = (torch.arange(14.0).view(7, 2) + rank).t()
        handle = C.reduce(r, dst=1, op="avg", algorithm=algorithm, async_op=True)
        out[f"reduce {algorithm}"] = (handle.wait(), r.tolist() if rank == 1 else None)
    for algorithm in ("ring", "native"):
        full = torch.arange(10.0) * (rank + 1)
        part = torch.empty(len(torch.arange(10).tensor_split(world)[rank]))
        handle = C.reduce_scatter(part, full.clone(), op="avg", algorithm=algorithm, async_op=True)
        out[f"reduce_scatter {algorithm}"] = (handle.get_future().wait()[0] is part, part.tolist())
        gathered = torch.empty(3, world).t()  # not contiguous
        handle = C.all_gather(gathered, torch.full((3,), float(rank)), algorithm=algorithm, async_op=True)
        out[f"all_gather {algorithm}"] = (handle.wait(), gathered.tolist())
    out["sync"] = [C.broadcast(torch.ones(2)), C.reduce(torch.ones(2)), C.all_gather(torch.empty(2 * world),
                   torch.ones(2)), C.reduce_scatter(torch.empty(1), torch.ones(world))]
    return out


def test_every_building_block_takes_async_op_on_gloo_and_mpi(dist3, mpi3):
    world = 3
    for rank, out in enumerate(dist3.run(_building_blocks_async) + mpi3.run(_building_blocks_async)):
        rank %= world
        for algorithm in ("native", "naive", "tree"):
            assert out[f"broadcast {algorithm}"] == (True, [[2.0] * 7] * 2, True)
            if rank == 1:  # the mean of 14 * j + 2 * i + rank over the ranks, transposed
                assert out[f"reduce {algorithm}"] == (True, [[2.0 * i + j + 1 for i in range(7)] for j in range(2)])
        chunk = torch.arange(10).tensor_split(world)[rank]
        for algorithm in ("ring", "native"):
            assert out[f"reduce_scatter {algorithm}"] == (True, [float(i) * 2 for i in chunk.tolist()])
            assert out[f"all_gather {algorithm}"] == (True, [[float(r)] * 3 for r in range(world)])
        assert out["sync"] == [None] * 4


def _bad_inputs() -> list[str]:
    errors = []
    for call in (
        lambda: C.all_reduce(torch.ones(3 + dist.get_rank()), algorithm="ring"),
        lambda: C.all_reduce(torch.ones(3, dtype=torch.float32 if dist.get_rank() else torch.float64)),
        lambda: C.all_reduce(torch.ones(3), algorithm="butterfly"),
        lambda: C.all_reduce(torch.ones(3), op="median"),
        lambda: C.all_reduce(torch.ones(3, dtype=torch.int64), op="avg"),
        lambda: C.all_reduce(torch.ones(3, dtype=torch.complex64), op="min", algorithm="naive"),
        lambda: C.all_reduce(torch.ones(3).to_sparse(), algorithm="tree"),
        lambda: C.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND, algorithm="ring"),
    ):
        try:
            call()
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    return errors


def _outside_the_group() -> str:
    group = dist.new_group([0])  # every rank takes part in creating it
    if dist.get_rank() == 0:
        return "member"
    try:
        C.all_reduce(torch.ones(2), group=group)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_rank_outside_the_group_is_refused(dist2):
    assert dist2.run(_outside_the_group)[1].startswith("this rank (1) is not in the group")


def _roots_in_a_subgroup() -> dict:
    group = dist.new_group([1, 2])  # every rank takes part in creating it
    rank, out = dist.get_rank(), {}
    if rank == 0:
        return out
    for algorithm in ("native", "naive", "tree"):
        for how, kwargs in (("src=1", {"src": 1}), ("group_src=1", {"group_src": 1})):
            t = torch.full((3,), 10.0 * rank)
            C.broadcast(t, algorithm=algorithm, group=group, **kwargs)
            out[f"broadcast {how} {algorithm}"] = t.tolist()
        t = torch.full((3,), 10.0 * rank)
        C.reduce(t, dst=2, algorithm=algorithm, group=group)
        out[f"reduce dst=2 {algorithm}"] = t.tolist()
    for kwargs in ({"src": 0}, {"src": 1, "group_src": 0}, {"group_src": 2}):
        try:
            C.broadcast(torch.ones(2), group=group, **kwargs)
        except ValueError as e:
            out[str(kwargs)] = str(e)
    return out


def test_src_and_dst_are_global_ranks_and_group_src_a_rank_within_the_group(dist3):
    # As torch.distributed: src/dst are global ranks, group_src/group_dst ranks within the group. ddpkit took
    # src=1 in the group of global ranks [1, 2] for its second member, and sent global rank 2's data.
    _, one, two = dist3.run(_roots_in_a_subgroup)
    for algorithm in ("native", "naive", "tree"):
        for out in (one, two):
            assert out[f"broadcast src=1 {algorithm}"] == [10.0] * 3
            assert out[f"broadcast group_src=1 {algorithm}"] == [20.0] * 3
        assert two[f"reduce dst=2 {algorithm}"] == [30.0] * 3
    assert "src=0 is not a rank of the group (its global ranks: [1, 2])" in one["{'src': 0}"]
    assert "not both" in one["{'src': 1, 'group_src': 0}"]
    assert "group_src=2 is not a rank within the group (0 to 1)" in one["{'group_src': 2}"]


def _average_waited_twice() -> list[list[float]]:
    results = []
    for _ in range(20):
        t = torch.full((4,), 1.0 + dist.get_rank())
        handle = C.all_reduce(t, op="avg", async_op=True)
        handle.get_future()  # its callback and wait() both finish the average: once
        handle.wait(timeout=timedelta(seconds=30))  # (torch's Work.wait takes one)
        results.append(t.tolist())
    return results


def test_an_average_whose_future_was_taken_is_divided_once(dist2):
    for results in dist2.run(_average_waited_twice):
        assert results == [[1.5] * 4] * 20


def test_bad_inputs_are_named_on_every_rank_without_hanging(dist2):
    for errors in dist2.run(_bad_inputs, timeout=60):
        assert "every rank must pass the same shape and dtype" in errors[0]
        assert "every rank must pass the same shape and dtype" in errors[1]
        assert "algorithm='butterfly' is not known" in errors[2]
        assert "op='median' is not a reduction" in errors[3]
        assert "op='avg' on a torch.int64 tensor" in errors[4]
        assert "op='min' is not defined for complex tensors" in errors[5]  # torch.distributed: ValueError too
        assert "a torch.sparse_coo tensor is not supported" in errors[6]
        assert "op='band' (bitwise) of a torch.float32 tensor: bitwise ops take integer or bool tensors" in errors[7]


def _leaf_and_reduce_op(algorithm: str) -> list[torch.Tensor]:
    # A leaf that requires grad is reduced in place, as dist.all_reduce does it; torch's ReduceOp works as op.
    leaf = torch.full((5,), dist.get_rank() + 1.0, requires_grad=True)
    C.all_reduce(leaf, algorithm=algorithm)
    other = torch.full((3,), dist.get_rank() + 2.0, requires_grad=True)
    C.all_reduce(other, op=dist.ReduceOp.MAX, algorithm=algorithm)
    avg = torch.full((4,), dist.get_rank() + 1.0, requires_grad=True)
    C.all_reduce(avg, op="avg", algorithm=algorithm, async_op=True).wait()
    return [leaf.detach(), other.detach(), avg.detach()]


@pytest.mark.parametrize("algorithm", ["native", "naive", "ring", "tree"])
def test_leaves_that_require_grad_and_torchs_reduce_ops(dist2, algorithm):
    for leaf, other, avg in dist2.run(_leaf_and_reduce_op, algorithm):
        assert leaf.eq(3).all() and other.eq(3).all() and avg.eq(1.5).all()


def _train_with(algorithm: str) -> dict:
    model = ddpkit.DDP(make("convbn"), bucket_cap_mb=1e-4)  # several buckets
    model.register_comm_hook(ddpkit.hooks.AllReduceState(algorithm=algorithm), ddpkit.hooks.allreduce_hook)
    return state(train(model, "convbn", 3, 0.9))


@pytest.mark.parametrize("algorithm", ["naive", "ring", "tree", "hierarchical"])
def test_ddp_trains_the_same_with_each_algorithm(dist3, algorithm):
    # Three addends in another order than gloo's: float32 sums a few ulps
    # apart, grown over 3 momentum steps; 1e-5 relative is ~100 ulps.
    native = dist3.run(_train_with, "native")
    ours = dist3.run(_train_with, algorithm)
    for a, b in zip(native, ours):
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
