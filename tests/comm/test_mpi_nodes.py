"""The mpi backend across two "nodes" (network namespaces joined by a veth pair), started by Open MPI's mpirun
over a remote shell that enters each namespace: the MNIST job trains to the same weights as on one node."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from netns import in_namespace, mpirun_agent, two_nodes
from procs import base_env
from safetensors.torch import load_file

from ddpkit.runtime import mpirun

pytestmark = pytest.mark.slow("two namespaces, an mpirun job across them and one on a node, about 30 s")

MNIST = Path(__file__).resolve().parents[3] / "shared" / "data" / "mnist"
TRAIN = ["-m", "ddpkit", "train", "--dataset", "mnist", "--data-dir", str(MNIST), "--epochs", "1", "--no-progress",
         "--backend", "mpi"]


def test_mnist_over_two_nodes_equals_one_node(tmp_path: Path, needs_mpi):
    if not MNIST.is_dir():
        pytest.skip(f"the MNIST test split is not at {MNIST} (../shared/data/mnist)")
    launcher = mpirun.find()
    if launcher.vendor != "openmpi":
        pytest.skip("the namespaces' remote shell is given to Open MPI's mpirun (plm_rsh_agent)")
    one = subprocess.run([sys.executable, *TRAIN, "--nproc-per-node", "2", "--output-dir", str(tmp_path / "one")],
                         env=base_env(), capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    with two_nodes() as (names, addresses):
        agent = mpirun_agent(tmp_path, names, addresses)
        subnet = addresses[0].rsplit(".", 1)[0] + ".0/24"
        # TCP between the nodes, as between real ones (not shared memory, which both namespaces could use).
        extra = ["--mca", "plm_rsh_agent", str(agent), "--mca", "btl", "tcp,self", "--mca", "oob_tcp_if_include",
                 subnet, "--mca", "btl_tcp_if_include", subnet]
        argv = mpirun.command(launcher, 2, [sys.executable, *TRAIN, "--output-dir", str(tmp_path / "two")],
                              env=["OMP_NUM_THREADS", "PATH", "PYTHONPATH"], hosts=[f"{a}:1" for a in addresses],
                              extra=extra)
        two = subprocess.run(in_namespace(names[0], argv), env=base_env(PYTHONPATH=":".join(sys.path)),
                             capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    ours, theirs = load_file(tmp_path / "two" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert ours.keys() == theirs.keys() and ours
    # Two ranks: every all-reduce adds two numbers, whichever algorithm and transport (tcp here, shared memory on
    # one node) Open MPI picks, so the weights are equal bit for bit.
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
