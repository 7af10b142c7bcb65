"""``ddpkit train --strategy ps-sync|ps-async|ssp``: the servers started and torn down with the run, their state in
the checkpoints, a killed server restarted from the last checkpoint, and the digits trained to the bar."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from procs import base_env, children, wait_for
from safetensors.torch import load_file
from shared_runs import SYNTHETIC_RUN

from ddpkit.runtime.options import ConfigError
from ddpkit.train.checkpoint import load_checkpoint
from ddpkit.train.loop import train
from ddpkit.train.restart import check_servers
from ddpkit.train.state import checkpoint_files
from ddpkit.train.strategy import async_momentum
from ddpkit.train.train_config import TrainConfig

# 384 images per rank, 24 steps per epoch, a checkpoint every 5 steps (as tests/train/test_restart.py).
FLAGS = ["--dataset", "synthetic", "--synthetic-samples", "768", "--batch-size", "16", "--epochs", "2",
         "--checkpoint-every", "5", "--no-progress"]
CONFIG = dict(dataset="synthetic", synthetic_samples=768, batch_size=16, epochs=2, checkpoint_every=5,
              progress=False, nproc_per_node=2)


@pytest.fixture(scope="module")
def ddp_run(synthetic_run) -> Path:
    # The session's run of this job on a rank pool (tests/conftest.py): the same bits as ``ddpkit train``'s own
    # two workers (test_restart.py compares its restarted runs of ddpkit train with it).
    assert {**SYNTHETIC_RUN, "nproc_per_node": 2} == CONFIG
    return synthetic_run


def _same_weights(a: Path, b: Path) -> None:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(x) == sorted(y)
    for k in x:
        assert torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("servers", [1, 2])
def test_ps_sync_trains_ddps_weights_and_checkpoints_the_servers_state(tmp_path: Path, ddp_run: Path,
                                                                       servers: int) -> None:
    out = tmp_path / "run"
    summary = train(TrainConfig(**CONFIG, strategy="ps-sync", num_servers=servers, output_dir=out))
    _same_weights(out, ddp_run)  # two workers: the servers' sum is gloo's, bit for bit
    assert summary["num_servers"] == servers and len(summary["per_rank"]) == 2
    assert all(r["staleness_max"] == 0 and r["steps"] == 48 for r in summary["per_rank"])
    # The last checkpoint holds the servers' optimizer state, in the local optimizer's format: DDP's, exactly.
    mine = load_checkpoint(checkpoint_files(out / "checkpoints")[-1][1])["optimizer"]
    theirs = load_checkpoint(checkpoint_files(ddp_run / "checkpoints")[-1][1])["optimizer"]
    assert sorted(mine["state"]) == sorted(theirs["state"]) == list(range(10))  # every ConvNet tensor
    for i in theirs["state"]:
        assert torch.equal(mine["state"][i]["momentum_buffer"], theirs["state"][i]["momentum_buffer"])
    assert mine["param_groups"] == theirs["param_groups"]


def _digits(tmp_path: Path, strategy: str, **kw) -> dict:
    return train(TrainConfig(strategy=strategy, output_dir=tmp_path / strategy, progress=False, **kw))


@pytest.mark.slow("whole training runs of the asynchronous strategies")
@pytest.mark.parametrize("strategy, staleness", [("ps-async", None), ("ssp", None)])
def test_async_strategies_train_the_digits_to_97_percent_in_the_default_epochs(tmp_path: Path, strategy: str,
                                                                               staleness: int | None) -> None:
    summary = _digits(tmp_path, strategy, staleness=staleness)
    assert summary["test_accuracy"] >= 0.97, summary
    seen = summary["per_rank"]
    assert len(seen) == 2 and all(r["staleness_max"] >= 1 for r in seen), seen  # really asynchronous
    if strategy == "ssp":
        assert summary["staleness"] == 2 and all(r["staleness_max"] <= 2 for r in seen)
    saved = json.loads((tmp_path / strategy / "summary.json").read_text())
    assert saved["per_rank"] == seen and len(saved["wait_s"]) == 2


def test_a_straggler_under_ps_async_with_a_bound_holds_the_fast_worker(tmp_path: Path) -> None:
    summary = train(TrainConfig(**{**CONFIG, "epochs": 1}, strategy="ps-async", staleness=1, straggler="1:4",
                                output_dir=tmp_path / "run"))
    fast, slow = summary["per_rank"]
    assert fast["max_lead"] == 1 and slow["max_lead"] <= 1
    assert fast["bound_wait_s"] > slow["bound_wait_s"]


def _server_pid(parent: int) -> int:
    """The parameter server of ``ddpkit train`` (``parent``): its forkserver's child named ``ddpkit-server0``."""
    forkservers = [pid for pid, line in children(parent) if "forkserver import main" in line]
    for pid in (pid for server in forkservers for pid, _ in children(server)):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "ddpkit-server0":
                return pid
        except OSError:
            continue
    raise AssertionError("ddpkit train started no process named ddpkit-server0")


