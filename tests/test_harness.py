"""The rank-pool harness itself: results by rank, failures with tracebacks, timeouts, recovery."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from harness import RankPool

import ddpkit
from ddpkit.runtime.spawn import WorkerError


def _rank_and_sum():
    t = torch.tensor([float(ddpkit.rank())])
    dist.all_reduce(t)
    return ddpkit.rank(), t.item(), os.getpid()


def _fail_on_last_rank():
    if ddpkit.rank() == ddpkit.world_size() - 1:
        raise ArithmeticError("bad step on the last rank")
    dist.barrier()  # the other ranks block here until they are killed


def _sleep(seconds):
    time.sleep(seconds)


def test_results_come_back_by_rank_and_workers_are_reused(dist2):
    first = dist2.run(_rank_and_sum)
    second = dist2.run(_rank_and_sum)
    assert [r[:2] for r in first] == [(0, 1.0), (1, 1.0)]
    assert [r[2] for r in first] == [r[2] for r in second]  # same processes


def test_failure_names_the_rank_and_the_pool_recovers(dist2):
    with pytest.raises(WorkerError) as info:
        dist2.run(_fail_on_last_rank, timeout=60)
    assert info.value.rank == 1
    assert "ArithmeticError: bad step on the last rank" in str(info.value)
    assert 'raise ArithmeticError("bad step on the last rank")' in info.value.traceback
    assert [r[:2] for r in dist2.run(_rank_and_sum)] == [(0, 1.0), (1, 1.0)]


def test_timeout_fails_instead_of_hanging():
    pool = RankPool(2)
    try:
        with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not answer within 1 s"):
            pool.run(_sleep, 30, timeout=1)
    finally:
        pool.close()
