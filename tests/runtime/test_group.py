"""The runtime with real processes: every discovery scheme, zero_first, and rendezvous errors."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from procs import base_env, run_ranks, script

import ddpkit
from ddpkit.runtime.process import free_port


def _check_pair(done, scheme):
    for d in done:
        assert d.returncode == 0, d.stderr
    reports = [r for d in done for r in d.reports()]
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["world_size"] == 2 and r["sum"] == 1.0 and r["scheme"] == scheme for r in reports)
    assert [r["local_rank"] for r in reports] == [0, 1]
    assert all(r["backend"] == "gloo" and r["device"] == "cpu" for r in reports)


def test_openmpi_environment_joins_with_real_processes():
    # One real-process check of a non-launcher scheme; PMI and SLURM share the
    # same path after discovery, which tests/runtime/test_discovery.py covers.
    port = str(free_port())
    envs = [{"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
             "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_PORT": port} for r in range(2)]
    _check_pair(run_ranks(envs), "openmpi")


def test_no_environment_is_a_working_world_of_one():
    ddpkit.shutdown()  # harmless without init
    ctx = ddpkit.init()
    assert ddpkit.init() is ctx  # a second init is harmless and returns the same context
    assert (ctx.rank, ctx.world_size, ctx.scheme, ctx.backend) == (0, 1, "single", "gloo")
    assert ddpkit.is_main() and ddpkit.world_size() == 1 and ddpkit.local_rank() == 0
    t = torch.tensor([3.0])
    dist.all_reduce(t)
    assert t.item() == 3.0
    ddpkit.barrier()
    with ddpkit.zero_first():
        pass
    ddpkit.shutdown()
    ddpkit.shutdown()
    assert not dist.is_initialized()


def test_print0_prints_on_rank_zero_only(capsys, monkeypatch):
    ddpkit.print0("hello")
    assert capsys.readouterr().out == "hello\n"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    ddpkit.print0("hidden")
    assert capsys.readouterr().out == ""


def test_bad_timeout_is_rejected(monkeypatch):
    monkeypatch.setenv("DDPKIT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DDPKIT_TIMEOUT='soon'"):
        ddpkit.init()
    with pytest.raises(ValueError, match="timeout -1"):
        ddpkit.init(timeout=-1)


def test_rank_without_world_size_is_rejected(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE is not"):
        ddpkit.init()


def _zero_first_trace(local):
    enter = time.time()
    with ddpkit.zero_first(local=local):
        inside = time.time()
        if ddpkit.rank() == 0:
            time.sleep(0.3)
        leave = time.time()
    return enter, inside, leave


@pytest.mark.parametrize("local", [True, False])
def test_zero_first_runs_rank_zero_before_the_others(dist3, local):
    traces = dist3.run(_zero_first_trace, local)
    rank0_leave = traces[0][2]
    for _, inside, _ in traces[1:]:
        assert inside >= rank0_leave


@pytest.mark.slow("waits for a rendezvous that cannot complete")
def test_world_size_larger_than_the_processes_started_fails_fast():
    port = str(free_port())
    envs = [{"RANK": str(r), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
             "DDPKIT_TIMEOUT": "3"} for r in range(2)]
    start = time.monotonic()
    done = run_ranks(envs)
    assert time.monotonic() - start < 20
    assert all(d.returncode != 0 for d in done)
    assert "only 2 of WORLD_SIZE=3 processes joined" in done[0].stderr
    # Rank 1 either times out itself or sees rank 0 give up first.
    assert "WORLD_SIZE=3 processes" in done[1].stderr and "check that WORLD_SIZE matches" in done[1].stderr


def test_ranks_that_disagree_on_world_size_fail_with_both_values():
    port = str(free_port())
    envs = [{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "DDPKIT_TIMEOUT": "10"},
            {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "DDPKIT_TIMEOUT": "10"}]
    done = run_ranks(envs)
    for d in done:
        assert d.returncode != 0
        assert "rank 1 has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2" in d.stderr


def test_two_processes_claiming_one_rank_fail():
    port = str(free_port())
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "DDPKIT_TIMEOUT": "10"}
    pair = [subprocess.Popen([sys.executable, script("sleeper.py")], env=base_env(RANK=r, **env),
                             stdout=subprocess.PIPE, text=True) for r in ("0", "1")]
    try:
        for proc in pair:
            assert proc.stdout.readline().startswith("SLEEPING")
        (intruder,) = run_ranks([{**env, "RANK": "1"}])
        assert intruder.returncode != 0
        assert "rank 1 is claimed by more than one process" in intruder.stderr
    finally:
        for proc in pair:
            proc.kill()
            proc.wait()


@pytest.mark.slow("waits out a rendezvous timeout")
def test_unreachable_master_fails_within_the_timeout():
    port = str(free_port())  # nothing listens there
    envs = [{"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "DDPKIT_TIMEOUT": "2"}]
    start = time.monotonic()
    (done,) = run_ranks(envs)
    assert time.monotonic() - start < 20
    assert done.returncode != 0
    assert f"could not reach the rendezvous at 127.0.0.1:{port}" in done.stderr


@pytest.mark.slow("waits out a rendezvous timeout")
def test_a_port_that_never_answers_the_handshake_fails_within_the_timeout():
    # A listener that accepts and never answers (a frozen rank 0, another program): torch's store client waits for
    # the handshake's answer past its own timeout (still waiting after 100 s).
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = str(holder.getsockname()[1])
        envs = [{"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                 "DDPKIT_TIMEOUT": "3"}]
        start = time.monotonic()
        (done,) = run_ranks(envs)
    assert time.monotonic() - start < 30
    assert done.returncode != 0
    assert f"rank 1 reached 127.0.0.1:{port}, but what listens there did not answer the rendezvous store's " \
           "handshake" in done.stderr


def test_unresolvable_master_names_the_address():
    envs = [{"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29999"}]
    (done,) = run_ranks(envs)
    assert "MASTER_ADDR='no-such-host.invalid' does not resolve" in done.stderr


def test_second_init_with_another_backend_is_an_error():
    ctx = ddpkit.init(backend="gloo")
    assert ddpkit.init(backend="gloo") is ctx
    with pytest.raises(ValueError, match="already exists with backend 'gloo'"):
        ddpkit.init(backend="mpi")


def test_barrier_before_init(monkeypatch):
    ddpkit.barrier()  # a world of one: nothing to wait for
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(RuntimeError, match=r"call ddpkit.init\(\) first"):
        ddpkit.barrier()


def _zero_first_raising_on_rank_zero():
    order = []
    try:
        with ddpkit.zero_first(local=False):
            order.append(("inside", time.time()))
            if ddpkit.rank() == 0:
                time.sleep(0.2)
                raise KeyError("download failed")
    except KeyError as e:
        order.append(("raised", str(e)))
    return order


def test_zero_first_releases_the_others_when_the_block_raises(dist2):
    # Rank 0's error surfaces on rank 0; rank 1 is released (no hang) and runs its block after.
    rank0, rank1 = dist2.run(_zero_first_raising_on_rank_zero, timeout=30)
    assert [k for k, _ in rank0] == ["inside", "raised"] and rank0[1][1] == "'download failed'"
    assert [k for k, _ in rank1] == ["inside"] and rank1[0][1] >= rank0[0][1] + 0.2


def test_the_backend_is_spelt_as_torch_takes_it_and_the_per_device_form_is_named(monkeypatch):
    from ddpkit.runtime.group import choose_backend

    monkeypatch.delenv("DDPKIT_BACKEND", raising=False)
    assert choose_backend("GLOO") == choose_backend(" gloo") == "gloo"  # torch's Backend lowercases too
    with pytest.raises(ValueError, match=r"backend 'cpu:gloo,cuda:nccl': a backend per device type \(torch's form\) "
                                         "is not supported"):
        choose_backend("cpu:gloo,cuda:nccl")
    with pytest.raises(ValueError, match="backend 'ucc' is not one of gloo, nccl, mpi"):
        choose_backend("ucc")


def _adopting(rank: int, port: int, out: str) -> None:
    import json
    import os
    from datetime import timedelta
    from pathlib import Path

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)  # torch.multiprocessing.spawn's children: no launcher variable
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    before = (ddpkit.rank(), ddpkit.world_size(), ddpkit.is_main())
    ctx = ddpkit.init(backend="GLOO", timeout=timedelta(seconds=30))  # torch's spelling and timeout type
    assert ddpkit.init(backend="Gloo") is ctx
    Path(out, f"{rank}.json").write_text(json.dumps(
        {"before": before, "ctx": [ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size],
         "after": [ddpkit.rank(), ddpkit.world_size(), ddpkit.is_main()]}))
    dist.destroy_process_group()


def test_a_group_made_by_init_process_group_is_adopted_with_its_rank_and_size(tmp_path):
    # The classic torch pattern: ddpkit.init() after init_process_group(init_method="tcp://...", rank, world_size)
    # read the empty environment: rank 0 of a world of 1 on every rank (print0 printed everywhere, zero_first let
    # every rank first). A timedelta timeout (torch's type) was a TypeError, "Gloo" then "GLOO" a clash.
    import json

    import torch.multiprocessing as mp

    mp.spawn(_adopting, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got["before"] == got["after"] == [rank, 2, rank == 0]
        assert got["ctx"] == [rank, 2, rank, 2]


def test_a_job_with_a_secret_shuts_its_group_down_and_meets_again_in_the_same_processes():
    # Found by a review: the sealed stores of a job with a secret (runtime/sealed_store.py) were kept for the
    # process's life, and rank 0's store server with them: a second init() after shutdown() found its port taken.
    port = str(free_port())
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "DDPKIT_JOB_TOKEN": "s" * 40, "DDPKIT_TIMEOUT": "20"}
            for r in range(2)]
    for rank, done in enumerate(run_ranks(envs, script="reinit.py")):
        assert done.returncode == 0, done.stderr
        assert done.stdout.split("\n")[:2] == [f"{rank} first 2.0", f"{rank} second 2.0"], done.stdout
