"""Two nodes in two network namespaces: no GLOO_SOCKET_IFNAME needed, same result as one node."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.netns import in_namespace, two_nodes
from tests.procs import NODES_SECRET, SCRIPTS, base_env, launch


def _checksum(text: str) -> str:
    return next(line.split()[-1] for line in text.splitlines() if "CHECKSUM" in line)


@pytest.mark.slow("one job on one node, then the same job on two network namespaces")
def test_two_namespaces_train_without_gloo_socket_ifname_like_one_node():
    env = base_env()
    env.pop("GLOO_SOCKET_IFNAME", None)
    one = launch("--nproc-per-node", "2", str(SCRIPTS / "tiny_train.py"), env=env, timeout=120)
    assert one.returncode == 0, one.stderr
    env["DDPKIT_JOB_TOKEN"] = NODES_SECRET
    with two_nodes() as (names, addresses):
        procs = [
            subprocess.Popen(in_namespace(name, [
                sys.executable, "-m", "ddpkit", "launch", "--nnodes", "2", "--node-rank", str(k),
                "--master-addr", addresses[0], "--master-port", "29611", "--rdzv-id", "two-nodes",
                "--nproc-per-node", "1", str(SCRIPTS / "tiny_train.py")]),
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for k, name in enumerate(names)
        ]
        outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    assert _checksum(outs[0][0]) == _checksum(one.stdout)
