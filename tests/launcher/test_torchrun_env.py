"""The whole worker environment under ddpkit launch equals torchrun's, but for run-specific values and ddpkit's own."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from procs import ROOT, base_env, script

from ddpkit.runtime.process import free_port

pytest.importorskip("torch.distributed.run")

ADDITIONS = {"DDPKIT_JOB_TOKEN"}
"""ddpkit's own variables (documented in docs/launching.md)."""
PER_RUN = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID"}
"""Values that differ between any two runs of one launcher (checked for their form instead)."""
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _start(launcher: list[str], flags: list[str], out: Path) -> subprocess.Popen:
    out.mkdir()
    return subprocess.Popen([*launcher, *flags, script("dump_env.py"), str(out)], env=base_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _envs(proc: subprocess.Popen, out: Path, nproc: int) -> list[dict[str, str]]:
    text, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, text
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    assert [r["sum"] for r in reports] == [float(nproc)] * nproc  # torch's env:// met at the launcher's store
    return [r["env"] for r in reports]


@pytest.mark.slow("four launches, two of ddpkit's and two of torchrun's, each with two workers")
def test_worker_environment_equals_torchruns(tmp_path):
    port = free_port()
    # (name, ddpkit flags, torchrun flags): a static node on a given port, and --standalone with an elastic node
    # range (torchrun waits 30 s there for nodes that cannot come, so its --nnodes 1 run is the reference).
    cases = [
        ("static", ["--nproc-per-node", "2", "--master-port", str(port)],
         ["--nproc-per-node", "2", "--master-port", str(port + 1 if port < 65535 else port - 1)]),
        ("range", ["--standalone", "--nnodes", "1:2", "--nproc-per-node", "2"],
         ["--standalone", "--nnodes", "1", "--nproc-per-node", "2"]),
    ]
    ddpkit, torchrun = [sys.executable, "-m", "ddpkit", "launch"], [sys.executable, "-m", "torch.distributed.run"]
    runs = [(name, _start(ddpkit, ours, tmp_path / f"{name}-ddpkit"),
             _start(torchrun, theirs, tmp_path / f"{name}-torch")) for name, ours, theirs in cases]
    for name, ours, theirs in runs:
        for rank, (mine, ref) in enumerate(zip(_envs(ours, tmp_path / f"{name}-ddpkit", 2),
                                               _envs(theirs, tmp_path / f"{name}-torch", 2), strict=True)):
            assert set(mine) - set(ref) == ADDITIONS, name
            assert set(ref) - set(mine) == set(), name
            differ = {k for k in ref if mine[k] != ref[k]}
            assert differ <= PER_RUN, (name, {k: (mine[k], ref[k]) for k in differ - PER_RUN})
            assert mine["TORCHELASTIC_USE_AGENT_STORE"] == "True"
            for env in (mine, ref):
                assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{rank}/error.json"), name
                if name == "static":
                    assert env["TORCHELASTIC_RUN_ID"] == "none"
                else:
                    assert UUID.fullmatch(env["TORCHELASTIC_RUN_ID"]), name


def test_standalone_cannot_wait_for_nodes_that_cannot_join():
    done = subprocess.run([sys.executable, "-m", "ddpkit", "launch", "--standalone", "--nnodes", "2:3",
                           script("dump_env.py"), "x"], env=base_env(), capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert "--standalone runs this node alone, but --nnodes 2:3 needs at least 2" in done.stderr
    assert "--rdzv-backend c10d --rdzv-endpoint" in done.stderr
