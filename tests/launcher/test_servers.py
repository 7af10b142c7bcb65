"""``ddpkit launch --num-servers K``: parameter server processes planned on node 0, started, and torn down."""

from __future__ import annotations

from pathlib import Path

import pytest
from procs import launch, script

from ddpkit.launcher import LaunchConfig, plan_workers, resolve
from ddpkit.runtime.options import ConfigError


def test_servers_are_planned_on_node_0_after_the_workers_with_their_role():
    cfg = LaunchConfig(program=__file__, nproc_per_node=2, nnodes=2, node_rank=0, master_addr="node0",
                       master_port=1234, num_servers=2)
    specs = plan_workers(resolve(cfg), master_port=1234, restart_count=0, base_env={"PATH": "/bin"})
    workers, servers = specs[:2], specs[2:]
    assert [s.server for s in specs] == [None, None, 0, 1] and [s.rank for s in servers] == [4, 5]
    assert all(w.env["DDPKIT_NUM_SERVERS"] == "2" and "DDPKIT_ROLE" not in w.env for w in workers)
    env = servers[1].env
    assert env["DDPKIT_ROLE"] == "server" and env["DDPKIT_SERVER_RANK"] == "1" and env["DDPKIT_NUM_SERVERS"] == "2"
    assert env["WORLD_SIZE"] == "4" and env["MASTER_ADDR"] == "node0" and env["MASTER_PORT"] == "1234"
    assert "RANK" not in env and "LOCAL_RANK" not in env and env["ROLE_NAME"] == "server"
    assert servers[0].argv[-3:] == ["-u", "-m", "ddpkit.parallel.ps.server"]
    other = LaunchConfig(program=__file__, nproc_per_node=2, nnodes=2, node_rank=1, master_addr="node0",
                         master_port=1234, num_servers=2)
    on_node_1 = plan_workers(resolve(other), master_port=1234, restart_count=0, base_env={})
    assert [s.server for s in on_node_1] == [None, None] and on_node_1[0].env["DDPKIT_NUM_SERVERS"] == "2"


@pytest.mark.parametrize("kwargs, message", [
    ({"num_servers": -1}, "--num-servers -1 must be 0"),
    ({"num_servers": 1, "nnodes": "1:2", "rdzv_backend": "c10d", "rdzv_endpoint": "h:1"},
     "does not fit an elastic --nnodes 1:2"),
])
def test_bad_server_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LaunchConfig(program="train.py", **kwargs)


@pytest.mark.slow("a launched job with parameter servers, waited out")
def test_a_script_that_never_closes_its_servers_still_ends_and_leaves_none_running(tmp_path):
    done = launch("--standalone", "--nproc-per-node", "2", "--num-servers", "1", "--log-dir", str(tmp_path),
                  script("ps_script.py"), timeout=120)
    assert done.returncode == 0, done.stderr
    assert [r["steps"] for r in done.reports()] == [5, 5]
    assert {r["world"] for r in done.reports()} == {2}  # the servers are not in the workers' world
    assert not _servers_running()
    # --log-dir holds the server's output beside the ranks' (it went to the console only until 2026-12-01).
    assert sorted(p.name for p in (tmp_path / "attempt_0").iterdir()) == ["rank0.log", "rank1.log", "server0.log"]


def _servers_running() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode() if entry.name.isdigit() else ""
        except OSError:
            continue
        if "ddpkit.parallel.ps.server" in line:
            found.append(line)
    return found
