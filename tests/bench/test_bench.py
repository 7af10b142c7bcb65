"""``ddpkit bench`` end to end at toy sizes: it runs, reports, and validates its config."""

from __future__ import annotations

import json

import pytest

from ddpkit.bench.engines import BenchConfig, format_results
from ddpkit.cli import main


def test_bench_cli_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main([
        "bench", "--steps", "2", "--warmup", "1", "--block", "1", "--samples-per-rank", "4",
        "--mlp-hidden", "16", "--mlp-batch", "4", "--json", str(out),
    ])
    assert code == 0
    results = json.loads(out.read_text())
    assert [r["workload"] for r in results] == ["convnet", "mlp"]
    for r in results:
        assert r["ddpkit_ms"] > 0 and r["torch_ms"] > 0 and 0 <= r["hidden_ddpkit"] <= 1
    text = capsys.readouterr().out
    assert "ratio" in text and "convnet" in text and "mlp" in text


def test_bench_config_validation():
    with pytest.raises(ValueError, match="workloads"):
        BenchConfig(workloads=("resnet9000",))
    with pytest.raises(ValueError, match="--steps 0"):
        BenchConfig(steps=0)
    assert main(["bench", "--steps", "-1"]) == 2


def test_format_results_has_one_row_per_workload():
    assert len(format_results([], 2).splitlines()) == 3
