"""``ddpkit bench --scaling``: the sweeps, their plots and JSON (tiny workloads; nothing asserts a timing)."""

from __future__ import annotations

import json

import pytest

from ddpkit.bench.bench_config import BenchConfig
from ddpkit.bench.sections.scaling import mlp_hidden_for, plan
from ddpkit.cli import main


@pytest.mark.parametrize("params", [1e5, 1e6, 5e6, 25e6, 100e6])
def test_mlp_hidden_for_hits_the_parameter_count(params):
    from ddpkit.models import MLP

    h = mlp_hidden_for(params)
    got = sum(p.numel() for p in MLP(hidden=h).parameters()) if params <= 1e6 else h * h + 796 * h + 10
    assert abs(got - params) / params < 0.01


def test_plan_keeps_the_batch_per_rank_weak_and_the_global_batch_strong():
    cfg = BenchConfig(scaling=True, workloads=("convnet", "transformer", "dp"), world_sizes=(1, 2, 4),
                      samples_per_rank=12, transformer_batch=8, mlp_sizes=(1e4,), world_size=2)
    jobs = plan(cfg)
    assert sorted(jobs) == [1, 2, 4]
    for world, todo in jobs.items():
        for sweep, name, sub in todo:
            assert sub.world_size == world and not sub.scaling and name != "dp"
            batch = sub.samples_per_rank if name == "convnet" else sub.transformer_batch
            if sweep == "weak":
                assert batch == (12 if name == "convnet" else 8)
            elif sweep == "strong":
                assert batch * world == (12 if name == "convnet" else 8) * 4
    assert [(s, n) for s, n, _ in jobs[2] if s == "size"] == [("size", "mlp")]


def test_scaling_cli_writes_json_and_two_pngs(tmp_path, capfd):
    import matplotlib.image

    out, png = tmp_path / "s.json", tmp_path / "s.png"
    code = main(["bench", "--scaling", "--workloads", "convnet", "--world-sizes", "1", "2", "--steps", "2",
                 "--warmup", "1", "--samples-per-rank", "4", "--mlp-sizes", "2e4", "--json", str(out), "--plot",
                 str(png)])
    assert code == 0
    data = json.loads(out.read_text())
    points = data["points"]
    assert sorted((p["sweep"], p["world_size"]) for p in points) == [
        ("size", 2), ("strong", 1), ("strong", 2), ("weak", 1), ("weak", 2)]
    assert all(p["ddpkit_ms"] > 0 and p["torch_ms"] > 0 and p["steps"] == 2 for p in points)
    assert {e["world_size"]: e["ddpkit"] for e in data["efficiency"] if e["sweep"] == "weak"}[1] == 1.0
    assert data["machine_at_start"]["cpu_count"] >= 1 and data["settings"]["scaling"] is True
    for picture in (png, tmp_path / "s-sizes.png"):
        assert matplotlib.image.imread(picture).ndim == 3
    text = capfd.readouterr().out
    assert "eff ddpkit" in text and f"plots: {png}" in text


def test_scaling_report_has_the_table_and_the_plots(tmp_path):
    report = tmp_path / "scaling"
    assert main(["bench", "--scaling", "--workloads", "linear200", "--world-sizes", "1", "2", "--steps", "2",
                 "--warmup", "1", "--mlp-batch", "4", "--mlp-sizes", "2e4", "--report", str(report),
                 "--no-progress"]) == 0
    assert sorted(p.name for p in report.iterdir()) == ["bench.json", "scaling-sizes.png", "scaling.png",
                                                         "summary.md"]
    summary = (report / "summary.md").read_text()
    assert "![scaling](scaling.png)" in summary and "![scaling-sizes](scaling-sizes.png)" in summary
    assert "strong  linear200" in summary and "size    mlp" in summary
