"""The chaos harness, short: seeded faults during real training runs, each ending bit-identical.

``scripts/chaos.py`` is the full harness (``--faults 50``); here a few faults
of each kind that the design survives, and the one it cannot (the static
rendezvous host's launcher killed), which the harness relaunches with
``--resume`` as a user would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from procs import ROOT, base_env

pytestmark = pytest.mark.alone("whole jobs of two to four ranks, and faults sent while a step runs")


def _chaos(tmp_path: Path, *args: str) -> dict:
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "chaos.py"), "--json", str(report),
                           "--workdir", str(tmp_path / "work"), *args], env=base_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(report.read_text())


@pytest.mark.slow("a reference run, then four faults in one run, each restarting every worker under ZeRO-2")
def test_worker_faults_under_ddpkit_launch_end_bit_identical(tmp_path: Path) -> None:
    # Under ZeRO stage 2 (sharded gradients and optimizer state), against the stage-0 reference.
    report = _chaos(tmp_path, "--mode", "launch", "--faults", "4", "--seed", "1", "--epochs", "6", "--zero", "2",
                    "--kinds", "sigkill-worker", "sigterm-worker", "sigstop-worker", "kill-mid-checkpoint")
    assert report["ok"] and sum(report["sent"].values()) == 4 and report["survived_by_the_job"] == 4
    assert all(r["bit_identical"] and not r["epochs_not_once"] and not r["processes_left"] for r in report["runs"])


@pytest.mark.slow("a reference run, then a killed run and its relaunch with --resume")
def test_a_killed_train_process_ends_bit_identical_after_a_relaunch(tmp_path: Path) -> None:
    report = _chaos(tmp_path, "--mode", "train", "--faults", "1", "--seed", "1", "--epochs", "8",
                    "--kinds", "sigkill-launcher")
    assert report["ok"] and report["sent"] == {"sigkill-launcher": 1} and report["needed_a_relaunch"] == 1
    assert all(r["bit_identical"] and r["step_files"] <= 3 and not r["lock_left"] for r in report["runs"])


@pytest.mark.slow("a reference run, then two nodes' launchers killed: a relaunch and a restart round of fresh workers")
def test_two_nodes_survive_node_1s_launcher_and_are_relaunched_after_node_0s(tmp_path: Path) -> None:
    # Seed 2 kills node 0's launcher (the static rendezvous: the job ends, relaunched with --resume), then
    # node 1's (a new launcher joins the restart round, the job goes on by itself).
    report = _chaos(tmp_path, "--mode", "nodes", "--faults", "2", "--seed", "2", "--epochs", "10",
                    "--kinds", "sigkill-launcher")
    assert report["ok"] and report["sent"] == {"sigkill-launcher": 2}
    assert report["survived_by_the_job"] == 1 and report["needed_a_relaunch"] == 1
    assert report["not_survivable"] == ["node 0's launcher serves the static rendezvous: the job cannot outlive it"]