def _kill_and_finish(cmd: list[str], out: Path, find) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=out.parent)
    try:
        wait_for(lambda: (out / "checkpoints" / f"step-{10:08d}.safetensors").is_file())
        os.kill(find(proc.pid), signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.slow("a run whose server is killed, and its restart")
def test_a_killed_server_under_ddpkit_train_restarts_from_the_checkpoint_bit_identical(tmp_path: Path,
                                                                                       ddp_run: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ddpkit", "train", *FLAGS, "--strategy", "ps-sync", "--max-restarts", "1",
           "--output-dir", str(out)]
    done = _kill_and_finish(cmd, out, _server_pid)
    assert done.returncode == 0, done.stderr
    assert "ddpkit train: parameter server 0 failed; restarting the workers (restart 1 of 1)" in done.stdout
    assert "restart 1: resuming from" in done.stdout
    _same_weights(out, ddp_run)


@pytest.mark.slow("a run whose server is killed, its restart, and the DDP reference (a fixture) to compare with")
def test_a_killed_server_under_ddpkit_launch_is_the_root_cause_and_the_relaunch_is_bit_identical(
        tmp_path: Path, ddp_run: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ddpkit", "launch", "--standalone", "--nproc-per-node", "2", "--num-servers", "1",
           "--max-restarts", "1", "-m", "ddpkit", "train", *FLAGS, "--strategy", "ps-sync",
           "--output-dir", str(out)]

    def server(pid: int) -> int:
        return next(child for child, line in children(pid) if "ddpkit.parallel.ps.server" in line)

    done = _kill_and_finish(cmd, out, server)
    assert done.returncode == 0, done.stderr
    assert "parameter server 0 failed first" in done.stderr
    assert "restarting the worker group (restart 1 of 1)" in done.stderr
    _same_weights(out, ddp_run)


def test_under_a_launcher_without_servers_the_error_says_how_to_start_them() -> None:
    config = TrainConfig(strategy="ps-sync", num_servers=2)
    with pytest.raises(ConfigError, match="ddpkit launch --num-servers 2"):
        check_servers(config, {})
    with pytest.raises(ConfigError, match="--num-servers 2 but the launcher started 1"):
        check_servers(config, {"DDPKIT_NUM_SERVERS": "1"})
    check_servers(config, {"DDPKIT_NUM_SERVERS": "2"})
    check_servers(TrainConfig(), {})
    # Under --on-failure continue (ddpkit train's workers of the mode check it too): the copies of each key range.
    replicated = TrainConfig(strategy="ps-async", num_servers=2, ps_replication=2, on_failure="continue")
    with pytest.raises(ConfigError, match=r"--ps-replication 2 but the launcher keeps each key range on 1 server"):
        check_servers(replicated, {"DDPKIT_NUM_SERVERS": "2"})
    check_servers(replicated, {"DDPKIT_NUM_SERVERS": "2", "DDPKIT_PS_REPLICATION": "2"})


@pytest.mark.parametrize("kwargs, message", [
    ({"staleness": 2}, "--staleness 2 bounds --strategy ps-async or ssp, not --strategy ddp"),
    ({"strategy": "ps-async", "staleness": -1}, "--staleness -1 must be 0"),
    ({"num_servers": 2}, "--num-servers 2 needs --strategy ps-sync or ps-async"),
    ({"strategy": "ps-sync", "num_servers": 0}, "--num-servers 0 must be at least 1"),
    ({"strategy": "ssp", "amp": "fp16"}, "--amp 'fp16' does not fit --strategy ssp"),
    ({"straggler": "1"}, "--straggler '1' is not RANK:FACTOR"),
    ({"straggler": "1:0.5"}, "--straggler '1:0.5' is not RANK:FACTOR"),
    ({"strategy": "ps-sync", "zero": 1}, "--zero 1 needs --engine ddpkit --strategy ddp"),
    ({"strategy": "ssp", "trace": "t.json"}, "--strategy ssp has none: drop --trace"),
])
def test_bad_consistency_settings_name_the_flag(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs)


def test_ssp_defaults_its_bound_and_async_momentum_leaves_what_asynchrony_adds() -> None:
    assert TrainConfig(strategy="ssp").staleness == 2
    assert TrainConfig(strategy="ps-async").staleness is None
    assert async_momentum(0.9, 2) == pytest.approx(0.4)
    assert async_momentum(0.9, 4) == pytest.approx(0.15)
    assert async_momentum(0.5, 4) == 0.0
    assert async_momentum(0.9, 1) == pytest.approx(0.9)


def test_a_straggler_rank_beyond_the_world_is_refused_alike_by_train_and_the_bench(capsys, tmp_path: Path) -> None:
    from ddpkit.cli import main

    assert main(["train", "--strategy", "ps-async", "--straggler", "5:3", "--nproc-per-node", "2",
                 "--output-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == ("ddpkit train: error: --straggler 5:3: rank 5 does not exist at world "
                                               "size 2: choose a rank in 0..1")
    assert not (tmp_path / "run").exists()  # refused before the run directory was claimed
    assert main(["bench", "strategies", "--straggler", "9:2", "--world-sizes", "2", "4"]) == 2
    assert capsys.readouterr().err.strip() == ("ddpkit bench: error: --straggler 9:2: rank 9 does not exist at world "
                                               "size 2: choose a rank in 0..1")
    TrainConfig(straggler="3:2").check_world(4)  # a rank that exists


def test_bench_strategies_warms_the_larger_worlds_up_says_so_and_takes_no_progress(capsys) -> None:
    from ddpkit.bench.sections.strategies import (
        ConsistencyBenchConfig,
        RunResult,
        format_runs,
    )
    from ddpkit.cli import main

    cfg = ConsistencyBenchConfig(world_sizes=(2, 4, 8))
    assert [cfg.warmup_at(w) for w in (2, 4, 8)] == [0.0, 2.0, 4.0]
    assert cfg.train_config("ddp", 4, Path("x")).warmup_epochs == 2.0
    assert cfg.train_config("diloco", 4, Path("x")).warmup_epochs == 0.0  # its inner rate is not scaled
    assert ConsistencyBenchConfig(epochs=4, world_sizes=(8,)).warmup_at(8) == 2.0  # at most half the epochs
    assert ConsistencyBenchConfig(warmup_epochs=1.5).warmup_at(2) == 1.5
    row = RunResult(strategy="ddp", world_size=4, epoch_s=1.0, epoch_iqr=(1.0, 1.0), time_to_target_s=None,
                    final_accuracy=0.99, mb_per_step=0.1, wait_ms_per_step=1.0, max_wait_ms_per_step=1.0,
                    staleness_mean=None, staleness_max=None, max_lead=None, steps=96, warmup_epochs=2.0)
    table = format_runs([row], cfg)
    assert ("learning rates (the same for every strategy of a world size): world 4: lr 0.02 x 4 = 0.08, reached "
            "over 2 epochs of warm-up") in " ".join(table.split())
    assert max(map(len, table.splitlines())) <= 100
    assert main(["bench", "strategies", "--no-progress", "--epochs", "0"]) == 2  # the flag is taken
    assert "--repeats 1 and --epochs 0" in capsys.readouterr().err
