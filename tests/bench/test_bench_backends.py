"""``ddpkit bench backends`` end to end at toy sizes: both tables and the JSON, from one mpirun job."""

from __future__ import annotations

import json

import pytest

from ddpkit.bench.sections.mpi_vs_gloo import BackendsBenchConfig
from ddpkit.cli import main


def test_backends_bench_end_to_end(tmp_path, capsys, needs_mpi):
    out = tmp_path / "b.json"
    code = main(["bench", "backends", "--sizes", "4096", "1048576", "--world-sizes", "2", "--iters", "2",
                 "--workloads", "convnet", "--steps", "3", "--warmup", "1", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert [(r["world_size"], r["bytes"]) for r in data["bandwidth"]] == [(2, 4096), (2, 1048576)]
    for r in data["bandwidth"]:
        assert r["mpi_s"] > 0 and r["gloo_s"] > 0 and r["rounds"] == 2
        assert r["mpi_busbw_gbs"] == pytest.approx(r["bytes"] / r["mpi_s"] / 1e9)  # 2(p-1)/p = 1 at p = 2
    [step] = data["steps"]
    assert step["workload"] == "convnet" and step["steps"] == 3 and step["params"] > 0
    assert all(step[f"{e}_ms"] > 0 for e in ("ddpkit_mpi", "ddpkit_gloo", "torch_gloo"))
    low, high = step["speedup_ci95"]
    assert low <= step["speedup_vs_torch_gloo"] <= high and step["verdict"] in ("faster", "slower", "level")
    said = capsys.readouterr()
    assert "mpi/gloo" in said.out and "speed-up" in said.out and "ddpkit bench backends: world size 2 (1/1)" in said.err


def test_backends_bench_config_is_validated():
    with pytest.raises(ValueError, match="--world-sizes 1"):
        BackendsBenchConfig(world_sizes=(1,))
    with pytest.raises(ValueError, match="--workloads linear200"):
        BackendsBenchConfig(workloads=("linear200",))
    assert main(["bench", "backends", "--steps", "0"]) == 2
