"""The commands on CUDA: ``ddpkit train`` with every strategy, ZeRO stage and comm hook, restart and resume
across devices, TensorBoard, ``ddpkit bench --device cuda`` and ``ddpkit bench strategies``.

Two paths each: NCCL at the GPU count (one GPU per process), and gloo with
two processes sharing one GPU (``--backend gloo``), which is how a machine
with fewer GPUs than processes runs. Every run has ``--deterministic``, so
results that are bitwise on the CPU are compared bitwise here too: a
strategy that makes DDP's update against a DDP run of the same path, ddpkit's
engine against torch's, a killed and restarted run against an uninterrupted
one. Parameter servers step on the CPU by design and are compared within
float32's rounding. The accuracy bars are the CPU suite's.

``pytest -n N --dist loadgroup`` (``scripts/gpu_check.sh``) keeps the runs
that share a reference on one worker, so each reference trains once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_ranks import GPUS, ON_CPU, needs_cuda
from procs import children, wait_for
from safetensors.torch import load_file

pytestmark = needs_cuda
ROOT = Path(__file__).resolve().parents[2]
WORLD = max(GPUS, 1)
DEVICE = "cpu" if ON_CPU else "cuda"
SHORT = ["--epochs", "2"]
"""Long enough for every strategy to step, checkpoint and evaluate; bitwise comparisons need no more."""
PATHS = {"nccl": [], "gloo": ["--backend", "gloo", "--nproc-per-node", "2"]}
"""The two ways ranks meet a GPU (see the module notes)."""
SAME_JOB = "rehearsal: on the CPU the gloo path is the nccl path's job (gloo, two processes), rehearsed there"
"""Why the CPU rehearsal runs a test on one path only: both paths are gloo with two processes there."""
BY_REFERENCE = [pytest.param(path, marks=pytest.mark.xdist_group(f"ddp-{path}"), id=path) for path in PATHS]
"""The paths, each test on a worker with the others that compare with the same DDP run."""


def once_per_job(path: str) -> None:
    """Skip, in the CPU rehearsal, the gloo path of a test that runs the nccl path too (:data:`SAME_JOB`)."""
    if ON_CPU and path == "gloo":
        pytest.skip(SAME_JOB)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DDPKIT_BACKEND")}
    return {**env, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **extra}


def ddpkit(*args: str, env: dict[str, str] | None = None, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpkit", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env or _env())


def train(out: Path, *flags: str, env: dict[str, str] | None = None) -> dict:
    """``ddpkit train FLAGS`` (deterministic, no bar) into ``out``; its summary."""
    done = ddpkit("train", "--no-progress", "--deterministic", "--output-dir", str(out), *flags, env=env)
    assert done.returncode == 0, f"ddpkit train {' '.join(flags)}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads((out / "summary.json").read_text())


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def assert_same_weights(a: Path, b: Path, exact: bool = True) -> None:
    x, y = weights(a), weights(b)
    assert sorted(x) == sorted(y)
    for k in x:
        if exact:
            assert torch.equal(x[k], y[k]), f"{k}: {(x[k].double() - y[k].double()).abs().max().item()}"
        else:
            torch.testing.assert_close(x[k], y[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


# -- the main job --------------------------------------------------------------------------------------------------

def test_train_reaches_torchs_accuracy_and_writes_tensorboard(tmp_path):
    summary = train(tmp_path / "run", "--tensorboard", str(tmp_path / "tb"))
    # The bar is torch's DDP on the same device, world and steps (the same weights, bit for bit, so the same
    # accuracy), not a figure fitted to an earlier run's.
    reference = train(tmp_path / "torch", "--engine", "torch")
    assert summary["test_accuracy"] == reference["test_accuracy"], (summary, reference)
    assert summary["world_size"] == (2 if ON_CPU else WORLD)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*")), "no TensorBoard event file"
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(history) == 8 and all(r["min_seen"] >= 1 for r in history)


# -- every strategy against DDP on the same path -------------------------------------------------------------------

@pytest.fixture(scope="module")
def ddp_runs(shared_runs) -> dict[str, Path]:
    """The DDP run of each path, trained once per session (``shared_runs``) and only when a test asks for it; in
    the CPU rehearsal both paths are one job, trained once."""

    def get(path: str) -> Path:
        path = "nccl" if ON_CPU else path
        _, folder = shared_runs.get(f"gpu commands: ddp {path} {SHORT}", lambda folder: train(folder / "run", *SHORT,
                                                                                                *PATHS[path]))
        return folder / "run"

    return get  # type: ignore[return-value]


@pytest.fixture(scope="module")
def torch_runs(shared_runs) -> dict[str, Path]:
    """torch's DDP (``--engine torch``) on each path, trained once per session: ``(summary, folder)``."""

    def get(path: str) -> tuple[dict, Path]:
        summary, folder = shared_runs.get(f"gpu commands: torch {path} {SHORT}", lambda folder: train(
            folder / "run", *SHORT, *PATHS[path], *BITWISE["engine-torch"]))
        return summary, folder / "run"

    return get  # type: ignore[return-value]


