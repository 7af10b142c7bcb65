"""ddpkit.comm.direct (the ZeRO engines' gathers and reductions on gloo) against torch's collectives, on real gloo
ranks (2 and 3)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddpkit.comm.direct import direct_all_gather, direct_reduce_scatter

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]
CHUNKS = [0, 1, 7, 4099]


def _data(n: int, dtype: torch.dtype, rank: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + 10 * n + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


def _everyones(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _gathers_and_reductions() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    for dtype in DTYPES:
        for n in CHUNKS:
            part = _data(n, dtype, rank)
            out = torch.full((world * n,), 7, dtype=dtype)
            direct_all_gather(out, part, dist.group.WORLD).wait()
            expected = torch.empty_like(out)
            dist.all_gather_into_tensor(expected, part)
            if not torch.equal(out, expected):
                failures.append(f"all-gather {dtype} chunk {n}")
            flat = _data(world * n, dtype, rank, salt=1)
            mine = torch.empty(n, dtype=dtype)
            direct_reduce_scatter(mine, flat, dist.group.WORLD).wait()
            chunks = [t[rank * n: (rank + 1) * n] for t in _everyones(flat)]
            in_rank_order = chunks[0] + chunks[1]
            for c in chunks[2:]:
                in_rank_order = in_rank_order + c
            if not torch.equal(mine, in_rank_order):
                failures.append(f"reduce-scatter {dtype} chunk {n}")
            if world == 2:  # a sum of two in any order: gloo's all-reduce's very values
                reduced = flat.clone()
                dist.all_reduce(reduced)
                if not torch.equal(mine, reduced[rank * n: (rank + 1) * n]):
                    failures.append(f"reduce-scatter {dtype} chunk {n} is not the all-reduce's at world 2")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_equal_torchs_all_gather_and_the_rank_order_sum(request, world):
    for failures in request.getfixturevalue(f"dist{world}").run(_gathers_and_reductions):
        assert failures == []


def _in_flight_together() -> dict:
    """Two gathers and two reductions in flight at once, the kinds posted in another order on odd ranks than on
    even ones (each kind in the same order everywhere), waited for out of order, one through its future (as an
    observer watches it): each gets its own messages."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    parts = [_data(n, torch.float32, rank, salt=s) for s, n in ((2, 300), (3, 5))]
    gathered = [torch.empty(world * p.numel()) for p in parts]
    flats = [_data(world * n, torch.float32, rank, salt=s) for s, n in ((4, 300), (5, 5))]
    mine = [torch.empty(f.numel() // world) for f in flats]
    gathers = [lambda k=k: direct_all_gather(gathered[k], parts[k], group) for k in (0, 1)]
    reductions = [lambda k=k: direct_reduce_scatter(mine[k], flats[k], group) for k in (0, 1)]
    posts = [reductions[0], gathers[0], gathers[1], reductions[1]] if rank % 2 == 0 else gathers + reductions
    works = [post() for post in posts]
    future = works[1].get_future()
    assert works[1].get_future() is future  # one watcher per work
    future.wait()
    for work in reversed(works):
        work.wait()
    works[1].wait()  # a second wait is a no-op
    ok = all(torch.equal(g, torch.cat(_everyones(p))) for g, p in zip(gathered, parts))
    sums = [sum(t[rank * m.numel(): (rank + 1) * m.numel()] for t in _everyones(f)) for f, m in zip(flats, mine)]
    return {"gathered": ok, "reduced": all(torch.allclose(m, s, rtol=1e-6, atol=1e-6) for m, s in zip(mine, sums)),
            "completed": all(w.is_completed() for w in works)}


def test_collectives_in_flight_at_once_keep_to_their_own_messages(dist3):
    for r in dist3.run(_in_flight_together):
        assert r == {"gathered": True, "reduced": True, "completed": True}


def _bad_sizes() -> list[str]:
    said = []
    for call in (lambda: direct_all_gather(torch.empty(5), torch.empty(2), dist.group.WORLD),
                 lambda: direct_reduce_scatter(torch.empty(2), torch.empty(5), dist.group.WORLD)):
        try:
            call()
        except ValueError as e:
            said.append(str(e))
    return said


def test_mismatched_sizes_are_named_before_any_message(dist2):
    for said in dist2.run(_bad_sizes):
        assert said == ["direct_all_gather: out has 5 elements, 2 ranks' parts of 2 need 4",
                        "direct_reduce_scatter: 5 elements do not make 2 chunks of 2 (out's)"]
