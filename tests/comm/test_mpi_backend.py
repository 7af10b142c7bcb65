"""The mpi backend as torch users call it: point to point, objects, subgroups, works and futures, errors.

Collective results against gloo are in test_mpi_collectives.py; this file
checks the rest of the contract a process group keeps, on an mpirun pool.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.slow("mpirun jobs of 2 and 3 ranks, about 30 s")


def identity() -> dict:
    import ddpkit

    ctx = ddpkit.init()
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(),
            "ctx_backend": ctx.backend, "local_rank": ctx.local_rank, "local_world": ctx.local_world_size,
            "node_rank": ctx.node_rank, "scheme": ctx.scheme,
            "launcher_rank": os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK"))}


def test_ranks_come_from_the_communicator(mpi3):
    from ddpkit.runtime import mpirun

    scheme = {"openmpi": "openmpi", "mpich": "pmi"}[mpirun.find().vendor]  # Open MPI's variables, or Hydra's PMI
    got = mpi3.run(identity)
    assert [g["rank"] for g in got] == [0, 1, 2]
    assert [g["launcher_rank"] for g in got] == ["0", "1", "2"]
    assert {g["world"] for g in got} == {3}
    assert {(g["backend"], g["ctx_backend"], g["scheme"]) for g in got} == {("mpi4py", "mpi", scheme)}
    assert [(g["local_rank"], g["local_world"], g["node_rank"]) for g in got] == [(0, 3, 0), (1, 3, 0), (2, 3, 0)]


def point_to_point() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # A ring, both directions at once: blocking sends here would deadlock; posted requests do not.
    right, left = (rank + 1) % world, (rank - 1) % world
    big = torch.full((1 << 20,), float(rank))  # 4 MB: beyond any eager limit, a send waits for its receive
    got = torch.empty_like(big)
    ops = [dist.P2POp(dist.isend, big, right), dist.P2POp(dist.irecv, got, left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["ring"] = got[:3].tolist()
    # Tags received out of order: the tag picks the message (sent without blocking: gloo's blocking send
    # waits for its receive, and would wait forever here).
    if rank == 0:
        works = [dist.isend(torch.tensor([1.0]), 1, tag=7), dist.isend(torch.tensor([2.0]), 1, tag=8)]
        for work in works:
            work.wait()
    elif rank == 1:
        b, a = torch.zeros(1), torch.zeros(1)
        dist.recv(b, 0, tag=8)
        dist.recv(a, 0, tag=7)
        out["tags"] = (a.item(), b.item())
    # A receive from any rank says where the message came from.
    if rank == 2 % world:
        t = torch.zeros(2)
        sender = dist.recv(t)
        out["any"] = (sender, t.tolist())
    elif rank == 0:
        dist.send(torch.tensor([5.0, 6.0]), 2 % world)
    dist.barrier()
    return out


def test_point_to_point(mpi3, dist3):
    ours, theirs = mpi3.run(point_to_point), dist3.run(point_to_point)
    assert ours == theirs
    assert ours[0]["ring"] == [2.0] * 3 and ours[1]["tags"] == (1.0, 2.0) and ours[2]["any"] == (0, [5.0, 6.0])


def views_point_to_point() -> list[list[float]] | None:
    rank = dist.get_rank()
    if rank == 0:
        dist.isend(torch.arange(6.0).view(2, 3).t(), 1).wait()
    elif rank == 1:
        buffer = torch.zeros(2, 3)
        dist.irecv(buffer.t(), 0).wait()
        return buffer.tolist()
    return None


def test_point_to_point_of_views(mpi2):
    """A transposed view goes out and comes in through a contiguous copy (gloo refuses it: 'input tensor has to
    be contiguous'; MPI's datatypes could describe it, a copy is as good at these sizes)."""
    assert mpi2.run(views_point_to_point)[1] == torch.arange(6.0).view(2, 3).t().t().tolist()


def objects() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    everyone = [None] * world
    dist.all_gather_object(everyone, {"rank": rank, "text": "x" * (rank * 1000)})
    out["all_gather_object"] = [(o["rank"], len(o["text"])) for o in everyone]
    box = [{"from": rank}, rank * 10]
    dist.broadcast_object_list(box, src=1)
    out["broadcast_object_list"] = box
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(("g", rank), gathered, dst=0)
    out["gather_object"] = gathered
    got = [None]
    dist.scatter_object_list(got, [("s", r) for r in range(world)] if rank == 1 else None, src=1)
    out["scatter_object_list"] = got[0]
    return out


def test_object_collectives(mpi3, dist3):
    assert mpi3.run(objects) == dist3.run(objects)


def subgroups() -> dict:
    rank = dist.get_rank()
    out = {}
    pair = dist.new_group([0, 1])
    rest = dist.new_group([1, 2])
    if rank in (0, 1):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=pair)
        out["pair"] = t.item()
        out["pair_rank"] = dist.get_rank(pair)
        outs = [torch.zeros(1) for _ in range(2)]
        dist.all_gather(outs, torch.tensor([float(rank)]), group=pair)
        out["pair_gather"] = [o.item() for o in outs]
    if rank in (1, 2):
        t = torch.tensor([float(rank)])
        dist.broadcast(t, src=2, group=rest)  # a global rank, as torch's API takes it
        out["rest"] = t.item()
    # Two groups' collectives in flight at once, each group's progress thread on its own.
    if rank == 1:
        a, b = torch.ones(1 << 16), torch.ones(1 << 16) * 2
        wa = dist.all_reduce(a, group=pair, async_op=True)
        wb = dist.all_reduce(b, group=rest, async_op=True)
        wb.wait()
        wa.wait()
        out["both"] = (a[0].item(), b[0].item())
    elif rank == 0:
        a = torch.ones(1 << 16)
        dist.all_reduce(a, group=pair)
    elif rank == 2:
        b = torch.ones(1 << 16) * 2
        dist.all_reduce(b, group=rest)
    # torch's helper that splits the world into equal subgroups.
    mine, _ = dist.new_subgroups(group_size=1)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    out["own"] = t.item()
    for group in (pair, rest):
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)
    dist.barrier()
    return out


def test_subgroups(mpi3, dist3):
    ours = mpi3.run(subgroups)
    assert ours == dist3.run(subgroups)
    assert ours[1]["both"] == (2.0, 4.0)


def works_and_futures() -> dict:
    rank = dist.get_rank()
    out = {}
    t = torch.ones(1 << 18) * (rank + 1)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future().then(lambda f: f.value()[0] * 2)
    work.wait()
    out["is_completed"] = work.is_completed()
    out["is_success"] = work.is_success()
    out["then"] = fut.wait()[0].item()
    out["result"] = work.result()[0][0].item()
    # Many in flight, completed in issue order.
    tensors = [torch.full((1000,), float(i + rank)) for i in range(20)]
    works = [dist.all_reduce(x, async_op=True) for x in tensors]
    for w in reversed(works):
        w.wait()
    out["many"] = [x[0].item() for x in tensors]
    # torch's functional collectives (DTensor's path) go through the same group.
    import torch.distributed._functional_collectives as funcol

    out["funcol"] = funcol.all_reduce(torch.full((2,), float(rank)), "sum", dist.group.WORLD).tolist()
    out["funcol_gather"] = funcol.all_gather_tensor(torch.full((2,), float(rank)), 0, dist.group.WORLD).tolist()
    return out


def test_works_and_futures(mpi2, dist2):
    ours = mpi2.run(works_and_futures)
    assert ours == dist2.run(works_and_futures)
    assert ours[0]["then"] == 6.0


def bad_calls() -> dict:
    """Each mistake: the error type and its first line; the group goes on working after each."""
    world = dist.get_world_size()
    out = {}

    def outcome(name, fn):
        try:
            fn()
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world, name  # still in step

    outcome("bitwise float", lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND))
    outcome("gather_into_tensor size", lambda: dist.all_gather_into_tensor(torch.zeros(3), torch.ones(2)))
    outcome("broadcast rank", lambda: dist.broadcast(torch.ones(2), src=world + 5))
    outcome("monitored_barrier", lambda: dist.monitored_barrier())
    return out


def test_bad_calls_say_what_and_keep_the_group(mpi2):
    got = mpi2.run(bad_calls)[0]
    assert got["bitwise float"].startswith("ValueError: reduce op BAND is bitwise") and "float32" in got["bitwise float"]
    assert "all_gather_into_tensor" in got["gather_into_tensor size"] and "resize" in got["gather_into_tensor size"]
    assert got["broadcast rank"] != "no error"
    assert "GLOO" in got["monitored_barrier"]  # torch's own rule: gloo only


def half_input(name: str, rank: int) -> torch.Tensor:
    return (torch.linspace(-3, 3, 1001) * (rank + 1) / 7).to(getattr(torch, name))


def half_precision() -> dict:
    rank = dist.get_rank()
    out = {}
    for name in ("bfloat16", "float16"):
        t = half_input(name, rank)
        dist.all_reduce(t)
        out[name] = t
    return out


def test_half_precision_sums_like_gloo(mpi2, dist2, mpi3, dist3):
    """bfloat16 and float16 travel as 16-bit words and are summed by torch in their dtype: equal to gloo at
    world 2 (one addition); at world 3 the two libraries add in different orders, each rounding every addition,
    so both are within two units in the last place of the exact sum."""
    for ours, theirs in zip(mpi2.run(half_precision), dist2.run(half_precision)):
        assert all(torch.equal(ours[name], theirs[name]) for name in ("bfloat16", "float16"))
    ours, theirs = mpi3.run(half_precision), dist3.run(half_precision)
    for name in ("bfloat16", "float16"):
        exact = sum(half_input(name, r).double() for r in range(3))
        ulp = torch.finfo(getattr(torch, name)).eps * exact.abs().clamp(min=1e-3)
        for got in (ours[0][name], theirs[0][name]):
            assert ((got.double() - exact).abs() <= 2 * ulp).all(), name
        assert all(torch.equal(o[name], ours[0][name]) for o in ours)  # every rank holds the same sum


_SCRIPT = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist, ddpkit
    ctx = ddpkit.init(backend="mpi", timeout=float(sys.argv[1]))
    if ctx.rank == 0:
        print("rank 0 waits in an all_reduce that rank 1 never joins", flush=True)
        dist.all_reduce(torch.ones(4))
        print("UNREACHED", flush=True)
    else:
        time.sleep(60)
""")


def test_a_collective_past_its_timeout_aborts_the_job(tmp_path, needs_mpi):
    from ddpkit.runtime import mpirun

    script = tmp_path / "hang.py"
    script.write_text(_SCRIPT)
    argv = mpirun.command(mpirun.find(), 2, [sys.executable, str(script), "3"])
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    took = time.monotonic() - start
    assert done.returncode != 0
    assert "UNREACHED" not in done.stdout
    assert "all_reduce on group" in done.stderr and "has not completed in 3 s" in done.stderr, done.stderr[-2000:]
    assert took < 50  # not rank 1's 60 s sleep: the watchdog ended the job