BITWISE = {
    "optimizer": ["--strategy", "optimizer"],      # Horovod's DistributedOptimizer: the same averages
    "ssp-0": ["--strategy", "ssp", "--staleness", "0"],
    "zero-1": ["--zero", "1"],
    "zero-2": ["--zero", "2"],
    "zero-3": ["--zero", "3"],
    "engine-torch": ["--engine", "torch"],
}


@pytest.mark.parametrize("path", BY_REFERENCE)
@pytest.mark.parametrize("name", list(BITWISE))
def test_strategy_makes_ddps_update_bit_for_bit(tmp_path, ddp_runs, torch_runs, path, name):
    once_per_job(path)
    if name == "engine-torch":  # torch's run, trained once for this test and zero-3's
        summary, out = torch_runs(path)
    else:
        summary, out = train(tmp_path / name, *SHORT, *PATHS[path], *BITWISE[name]), tmp_path / name
    assert_same_weights(out, ddp_runs(path))
    if name == "zero-3":  # and against torch's DDP itself, not only through ddpkit's stage 0
        assert_same_weights(out, torch_runs(path)[1])
    assert summary["world_size"] == (2 if path == "gloo" or ON_CPU else WORLD)


@pytest.mark.parametrize("path", BY_REFERENCE)
def test_sync_parameter_servers_train_ddps_weights(tmp_path, ddp_runs, path):
    once_per_job(path)
    summary = train(tmp_path / "ps", *SHORT, *PATHS[path], "--strategy", "ps-sync", "--num-servers", "2")
    assert all(r["staleness_max"] == 0 for r in summary["per_rank"])
    # The servers step on the CPU (CUDA workers push and pull), DDP on the GPU: within float32's rounding.
    assert_same_weights(tmp_path / "ps", ddp_runs(path), exact=DEVICE == "cpu" and path == "gloo")


@pytest.mark.skipif(WORLD > 1 or ON_CPU, reason="local SGD equals DDP only at world 1, where averaging changes "
                    "nothing (the CPU rehearsal's world is 2)")
@pytest.mark.xdist_group("ddp-nccl")
def test_local_sgd_at_world_1_is_ddp(tmp_path, ddp_runs):
    train(tmp_path / "local", *SHORT, "--strategy", "local-sgd")
    assert_same_weights(tmp_path / "local", ddp_runs("nccl"))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("flags", [["--strategy", "ps-async"], ["--strategy", "ssp"], ["--strategy", "local-sgd"]],
                         ids=["ps-async", "ssp", "local-sgd"])
