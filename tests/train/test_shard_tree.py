"""The deterministic mode's tree of additions (ddpkit.train.shard_tree), without processes."""

from __future__ import annotations

import pytest
import torch

from ddpkit.train.shard_tree import ShardTree

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
