"""``ddpkit launch --on-failure continue`` across nodes: the launchers decide each membership by majority.

Three launchers as three nodes (on loopback, or in three network namespaces
on one bridge for a cut cable), each with one worker of
``tests/scripts/ft_train.py`` in the deterministic mode, so that a run with
deaths must end bitwise equal to the run without one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddpkit.runtime.process import free_port
from tests.netns import bridged_nodes, in_namespace
from tests.procs import NODES_SECRET, Streamed, alive, base_env, children, script
from shared_runs import ft_reference

pytestmark = pytest.mark.alone("three launchers and their workers, a node judged by how long it is not heard")

_RUN = {"DET": "1", "EPOCHS": "3", "SLEEP": "0.1"}


@pytest.fixture
def reference(shared_runs) -> dict[str, torch.Tensor]:
    """The same training without a death, on one node (computed once per session)."""
    return ft_reference(shared_runs, epochs=3)[0]


@pytest.fixture
def reference_long(shared_runs) -> dict[str, torch.Tensor]:
    """Six epochs without a death, on one node (the run tests/train/test_survive.py compares with too)."""
    return ft_reference(shared_runs, epochs=6)[0]


def _nodes(out: Path, addresses: list[str], *flags: str, namespaces: list[str] | None = None,
           nnodes: str | None = None, port: int | None = None, first: int = 0, **env: str) -> list[Streamed]:
    """One launcher per address (node ``first`` on), all meeting at ``addresses[0]``'s port (``port``)."""
    port = port or (free_port() if namespaces is None else 29611)
    nodes = []
    for node, address in enumerate(addresses, start=first):
        argv = [sys.executable, "-m", "ddpkit", "launch", "--nnodes", nnodes or str(len(addresses)), "--node-rank",
                str(node), "--nproc-per-node", "1", "--master-addr", addresses[0], "--master-port", str(port),
                "--rdzv-id", "council-test", "--on-failure", "continue", *flags, script("ft_train.py")]
        if namespaces is not None:
            argv = in_namespace(namespaces[node - first], argv)
        nodes.append(Streamed(argv, base_env(OUT=str(out), DDPKIT_JOB_TOKEN=NODES_SECRET, **{**_RUN, **env})))
    return nodes


@pytest.mark.slow("three launchers, node 0's killed while its worker writes the run's final files")
def test_the_store_s_node_lost_while_the_final_files_are_written_leaves_them_to_a_survivor(tmp_path: Path) -> None:
    # The survivors asked node 0's store whether the files were written, found it gone, and died with the state
    # (found in review). They now wait for the next view, which names the store's new place, and one writes.
    out, port = tmp_path / "writers", free_port()
    nodes = [Streamed([sys.executable, "-m", "ddpkit", "launch", "--nnodes", "3", "--node-rank", str(node),
                       "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-id",
                       "writers", "--on-failure", "continue", script("ft_writer.py")],
                      base_env(OUT=str(out), WRITE_S="60", DDPKIT_JOB_TOKEN=NODES_SECRET)) for node in range(3)]
    for node in (1, 2):  # (past their rendezvous, which node 0's store serves)
        nodes[node].wait_for(f"READY member {node}", timeout=90)
    nodes[0].wait_for("WRITING member 0", timeout=90)
    os.kill(nodes[0].pid, signal.SIGKILL)  # the store's host, and its worker (the writer) with it
    errs = _finish(nodes)
    assert [n.returncode for n in nodes] == [-signal.SIGKILL, 0, 0], errs
    assert out.read_text().splitlines() == ["1 [1, 2]"], errs


