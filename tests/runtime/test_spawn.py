"""ddpkit.spawn with real processes: success, the first failure's traceback, no stragglers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ddpkit


def _sum_ranks(rank: int, out: str) -> None:
    ctx = ddpkit.init()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    Path(out, f"{rank}.txt").write_text(f"{ctx.rank} {ctx.world_size} {t.item():g}")
    ddpkit.shutdown()


def _fail_on_rank_one(rank: int) -> None:
    ddpkit.init()
    if rank == 1:
        raise KeyError("missing shard")
    time.sleep(60)  # rank 0 would wait here; spawn must not wait for it


def test_spawn_runs_every_rank_with_the_launcher_env(tmp_path):
    ddpkit.spawn(_sum_ranks, 3, args=(str(tmp_path),))
    got = sorted(p.read_text() for p in tmp_path.iterdir())
    assert got == ["0 3 3", "1 3 3", "2 3 3"]


def _ports(rank: int, out: str) -> None:
    Path(out, f"{rank}.ports").write_text(f"{os.environ['MASTER_PORT']} {os.environ.get('DDPKIT_PS_PORT', '-')}")


def test_the_parameter_servers_channel_gets_a_port_found_free_not_the_rendezvous_port_plus_one(tmp_path,
                                                                                                monkeypatch):
    # Rank 0 serves the channel when there are no servers (ddpkit bench strategies' ps-sync): its default port,
    # MASTER_PORT + 1, was never checked, and a run under load found it taken ("Address already in use").
    monkeypatch.delenv("DDPKIT_PS_PORT", raising=False)
    ddpkit.spawn(_ports, 2, args=(str(tmp_path),))
    ports = {p.read_text() for p in tmp_path.glob("*.ports")}
    assert len(ports) == 1  # the same for every rank
    master, channel = ports.pop().split()
    assert channel.isdigit() and channel != master  # spawn found one (before, none was given: MASTER_PORT + 1)
    monkeypatch.setenv("DDPKIT_PS_PORT", "40123")  # the user's choice stands
    ddpkit.spawn(_ports, 2, args=(str(tmp_path),))
    assert {p.read_text().split()[1] for p in tmp_path.glob("*.ports")} == {"40123"}


def test_spawn_reraises_the_failing_rank_with_its_traceback_and_stops_the_rest():
    start = time.monotonic()
    with pytest.raises(ddpkit.WorkerError) as info:
        ddpkit.spawn(_fail_on_rank_one, 2)
    assert time.monotonic() - start < 30  # not the 60 s rank 0 sleeps
    err = info.value
    assert err.rank == 1 and err.exitcode == 1
    assert "rank 1 failed: KeyError" in str(err)
    assert 'raise KeyError("missing shard")' in err.traceback
    assert isinstance(err.__cause__, KeyError)


def _fail_at_length(rank: int, out: str) -> None:
    import atexit

    log = open(Path(out, f"{rank}.log"), "w")  # noqa: SIM115 - left open on purpose: the exit must flush it
    log.write(f"rank {rank} wrote this")
    atexit.register(Path(out, f"{rank}.atexit").write_text, "ran")
    if rank == 1:
        raise ValueError("x" * 200_000)  # a report larger than the pipe's buffer


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_long_failure_report_arrives_and_a_worker_ends_as_the_interpreter_would(tmp_path, method):
    # A report over the pipe's 64 KiB kept the worker in its send while the parent waited for it to exit: a hang
    # (a load_state_dict error of a large model is enough). Its atexit handlers never ran and a file it left open
    # came out empty (os._exit), where torch's spawn runs the teardown. (A forked child's copy of its forkserver's
    # own exit handler must not end it with 0.)
    start = time.monotonic()
    with pytest.raises(ddpkit.WorkerError) as info:
        ddpkit.spawn(_fail_at_length, 2, args=(str(tmp_path),), start_method=method)
    assert time.monotonic() - start < 60
    assert info.value.rank == info.value.error_index == 1 and info.value.exit_code == 1
    assert "x" * 200_000 in str(info.value)
    assert Path(tmp_path, "1.log").read_text() == "rank 1 wrote this"
    assert Path(tmp_path, "1.atexit").read_text() == "ran"


def _exits(rank: int, how: str) -> None:
    import sys

    if how == "exit-0":
        sys.exit(0)
    if how == "exit-none" and rank == 0:
        sys.exit()
    if how == "interrupt" and rank == 1:
        raise KeyboardInterrupt
    if how == "exit-3" and rank == 1:
        sys.exit(3)
    time.sleep(0.5)


@pytest.mark.parametrize("how", ["exit-0", "exit-none", "interrupt"])
def test_sys_exit_0_and_keyboard_interrupt_in_a_worker_are_success_as_under_torch(how):
    ddpkit.spawn(_exits, 2, args=(how,))


def test_sys_exit_n_in_a_worker_fails_with_exit_code_n():
    with pytest.raises(ddpkit.WorkerError, match="rank 1 failed: SystemExit: 3") as info:
        ddpkit.spawn(_exits, 2, args=("exit-3",))
    assert info.value.exitcode == 3


@pytest.mark.parametrize("nprocs", [0, -1, 1.5])
def test_spawn_rejects_a_bad_process_count(nprocs):
    with pytest.raises(ValueError, match="nprocs"):
        ddpkit.spawn(_sum_ranks, nprocs)


def test_torchs_argument_order_is_named():
    with pytest.raises(ValueError, match="torch's spawn takes fn, args, nprocs: pass them by name"):
        ddpkit.spawn(_sum_ranks, ("out",), 2)


def _segfault_on_rank_zero(rank: int) -> None:
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)


def test_a_worker_killed_by_a_signal_is_reported_with_the_signal():
    with pytest.raises(ddpkit.WorkerError, match="rank 0 failed: process killed by signal SIGSEGV") as info:
        ddpkit.spawn(_segfault_on_rank_zero, 2)
    assert info.value.exitcode == -signal.SIGSEGV


def _threads(rank: int, out: str) -> None:
    import torch

    Path(out, f"{rank}.threads").write_text(str(torch.get_num_threads()))


def test_spawn_gives_each_worker_one_thread_unless_the_user_chose(tmp_path, monkeypatch):
    # torch is imported in the child before spawn sets OMP_NUM_THREADS (it comes
    # with this test module), so the thread count must be set by hand.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ddpkit.spawn(_threads, 2, args=(str(tmp_path),))
    assert sorted(p.read_text() for p in tmp_path.glob("*.threads")) == ["1", "1"]


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_die_with_a_parent_killed_outright(tmp_path, method):
    # The parent (ddpkit train's own workers have one) killed with SIGKILL cannot stop its children; the
    # kernel must, or they train on, orphaned, writing into the run directory. Under a forkserver (ddpkit
    # train's), the server must see the parent gone although every child got a copy of the pipe that tells it.
    import subprocess
    import sys

    from procs import base_env

    code = ("import time, ddpkit\n"
            "def worker(rank, out):\n"
            "    open(f'{out}/{rank}.pid', 'w').write(str(__import__('os').getpid()))\n"
            "    time.sleep(120)\n"
            "if __name__ == '__main__':\n"
            f"    ddpkit.spawn(worker, 2, args=({str(tmp_path)!r},), start_method={method!r})\n")
    script = tmp_path / "parent.py"
    script.write_text(code)
    parent = subprocess.Popen([sys.executable, str(script)], env=base_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        parent.kill()  # SIGKILL to the parent alone: its workers lead their own process groups
        parent.wait()
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "a worker outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def _killed_first(conn) -> None:  # type: ignore[no-untyped-def]
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)


def _raised_after(conn) -> None:  # type: ignore[no-untyped-def]
    from ddpkit.runtime.failures import encode_failure

    time.sleep(0.8)  # a peer's vanishing found out later: what a collective with the killed process raises
    try:
        raise ConnectionResetError("Connection reset by peer")
    except ConnectionResetError as e:
        conn.send(encode_failure(e))
    os._exit(1)


@pytest.mark.slow("0 CPU-s alone, but charged 30-52 CPU-s in two full runs: its forks from the xdist worker are "
                  "where the budget also counts what the worker's earlier descendants spend meanwhile (unexplained)")
def test_a_process_killed_outright_is_the_root_cause_even_when_a_peer_reports_before_the_parent_wakes(
        monkeypatch) -> None:
    # A busy parent finds both deaths in one wake-up; the peer's report is stamped after the kill but before the
    # parent looks, so "the first failure" must not fall to it: nothing but the outside sends SIGKILL.
    import multiprocessing as mp
    from multiprocessing.connection import wait as real_wait

    import ddpkit.runtime.spawn as spawn

    ctx = mp.get_context("fork")
    procs, conns = [], {}
    for rank, target in enumerate((_raised_after, _killed_first)):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=target, args=(theirs,))
        proc.start()
        procs.append(proc)
        conns[proc.sentinel] = (rank, ours)

    def slow_wait(objects):  # type: ignore[no-untyped-def]
        for proc in procs:
            proc.join()
        return real_wait(objects)

    monkeypatch.setattr(spawn, "wait", slow_wait)
    with pytest.raises(spawn.WorkerError, match="parameter server 0 failed: process killed by signal SIGKILL"):
        spawn._watch(procs, conns, workers=1)
