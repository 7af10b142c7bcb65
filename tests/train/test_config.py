"""TrainConfig stays torch-free and in step with the model and dataset registries."""

import subprocess
import sys

import pytest

from ddpkit import models
from ddpkit.data import datasets as data
from ddpkit.runtime.options import ConfigError
from ddpkit.train.train_config import DATASETS, MODELS, TEXT_MODELS, TrainConfig


def test_names_match_the_registries():
    assert set(MODELS) == set(models.MODELS)
    assert set(TEXT_MODELS) == set(models.registry.LANGUAGE_MODELS)
    assert set(DATASETS) == set(data.DATASETS)


def test_building_the_cli_does_not_import_torch():
    code = "import sys; from ddpkit.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("kwargs, message", [
    ({"model": "vgg"}, "--model 'vgg' is not a model"),
    ({"dataset": "cifar"}, "--dataset 'cifar' is not a dataset"),
    ({"batch_size": 0}, "--batch-size 0 must be at least 1"),
    ({"strategy": "gossip"}, "--strategy 'gossip' is not a strategy"),
    ({"strategy": "optimizer", "engine": "torch"}, "--strategy 'optimizer' needs --engine ddpkit"),
    ({"local_sgd": 0}, "--local-sgd 0 must be at least 1"),
    ({"local_sgd": 4, "strategy": "optimizer"}, "--local-sgd 4 does not fit --strategy optimizer"),
    ({"local_sgd_warmup": -1}, "--local-sgd-warmup -1 must be 0 or more"),
    ({"zero": 4}, "--zero 4 is not a ZeRO stage: choose 0, 1, 2 or 3"),
    ({"comm_hook": "fp16", "zero": 3}, "--comm-hook 'fp16' does not fit --zero 3"),
    ({"zero": 1, "engine": "torch"}, "--zero 1 needs --engine ddpkit --strategy ddp"),
    ({"zero": 2, "strategy": "local-sgd"}, "--zero 2 needs --engine ddpkit --strategy ddp"),
    ({"zero": 2, "amp": "fp16"}, "--zero 2 does not fit --amp fp16"),
    ({"comm_hook": "gzip"}, "--comm-hook 'gzip' is not a comm hook: choose one of none, fp16, bf16, powersgd"),
    ({"comm_hook": "fp16", "strategy": "ssp"}, "--comm-hook 'fp16' reduces DDP's buckets: it needs --strategy ddp"),
    ({"comm_hook": "powersgd", "engine": "single"}, "--comm-hook 'powersgd' reduces DDP's buckets"),
    ({"comm_hook": "bf16", "zero": 2}, "--comm-hook 'bf16' does not fit --zero 2"),
    ({"powersgd_rank": 0}, "--powersgd-rank 0 must be at least 1"),
    ({"powersgd_start": 1}, "--powersgd-start 1 must be at least 2"),
    ({"tensorboard": "/dev/null"}, "--tensorboard '/dev/null' is a file"),
    # A flag of one mode given outside it is refused, not ignored.
    ({"local_sgd_warmup": 2, "strategy": "diloco"}, "--local-sgd-warmup 2 sets local SGD's synchronous start: it "
                                                    "needs --strategy local-sgd"),
    ({"powersgd_rank": 4, "comm_hook": "fp16"}, "--powersgd-rank 4 sets PowerSGD's hook: it needs --comm-hook "
                                                "powersgd, not --comm-hook fp16"),
    ({"powersgd_start": 3, "comm_hook": "auto"}, r"not --comm-hook auto \(auto tries ranks 16 and 32"),
    ({"momentum": 0.5, "optimizer": "adamw"}, "--momentum 0.5 is SGD's: --optimizer adamw has none"),
    ({"sync_bn": True, "engine": "dp"}, "--sync-bn does not fit --engine dp"),
    # Each refusal of --on-failure continue says why, and a switch is named without its value.
    ({"sync_bn": True, "on_failure": "continue"}, "^--sync-bn does not fit --on-failure continue: SyncBatchNorm "
                                                  "all-gathers each forward.s batch statistics"),
    ({"sync_bn": True, "on_failure": "continue", "strategy": "diloco"}, r"drop --sync-bn \(BatchNorm then keeps each "
                                                                       "worker's own statistics"),
    ({"on_failure": "continue", "straggler": "1:2"}, "--straggler .1:2. does not fit --on-failure continue: it "
                                                     "slows a rank, and the mode's ranks change with each death"),
])
def test_bad_values_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


