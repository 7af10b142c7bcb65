"""``ddpkit bench failures`` end to end at the smallest size: one job, two workers, both modes with and without a
fault, and the table and JSON it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpkit.bench.sections.failure_cost import FailuresBenchConfig, format_rows
from ddpkit.cli import main

MNIST = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mnist"


@pytest.mark.slow("four ddpkit train runs of two workers, two with a worker killed (about 30 s)")
@pytest.mark.alone("the kill is timed from the unfaulted run's pace: beside other tests the faulted run ended first "
                   "(a clean clone's run of 2026-11-29)")
@pytest.mark.skipif(not MNIST.is_dir(), reason="needs ../shared/data/mnist")
def test_failures_bench_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "f.json"
    code = main(["bench", "failures", "--data-dir", str(MNIST), "--jobs", "mnist", "--world-sizes", "2", "--epochs",
                 "2", "--json", str(out)])
    assert code == 0
    restart, survive = json.loads(out.read_text())["rows"]
    assert (restart["mode"], survive["mode"]) == ("restart", "continue")
    for row in (restart, survive):
        assert row["every_sample_once"] and row["bitwise"], row  # both modes end with the uninterrupted run's bits
        assert row["detect_s"] is not None and 0 <= row["detect_s"] < 30, row
        assert row["wall_lost_s"] is not None and row["epoch_s"] > 0
    assert survive["steps_lost"] == 0 and survive["next_step_s"] >= survive["detect_s"]
    assert survive["step_ratio"] > 0 and restart["step_ratio"] is None
    said = capsys.readouterr()
    assert "| mnist | 2 | continue |" in said.out and "one worker killed" in said.err


def test_failures_bench_config_is_validated() -> None:
    assert main(["bench", "failures", "--data-dir", ".", "--kill-at", "2"]) == 2  # a usage error, from the command
    with pytest.raises(ValueError, match="give --data-dir"):
        FailuresBenchConfig()
    with pytest.raises(ValueError, match="--jobs big: not a job"):
        FailuresBenchConfig(jobs=("big",), data_dir=Path("."))
    with pytest.raises(ValueError, match="at least 2 workers"):
        FailuresBenchConfig(world_sizes=(1,), data_dir=Path("."))
    with pytest.raises(ValueError, match="--repeats 0"):
        FailuresBenchConfig(repeats=0, data_dir=Path("."))
    with pytest.raises(ValueError, match="--kill-at 1.5"):
        FailuresBenchConfig(kill_at=1.5, data_dir=Path("."))


def test_the_table_has_a_row_per_mode() -> None:
    row = {"job": "mnist", "world_size": 2, "mode": "continue", "detect_s": 0.01, "next_step_s": 0.05,
           "joined_s": None, "steps_lost": 0.0, "wall_lost_s": 1.0, "cpu_lost_s": 2.0, "every_sample_once": True,
           "bitwise": True, "epoch_s": 1.4, "step_ratio": 1.01, "notes": []}
    lines = format_rows([row, {**row, "mode": "restart", "notes": ["a note"], "step_ratio": None}]).splitlines()
    assert max(map(len, lines)) <= 100  # two tables, then the notes
    first, second = lines[:4], lines[5:9]
    for table in (first, second):
        assert len({line.count("|") for line in table}) == 1 and table[1].startswith("| --- |")
    assert first[2] == "| mnist | 2 | continue | 0.01 | 0.05 | - | 0.0 |"
    assert second[2] == "| mnist | 2 | continue | 1.0 | 2.0 | True | True | 1.40 | 1.010 |"
    assert second[3].endswith("| 1.40 | - |") and "mnist, 2 workers, restart: a note" in lines
