"""ddpkit train: the loop on a rank pool, resume bit-identity, output safety, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ddpkit
from ddpkit.cli import main
from ddpkit.train.loop import TrainConfig, train, worker

ROOT = Path(__file__).resolve().parents[2]
# Tiny and fast: 192 synthetic images, 6 steps per epoch and rank.
SMALL = dict(dataset="synthetic", synthetic_samples=192, batch_size=16, progress=False)


def _run(cfg: TrainConfig) -> dict:
    # out=None: rank 0 claims the directory and tells the others, the path
    # taken under a launcher.
    return worker(0, cfg, None)


def _train(pool, cfg: TrainConfig) -> dict:
    """Train on every rank of ``pool``; every rank must report the same summary."""
    summaries = pool.run(_run, cfg)
    untimed = [{k: v for k, v in s.items() if "time" not in k and "per_s" not in k} for s in summaries]
    assert all(u == untimed[0] for u in untimed), untimed
    return summaries[0]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def test_resume_is_bit_identical(dist2, tmp_path: Path) -> None:
    whole, part = tmp_path / "whole", tmp_path / "part"
    _train(dist2, TrainConfig(**SMALL, epochs=4, output_dir=whole))
    _train(dist2, TrainConfig(**SMALL, epochs=2, output_dir=part))
    summary = _train(dist2, TrainConfig(**SMALL, epochs=4, output_dir=part, resume=True))
    assert summary["resumed_from_epoch"] == 2 and summary["epochs"] == 4
    a, b = _weights(whole), _weights(part)
    assert sorted(a) == sorted(b) and not any(k.startswith("module.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    lines = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [1, 2, 3, 4]
    def untimed(path: Path) -> list[dict]:
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        return [{k: v for k, v in r.items() if "time" not in k and "per_s" not in k} for r in rows]

    assert untimed(part / "metrics.jsonl") == untimed(whole / "metrics.jsonl")
    # 6 steps per epoch; the 3 newest checkpoints are kept.
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == [
        f"step-000000{i}.safetensors" for i in (12, 18, 24)
    ]


def test_engines_grad_accum_and_bf16_agree(dist2, tmp_path: Path) -> None:
    runs = {}
    for name, extra in {
        "ddpkit": {},
        "torch": {"engine": "torch"},
        # Same global batch per step. An MLP: BatchNorm would see different
        # batches in micro-batches, which is a different model, not a bug.
        "mlp": {"model": "mlp"},
        "accum": {"model": "mlp", "grad_accum": 2, "batch_size": 8},
        "adamw": {"optimizer": "adamw"},
        "adamw-torch": {"optimizer": "adamw", "engine": "torch"},
        "bf16": {"amp": "bf16"},
    }.items():
        cfg = TrainConfig(**{**SMALL, **extra}, epochs=1, output_dir=tmp_path / name)
        runs[name] = _train(dist2, cfg)
    for ref, name in (("ddpkit", "torch"), ("mlp", "accum"), ("adamw", "adamw-torch")):
        a, b = _weights(tmp_path / ref), _weights(tmp_path / name)
        for k in a:
            # Same data, same steps: only the order of float additions differs
            # (per-rank pre-division, micro-batch sums), a few ulps per step.
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=f"{name}: {k}")
    s = runs["accum"]
    assert s["global_batch_size"] == 32 and s["world_size"] == 2 and s["lr"] == pytest.approx(0.04)
    fp32 = _weights(tmp_path / "ddpkit")
    for name in ("adamw", "bf16"):
        # AdamW and bf16 autocast really ran: same start, same data, other weights
        # (bf16 rounds every matmul input to 8 bits of mantissa).
        other = _weights(tmp_path / name)
        assert any(not torch.equal(fp32[k], other[k]) for k in fp32), name
        assert all(torch.isfinite(v).all() for v in other.values()), name
    assert runs["bf16"]["amp"] == "bf16"
    # Evaluation counts each of the 48 test images once, whatever the split.
    assert runs["bf16"]["test_samples"] == 48


def _run_and_reset(cfg: TrainConfig) -> dict:
    try:
        return _run(cfg)
    finally:
        torch.use_deterministic_algorithms(False)  # --deterministic sets it process-wide: the pool's ranks go on


def test_comm_hooks_run_on_both_engines_and_deterministic_changes_no_bits_on_the_cpu(dist2, tmp_path: Path) -> None:
    runs = {
        "fp16": {"comm_hook": "fp16"},
        "fp16-torch": {"comm_hook": "fp16", "engine": "torch", "deterministic": True},
        "powersgd": {"comm_hook": "powersgd", "powersgd_start": 3, "powersgd_rank": 2},
        "powersgd-torch": {"comm_hook": "powersgd", "powersgd_start": 3, "powersgd_rank": 2, "engine": "torch"},
        "plain": {},
    }
    summaries = {name: dist2.run(_run_and_reset, TrainConfig(**{**SMALL, **extra}, model="mlp", epochs=1,
                                                             output_dir=tmp_path / name))[0]
                 for name, extra in runs.items()}
    for ours, theirs in (("fp16", "fp16-torch"), ("powersgd", "powersgd-torch")):
        a, b = _weights(tmp_path / ours), _weights(tmp_path / theirs)
        for k in a:
            # ddpkit's hooks on both engines, one bucket, gloo's sum of two: the same bits.
            assert torch.equal(a[k], b[k]), f"{ours}: {k}"
    plain = _weights(tmp_path / "plain")
    for name in ("fp16", "powersgd"):  # the hooks really reduced otherwise than a plain all-reduce
        assert any(not torch.equal(plain[k], v) for k, v in _weights(tmp_path / name).items()), name
    assert summaries["powersgd"]["test_samples"] == 48


def test_warm_up_ramps_the_rate_per_step_and_resumes_bit_identically_inside_it(dist2, tmp_path: Path) -> None:
    # 6 steps an epoch; the rate climbs from 0.02 to 0.04 over 2 epochs (12 steps), then stays.
    whole, part = tmp_path / "whole", tmp_path / "part"
    _train(dist2, TrainConfig(**SMALL, epochs=3, warmup_epochs=2, output_dir=whole))
    _train(dist2, TrainConfig(**SMALL, epochs=1, warmup_epochs=2, output_dir=part))
    _train(dist2, TrainConfig(**SMALL, epochs=3, warmup_epochs=2, output_dir=part, resume=True))
    a, b = _weights(whole), _weights(part)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    rates = [json.loads(x)["lr"] for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert rates == pytest.approx([0.02 + 0.02 * 5 / 12, 0.02 + 0.02 * 11 / 12, 0.04])  # each epoch's last step
    plain = tmp_path / "plain"  # the same run without warm-up: the optimizer really took the lower rates
    _train(dist2, TrainConfig(**SMALL, epochs=3, output_dir=plain))
    assert any(not torch.equal(v, _weights(plain)[k]) for k, v in a.items())


def test_engine_single_equals_ddp_on_one_process(tmp_path: Path) -> None:
    # In this process, a world of one: DDP over one rank must be the plain module exactly.
    one = dict(SMALL, nproc_per_node=1, epochs=1)
    single = train(TrainConfig(**one, engine="single", output_dir=tmp_path / "single"))
    ddp = train(TrainConfig(**one, engine="ddpkit", output_dir=tmp_path / "ddp"))
    assert single["engine"] == "single" and single["world_size"] == 1 and single["lr"] == pytest.approx(0.02)
    assert ddp["engine"] == "ddpkit" and ddp["world_size"] == 1
    a, b = _weights(tmp_path / "single"), _weights(tmp_path / "ddp")
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_bad_input_is_a_usage_error(tmp_path: Path, capsys) -> None:
    cases = [
        (["--batch-size", "0"], "--batch-size 0 must be at least 1"),
        (["--dataset", "mnist"], "--dataset mnist needs --data-dir: point it at"),
        (["--dataset", "mnist", "--data-dir", str(tmp_path / "none")], "does not exist"),
        (["--dataset", "mnist", "--data-dir", str(tmp_path)], "is empty"),
        (["--engine", "single", "--nproc-per-node", "2"], "does not fit --engine single"),
        (["--output-dir", str(tmp_path), "--resume"], "no checkpoint in checkpoints/"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--amp", "fp16"], "--amp fp16 needs CUDA"))
    for argv, message in cases:
        assert main(["train", *argv]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--model", "vgg"])
    assert "invalid choice: 'vgg'" in capsys.readouterr().err


def test_output_dir_holding_a_run_is_refused(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"epoch": 1}\n')
    assert main(["train", "--output-dir", str(out)]) == 2
    assert "holds another run" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == '{"epoch": 1}\n'
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def test_resume_checks_checkpoint_settings_and_world(dist2, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    _train(dist2, TrainConfig(**SMALL, epochs=1, output_dir=out))
    base = ["train", "--dataset", "synthetic", "--synthetic-samples", "192", "--batch-size", "16",
            "--output-dir", str(out), "--resume", "--epochs", "2"]
    assert main([*base, "--nproc-per-node", "3"]) == 2
    assert "written by 2 processes, this run has 3" in capsys.readouterr().err
    assert main([*base[:-2], "--epochs", "1"]) == 2
    assert "already finished 1 epochs" in capsys.readouterr().err
    assert main([*base, "--lr", "0.5"]) == 2
    assert "lr: 0.02 -> 0.5" in capsys.readouterr().err
    ckpt = out / "checkpoints" / "step-00000006.safetensors"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    with pytest.warns(UserWarning, match="skipping checkpoint .*step-00000006"):
        assert main(base) == 2
    err = capsys.readouterr().err
    assert "step-00000006.safetensors" in err and "truncated" in err


def test_cli_end_to_end_two_processes(tmp_path: Path) -> None:
    # The default data set (digits) on 2 processes is trained by
    # tests/test_examples.py; here the CLI's own workers on tiny data.
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "ddpkit", "train", "--epochs", "1", "--no-progress",
         "--dataset", "synthetic", "--synthetic-samples", "192", "--batch-size", "16",
         "--output-dir", str(out)],
        capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "test accuracy:" in proc.stdout and "lr 0.02 x 2 = 0.04" in proc.stdout
    # The header says how the job runs: what a log read weeks later needs first.
    assert ("engine ddpkit, backend gloo, strategy ddp, on failure: the job stops (--max-restarts 0), "
            "2 process(es)") in proc.stdout, proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    for key in ("test_accuracy", "test_loss", "epochs", "world_size", "global_batch_size", "lr",
                "wall_time_s", "samples_per_s", "engine"):
        assert key in summary
    assert summary["world_size"] == 2 and summary["test_samples"] == 48
    assert (out / "checkpoints" / "step-00000006.safetensors").is_file()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert (out / "curves.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow("a training run under ddpkit launch")
def test_train_under_ddpkit_launch_uses_the_given_ranks(tmp_path: Path) -> None:
    # Inside a launcher `ddpkit train` starts no workers of its own: the two
    # launched processes are the world, whatever --nproc-per-node says.
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "ddpkit", "launch", "--standalone", "--nproc-per-node", "2", "-m", "ddpkit",
         "train", "--dataset", "synthetic", "--synthetic-samples", "192", "--batch-size", "16",
         "--epochs", "1", "--no-progress", "--output-dir", str(out)],
        capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["engine"] == "ddpkit"
    # Unprefixed, as under torchrun: a parser anchored at the line start finds its lines.
    assert any(line.startswith("ddpkit train: ") for line in proc.stdout.splitlines()), proc.stdout
    assert "[rank" not in proc.stdout


def _flip_tensor_bytes(path: Path) -> None:
    """Overwrite bytes in the middle of the tensor data (the header stays readable)."""
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    middle = header + (len(data) - header) // 2
    data[middle : middle + 8] = b"\xff" * 8  # NaN bytes in float32
    path.write_bytes(bytes(data))


def test_resume_mid_epoch_and_past_a_damaged_checkpoint_is_bit_identical(dist2, tmp_path: Path) -> None:
    # 6 steps per epoch, a checkpoint every 4 steps: steps 4 (mid-epoch 1), 6, 8 (mid-epoch 2), 12.
    cfg = dict(SMALL, epochs=2, checkpoint_every=4, keep_checkpoints=10)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    _train(dist2, TrainConfig(**cfg, output_dir=whole))
    _train(dist2, TrainConfig(**cfg, output_dir=cut))
    names = sorted(p.name for p in (cut / "checkpoints").iterdir())
    assert names == [f"step-{s:08d}.safetensors" for s in (4, 6, 8, 12)]
    # As if the run had died right after step 8's save, and step 8's file
    # then rotted on disk: resume must skip it (warning) and go back to step 6.
    for name in ("model.safetensors", "summary.json"):
        (cut / name).unlink()
    (cut / "checkpoints" / "step-00000012.safetensors").unlink()
    _flip_tensor_bytes(cut / "checkpoints" / "step-00000008.safetensors")
    with pytest.raises(ddpkit.CheckpointError, match="does not match its checksum"):
        ddpkit.load_checkpoint(cut / "checkpoints" / "step-00000008.safetensors")
    summaries = dist2.run(_run, TrainConfig(**cfg, output_dir=cut, resume=True))
    assert summaries[0]["resumed_from_epoch"] == 1
    a, b = _weights(whole), _weights(cut)
    for k in a:
        assert torch.equal(a[k], b[k]), k

    # And from the mid-epoch checkpoint at step 4 (epoch 1 resumed half-way).
    for p in (cut / "checkpoints").iterdir():
        if p.name != "step-00000004.safetensors":
            p.unlink()
    (cut / "model.safetensors").unlink()
    summary = dist2.run(_run, TrainConfig(**cfg, output_dir=cut, resume=True))[0]
    assert summary["resumed_from_epoch"] == 0 and summary["steps"] == 12
    b = _weights(cut)
    for k in a:
        assert torch.equal(a[k], b[k]), k

    def untimed(path: Path) -> list[dict]:
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        return [{k: v for k, v in r.items() if "time" not in k and "per_s" not in k} for r in rows]

    # The epoch's loss is exact too: each rank's partial sums were saved.
    assert untimed(cut / "metrics.jsonl") == untimed(whole / "metrics.jsonl")


def test_synthetic_data_is_learnable_with_and_without_sync_bn(dist2, tmp_path: Path) -> None:
    # Ten classes: chance is 10 %. Two small epochs of the ConvNet must be far above it,
    # with BatchNorm per rank and with SyncBatchNorm over the global batch.
    cfg = dict(SMALL, synthetic_samples=512, epochs=2)
    plain = _train(dist2, TrainConfig(**cfg, output_dir=tmp_path / "plain"))
    synced = _train(dist2, TrainConfig(**cfg, sync_bn=True, output_dir=tmp_path / "sync"))
    assert plain["test_accuracy"] > 0.6 and synced["test_accuracy"] > 0.6, (plain, synced)
    a, b = _weights(tmp_path / "plain"), _weights(tmp_path / "sync")
    assert sorted(a) == sorted(b)  # same names: the checkpoint loads into the plain model
    stats = next(k for k in a if k.endswith("running_var"))
    assert not torch.equal(a[stats], b[stats])  # global-batch statistics differ from rank 0's own


def test_engine_dp_trains_in_one_process_with_cpu_replicas(tmp_path: Path) -> None:
    # Two CPU replicas in threads, 16 samples each: the global batch and the
    # scaled learning rate of the 2-process DDP default.
    cfg = dict(SMALL, synthetic_samples=512, epochs=2, engine="dp", nproc_per_node=2)
    summary = train(TrainConfig(**cfg, output_dir=tmp_path / "dp"))
    assert summary["engine"] == "dp" and summary["world_size"] == 1 and summary["replicas"] == 2
    assert summary["global_batch_size"] == 32 and summary["lr"] == pytest.approx(0.04)
    assert summary["test_accuracy"] > 0.6, summary
    assert not any(k.startswith("module.") for k in _weights(tmp_path / "dp"))


def test_trace_records_the_first_steps_of_every_rank(tmp_path: Path) -> None:
    trace = tmp_path / "train.json"
    base = ["train", "--dataset", "synthetic", "--synthetic-samples", "192", "--batch-size", "16", "--epochs", "1",
            "--no-progress", "--output-dir", str(tmp_path / "run"), "--trace", str(trace), "--trace-steps", "2"]
    assert main(base) == 0
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        names = [(e["tid"], e["name"]) for e in spans if e["pid"] == rank]
        for phase in ("data", "forward", "backward", "optimizer"):
            assert names.count(("ddpkit step", phase)) == 2  # only the traced steps, of 6
        assert names.count(("ddpkit gradients", "computing gradients")) == 2
        assert names.count(("ddpkit wait", "wait for buckets")) == 2
        assert names.count(("ddpkit bucket 0", "all-reduce bucket 0")) == 2
    assert main([*base[:-4], "--output-dir", str(tmp_path / "x"), "--trace", str(tmp_path / "no" / "t.json")]) == 2


def test_strategies_optimizer_equals_ddp_and_local_sgd_resumes_exactly(dist2, tmp_path: Path) -> None:
    # An MLP (no BatchNorm, whose statistics DDP broadcasts and the optimizer leaves local).
    mlp = dict(SMALL, model="mlp", grad_accum=2, batch_size=8)
    ddp = _train(dist2, TrainConfig(**mlp, epochs=1, output_dir=tmp_path / "ddp"))
    hvd = _train(dist2, TrainConfig(**mlp, epochs=1, strategy="optimizer", output_dir=tmp_path / "hvd"))
    assert ddp["strategy"] == "ddp" and hvd["strategy"] == "optimizer"
    a, b = _weights(tmp_path / "ddp"), _weights(tmp_path / "hvd")
    for k in a:
        assert torch.equal(a[k], b[k]), f"optimizer strategy: {k}"  # the same averages, the same steps
    # Local SGD: 6 steps per epoch, averaged after steps 2, 5 (period 3, warm-up 2), and at every
    # checkpoint (each epoch end here) so that a resumed run continues from the same model.
    local = dict(SMALL, local_sgd=3, local_sgd_warmup=2)
    whole = _train(dist2, TrainConfig(**local, epochs=2, output_dir=tmp_path / "local"))
    assert whole["strategy"] == "local-sgd" and whole["local_sgd_period"] == 3
    assert whole["parameter_averages"] == 2 + 1 + 2 + 1  # epoch 1: steps 2, 5, end; epoch 2: steps 8, 11, end
    _train(dist2, TrainConfig(**local, epochs=1, output_dir=tmp_path / "cut"))
    _train(dist2, TrainConfig(**local, epochs=2, output_dir=tmp_path / "cut", resume=True))
    a, b = _weights(tmp_path / "local"), _weights(tmp_path / "cut")
    for k in a:
        assert torch.equal(a[k], b[k]), f"local SGD resumed: {k}"
    assert all(torch.isfinite(v).all() for v in a.values())


def test_the_curves_are_drawn_from_the_history_and_a_failure_only_warns(tmp_path: Path, capsys) -> None:
    from PIL import Image

    from ddpkit.train.curves import write_curves

    history = [{"epoch": e, "train_loss": 2.0 / e, "test_loss": 1.0 / e, "test_accuracy": 0.8 + 0.05 * e,
                "world_size": 4 if e < 3 else 3} for e in (1, 2, 3)]
    path = write_curves(tmp_path, history)
    assert path == tmp_path / "curves.png" and Image.open(path).size == (810, 324)
    assert write_curves(tmp_path, []) is None
    (tmp_path / "a-file").write_text("")
    assert write_curves(tmp_path / "a-file", history) is None  # cannot be written: a warning, not a failure
    assert "could not draw" in capsys.readouterr().err


def test_diloco_trains_checkpoints_change_nothing_and_a_resume_mid_exchange_is_exact(dist2, tmp_path: Path) -> None:
    # 6 steps an epoch; H = 4 in two fragments (after steps 2 and 4, then every 4), each exchange applied a step
    # later and mixed half and half, the pseudo-gradients in int8. A checkpoint at step 4 has fragment 1's
    # exchange in flight and every rank's own parameters and AdamW state in it.
    cfg = dict(SMALL, model="mlp", optimizer="adamw", lr=0.002, sync_every=4, fragments=2, fragment_delay=1,
               fragment_mixing=0.5, outer_codec="int8")
    quiet = _train(dist2, TrainConfig(**cfg, epochs=2, checkpoint_every=0, output_dir=tmp_path / "quiet"))
    # Fragment 0 begins after steps 2, 6, 10 (applied a step later), fragment 1 after 4, 8, 12; at the end fragment
    # 1's last exchange is applied and a last outer step of both takes their steps since in.
    assert quiet["strategy"] == "diloco" and quiet["outer_syncs"] == 8
    assert quiet["outer_bytes_sent"][0] == quiet["outer_bytes_sent"][1] > 0
    _train(dist2, TrainConfig(**cfg, epochs=2, checkpoint_every=4, output_dir=tmp_path / "busy"))
    a, b = _weights(tmp_path / "quiet"), _weights(tmp_path / "busy")
    for k in a:
        assert torch.equal(a[k], b[k]), f"a checkpoint changed training: {k}"
    cut = tmp_path / "cut"
    _train(dist2, TrainConfig(**cfg, epochs=1, checkpoint_every=4, output_dir=cut))
    newest = sorted((cut / "checkpoints").glob("step-*.safetensors"))[-1]
    assert newest.name == "step-00000006.safetensors"
    newest.unlink()  # resume from step 4: mid-epoch, an exchange in flight
    _train(dist2, TrainConfig(**cfg, epochs=2, checkpoint_every=4, output_dir=cut, resume=True))
    c = _weights(cut)
    for k in a:
        assert torch.equal(a[k], c[k]), f"DiLoCo resumed: {k}"
    assert quiet["test_accuracy"] > 0.3, quiet
    # Resumed after the last epoch's checkpoint (the final weights lost): nothing to train, the same global model.
    (tmp_path / "quiet" / "model.safetensors").unlink()
    (tmp_path / "quiet" / "summary.json").unlink()
    _train(dist2, TrainConfig(**cfg, epochs=2, checkpoint_every=0, output_dir=tmp_path / "quiet", resume=True))
    again = _weights(tmp_path / "quiet")
    for k in a:
        assert torch.equal(a[k], again[k]), f"the final weights written again: {k}"


SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare"


@pytest.mark.skipif(not SHAKESPEARE.is_dir(), reason="needs ../shared/data/tinyshakespeare")
def test_the_gpt_learns_tiny_shakespeare_under_ddp_and_diloco(dist2, tmp_path: Path) -> None:
    # 512 samples of 64 characters, 16 steps; the loss per character starts at ln 65 = 4.17.
    cfg = dict(model="gpt", dataset="shakespeare", data_dir=SHAKESPEARE, train_samples=512, test_samples=32,
               batch_size=16, optimizer="adamw", lr=0.001, epochs=1, progress=False)
    ddp = _train(dist2, TrainConfig(**cfg, output_dir=tmp_path / "ddp"))
    diloco = _train(dist2, TrainConfig(**cfg, sync_every=4, output_dir=tmp_path / "diloco"))
    assert ddp["test_samples"] == diloco["test_samples"] == 32 * 64  # the symbols predicted
    assert ddp["test_loss"] < 3.6 and diloco["test_loss"] < 3.9, (ddp, diloco)
    assert diloco["outer_syncs"] == 4 and "tokens.weight" in _weights(tmp_path / "diloco")
    # DDP's rate is scaled by the world (2), DiLoCo's inner one is --lr itself: each worker steps on its own batch
    assert ddp["lr"] == 0.002 and diloco["lr"] == 0.001, (ddp["lr"], diloco["lr"])


def test_the_steps_left_to_a_run_count_the_rest_of_a_resharded_epoch_then_whole_ones():  # and an epoch's steps
    # what --comm-hook auto's trials are bounded by: 1,000 samples, batch 32, 3 epochs
    from ddpkit.train.recipe import steps_left, whole_epoch_steps

    config = TrainConfig(batch_size=32, epochs=3)
    data = list(range(1000))
    fresh = ddpkit.DistributedSampler(data, num_replicas=2, rank=0)
    assert steps_left(config, fresh, 0, mid_epoch=False) == 16 * 3  # 500 samples a rank: 16 steps an epoch
    saved = fresh.state_dict(consumed=160)  # 5 steps into epoch 0 at world 2 ...
    saved["epoch"] = 1
    resumed = ddpkit.DistributedSampler(data, num_replicas=4, rank=0)
    resumed.load_state_dict(saved)  # ... of epoch 1, resumed at world 4: 680 samples left, 170 a rank
    assert steps_left(config, resumed, 1, mid_epoch=True) == 6 + 8  # the rest (6 steps), then an epoch of 250 a rank
    # an epoch's steps (the warm-up's unit, Run.steps_per_epoch) stay a whole epoch's at this world, not the rest's
    assert whole_epoch_steps(config, resumed) == 8 and resumed.num_samples == 170
    assert steps_left(config, resumed, 2, mid_epoch=True) == 6  # the last epoch's rest alone
    # resumed at an epoch's start, the sampler still holding the offset of the re-sharded epoch before: whole epochs
    assert steps_left(config, resumed, 2, mid_epoch=False) == 8
    assert steps_left(config, resumed, 3, mid_epoch=False) == 0  # past the last epoch: none
    assert steps_left(TrainConfig(batch_size=32, epochs=3, grad_accum=2), fresh, 0, mid_epoch=False) == 8 * 3