def _finish(nodes: list[Streamed], timeout: float = 120) -> list[str]:
    try:
        return [node.communicate(timeout=timeout)[1] for node in nodes]
    except subprocess.TimeoutExpired:
        shown = "\n".join(f"node {n}:\n" + "".join(line for line in node.lines[1] if not line.startswith("frame"))
                          for n, node in enumerate(nodes))
        raise AssertionError(f"a node did not end within {timeout} s:\n{shown}") from None
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow("three launchers: a worker's death, its replacement, then the store's node killed")
def test_the_store_s_node_and_a_worker_die_and_the_others_end_bitwise_equal(
        tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "run"
    nodes = _nodes(out, ["127.0.0.1"] * 3, "--max-restarts", "1", KILL="1:3", GROW="3",  # waits for member 7
                   GROW_WAITS="1")
    nodes[1].wait_for("member 7 holds the training state", timeout=90)  # node 1's replacement for member 1
    os.kill(nodes[0].pid, signal.SIGKILL)  # node 0's launcher: it serves the store, it leads; its worker dies with it
    errs = _finish(nodes)
    assert [n.returncode for n in nodes] == [-signal.SIGKILL, 0, 0], errs
    for err in errs[1:]:
        assert "member 1 (rank 1 at the start) died" in errs[1]
        assert "node(s) 0 left the job" in err and "the workers' store moves to node 1" in err, err
        assert "membership generation 3: 2 worker(s), member(s) 0 left" in err, err
    assert _equal(torch.load(f"{out}.pt"), reference)
    account = json.loads(Path(f"{out}.json").read_text())
    first, last = account["changes"][0], account["changes"][-1]
    assert (first["generation"], first["size"], last["generation"], last["size"]) == (1, 2, 3, 2), account["changes"]
    assert last["resumed"] - last["noticed"] < 5


@pytest.mark.slow("two launchers: a worker's death survived, then a node's loss stops the other")
def test_with_two_nodes_a_workers_death_is_survived_and_a_nodes_loss_stops_the_job(tmp_path: Path) -> None:
    nodes = _nodes(tmp_path / "run", ["127.0.0.1"] * 2, EPOCHS="20", KILL="1:3")
    nodes[0].wait_for("membership generation 1: 1 worker(s), member(s) 1 left", timeout=90)
    assert nodes[1].poll() is None, "node 1's launcher goes on without workers: it still votes"
    os.kill(nodes[1].pid, signal.SIGKILL)
    errs = _finish(nodes)
    assert nodes[0].returncode == 1
    assert "--on-failure continue with 2 nodes: a worker's death is survived, a node's loss is not" in errs[0]
    assert "node 0 hears 1 of the job's 2 nodes, not a majority (2)" in errs[0], errs[0]


@pytest.mark.slow("three launchers in three network namespaces, one node's cable cut")
def test_a_node_cut_off_stops_itself_and_the_majority_ends_bitwise_equal(
        tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "run"
    with bridged_nodes(3) as (names, addresses, links):
        nodes = _nodes(out, addresses, namespaces=names, KILL="0:2")
        nodes[2].wait_for("membership generation 1", timeout=90)
        subprocess.run(["ip", "link", "set", links[2], "down"], check=True)
        errs = _finish(nodes)
    assert [n.returncode for n in nodes] == [0, 0, 1], errs
    assert "not a majority" in errs[2] and "split brain refused" in errs[2], errs[2]
    for err in errs[:2]:
        assert "node(s) 2 left the job" in err and "membership generation 2: 1 worker(s), member(s) 2 left" in err, err
    assert _equal(torch.load(f"{out}.pt"), reference)
    last = json.loads(Path(f"{out}.json").read_text())["changes"][-1]  # generation 1 may be skipped (cut meanwhile)
    assert (last["generation"], last["size"]) == (2, 1)


@pytest.mark.slow("three namespaces: workers and a replacement die on two nodes, then a node's cable is cut")
def test_deaths_replacements_and_a_cut_across_nodes_leave_the_weights_and_no_process(
        tmp_path: Path, reference_long: dict[str, torch.Tensor]) -> None:
    out, pids = tmp_path / "run", tmp_path / "pids"
    with bridged_nodes(3) as (names, addresses, links):
        # members 0 and 1 die; node 1's replacement (7) dies too if it joined in time (node 0's, 6, lives on: a
        # holder of the state must outlive the cut, or the job rightly ends with no one to hand the state on)
        # (steps of 0.25 s: the training left after the cut outlasts the 6 s in which the others judge node 2)
        nodes = _nodes(out, addresses, "--max-restarts", "2", namespaces=names, EPOCHS="6", PIDS=str(pids),
                       KILL="1:2,0:12,7:30", SLEEP="0.25")
        nodes[0].wait_for("member 6 holds the training state", timeout=120)  # after both deaths, in some order
        subprocess.run(["ip", "link", "set", links[2], "down"], check=True)
        errs = _finish(nodes, timeout=180)
    assert [n.returncode for n in nodes] == [0, 0, 1], errs
    assert "split brain refused" in errs[2]
    assert _equal(torch.load(f"{out}.pt"), reference_long)
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) >= 5 and not [pid for pid in started if alive(pid)]


@pytest.mark.slow("two launchers and a spare: the spare joins the running job, then node 0 is killed")
def test_a_spare_node_joins_the_running_job_and_carries_it_through_node_0s_loss(
        tmp_path: Path, reference_long: dict[str, torch.Tensor]) -> None:
    out, port = tmp_path / "run", free_port()
    run = {"KILL": "1:3", "EPOCHS": "6", "SLEEP": "0.25", "GROW": "2", "GROW_WAITS": "1"}  # waits for the spare
    nodes = _nodes(out, ["127.0.0.1"] * 2, nnodes="2:3", port=port, **run)
    nodes[0].wait_for("membership generation 1: 1 worker(s), member(s) 1 left", timeout=90)
    assert nodes[1].poll() is None, "node 1's launcher goes on without workers: it still votes"
    nodes += _nodes(out, ["127.0.0.1"], nnodes="2:3", port=port, first=2, **run)  # the spare comes now
    nodes[2].wait_for("member 4 holds the training state", timeout=90)
    os.kill(nodes[0].pid, signal.SIGKILL)  # store host and leader: nodes 1 and 2 are a majority of three
    errs = _finish(nodes)
    assert [n.returncode for n in nodes] == [-signal.SIGKILL, 0, 0], errs
    assert "spare node 2 admitted: 3 voting nodes" in errs[2], errs[2]
    for err in errs[1:]:
        assert "node(s) 0 left the job" in err and "the workers' store moves to node 1" in err, err
        assert "membership generation 3: 1 worker(s), member(s) 0 left" in err, err
    assert _equal(torch.load(f"{out}.pt"), reference_long)
    sizes = [(c["generation"], c["size"]) for c in json.loads(Path(f"{out}.json").read_text())["changes"]]
    assert sizes == [(2, 2), (3, 1)], sizes  # as the spare's worker lived them: it writes, the only one left



@pytest.mark.slow("three namespaces: a spare joins on its own network, then node 0's cable is cut")
def test_a_spare_on_its_own_network_joins_and_outvotes_node_0_cut_off(
        tmp_path: Path, reference_long: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "run"
    run = {"KILL": "1:3", "EPOCHS": "6", "SLEEP": "0.25", "GROW": "2", "GROW_WAITS": "1"}  # waits for the spare
    with bridged_nodes(3) as (names, addresses, links):
        nodes = _nodes(out, addresses[:2], nnodes="2:3", namespaces=names[:2], **run)
        nodes[0].wait_for("membership generation 1: 1 worker(s), member(s) 1 left", timeout=90)
        nodes += _nodes(out, addresses[:1], nnodes="2:3", namespaces=names[2:], first=2, **run)
        nodes[2].wait_for("member 4 holds the training state", timeout=90)
        subprocess.run(["ip", "link", "set", links[0], "down"], check=True)  # the store's node and the leader
        errs = _finish(nodes)
    assert [n.returncode for n in nodes] == [1, 0, 0], errs
    assert "split brain refused" in errs[0], errs[0]
    for err in errs[1:]:
        assert "node(s) 0 left the job" in err and "the workers' store moves to node 1" in err, err
    assert _equal(torch.load(f"{out}.pt"), reference_long)


@pytest.mark.slow("three launchers: node 2's paused past the failure detector and its worker's timeout")
def test_a_node_paused_past_the_detector_is_left_out_and_comes_back_as_a_spare(
        tmp_path: Path, reference_long: dict[str, torch.Tensor]) -> None:
    # A launcher stopped longer than the detector's timeout (2 s here) is judged gone with its worker, which dies
    # meanwhile (its group's timeout, 20 s here, with no view from its stopped launcher). Let go on, the launcher
    # learns that it was left out (the worker's exit is no death: no replacement is spent on it), asks back, is
    # made a voting node again, and its new worker joins with the state from a peer. The code before stopped it
    # for good.
    out, pids = tmp_path / "run", tmp_path / "pids"
    nodes = _nodes(out, ["127.0.0.1"] * 3, "--rdzv-conf", "keep_alive_interval=0.5,keep_alive_max_attempt=4",
                   "--max-restarts", "1", EPOCHS="6", SLEEP="0.25", PIDS=str(pids), GROW="3", GROW_WAITS="1",
                   DDPKIT_TIMEOUT="20")
    _until_lines(pids, 3)  # every worker trains
    [(worker, _)] = children(nodes[2].pid)
    os.kill(nodes[2].pid, signal.SIGSTOP)  # its launcher alone: its worker trains on until the others leave it
    try:
        nodes[0].wait_for("node(s) 2 left the job", timeout=60)
        deadline = time.monotonic() + 90
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker), "node 2's worker outlived its group's timeout"
    finally:
        os.kill(nodes[2].pid, signal.SIGCONT)
    nodes[2].wait_for("node 2 is a voting node again", timeout=60)
    errs = _finish(nodes)
    assert [n.returncode for n in nodes] == [0, 0, 0], errs
    assert "left node 2 out of membership entry" in errs[2] and "node 2 asks to vote again as a spare does" in errs[2]
    assert all("node(s) 2 came back: 3 voting nodes" in err for err in errs[:2]), errs
    assert not any("member 2 (rank 2 at the start) died" in err or "replacement(s) left" in err for err in errs), errs
    assert "member 8 holds the training state" in errs[2], errs[2]  # world 3 + node 2 + 1 x 3 nodes
    assert _equal(torch.load(f"{out}.pt"), reference_long)
    sizes = [c["size"] for c in json.loads(Path(f"{out}.json").read_text())["changes"]]
    assert sizes == [2, 3], sizes
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 4 and not [pid for pid in started if alive(pid)]


def _until_lines(path: Path, count: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and len(path.read_text().split()) >= count):
        assert time.monotonic() < deadline, f"{path}: fewer than {count} lines within {timeout} s"
        time.sleep(0.05)
