"""ddpkit.DistributedSampler: parity with torch's, resume, evaluation mode, warnings."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from ddpkit import DistributedSampler


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def test_parity_with_torch_for_every_combination() -> None:
    # Lengths cover empty, smaller than the world, exact multiples and remainders.
    for n, replicas, shuffle, drop_last, seed in itertools.product(
        range(0, 14), range(1, 6), (False, True), (False, True), (0, 7)
    ):
        data = _Sized(n)
        for rank in range(replicas):
            ours = DistributedSampler(data, replicas, rank, shuffle, seed, drop_last)
            ref = TorchSampler(data, replicas, rank, shuffle, seed, drop_last)
            for epoch in (0, 3):
                ours.set_epoch(epoch)
                ref.set_epoch(epoch)
                got = list(ours)
                assert got == list(ref), (n, replicas, rank, shuffle, drop_last, seed, epoch)
                assert len(ours) == len(ref) == len(got)


def test_a_dataset_that_changes_size_after_construction_behaves_as_under_torch() -> None:
    # Where torch's shards sized at construction no longer fit (grown without drop_last, shrunk with it),
    # torch fails with an AssertionError and so does ddpkit, saying why; elsewhere both go on alike.
    for n, grown, drop_last in itertools.product((5, 6, 10), (-2, 1, 3), (False, True)):
        for rank in range(2):
            data = _Sized(n)
            ours, ref = DistributedSampler(data, 2, rank, True, 0, drop_last), TorchSampler(data, 2, rank, True, 0,
                                                                                           drop_last)
            data.n = n + grown
            try:
                want = list(ref)
            except AssertionError:
                with pytest.raises(AssertionError, match=f"has {n + grown} samples now, but this Distributed"
                                                         f"Sampler was built for {n}"):
                    list(ours)
                continue
            assert list(ours) == want, (n, grown, drop_last, rank)


def test_eval_mode_counts_every_sample_once() -> None:
    for n, replicas, shuffle in itertools.product(range(0, 12), range(1, 5), (False, True)):
        shards = [
            list(DistributedSampler(_Sized(n), replicas, r, shuffle=shuffle, pad=False))
            for r in range(replicas)
        ]
        assert sorted(itertools.chain(*shards)) == list(range(n))
        assert [len(s) for s in shards] == [
            len(DistributedSampler(_Sized(n), replicas, r, pad=False)) for r in range(replicas)
        ]
        assert max(map(len, shards), default=0) - min(map(len, shards), default=0) <= 1


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="rank=2 is out of range for num_replicas=2"):
        DistributedSampler(_Sized(4), 2, 2)
    with pytest.raises(ValueError, match="num_replicas=0"):
        DistributedSampler(_Sized(4), 0, 0)
    with pytest.raises(ValueError, match="drop_last=True with pad=False"):
        DistributedSampler(_Sized(4), 2, 0, drop_last=True, pad=False)


@pytest.mark.parametrize("n,replicas,drop_last", [(23, 3, False), (23, 3, True), (10, 4, False)])
def test_resume_mid_epoch_repeats_and_skips_nothing(n: int, replicas: int, drop_last: bool) -> None:
    for rank in range(replicas):
        full = DistributedSampler(_Sized(n), replicas, rank, seed=5, drop_last=drop_last)
        full.set_epoch(2)
        expected = list(full)
        full.set_epoch(3)
        next_epoch = list(full)
        for cut in range(len(expected) + 1):
            first = DistributedSampler(_Sized(n), replicas, rank, seed=5, drop_last=drop_last)
            first.set_epoch(2)
            it = iter(first)
            head = [next(it) for _ in range(cut)]
            state = first.state_dict()
            assert state["consumed"] == cut and state["epoch"] == 2

            resumed = DistributedSampler(_Sized(n), replicas, rank, seed=5, drop_last=drop_last)
            resumed.load_state_dict(state)
            assert len(resumed) == len(expected) - cut
            assert head + list(resumed) == expected
            # The pass after the resumed one is a whole epoch again.
            resumed.set_epoch(3)
            assert list(resumed) == next_epoch


def test_state_dict_explicit_consumed_and_mismatch_errors() -> None:
    s = DistributedSampler(_Sized(20), 2, 1, seed=1)
    s.set_epoch(4)
    state = s.state_dict(consumed=6)
    r = DistributedSampler(_Sized(20), 2, 1, seed=1)
    r.load_state_dict(state)
    assert list(r) == list(s)[6:]
    with pytest.raises(ValueError, match="seed=1 but this sampler has seed=2"):
        DistributedSampler(_Sized(20), 2, 1, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset of 20 samples, this one has 21"):
        DistributedSampler(_Sized(21), 2, 1, seed=1).load_state_dict(state)
    evaluation = DistributedSampler(_Sized(20), 2, 1, shuffle=False, pad=False).state_dict(consumed=3)
    with pytest.raises(ValueError, match="mid-epoch with num_replicas=2 and pad=False"):
        DistributedSampler(_Sized(20), 4, 1, shuffle=False, pad=False).load_state_dict(evaluation)
    # At an epoch boundary a different world size is fine.
    boundary = s.state_dict(consumed=0)
    other = DistributedSampler(_Sized(20), 4, 1, seed=1)
    other.load_state_dict(boundary)
    ref = TorchSampler(_Sized(20), 4, 1, seed=1)
    ref.set_epoch(4)
    assert list(other) == list(ref)


def test_warns_once_on_second_pass_without_set_epoch() -> None:
    s = DistributedSampler(_Sized(10), 2, 0, shuffle=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(s)
        s.set_epoch(1)
        list(s)
    with pytest.warns(UserWarning, match="set_epoch"):
        list(s)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(s)  # only once per sampler
        # No shuffle: repeating the same order is the point, no warning.
        plain = DistributedSampler(_Sized(10), 2, 0, shuffle=False)
        list(plain)
        list(plain)


def _defaults_and_eval_union() -> tuple[int, int, list[int], int]:
    n = 11
    s = DistributedSampler(_Sized(n), shuffle=True, seed=3, pad=False)
    mine = list(s)
    gathered: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    union = sorted(i for shard in gathered for i in shard)
    return s.rank, s.num_replicas, union, n


def test_defaults_come_from_the_process_group(dist3) -> None:
    results = dist3.run(_defaults_and_eval_union)
    assert [r[:2] for r in results] == [(0, 3), (1, 3), (2, 3)]
    for _, _, union, n in results:
        assert union == list(range(n))


def test_defaults_come_from_the_environment_before_init(monkeypatch) -> None:
    # No process group yet: the launcher's variables say who this rank is.
    s = DistributedSampler(_Sized(10), shuffle=False)
    assert (s.num_replicas, s.rank) == (1, 0)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    s = DistributedSampler(_Sized(10), shuffle=False)
    assert (s.num_replicas, s.rank) == (3, 2) and list(s) == [2, 5, 8, 1]


@pytest.mark.parametrize("n, before, after, consumed, drop_last", [
    (50, 2, 3, 7, False), (50, 3, 2, 5, False), (51, 2, 3, 10, True), (10, 3, 1, 3, False), (23, 4, 3, 2, False),
])
def test_mid_epoch_state_at_another_world_size_reshards_the_rest_of_the_epoch(n, before, after, consumed, drop_last):
    # An elastic job: every old rank consumed `consumed` samples, then the world changed.
    old = [TorchSampler(_Sized(n), before, r, seed=3, drop_last=drop_last) for r in range(before)]
    for s in old:
        s.set_epoch(2)
    done = [i for s in old for i in list(s)[:consumed]]
    saved = DistributedSampler(_Sized(n), before, 0, seed=3, drop_last=drop_last)
    saved.set_epoch(2)
    state = saved.state_dict(consumed=consumed)
    new = []
    for r in range(after):
        s = DistributedSampler(_Sized(n), after, r, seed=3, drop_last=drop_last)
        s.load_state_dict(state)
        new.append(list(s))
        assert len(s) == len(new[-1])
    assert len({len(shard) for shard in new}) == 1  # even shards: one collective per batch still lines up
    rest = [i for shard in new for i in shard]
    # Nothing done is left out or done again, beyond the padding torch's rule adds.
    kept = n - len(done) if not drop_last else (n - len(done)) // after * after
    assert len(set(rest) - set(done)) == kept
    assert len(rest) - kept < after
    # The next epoch is the plain one again.
    s = DistributedSampler(_Sized(n), after, after - 1, seed=3, drop_last=drop_last)
    s.load_state_dict(state)
    s.set_epoch(3)
    ref = TorchSampler(_Sized(n), after, after - 1, seed=3, drop_last=drop_last)
    ref.set_epoch(3)
    assert list(s) == list(ref)


def test_a_resharded_state_resumes_exactly_at_its_own_world_size() -> None:
    state = DistributedSampler(_Sized(40), 2, 0, seed=1).state_dict(consumed=6)
    three = [DistributedSampler(_Sized(40), 3, r, seed=1) for r in range(3)]
    for s in three:
        s.load_state_dict(state)
    whole = [list(s) for s in three]
    again = [DistributedSampler(_Sized(40), 3, r, seed=1) for r in range(3)]
    for s in again:
        s.load_state_dict(state)
        it = iter(s)
        for _ in range(4):
            next(it)
    mid = again[0].state_dict()
    assert mid["offset"] == 12 and mid["consumed"] == 4
    for r in range(3):
        s = DistributedSampler(_Sized(40), 3, r, seed=1)
        s.load_state_dict(mid)
        assert list(s) == whole[r][4:]
