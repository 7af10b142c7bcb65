"""The strategies and flags of ``ddpkit train`` (those of issue 65's catalog, and the optimizer) under every failure
mode and backend either run or are refused in one line before any worker starts (issue 65: ``--compile
--on-failure continue`` was neither, every worker died).

The answers are walked in-process for every flag and every pair of them (the parser and ``TrainConfig``, the
checks that refuse a combination; ``ddpkit train`` makes a few more of the machine before any worker starts: the
backend's availability, the world size). Each flag that is taken then trains for real, alone, under each failure
mode's path on gloo, with no fault injected (the faults have tests of their own: test_survive, test_restart,
test_chaos); pairs are not trained here (a probe of about 130 taken pairs found ``--zero 3 --optimizer adamw``,
now a test of its own in tests/parallel/test_zero3.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.cli import build_parser, main
from ddpkit.runtime.options import ConfigError
from ddpkit.train.train_config import TrainConfig
from budget import charge_to_session, cpu_seconds
from procs import base_env
from train_each import parse

FLAGS = {
    "ddp": [], "optimizer": ["--strategy", "optimizer"], "local-sgd": ["--strategy", "local-sgd"],
    "diloco": ["--strategy", "diloco", "--sync-every", "2"],
    "ps-sync": ["--strategy", "ps-sync"], "ps-async": ["--strategy", "ps-async"], "ssp": ["--strategy", "ssp"],
    "torch": ["--engine", "torch"], "dp": ["--engine", "dp"], "zero1": ["--zero", "1"], "zero2": ["--zero", "2"],
    "zero3": ["--zero", "3"], "fp16-hook": ["--comm-hook", "fp16"], "powersgd": ["--comm-hook", "powersgd"],
    "compile": ["--compile"], "bf16": ["--amp", "bf16"], "sync-bn": ["--sync-bn"], "accum": ["--grad-accum", "2"],
    "deterministic": ["--deterministic"], "adamw": ["--optimizer", "adamw"],
}
"""The strategies and flags of the catalog that found the composition which broke (issue 65)."""
MODES = {
    "stop": [], "restart": ["--max-restarts", "1"], "continue": ["--on-failure", "continue"],
    "continue-ordered": ["--on-failure", "continue", "--max-restarts", "1", "--deterministic-shards", "2"],
}
"""The failure modes: the job stops, restarts from its checkpoint, or goes on with the workers left (summed shards),
or with replacements and ordered shards."""
BACKENDS = {"gloo": [], "mpi": ["--backend", "mpi"]}
SMALL = ["--dataset", "synthetic", "--synthetic-samples", "64", "--batch-size", "16", "--epochs", "1",
         "--no-progress"]


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """The command's parser, built once: building it is most of a refusal's cost (1,368 cells: 6.6 s, or 0.1 s
    with one parser; argparse's parse leaves its parser as it was)."""
    return build_parser()


def refusal(argv: list[str]) -> str | None:
    """What ``ddpkit train`` says of ``argv`` before it starts any worker: None where it takes them."""
    args = _parser().parse_args(["train", *argv])
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        TrainConfig(**{k: v for k, v in vars(args).items() if k in names}).check_world(2)  # (the default world)
    except ConfigError as e:
        return str(e)
    return None


def cells() -> list[list[str]]:
    """Every flag alone and every pair of flags (of different options), under each mode and backend."""
    others = [f for f in FLAGS if FLAGS[f]]  # "ddp" is no flag: with another, it is that other alone
    sets = [[f] for f in FLAGS] + [[a, b] for a, b in itertools.combinations(others, 2)
                                   if FLAGS[a][0] != FLAGS[b][0]]
    return [[*(x for f in flags for x in FLAGS[f]), *MODES[m], *BACKENDS[b]]
            for flags in sets for m in MODES for b in BACKENDS]


def test_every_pair_of_flags_is_taken_or_refused_in_one_line_naming_a_flag(capsys) -> None:
    refused = taken = 0
    for argv in cells():
        why = refusal(argv)
        if why is None:
            taken += 1
            continue
        refused += 1
        assert "\n" not in why and why.startswith("--"), (argv, why)
        assert why.split()[0] in argv, (argv, why)  # it names a flag that was given
    assert taken and refused
    # The command itself answers the same, exit 2, one line on stderr, nothing started (a sample of the refusals).
    for argv in (["--zero", "3", "--on-failure", "continue"], ["--comm-hook", "fp16", "--strategy", "ssp"],
                 ["--strategy", "ps-sync", "--on-failure", "continue", "--max-restarts", "1"],
                 ["--sync-bn", "--on-failure", "continue", "--backend", "mpi"]):
        assert main(["train", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("ddpkit train: error: --"), err


RUNS = [(flag, mode) for flag in FLAGS for mode in ("restart", "continue", "continue-ordered")
        if refusal(FLAGS[flag] + MODES[mode]) is None]


def test_the_modes_take_what_they_can_train() -> None:
    # The matrix below is not empty by accident: what the continuing mode takes, and what it refuses.
    assert FAST_CONTINUE <= set(RUNS)  # a run the fast tier keeps is one of the matrix's (not a typo)
    taken = {flag for flag, mode in RUNS if mode == "continue"}
    assert taken == {"ddp", "ps-sync", "ps-async", "ssp", "diloco", "compile", "bf16", "deterministic", "adamw",
                     "fp16-hook", "accum"}
    # (--grad-accum 2 with --deterministic-shards 2 at two workers: shards of two micro-batches, refused)
    assert {flag for flag, mode in RUNS if mode == "continue-ordered"} == {"ddp", "compile", "bf16", "deterministic",
                                                                          "adamw", "fp16-hook"}
    assert {flag for flag, mode in RUNS if mode == "restart"} == set(FLAGS)


FAST_CONTINUE = {("ddp", "continue"), ("ddp", "continue-ordered"), ("diloco", "continue"), ("ps-async", "continue")}
"""The runs of the continuing mode the fast tier keeps: the engine's workers in both ways of reducing
(``train/fault_tolerant_loop.py``), DiLoCo's workers and the parameter servers' workers and servers
(``train/fault_tolerant_async.py``); ps-sync's and SSP's runs, and the other flags', are the whole suite's."""


SHARED = [flag for flag, mode in RUNS if mode == "restart" and flag != "compile"]
"""The restart mode's runs, made one after another by one process (``tests/train_each.py``, each as the
command makes it): a restart forks its workers from a forkserver, which that process starts once for all of them,
where each command would pay a second interpreter's imports twice (its own, and its forkserver's: about 5 of a
run's 6 CPU-seconds in a clean clone's run of 2026-12-01). ``--compile``'s run is a command of its own: its
compilation is the whole suite's."""


def _param(flag: str, mode: str) -> list:
    if flag == "compile":
        marks = [pytest.mark.slow("torch.compile's first compilation in each of two workers")]
    elif mode.startswith("continue") and (flag, mode) not in FAST_CONTINUE:
        # 9-14 CPU-s each in a clean clone's run of 2026-11-30 (the mode's launcher and fresh interpreters, where a
        # restart forks preloaded workers): the fast tier keeps FAST_CONTINUE's, the whole suite runs every one.
        marks = [pytest.mark.slow("a job of the continuing mode's launcher and its fresh workers (and servers), "
                                  "for one flag")]
    elif mode == "restart":
        marks = [pytest.mark.xdist_group("flag-matrix-restart")]  # one worker makes the shared runs, once
    else:
        marks = []
    return pytest.param(flag, mode, marks=marks, id=f"{flag}-{mode}")


@pytest.fixture(scope="module")
def restart_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """:data:`SHARED`'s runs, each in its own output directory under the folder returned, with what each printed
    on stdout and on stderr (``{flag: (exit code, text)}``)."""
    cpu, wall = cpu_seconds(), time.monotonic()
    folder = tmp_path_factory.mktemp("restart-runs")
    runs = {flag: [*FLAGS[flag], *MODES["restart"], *SMALL, "--output-dir", str(folder / flag)] for flag in SHARED}
    (folder / "runs.json").write_text(json.dumps(runs))
    done = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "train_each.py"), str(folder / "runs.json")],
                          capture_output=True, text=True, timeout=600, env=base_env(), cwd=folder)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    charge_to_session(cpu_seconds() - cpu, time.monotonic() - wall)  # every test of SHARED's, not the first's
    return folder, parse(done.stdout), parse(done.stderr)


@pytest.mark.parametrize("flag, mode", [_param(f, m) for f, m in RUNS])
def test_each_flag_that_is_taken_trains_under_each_failure_mode(flag: str, mode: str, tmp_path: Path,
                                                               request: pytest.FixtureRequest) -> None:
    if flag in SHARED and mode == "restart":
        folder, out, err = request.getfixturevalue("restart_runs")
        (code, stdout), (_, stderr) = out[flag], err[flag]
        run = folder / flag
    else:
        argv = [*FLAGS[flag], *MODES[mode], *SMALL, "--output-dir", str(tmp_path / "run")]
        done = subprocess.run([sys.executable, "-m", "ddpkit", "train", *argv], capture_output=True, text=True,
                              timeout=240, env=base_env(), cwd=tmp_path)
        code, stdout, stderr, run = done.returncode, done.stdout, done.stderr, tmp_path / "run"
    assert code == 0, stdout[-2000:] + stderr[-3000:]
    assert "test accuracy:" in stdout and "Traceback" not in stderr
    assert (run / "model.safetensors").is_file()
