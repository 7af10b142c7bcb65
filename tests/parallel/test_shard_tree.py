"""The deterministic mode's tree of additions (ddpkit.parallel.fault_tolerance.shard_tree) and its sum at a world of
one (ordered_sum), without processes."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ddpkit.parallel.fault_tolerance.ordered_sum import OrderedSum, wire_scale
from ddpkit.parallel.fault_tolerance.shard_tree import ShardTree

SIZES = [(v, n) for v in (1, 2, 3, 5, 8, 12, 16, 17) for n in range(1, v + 1) if n <= 6]


def _leaves(v: int) -> list[torch.Tensor]:
    # magnitudes from 1e-8 to 1e8: any change in the order of additions changes some bits
    g = torch.Generator().manual_seed(v)
    return [torch.randn(257, generator=g, dtype=torch.float32) * 10.0 ** torch.randint(-8, 9, (257,), generator=g)
            for _ in range(v)]


@pytest.mark.parametrize("v, n", SIZES)
def test_the_runs_and_their_partial_sums_cover_every_shard_once(v: int, n: int) -> None:
    tree = ShardTree(v, n)
    assert [s for run in tree.runs for s in run] == list(range(v))
    assert all(len(run) >= 1 for run in tree.runs)
    for rank, (run, cover) in enumerate(zip(tree.runs, tree.covers)):
        assert [s for lo, hi in cover for s in range(lo, hi)] == list(run)
        assert all(tree.owner(s) == (rank, s - run.start) for s in run)
    assert tree.rows == max(len(c) for c in tree.covers) and len(tree.sent) == sum(len(c) for c in tree.covers)


@pytest.mark.parametrize("v, n", SIZES)
def test_the_sum_from_any_worlds_partial_sums_has_the_bits_of_one_rank(v: int, n: int) -> None:
    leaves = _leaves(v)
    alone = ShardTree(v, 1).total({}, leaves.__getitem__)
    tree = ShardTree(v, n)
    partial = {node: tree.add(node, {}, leaves.__getitem__) for node in tree.sent}
    together = tree.total(partial, lambda shard: pytest.fail(f"shard {shard} is inside a partial sum"))
    assert torch.equal(together, alone)
    if v >= 4:  # the order matters for these numbers: the plain left-to-right sum differs
        plain = torch.zeros(257)
        for leaf in leaves:
            plain = plain + leaf
        assert not torch.equal(plain, alone)


@pytest.mark.parametrize("v", [1, 2, 3, 7, 8, 16, 17])
def test_sums_written_into_kept_room_have_the_bits_of_new_tensors(v: int) -> None:
    leaves = _leaves(v)
    tree = ShardTree(v, 1)
    fresh = tree.total({}, leaves.__getitem__)
    out, scratch = torch.full((257,), float("nan")), []
    for _ in range(2):  # the second time in the room the first left (nothing allocated again)
        kept = [t.data_ptr() for t in scratch]
        assert tree.total({}, leaves.__getitem__, out=out, scratch=scratch) is out
        assert torch.equal(out, fresh)
    assert [t.data_ptr() for t in scratch] == kept and len(scratch) <= max(1, v).bit_length()
    half = ShardTree(v, min(v, 2))  # from partial sums too, as the owner of a block adds them
    partial = {node: half.add(node, {}, leaves.__getitem__) for node in half.sent}
    assert torch.equal(half.total(partial, lambda s: pytest.fail(f"shard {s}"), out=out, scratch=[]), fresh)


@pytest.mark.parametrize("v, n", [(2, 2), (8, 2), (8, 4), (16, 4), (32, 8)])
def test_at_powers_of_two_each_rank_sends_one_partial_sum(v: int, n: int) -> None:
    assert ShardTree(v, n).rows == 1


def test_a_world_larger_than_the_shards_is_refused() -> None:
    with pytest.raises(ValueError, match="3 shards cannot be trained by 4 ranks"):
        ShardTree(3, 4)


@pytest.mark.parametrize("v, n", SIZES)
def test_the_schedule_adds_each_ranks_shards_as_they_come_into_its_partial_sums(v: int, n: int) -> None:
    """Taking a run's shards one by one, adding the newest two as the schedule says, gives each partial sum of
    the cover with the tree's bits, on a stack no deeper than the tree plus one."""
    leaves = _leaves(v)
    tree = ShardTree(v, n)
    for rank, run in enumerate(tree.runs):
        stack: list[torch.Tensor] = []
        partials, deepest = [], 0
        for shard, (merges, done) in zip(run, tree.schedule(rank), strict=True):
            stack.append(leaves[shard].clone())
            deepest = max(deepest, len(stack))
            for _ in range(merges):
                right = stack.pop()
                stack[-1].add_(right)
            if done:
                [partial] = stack
                partials.append(stack.pop())
        assert not stack and len(partials) == len(tree.covers[rank])
        for node, partial in zip(tree.covers[rank], partials):
            assert torch.equal(partial, tree.add(node, {}, leaves.__getitem__))
        assert deepest <= len(run).bit_length() + 1