def test_asynchronous_strategies_reach_the_cpu_bar(tmp_path, path, flags):
    once_per_job(path)
    summary = train(tmp_path / "run", *PATHS[path], *flags)
    assert summary["test_accuracy"] >= 0.97, summary  # tests/train/test_consistency.py's bar, default epochs


# -- comm hooks: ddpkit's hooks on both engines ---------------------------------------------------------------------

@pytest.mark.parametrize("path, hook", [("nccl", "fp16"), ("nccl", "bf16"), ("nccl", "powersgd"),
                                        ("gloo", "fp16"), ("gloo", "powersgd")])
def test_comm_hook_in_train_on_both_engines(tmp_path, path, hook):
    if ON_CPU and hook == "bf16":
        pytest.skip("rehearsal: torch's DDP takes the bf16 hook with CUDA and NCCL only")
    once_per_job(path)
    flags = [*SHORT, *PATHS[path], "--comm-hook", hook]
    ours = train(tmp_path / "ddpkit", *flags)
    train(tmp_path / "torch", *flags, "--engine", "torch")
    assert ours["test_accuracy"] > 0.8, ours
    # One bucket on each engine, the same hook and kernels: the same bits.
    assert_same_weights(tmp_path / "ddpkit", tmp_path / "torch")


@pytest.mark.parametrize("path", list(PATHS))
def test_comm_auto_decides_once_and_trains_on_the_gpu(tmp_path, path):
    # Not --deterministic (refused with auto: two runs may choose apart), so not against a reference's bits.
    once_per_job(path)
    done = ddpkit("train", "--no-progress", "--output-dir", str(tmp_path), *SHORT, *PATHS[path], "--comm-hook", "auto")
    assert done.returncode == 0, done.stderr[-4000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("comm auto at step")]
    assert "pin it with --comm-hook " in line
    assert json.loads((tmp_path / "summary.json").read_text())["test_accuracy"] > 0.8


# -- restart and resume ------------------------------------------------------------------------------------------

KILL = ["--dataset", "synthetic", "--synthetic-samples", "768", "--batch-size", "16", "--epochs", "2",
        "--checkpoint-every", "5"]


def _workers(pid: int) -> list[int]:
    servers = [child for child, line in children(pid) if "forkserver import main" in line]
    return sorted(worker for server in servers for worker, _ in children(server))


@pytest.mark.xdist_group("ddp-gloo")
def test_on_failure_continue_makes_ddps_update_on_the_gpu(tmp_path, ddp_runs):
    # The mode reduces over gloo, so its GPU path is two processes sharing the GPU, against DDP's run of that path.
    summary = train(tmp_path / "continue", *SHORT, *PATHS["gloo"], "--on-failure", "continue")
    assert_same_weights(tmp_path / "continue", ddp_runs("gloo"))
    assert summary["world_size"] == 2 and summary["on_failure"] == "continue"


def test_a_killed_worker_restarts_bit_identical(tmp_path):
    reference = tmp_path / "reference"
    train(reference, *KILL)
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "ddpkit", "train", "--no-progress", "--deterministic", *KILL, "--max-restarts", "1",
           "--output-dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / "checkpoints" / "step-00000015.safetensors").is_file(), timeout=300)
        os.kill(_workers(proc.pid)[-1], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-4000:]
    assert "restarting the workers (restart 1 of 1)" in stdout and "restart 1: resuming from" in stdout
    assert_same_weights(out, reference)


@pytest.mark.xdist_group("ddp-nccl")
def test_resume_on_the_gpu_is_bit_identical(tmp_path, ddp_runs):
    out = tmp_path / "part"
    train(out, "--epochs", "1")
    summary = train(out, "--epochs", "2", "--resume")
    assert summary["resumed_from_epoch"] == 1
    assert_same_weights(out, ddp_runs("nccl"))  # the whole run: SHORT on the default path
    if ON_CPU:  # test_resume_across_devices's checks: on the CPU its runs are this test's (CROSSING)
        _assert_resumed_well(out, summary)


