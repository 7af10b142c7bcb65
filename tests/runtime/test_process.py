"""runtime.process: the worker env contract, exit descriptions and teardown of whole process groups."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ddpkit.runtime.process import describe_exit, free_ports, terminate, worker_env
from ddpkit.runtime.spawn import _env as spawn_env

CONTRACT = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"}


def test_worker_env_is_torchruns_contract() -> None:
    base = {"PATH": "/bin", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    env = worker_env(rank=5, local_rank=1, world_size=8, local_world_size=4, master_port=1234,
                     master_addr="node0", node_rank=1, nnodes=2, restart_count=2, max_restarts=3, base=base)
    assert CONTRACT <= set(env) and env["PATH"] == "/bin"
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("5", "1", "1", "2")
    assert (env["ROLE_RANK"], env["ROLE_WORLD_SIZE"], env["ROLE_NAME"]) == ("5", "8", "default")
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("2", "3")
    # torchrun's agent-store flag would send our workers to a store nobody serves.
    assert "TORCHELASTIC_USE_AGENT_STORE" not in env
    assert env["OMP_NUM_THREADS"] == "1"
    alone = worker_env(rank=0, local_rank=0, world_size=1, local_world_size=1, master_port=1, base={})
    assert "OMP_NUM_THREADS" not in alone
    assert worker_env(rank=0, local_rank=0, world_size=2, local_world_size=2, master_port=1,
                      base={"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"


def test_spawn_children_get_the_same_contract_as_launched_workers() -> None:
    env = spawn_env(2, 3, 4321, "gloo", "secret")
    assert CONTRACT <= set(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["MASTER_PORT"]) == ("2", "3", "3", "4321")
    assert env["DDPKIT_BACKEND"] == "gloo"
    assert env["DDPKIT_JOB_TOKEN"] == "secret"


def test_describe_exit() -> None:
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by signal SIGKILL"
    assert describe_exit(None) == "still running"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours is dead for this purpose.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_terminate_continues_a_stopped_worker_so_sigterm_ends_it() -> None:
    # A stopped process (SIGSTOP, Ctrl-Z) acts on SIGTERM only once continued: without the
    # SIGCONT it would sit out the whole grace period and die by SIGKILL.
    worker = subprocess.Popen(["sleep", "60"], start_new_session=True)
    os.kill(worker.pid, signal.SIGSTOP)
    terminate([worker], grace_s=60)
    assert worker.poll() == -signal.SIGTERM


def test_terminate_takes_down_children_that_ignore_sigterm() -> None:
    # The leader ignores SIGTERM and has a child that ignores it too: both must
    # be gone after the grace period (SIGKILL to the whole group).
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child = int(leader.stdout.readline())
    start = time.monotonic()
    terminate([leader], grace_s=0.5)
    assert time.monotonic() - start < 10
    assert leader.poll() == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


_KILLED_RANK = '''
import multiprocessing as mp, os, signal, sys

def rank(ready):
    from ddpkit.runtime.process import rank_bar
    from tqdm import tqdm
    bar = rank_bar(total=3, disable=True) if sys.argv[1] == "rank_bar" else tqdm(total=3, disable=True)
    ready.send(1)
    signal.pause()

if __name__ == "__main__":
    ctx = mp.get_context("forkserver")
    here, there = ctx.Pipe()
    child = ctx.Process(target=rank, args=(there,))
    child.start()
    here.recv()
    os.kill(child.pid, signal.SIGKILL)  # as a launcher's teardown ends a rank after another failed
    child.join()
'''


def test_a_killed_ranks_progress_bar_leaves_no_semaphore_behind(tmp_path) -> None:
    script = tmp_path / "killed_rank.py"
    script.write_text(_KILLED_RANK)
    said = {how: subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=60,
                                cwd=tmp_path).stderr for how in ("tqdm", "rank_bar")}
    assert "leaked semaphore" in said["tqdm"], said  # what the job's one-line error got beneath it
    assert said["rank_bar"] == "", said


def test_ports_found_together_are_all_different_and_free() -> None:
    # spawn's rendezvous and the parameter servers' channel: two calls of free_port may give one port twice.
    import socket

    ports = free_ports(20)
    assert len(set(ports)) == 20
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))  # free once returned


def test_ports_are_found_outside_the_range_outgoing_connections_take() -> None:
    # A port from the kernel's ephemeral range is free when found, but any process's next connection may take it
    # before the rank that serves it binds it (a parameter servers' channel failed so in a suite run).
    import random
    from pathlib import Path

    import pytest

    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except OSError as e:
        pytest.skip(f"the kernel's ephemeral range is unreadable here ({e}): the OS picks, as documented")
    room = max(0, min(29999, low - 1) - 10000 + 1) + max(0, 65000 - max(32768, high + 1) + 1)
    if room < 1000:
        pytest.skip(f"the ephemeral range {low}-{high} leaves no room outside it: the OS picks, as documented")
    state = random.getstate()
    ports = free_ports(200)
    assert not [p for p in ports if low <= p <= high], (low, high, ports)
    assert not [p for p in ports if 30000 <= p <= 32767 or p > 65000 or p < 10000], ports
    assert random.getstate() == state  # the user's generator is not drawn from