def test_local_sgd_implies_its_strategy():
    assert TrainConfig(local_sgd=8).strategy == "local-sgd"
    assert TrainConfig(strategy="local-sgd").local_sgd == 4


def test_backend_is_checked_before_any_worker_starts(capsys, monkeypatch, tmp_path) -> None:
    import torch

    from ddpkit.cli import main
    from ddpkit.comm.mpi import MPIBackend
    from ddpkit.runtime.options import ConfigError

    with pytest.raises(ConfigError, match="--backend 'ucc' is not a backend"):
        TrainConfig(backend="ucc")
    out = ["--output-dir", str(tmp_path / "run")]
    if not torch.cuda.is_available():
        assert main(["train", "--backend", "nccl", *out]) == 2
        assert "backend 'nccl' needs CUDA" in capsys.readouterr().err
    # mpi4py missing (as where the extra was not installed): said before any worker starts, with the fix.
    monkeypatch.setattr(MPIBackend, "unavailable", lambda self: "backend 'mpi' needs mpi4py, which is not installed: "
                        "pip install 'ddpkit[mpi]'")
    assert main(["train", "--backend", "mpi", *out]) == 2
    assert "pip install 'ddpkit[mpi]'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_launcher_that_cannot_run_the_backend_is_one_line_not_a_traceback(tmp_path) -> None:
    # torchrun's variables and --backend mpi: MPI did not start the process, so no communicator can form.
    import subprocess
    import sys

    from procs import base_env

    done = subprocess.run([sys.executable, "-m", "ddpkit", "train", "--backend", "mpi", "--output-dir",
                           str(tmp_path / "run"), "--epochs", "1"], capture_output=True, text=True, timeout=120,
                          env=base_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT="1"))
    if "needs mpi4py" in done.stderr:
        pytest.skip("mpi4py is not installed (bash scripts/setup.sh installs it)")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "ddpkit train: error: backend 'mpi' needs MPI's launcher" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_run_saved_before_a_setting_existed_resumes_at_its_default():
    from ddpkit.train.rundir import _differences

    now = TrainConfig().to_dict()
    older = {k: v for k, v in now.items() if k not in ("strategy", "local_sgd", "local_sgd_warmup")}
    assert _differences(older, now) == []
    assert _differences(older, TrainConfig(local_sgd=4).to_dict()) == ["local_sgd", "strategy"]


def test_a_run_saved_with_a_setting_that_changed_nothing_resumes_without_it(tmp_path):
    # Accepted and ignored until 2026-12-01, refused since: such a run resumes with the flags that are taken now.
    from ddpkit.train.rundir import _differences

    adamw = TrainConfig(optimizer="adamw").to_dict()
    assert _differences({**adamw, "momentum": 0.5, "powersgd_rank": 4, "local_sgd_warmup": 3}, adamw) == []
    dp = TrainConfig(engine="dp").to_dict()
    assert _differences({**dp, "sync_bn": True}, dp) == []
    sgd = TrainConfig().to_dict()
    assert _differences({**sgd, "momentum": 0.5}, sgd) == ["momentum"]  # where it did change the run: compared
    # ddpkit train --resume --output-dir DIR alone starts from DIR/config.json: taken without the inert setting.
    import json

    from ddpkit.cli import _saved_settings, build_parser

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**adamw, "momentum": 0.5, "output_dir": str(run)}, default=str))
    args = build_parser().parse_args(["train", "--resume", "--output-dir", str(run)])
    saved = _saved_settings(args, TrainConfig)
    assert "momentum" not in saved and TrainConfig(**saved).optimizer == "adamw"


