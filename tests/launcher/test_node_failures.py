"""Multi-node failures: every node learns the first failure through the rendezvous, tears down, restarts together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ddpkit.runtime.process import free_port
from tests.netns import in_namespace, two_nodes, veth_end
from tests.procs import NODES_SECRET, SCRIPTS, Streamed, alive, base_env

pytestmark = pytest.mark.alone("several launchers and their workers, deaths judged by how long a node is not heard")


def _node(node: int, port: int, mode: str, *flags: str, addr: str = "127.0.0.1", prefix: list[str] | None = None,
          **env: str) -> Streamed:
    argv = [sys.executable, "-m", "ddpkit", "launch", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
            "1", "--master-addr", addr, "--master-port", str(port), "--rdzv-id", "nodes-test", *flags,
            str(SCRIPTS / "nodes.py"), mode]
    return Streamed((prefix or []) + argv, base_env(**{"DDPKIT_JOB_TOKEN": NODES_SECRET, **env}))


def _finish(procs: list[Streamed], timeout: float) -> list[tuple[str, str]]:
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def _pids(out: str) -> list[int]:
    return [int(line.split()[-1]) for line in out.splitlines() if "PID " in line]


@pytest.mark.slow("two launchers and their workers, one crashing")
def test_a_crash_on_one_node_stops_every_node_and_names_it():
    port = free_port()
    start = time.monotonic()
    outs = _finish([_node(n, port, "crash", CRASH_RANK="1") for n in (0, 1)], timeout=90)
    took = time.monotonic() - start
    (out0, err0), (_, err1) = outs
    assert "RuntimeError: deliberate failure on rank 1" in err1 and "Root cause: rank 1" in err1
    assert "node 1, rank 1, failed first: exit code 1" in err0, err0
    assert "RuntimeError: deliberate failure on rank 1" in err0
    assert "stopped this node's workers" in err0
    assert "DONE" not in out0 and took < 45
    assert not any(alive(pid) for pid in _pids(out0))


@pytest.mark.slow("two launchers, a crash and a second round of fresh workers on each node")
def test_max_restarts_restarts_every_node_together():
    port = free_port()
    procs = [_node(n, port, "crash", "--max-restarts", "1", CRASH_RANK="0") for n in (0, 1)]
    outs = _finish(procs, timeout=120)
    assert [p.returncode for p in procs] == [0, 0], outs
    for node, (out, err) in enumerate(outs):
        assert f"DONE {node} round 1" in out, out
        assert "restarting the worker group (restart 1 of 1), every node together" in err, err
    assert "node 0, rank 0, failed first" in outs[1][1]


@pytest.mark.slow("two launchers, one killed, the other waiting to notice")
def test_a_killed_node_is_named_by_the_others_and_nothing_is_left_running():
    port = free_port()
    procs = [_node(n, port, "long", DDPKIT_TIMEOUT="60") for n in (0, 1)]
    try:
        procs[0].wait_for("TRAINING 0 round 0")  # both nodes are training now
        # Node 1 dies whole: its launcher and its workers (each leads its own process group).
        worker = int(subprocess.run(["pgrep", "-f", "-P", str(procs[1].pid), "nodes.py"], capture_output=True,
                                    text=True).stdout.split()[0])
        start = time.monotonic()
        os.killpg(procs[1].pid, signal.SIGKILL)
        os.killpg(worker, signal.SIGKILL)
        out0, err0 = procs[0].communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        _finish(procs, timeout=1)
    assert procs[0].returncode == 1
    assert "node 1 failed first: its launcher stopped answering" in err0, err0
    assert took < 20, took
    assert not any(alive(pid) for pid in _pids(out0))


@pytest.mark.slow("two network namespaces, then DDPKIT_TIMEOUT (10 s) of silence before both nodes end")
def test_a_cut_link_ends_both_nodes_within_the_timeout():
    with two_nodes() as (names, addresses):
        port = 29612
        procs = [_node(n, port, "long", addr=addresses[0], prefix=in_namespace(names[n], []), DDPKIT_TIMEOUT="10")
                 for n in (0, 1)]
        try:
            procs[0].wait_for("TRAINING 0 round 0")
            veth = veth_end(names, 1)
            start = time.monotonic()
            subprocess.run(["ip", "-n", names[1], "link", "set", veth, "down"], check=True)
            outs = [p.communicate(timeout=90) for p in procs]
            took = time.monotonic() - start
        finally:
            _finish(procs, timeout=1)
            leftovers = [subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
                         for n in names]
    assert [p.returncode for p in procs] == [1, 1], outs
    assert "node 1 failed first: its launcher stopped answering" in outs[0][1], outs[0][1]
    assert "node 0 failed first: the rendezvous it serves stopped answering" in outs[1][1], outs[1][1]
    assert took < 45, took
    assert leftovers == [[], []]


@pytest.mark.slow("a killed node, 6 s of silence before the other notices, then a relaunched node and a second round")
def test_a_node_that_comes_back_joins_the_restart_round():
    port = free_port()
    procs = [_node(n, port, "long", "--max-restarts", "1", DDPKIT_TIMEOUT="60") for n in (0, 1)]
    try:
        procs[0].wait_for("TRAINING 0 round 0")
        worker = int(subprocess.run(["pgrep", "-f", "-P", str(procs[1].pid), "nodes.py"], capture_output=True,
                                    text=True).stdout.split()[0])
        os.killpg(procs[1].pid, signal.SIGKILL)
        os.killpg(worker, signal.SIGKILL)
        procs[0].wait_for("restarting the worker group (restart 1 of 1)")  # node 0 noticed (6 s of silence)
        procs.append(_node(1, port, "long", "--max-restarts", "1", DDPKIT_TIMEOUT="60"))
        outs = [procs[0].communicate(timeout=90), procs[2].communicate(timeout=90)]
    finally:
        _finish(procs, timeout=1)
    assert procs[0].returncode == 0 and procs[2].returncode == 0, outs
    assert "node 1 failed first: its launcher stopped answering" in outs[0][1]
    assert "joining the job in progress at restart round 1" in outs[1][1], outs[1][1]
    assert "DONE 0 round 1" in outs[0][0] and "DONE 1 round 1" in outs[1][0]


@pytest.mark.slow("waits 15 s for the first word of a rendezvous that lacks a node")
def test_a_job_missing_a_node_says_within_20_s_whom_it_waits_for() -> None:
    # --nnodes 2 with node 1 never started: before, nothing was said until the rendezvous timeout (300 s).
    node = _node(0, free_port(), "crash", DDPKIT_TIMEOUT="120")
    try:
        node.wait_for("waits at the rendezvous", timeout=20)
        said = "".join(node.lines[1])
        assert "rank 0 waits at the rendezvous at 127.0.0.1:" in said and "for rank 1 (1 of 2 joined)" in said
        assert "it gives up in " in said and "(DDPKIT_TIMEOUT)" in said
    finally:
        os.killpg(node.pid, signal.SIGKILL)
