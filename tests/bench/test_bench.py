"""``ddpkit bench``: its measurements on the rank pool, its report, its config, and the command end to end."""

from __future__ import annotations

import json

import pytest

from ddpkit.bench.config import BenchConfig
from ddpkit.bench.engines import WorkloadResult, _bench_workload, format_results
from ddpkit.cli import main

TOY = dict(steps=3, warmup=1, block=1, samples_per_rank=4, mlp_hidden=16, mlp_batch=4)
# Parameter counts of the toy workloads: the tutorial's ConvNet, and the MLP
# 784-16-16-10 with biases.
PARAMS = {"convnet": 29_034, "mlp": 784 * 16 + 16 + 16 * 16 + 16 + 16 * 10 + 10}


def _measure(name: str) -> WorkloadResult:
    return _bench_workload(name, BenchConfig(**TOY))


@pytest.mark.parametrize("name", ["convnet", "mlp"])
def test_each_workload_is_measured_on_real_ranks(dist2, name):
    r = dist2.run(_measure, name)[0]
    assert r.workload == name and r.params == PARAMS[name] and r.buckets >= 1
    assert r.ddpkit_ms > 0 and r.torch_ms > 0 and r.compute_ms > 0 and r.comm_ms > 0
    assert r.exposed_ddpkit_ms > 0  # the timed wait really ran at every end of backward
    # The derived columns follow from the measured ones as documented.
    expected = min(1.0, max(0.0, (r.compute_ms + r.comm_ms - r.ddpkit_ms) / r.comm_ms))
    assert r.hidden_ddpkit == pytest.approx(expected)
    assert r.hidden_ddpkit_direct == pytest.approx(min(1.0, max(0.0, 1 - r.exposed_ddpkit_ms / r.comm_ms)))


def test_format_results_has_one_row_per_workload():
    rows = [WorkloadResult(workload=w, params=PARAMS[w], ddpkit_ms=2.0, torch_ms=4.0, ratio=0.5, compute_ms=1.0,
                           comm_ms=1.5, hidden_ddpkit=0.3, hidden_torch=0.1, exposed_ddpkit_ms=0.5,
                           hidden_ddpkit_direct=0.66, buckets=1) for w in ("convnet", "mlp")]
    lines = format_results(rows, 2).splitlines()
    body = [line for line in lines if line.startswith(("convnet", "mlp"))]
    assert [line.split()[0] for line in body] == ["convnet", "mlp"]
    assert all("0.500" in line and "2.00" in line and "4.00" in line for line in body)


def test_bench_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--workloads", "convnet", "--steps", "2", "--warmup", "1", "--samples-per-rank", "4",
                 "--json", str(out)])
    assert code == 0
    results = json.loads(out.read_text())["ddp"]
    assert [r["workload"] for r in results] == ["convnet"] and results[0]["params"] == PARAMS["convnet"]
    text = capsys.readouterr().out
    assert "ratio" in text and "convnet" in text


def test_bench_config_validation():
    with pytest.raises(ValueError, match="workloads"):
        BenchConfig(workloads=("resnet9000",))
    with pytest.raises(ValueError, match="--steps 0"):
        BenchConfig(steps=0)
    assert main(["bench", "--steps", "-1"]) == 2


def _dp_vs_ddp():
    from ddpkit.bench.dp import bench_dp_vs_ddp

    return bench_dp_vs_ddp(BenchConfig(**TOY))


def test_dp_vs_ddp_is_measured_on_real_ranks(dist2):
    a, b = dist2.run(_dp_vs_ddp)
    assert a == b  # rank 0's figures, on every rank
    assert a.replicas == 2 and a.global_batch == 8 and a.rounds == TOY["steps"]
    assert a.dp_ms > 0 and a.ddp_ms > 0 and a.ratio_q1 <= a.ratio <= a.ratio_q3