def test_diloco_steps_its_inner_optimizer_at_lr_itself_where_the_others_scale_it_and_refuses_a_warm_up() -> None:
    from ddpkit.train.recipe import lr_scale

    assert lr_scale(TrainConfig(strategy="diloco"), 4) == 1
    others = ("ddp", "optimizer", "local-sgd", "ssp", "ps-sync")
    assert [lr_scale(TrainConfig(strategy=s), 4) for s in others] == [4] * len(others)
    with pytest.raises(ConfigError, match=r"--warmup-epochs 0.5 does not fit --strategy diloco: its inner rate is "
                                          r"--lr itself"):
        TrainConfig(strategy="diloco", warmup_epochs=0.5)
    assert TrainConfig(sync_every=8, warmup_epochs=0).warmup_for(1) == 0  # none, said: allowed


def test_the_default_warm_up_follows_how_many_times_the_rate_is_scaled_and_a_given_one_wins() -> None:
    default = TrainConfig()
    assert [default.warmup_for(scale) for scale in (1, 2, 3, 4, 8)] == [0, 0, 1.5, 2, 4]
    assert TrainConfig(warmup_epochs=0).warmup_for(4) == 0 and TrainConfig(warmup_epochs=0.5).warmup_for(2) == 0.5
    # a rate not scaled (one process, DiLoCo's inner rate) has nothing to ramp to: no warm-up said or taken
    assert TrainConfig(warmup_epochs=0.5).warmup_for(1) == 0
    with pytest.raises(ConfigError, match="--warmup-epochs -1 must be 0"):
        TrainConfig(warmup_epochs=-1)


@pytest.mark.parametrize("kwargs,match", [
    ({"sync_every": 0}, "--sync-every 0 must be at least 1"),
    ({"sync_every": 4, "strategy": "ssp"}, "--sync-every 4 does not fit --strategy ssp"),
    ({"fragments": 2}, "--fragments 2 sets DiLoCo's outer loop: it needs --strategy diloco"),
    ({"sync_every": 4, "fragments": 5}, r"--fragments 5 must be from 1 to --sync-every \(4\)"),
    ({"sync_every": 4, "fragment_delay": 4}, r"--fragment-delay 4 must be from 0 to --sync-every - 1 \(3\)"),
    ({"sync_every": 4, "fragment_mixing": 2.0}, r"--fragment-mixing 2.0 must be in \[0, 1\]"),
    ({"sync_every": 4, "outer_codec": "int2"}, "--outer-codec 'int2' is not a codec"),
    ({"sync_every": 4, "outer_momentum": 1.0}, r"--outer-momentum 1.0 must be in \[0, 1\)"),
    ({"sync_every": 4, "fragments": 2, "on_failure": "continue"}, "streaming DiLoCo .* keeps exchanges in flight"),
    ({"sync_every": 4, "on_failure": "continue", "max_restarts": 2}, "a replacement would need another worker's data"),
])
def test_diloco_settings_are_checked_naming_the_flag(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**kwargs)


def test_sync_every_implies_diloco_and_the_codecs_are_diloco_s():
    from ddpkit.parallel.diloco import CODECS
    from ddpkit.train.train_config import DILOCO_CODECS

    assert TrainConfig(sync_every=8).strategy == "diloco"
    assert TrainConfig(strategy="diloco").sync_every == 100
    assert DILOCO_CODECS == CODECS


def test_the_gpt_reads_the_text_and_the_text_needs_its_folder():
    with pytest.raises(ConfigError, match="--model 'gpt' does not read --dataset digits: --model gpt, gpt-10m and "
                                          "gpt-25m read --dataset shakespeare"):
        TrainConfig(model="gpt")
    with pytest.raises(ConfigError, match="--model 'gpt-25m' does not read --dataset mnist"):
        TrainConfig(model="gpt-25m", dataset="mnist", data_dir="x")
    assert TrainConfig(model="gpt-10m", dataset="shakespeare", data_dir="x").model == "gpt-10m"
    with pytest.raises(ConfigError, match="--model 'convnet' does not read --dataset shakespeare"):
        TrainConfig(dataset="shakespeare", data_dir="x")
    with pytest.raises(ConfigError, match="--dataset shakespeare needs --data-dir"):
        TrainConfig(model="gpt", dataset="shakespeare")
    with pytest.raises(ConfigError, match="--train-samples 0 must be at least 1"):
        TrainConfig(train_samples=0)
