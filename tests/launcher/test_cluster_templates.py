"""examples/slurm and examples/kubernetes run as written: their command lines, with the scheduler's environment.

Each template's command runs here as its scheduler would run it: the sbatch
scripts under bash with SLURM's batch variables, ``srun`` starting one task a
node with SLURM's step variables and ``scontrol show hostnames`` expanding the
node list (both stand-ins on ``PATH``, as small as SLURM's behaviour is); the
Kubernetes containers' commands with the variables Kubernetes and the
PyTorchJob operator set, ``$(VAR)`` expanded as the kubelet does. Two "nodes"
are two launchers on this machine. Every template then trains the same job
(world 2) to the same weights, bit for bit, as ``ddpkit train`` on one node.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from procs import ROOT, base_env

from ddpkit.runtime.process import free_port

yaml = pytest.importorskip("yaml")
safetensors = pytest.importorskip("safetensors.torch")

EXAMPLES = ROOT / "examples"
TRAIN = ["--dataset", "synthetic", "--synthetic-samples", "256", "--epochs", "2", "--batch-size", "32",
         "--no-progress"]
"""A short job, passed through the templates' own "extra flags" slot (sbatch's arguments) or appended."""

SRUN = """#!/bin/bash
# srun for a step of one task a node: the command once per node, with SLURM's step variables.
n=${SLURM_JOB_NUM_NODES:?}
pids=()
for ((i = 0; i < n; i++)); do
    SLURM_PROCID=$i SLURM_NODEID=$i SLURM_LOCALID=0 SLURM_NTASKS=$n SLURM_STEP_NUM_TASKS=$n \\
    SLURM_STEP_NUM_NODES=$n SLURM_TASKS_PER_NODE="1(x$n)" SLURM_STEP_ID=0 SLURM_STEPID=0 "$@" &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST: one host a line (plain comma lists only).
[ "$1 $2" = "show hostnames" ] && tr ',' '\\n' <<< "$3"
"""


def _bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _env(bin_dir: Path | None = None, **extra: str) -> dict[str, str]:
    path = [str(Path(sys.executable).parent)] + ([str(bin_dir)] if bin_dir else []) + [os.environ["PATH"]]
    return base_env(PATH=os.pathsep.join(path), **extra)


def _sbatch(script: str, nodes: int, job_id: str, cwd: Path, bin_dir: Path, **extra: str) -> subprocess.Popen:
    """``sbatch script`` as SLURM runs the batch step: bash on the first node with the job's variables."""
    env = _env(bin_dir, SLURM_JOB_ID=job_id, SLURM_JOBID=job_id, SLURM_JOB_NUM_NODES=str(nodes),
               SLURM_NNODES=str(nodes), SLURM_JOB_NODELIST=",".join(["localhost"] * nodes),
               SLURM_SUBMIT_DIR=str(cwd), **extra)
    return subprocess.Popen(["bash", str(EXAMPLES / "slurm" / script), *TRAIN], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _expand(word: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` in a container's command: the variable's value, left as written when undefined."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), word)


SECRET = "f00dfeed" * 4
"""What ``kubectl create secret ... ddpkit-train-secret`` would hold (the templates' comment makes one so)."""


def _container(manifest: dict) -> tuple[list[str], dict[str, str]]:
    template = manifest["template"] if "template" in manifest else manifest["spec"]["template"]
    container = template["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    secrets = {e["name"]: SECRET for e in container.get("env", [])
               if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "ddpkit-train-secret"}
    assert secrets == {"DDPKIT_JOB_TOKEN": SECRET}, "the job's secret comes from a Secret, as the kubelet gives it"
    return list(container["command"]) + list(container.get("args", [])), {**env, **secrets}


def _pod(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    full = _env(**env)
    return subprocess.Popen([_expand(w, full) for w in command] + TRAIN, cwd=cwd, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen]) -> None:
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=180)
            assert proc.returncode == 0, out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # a launcher takes its workers with it
                proc.wait()


def _weights(path: Path) -> dict:
    return safetensors.load_file(str(path / "model.safetensors"))


@pytest.mark.slow("five jobs (two Slurm, two Kubernetes, the reference) of a launcher and two workers each, at once")
def test_every_cluster_template_trains_the_same_weights(tmp_path):
    bin_dir = _bin(tmp_path)
    runs = tmp_path / "runs"
    runs.mkdir()
    job = yaml.safe_load((EXAMPLES / "kubernetes" / "pytorchjob.yaml").read_text())
    service, indexed = yaml.safe_load_all((EXAMPLES / "kubernetes" / "indexed-job.yaml").read_text())
    started = [
        _sbatch("train_one_node.sbatch", 1, "101", tmp_path, bin_dir, NPROC_PER_NODE="2"),
        _sbatch("train_nodes.sbatch", 2, "102", tmp_path, bin_dir, NPROC_PER_NODE="1", RDZV_PORT=str(free_port())),
    ]

    # Kubeflow PyTorchJob: Master (node 0) and one Worker; the operator's variables per pod.
    port = str(free_port())
    replicas = [("Master", 0), ("Worker", 1)]
    for kind, node in replicas:
        command, env = _container(job["spec"]["pytorchReplicaSpecs"][kind])
        env.update(OUTPUT_DIR=str(runs / "pytorchjob"), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   WORLD_SIZE="2", RANK=str(node), PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=port,
                   PET_NNODES="2", PET_NODE_RANK=str(node), PET_NPROC_PER_NODE="1", PYTHONUNBUFFERED="1")
        assert job["spec"]["nprocPerNode"] == "auto"  # the operator's PET_NPROC_PER_NODE; 1 here for world 2
        started.append(_pod(command, env, tmp_path))

    # Indexed Job + headless Service: JOB_COMPLETION_INDEX per pod; pod 0's DNS name is loopback here.
    assert service["spec"]["clusterIP"] == "None" and indexed["spec"]["completionMode"] == "Indexed"
    command, env = _container(indexed)
    assert env["MASTER_HOST"] == f"{indexed['metadata']['name']}-0.{indexed['spec']['template']['spec']['subdomain']}"
    assert env["NNODES"] == str(indexed["spec"]["completions"])
    env.update(MASTER_HOST="127.0.0.1", RDZV_PORT=str(free_port()), OUTPUT_DIR=str(runs / "indexed"),
               NPROC_PER_NODE="1", JOB_ID="3b6c2e1c-indexed")
    for index in range(indexed["spec"]["completions"]):
        started.append(_pod(command, {**env, "JOB_COMPLETION_INDEX": str(index)}, tmp_path))

    reference = subprocess.Popen([sys.executable, "-m", "ddpkit", "train", "--nproc-per-node", "2",
                                  "--output-dir", str(runs / "reference"), *TRAIN], cwd=tmp_path, env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _finish([*started, reference])

    expected = _weights(runs / "reference")
    for name in ("slurm-101", "slurm-102", "pytorchjob", "indexed"):
        got = _weights(runs / name)
        assert got.keys() == expected.keys(), name
        for key in expected:
            assert got[key].equal(expected[key]), (name, key)
