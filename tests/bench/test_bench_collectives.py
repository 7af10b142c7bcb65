"""``ddpkit bench collectives`` end to end at toy sizes: table, JSON with a fit, and the PNG."""

from __future__ import annotations

import json

import pytest

from ddpkit.bench.sections.allreduce_perf import CollectivesBenchConfig
from ddpkit.cli import main


def test_collectives_bench_end_to_end(tmp_path, capsys):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    code = main(["bench", "collectives", "--sizes", "4096", "65536", "--world-sizes", "2", "--iters", "2",
                 "--json", str(out), "--plot", str(png)])
    assert code == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["bytes"], r["algorithm"]) for r in rows} == {(b, a) for b in (4096, 65536) for a in
                                                           ("native", "naive", "ring", "tree", "hierarchical")}
    for r in rows:
        assert r["time_s"] > 0 and r["rounds"] == 2
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])  # 2(p-1)/p = 1 at p = 2
        assert ("model_s" in r) == (r["algorithm"] != "native")
    fit = data["fits"]["2"]
    assert fit["alpha_s"] >= 0 and fit["beta_s_per_byte"] >= 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    said = capsys.readouterr()
    assert "alpha" in said.out and "ddpkit bench collectives: world size 2 (1/1)" in said.err


def test_collectives_bench_config_is_validated():
    with pytest.raises(ValueError, match="--world-sizes 1"):
        CollectivesBenchConfig(world_sizes=(1,))
    with pytest.raises(ValueError, match="--algorithms butterfly"):
        CollectivesBenchConfig(algorithms=("butterfly",))
    assert main(["bench", "collectives", "--iters", "0"]) == 2
    assert main(["bench", "collectives", "--no-progress", "--iters", "0"]) == 2  # taken, as by ddpkit bench
