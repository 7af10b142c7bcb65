"""Dynamic rendezvous (--rdzv-backend c10d) and elastic node counts, with launchers on one machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.runtime.process import free_port
from tests.procs import NODES_SECRET, SCRIPTS, Done, base_env


def _launcher(port: int, job: str, *args: str, nnodes: str = "2", log: Path | None = None,
              conf: str = "last_call_timeout=1") -> subprocess.Popen:
    """One node's launcher, started exactly like every other node's (no --node-rank)."""
    out = open(log, "w") if log else subprocess.PIPE  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "launch", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", job, "--nnodes", nnodes, "--rdzv-conf", conf, "--nproc-per-node", "1", *args],
        env=base_env(DDPKIT_JOB_TOKEN=NODES_SECRET), stdout=out, stderr=subprocess.STDOUT if log else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_nodes_started_alike_agree_on_ranks_world_size_and_the_torchrun_variables():
    port = free_port()
    procs = [_launcher(port, "alike", "--prefix-output", str(SCRIPTS / "report_env.py")) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        _kill(procs)
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    reports = Done(0, "".join(o for o, _ in outs), "").reports()
    assert [r["rank"] for r in reports] == [0, 1] and all(r["sum"] == 1.0 for r in reports)
    assert sorted(r["env"]["GROUP_RANK"] for r in reports) == ["0", "1"]
    for r in reports:
        env = r["env"]
        assert env["WORLD_SIZE"] == "2" and env["GROUP_WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0"
        assert env["TORCHELASTIC_RUN_ID"] == "alike" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == str(port)
        assert env["DDPKIT_RDZV_ROUND"] == "0" and env["TORCHELASTIC_ERROR_FILE"].endswith("/0/error.json")
    # Each launcher says which node it became.
    assert sorted("node 0 of 2" in err for _, err in outs) == [False, True]


@pytest.mark.slow("waits out a rendezvous's join timeout")
def test_too_few_nodes_within_join_timeout_is_an_error_saying_how_many_came():
    proc = _launcher(free_port(), "lonely", str(SCRIPTS / "report_env.py"), nnodes="2:3", conf="join_timeout=2")
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        _kill([proc])
    assert proc.returncode == 2, err
    assert "rendezvous round 0: 1 of the 2 nodes needed (--nnodes 2:3) joined within join_timeout 2 s" in err


def _wait_for(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared in {path}:\n{path.read_text() if path.exists() else ''}")


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.slow("three launchers, a killed node and two new rendezvous rounds, each starting fresh workers")
def test_a_killed_node_leaves_and_a_new_one_joins_while_ddpkit_train_continues(tmp_path):
    port, out = free_port(), tmp_path / "run"
    # --shutdown-timeout 5: the surviving node's workers, stuck in a collective with the lost node's, are killed
    # 5 s after their SIGTERM instead of torchrun's 30 (the scenario is the same; the test is 25 s shorter).
    # --zero 2: the sharded gradients and optimizer state are re-sharded at each new world size (2, 1, 2) from
    # the checkpoints' unsharded state.
    train = ["--max-restarts", "2", "--shutdown-timeout", "5", "-m", "ddpkit", "train", "--output-dir", str(out),
             "--dataset", "synthetic", "--synthetic-samples", "4096", "--epochs", "10", "--checkpoint-every", "5",
             "--no-progress", "--zero", "2"]
    logs = [tmp_path / f"node{k}.log" for k in range(3)]
    a = _launcher(port, "elastic", *train, nnodes="1:3", log=logs[0])
    # A serves the store (the node that does cannot leave the job): B is the one to lose.
    _wait_for(logs[0], "serving the rendezvous at 127.0.0.1:", 60)
    b = _launcher(port, "elastic", *train, nnodes="1:3", log=logs[1])
    procs = [a, b]
    try:
        _wait_for(out / "metrics.jsonl", '"epoch": 2', 120)
        workers = _children(b.pid)
        assert workers
        b.send_signal(signal.SIGKILL)  # the launcher only: its workers must die with it
        b.wait()
        # (Round numbers vary: A may have formed a round alone before B arrived.)
        _wait_for(logs[0], "node 0 of 1 (localhost x1), ranks 0..0 of 1, after 1 restart(s)", 60)
        for pid in workers:
            deadline = time.monotonic() + 10
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not os.path.exists(f"/proc/{pid}"), "a killed launcher's worker kept running"
        _wait_for(logs[0], "has 1: ", 60)  # ddpkit train resumed at world size 1
        c = _launcher(port, "elastic", *train, nnodes="1:3", log=logs[2])
        procs.append(c)
        assert a.wait(timeout=240) == 0, logs[0].read_text()
        assert c.wait(timeout=60) == 0, logs[2].read_text()
    finally:
        _kill(procs)
    first = logs[0].read_text()
    assert "node 1 failed first: its launcher stopped answering" in first
    assert "restarting with the nodes still here (restart 1 of 2), rendezvous round" in first
    assert "membership change: 1 node(s) arrived" in first and "(not counted as a restart)" in first
    assert any("node 0 of 2" in line and "after 1 restart(s)" in line for line in first.splitlines())
    assert "node 1 of 2" in logs[2].read_text()
    assert "the checkpoint was written by 2 process(es), this attempt has 1" in first
    assert "the checkpoint was written by 1 process(es), this attempt has 2" in first
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == list(range(1, 11))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["test_accuracy"] > 0.9


def test_a_stranger_raising_the_waiting_counter_is_no_node_waiting_for_room():
    # A node waiting for room was counted by a counter any client of the store could raise: one raise ended every
    # round for a membership change that no node made, and cost no restart, round after round (until 2026-12-02).
    from datetime import timedelta

    import torch.distributed as dist

    from ddpkit.launcher.elastic import DynamicRendezvous
    from ddpkit.launcher.launch_config import LaunchConfig
    from ddpkit.launcher.settings import resolve

    port = free_port()
    config = LaunchConfig(program=str(SCRIPTS / "sleeper.py"), nnodes="1:2", nproc_per_node="1", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{port}", rdzv_conf="last_call_timeout=0.1")
    rdzv = DynamicRendezvous(resolve(config), NODES_SECRET)
    try:
        rdzv.join(0)
        assert rdzv.membership_change(0) is None
        stranger = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=10), wait_for_workers=False)
        [counter] = [k for k in stranger.list_keys() if k.endswith("/count")]
        waiting = counter[: -len("r/0/count")] + "waiting/0"
        stranger.add(waiting, 1_000_000_000)  # (a launcher reads a bounded number of tickets' marks)
        stranger.set(waiting + "/1", "a node")
        assert rdzv.membership_change(0) is None
        rdzv.store.set("waiting/0/2", "a node")  # a launcher's own mark, sealed
        assert rdzv.membership_change(0) == "1 node(s) arrived and the job has room (--nnodes 1:2)"
    finally:
        rdzv.close()
