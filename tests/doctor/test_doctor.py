"""ddpkit doctor on this CPU machine: the report, the gloo self-test on real ranks, and each failure named."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from procs import ROOT, base_env

from ddpkit.doctor.doctor_config import DoctorConfig
from ddpkit.doctor.checkup import format_report
from ddpkit.doctor.selftest import plan
from ddpkit.runtime.options import ConfigError


def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpkit", "doctor", *args], cwd=ROOT, env=base_env(**env),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow("a whole doctor run: every backend's self-test in fresh ranks")
def test_the_self_test_passes_on_gloo_and_reports_everything():
    done = _doctor("--json", "--nproc-per-node", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    env = report["environment"]
    assert env["torch"]["version"] and env["python"]["version"] and env["backends"]["gloo"]["available"]
    assert env["network"]["interface"] == "lo" and env["env"]["OMP_NUM_THREADS"] == "1"
    assert report["problems"] == [] and report["ok"]
    assert report["seconds"] > 0  # how long it took is reported; no bound here (CI measured 68 s under load)
    groups = {g["backend"]: g for g in report["selftest"] if g["device"] == "cpu"}
    mpi = env["backends"]["mpi"]
    assert sorted(groups) == (["gloo", "mpi"] if mpi["available"] else ["gloo"])
    for group in groups.values():
        assert group["world"] == 3 and group["ok"]
        assert [c["check"] for c in group["checks"]] == ["collectives", "DDP step", "SyncBatchNorm",
                                                         "all-reduce bandwidth", "comm auto"]
        assert group["checks"][4]["detail"].startswith("all-reduce ") and " over 3 ranks;" in group["checks"][4]["detail"]
        assert all(c["ok"] for c in group["checks"])
        assert "hierarchical" in group["checks"][0]["detail"] and "torch's DDP" in group["checks"][1]["detail"]
        assert sorted(group["bus_gbps"]) == ["1 MiB", "16 MiB", "64 MiB"] and min(group["bus_gbps"].values()) > 0
    text = format_report(report)
    assert "gloo / cpu: ok" in text and "result: ok" in text and "DDPKIT_JOB_TOKEN" not in text
    if mpi["available"]:  # the MPI library, its version, thread level and CUDA-awareness
        assert mpi["name"] and mpi["standard"] and mpi["mpi4py"] and mpi["thread_level"] == "multiple"
        assert "mpi / cpu: ok" in text and f"mpi      {mpi['name']}" in text and "thread level multiple" in text


@pytest.mark.slow("a whole doctor run in a fresh process")
def test_a_backend_that_is_not_here_fails_with_the_reason():
    done = _doctor("--backends", "gloo", "nccl", "--nproc-per-node", "2")
    assert done.returncode == 1
    assert "nccl / -: FAILED: nccl is not available here: this torch has no NCCL" in done.stdout
    assert "gloo / cpu: ok" in done.stdout and "result: FAILED (nccl / -)" in done.stdout


def test_a_bad_interface_is_a_problem_and_fails_the_ranks_with_the_fix():
    done = _doctor("--nproc-per-node", "2", GLOO_SOCKET_IFNAME="nosuchif0")
    assert done.returncode == 1
    assert "PROBLEM  GLOO_SOCKET_IFNAME='nosuchif0': this machine has no interface nosuchif0" in done.stdout
    assert "gloo / cpu: FAILED" in done.stdout and "Unable to find address for: nosuchif0" in done.stdout
    assert "fix: gloo cannot use the interface GLOO_SOCKET_IFNAME names" in done.stdout
    assert "Traceback" not in done.stdout


def test_nccl_is_planned_one_gpu_per_rank():
    backends = {"gloo": {"available": True, "why": ""}, "nccl": {"available": True, "why": ""},
                "mpi": {"available": False, "why": "no MPI"}}
    groups = plan(backends, gpus=1, nproc=2, asked=None)
    assert [(g["backend"], g["device"]) for g in groups] == [("gloo", "cpu"), ("gloo", "cuda"), ("nccl", "cuda")]
    assert "NCCL needs one GPU per rank" in groups[2]["skip"]
    assert "skip" not in plan(backends, gpus=2, nproc=2, asked=("nccl",))[0]
    assert "fail" in plan(backends, gpus=0, nproc=2, asked=("mpi",))[0]


@pytest.mark.parametrize("kwargs, message", [
    ({"nproc_per_node": 0}, "--nproc-per-node 0 must be at least 1"),
    ({"backends": ("tcp",)}, "--backends tcp: choose among gloo, nccl, mpi"),
    ({"timeout": 0}, "--timeout 0 must be a positive number of seconds"),
    ({"backends": ("nccl",), "selftest": False}, "--backends nccl sets the self-test, and --no-selftest turns it off"),
    ({"nproc_per_node": 4, "selftest": False}, "--nproc-per-node 4 sets the self-test"),
])
def test_bad_flags_name_the_value(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DoctorConfig(**kwargs)


def test_the_comm_auto_line_says_up_to_which_step_compression_would_be_tried():
    from ddpkit.doctor.selftest import describe_auto

    line = describe_auto("all-reduce 12.5 MB/s, latency 90 us over 2 ranks",
                         {"none": 8.0, "fp16": 4.0, "powersgd:4": 0.5})
    assert line == ("all-reduce 12.5 MB/s, latency 90 us over 2 ranks; a 25 M-parameter model's reduction a step: "
                    "none 8000.0 ms, fp16 4000.0 ms, powersgd:4 500.0 ms; auto would try powersgd:4 for steps up to "
                    "150.00 s, fp16 for steps up to 80.00 s (each saving 5 % or more) and keep the exact all-reduce "
                    "above")
    # As auto picks them: bf16 before fp16 (their bytes, and so their times, are the same), one of them only; the
    # best three at most.
    tied = describe_auto("x", {"none": 8.0, "fp16": 4.0, "bf16": 4.0, "powersgd:16": 1.0, "powersgd:32": 2.0,
                               "powersgd:8": 0.5})
    assert tied.endswith("auto would try powersgd:8 for steps up to 150.00 s, powersgd:16 for steps up to 140.00 s, "
                         "powersgd:32 for steps up to 120.00 s (each saving 5 % or more) and keep the exact all-reduce "
                         "above")
    halves = describe_auto("x", {"none": 8.0, "fp16": 4.0, "bf16": 4.0, "powersgd:16": 9.0})
    assert "auto would try bf16 for steps up to 80.00 s (each" in halves
    fast = describe_auto("x", {"none": 0.01, "fp16": 0.012, "powersgd:4": 0.02})
    assert fast.endswith("no compression is predicted to pay for it at any step time: auto would keep the exact "
                         "all-reduce")


def test_bandwidth_at_world_1_says_there_is_no_bus_and_gives_the_calls_time():
    from ddpkit.doctor.selftest import describe_bandwidth

    line = describe_bandwidth({}, {"1 MiB": 12e-6, "16 MiB": 0.0001, "64 MiB": 0.0004})
    assert line.startswith("no bus at world 1") and "--nproc-per-node" in line and "0 GB/s" not in line
    assert "1 MiB 12 us, 16 MiB 100 us, 64 MiB 400 us" in line
    assert describe_bandwidth({"1 MiB": 1.5}, {"1 MiB": 0.001}) == "1 MiB 1.5 GB/s (bus bandwidth)"