CROSSING = "rehearsal: on the CPU both sides are gloo with two processes, the job test_resume_on_the_gpu checks"


def _assert_resumed_well(out: Path, summary: dict) -> None:
    assert summary["resumed_from_epoch"] == 1 and summary["epochs"] == 2 and summary["world_size"] == 2
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in history] == [1, 2] and history[1]["test_accuracy"] >= 0.9, history
    assert all(torch.isfinite(v).all() for v in weights(out).values())


@pytest.mark.parametrize("first, then", [("cpu", "gpu"), ("gpu", "cpu")])
def test_resume_across_devices(tmp_path, first, then):
    # Two processes on both sides, so the world size stays; on the GPU they share it over gloo (DDPKIT_BACKEND, an
    # environment setting, so the run's settings stay those it was started with).
    if ON_CPU:
        pytest.skip(CROSSING)
    where = {"cpu": _env(CUDA_VISIBLE_DEVICES=""), "gpu": _env(DDPKIT_BACKEND="gloo")}
    out = tmp_path / "run"
    train(out, "--epochs", "1", "--nproc-per-node", "2", env=where[first])
    summary = train(out, "--epochs", "2", "--nproc-per-node", "2", "--resume", env=where[then])
    _assert_resumed_well(out, summary)


def test_nccl_with_more_processes_than_gpus_is_refused_before_anything_starts(tmp_path):
    if ON_CPU:
        pytest.skip("rehearsal: no NCCL on the CPU")
    done = ddpkit("train", "--nproc-per-node", str(WORLD + 1), "--output-dir", str(tmp_path / "run"))
    assert done.returncode == 2
    assert f"--nproc-per-node {WORLD + 1}: NCCL needs one GPU per process" in done.stderr
    assert "--backend gloo" in done.stderr and "Traceback" not in done.stderr


# -- the benches -------------------------------------------------------------------------------------------------

def test_bench_on_the_gpu_times_every_workload_with_engine_cost_and_memory(tmp_path):
    out = tmp_path / "bench.json"
    done = ddpkit("bench", "--device", DEVICE, "--world-size", str(WORLD), "--workloads", "convnet", "mlp",
                  "transformer", "resnet", "linear200", "dp", "strategies", "--steps", "8", "--warmup", "2",
                  "--mlp-hidden", "512", "--no-progress", "--engine-cost", "--json", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = {r["workload"]: r for r in report["ddp"]}
    assert sorted(rows) == ["convnet", "linear200", "mlp", "resnet", "transformer"]
    assert all(r["noop_ratio"] > 0 and r["ddpkit_noop_ms"] > 0 for r in rows.values())
    if not ON_CPU:
        assert all(r["ddpkit_peak_mib"] > 0 and r["torch_peak_mib"] > 0 for r in rows.values())
        assert report["backend"] == "nccl"
    assert report["dp"]["dp_ms"] > 0 and {r["strategy"] for r in report["strategies"]} == {
        "ddp", "optimizer", "local-sgd", "powersgd", "ft", "ft:4n", "ft-det", "ft-det:4n"}
    assert "engine cost: both engines with the same no-op comm hook" in done.stdout


def test_bench_strategies_on_the_gpu(tmp_path):
    done = ddpkit("bench", "strategies", "--backend", "gloo", "--world-sizes", "2", "--epochs", "1", "--strategies",
                  "ddp", "local-sgd", "ps-sync", "ps-async:1", "ssp:1", "--json", str(tmp_path / "runs.json"))
    assert done.returncode == 0, done.stderr[-4000:]
    runs = json.loads((tmp_path / "runs.json").read_text())["runs"]
    assert [r["strategy"] for r in runs] == ["ddp", "local-sgd", "ps-sync", "ps-async:1", "ssp:1"]
    assert all(r["final_accuracy"] > 0.5 and r["steps"] > 0 for r in runs)