@pytest.mark.parametrize("wire", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("v", [1, 2, 3, 5, 8, 12, 17])
def test_the_ordered_sum_of_one_rank_has_the_trees_bits_in_room_kept_from_step_to_step(v: int,
                                                                                      wire: torch.dtype) -> None:
    """A world of one: the shards taken in one at a time (one without samples skipped: zeros) give the tree's
    total of the same leaves (in a hook's dtype: scaled by the power of two nearest V, rounded, unscaled), in two
    results that take turns, with at most a stack slot per level of the tree plus one."""
    leaves = [leaf / 1e6 for leaf in _leaves(v)]  # within half precision's range once scaled and added
    skipped = v // 2 if v > 2 else None
    if skipped is not None:
        leaves[skipped] = torch.zeros(257)
    tree = ShardTree(v, 1)
    scale = wire_scale(v)
    rounded = [(leaf * scale).to(wire) for leaf in leaves]
    expected = tree.total({}, rounded.__getitem__).float() / scale if wire != torch.float32 else tree.total(
        {}, leaves.__getitem__)
    summed = OrderedSum(torch.device("cpu"))
    results = []
    for _ in range(3):
        summed.start(tree, 0, 257, exchange=False, wire=wire)
        for shard in range(v):
            if shard == skipped:
                continue
            summed.leaf(shard).copy_(leaves[shard])
            summed.push()
        results.append(summed.finish(None, lambda *_: pytest.fail("a world of one exchanges nothing")))
        assert torch.isfinite(expected).all() and results[-1].dtype == torch.float32
        assert torch.equal(results[-1], expected)
    assert results[0].data_ptr() == results[2].data_ptr() != results[1].data_ptr()  # two in turn, kept
    assert len(summed._slots) <= v.bit_length() + 1


class _Threads:
    """An all-to-all among threads, one per rank: what OrderedSum's ranks hand each other, without processes."""

    def __init__(self, n: int) -> None:
        self.n, self.barrier, self.sent = n, threading.Barrier(n, timeout=30), [torch.empty(0)] * n

    def of(self, rank: int) -> Any:
        threads = self

        class Group:
            def alltoall_base(self, out: torch.Tensor, send: torch.Tensor, *splits: Any) -> Any:
                threads.sent[rank] = send.clone()
                threads.barrier.wait()
                for source in range(threads.n):
                    out[source].copy_(threads.sent[source][rank])
                threads.barrier.wait()
                return SimpleNamespace(wait=lambda: None)

        return Group()


@pytest.mark.parametrize("numel", [7, 257])
@pytest.mark.parametrize("wire", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("v, n", [(2, 2), (8, 2), (5, 3), (6, 3), (6, 4), (12, 5), (16, 4)])
def test_the_ordered_sum_over_ranks_has_one_ranks_bits(v: int, n: int, wire: torch.dtype, numel: int) -> None:
    """n ranks (threads) exchanging their partial sums: every rank's result has the bits of the tree's total of
    all leaves at a world of one, with rows > 1 and = 1 (the send row as the stack's bottom, a tail past the
    gradient when n does not divide it), shards without samples skipped, and the last step's result intact."""
    tree, threads = ShardTree(v, n), _Threads(n)
    sums = [OrderedSum(torch.device("cpu")) for _ in range(n)]
    g = torch.Generator().manual_seed(v * 31 + n)
    kept: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n)]
    for step, skipped in enumerate([(), (0, v - 1), tuple(range(1, v, 2))]):
        leaves = [torch.randn(numel, generator=g) * 10.0 ** torch.randint(-3, 3, (numel,), generator=g) / 1e3
                  for _ in range(v)]
        for shard in skipped:
            leaves[shard] = torch.zeros(numel)
        scale = wire_scale(v)
        rounded = [(leaf * scale).to(wire) for leaf in leaves]
        expected = (ShardTree(v, 1).total({}, rounded.__getitem__).float() / scale if wire != torch.float32
                    else ShardTree(v, 1).total({}, leaves.__getitem__))
        results: list[torch.Tensor | None] = [None] * n

        def rank(r: int) -> None:
            summed = sums[r]
            summed.start(tree, r, numel, exchange=True, wire=wire)
            for shard in tree.runs[r]:
                if shard not in skipped:
                    summed.leaf(shard).copy_(leaves[shard])
                    summed.push()
            results[r] = summed.finish(threads.of(r), lambda what, payload, start: start().wait())

        workers = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        for r in range(n):
            result = results[r]
            assert result is not None and torch.equal(result, expected), (step, r)
            if kept[r]:  # ``.grad`` views the last step's result while this one's arrives
                assert torch.equal(kept[r][-1][0], kept[r][-1][1]), (step, r)
            kept[r].append((result, result.clone()))
