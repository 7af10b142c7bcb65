"""ddpkit's environment variables: one rule each, checked before any worker starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from procs import SCRIPTS, base_env

from ddpkit.runtime import variables

BAD = [
    ({"DDPKIT_TIMEOUT": "abc"}, "DDPKIT_TIMEOUT='abc' is not a number of seconds"),
    ({"DDPKIT_TIMEOUT": "-5"}, "DDPKIT_TIMEOUT='-5' must be a positive number of seconds"),
    ({"DDPKIT_STALL_WARN": "abc"}, "DDPKIT_STALL_WARN='abc' is not a number of seconds"),
    ({"DDPKIT_STALL_WARN": "-1"}, "DDPKIT_STALL_WARN='-1' must be 0 (off) or a positive number of seconds"),
    ({"DDPKIT_BACKEND": "tcp"}, "DDPKIT_BACKEND='tcp' is not a backend: use one of gloo, nccl, mpi"),
    ({"DDPKIT_RDZV_ROUND": "two"}, "DDPKIT_RDZV_ROUND='two' is not a whole number >= 0"),
    ({"TORCHELASTIC_RESTART_COUNT": "-1"}, "TORCHELASTIC_RESTART_COUNT='-1' is not a whole number >= 0"),
    ({"GLOO_SOCKET_IFNAME": "nosuchif0"}, "GLOO_SOCKET_IFNAME='nosuchif0': this machine has no interface nosuchif0"),
    ({"DDPKIT_MPI_CUDA_AWARE": "maybe"}, "DDPKIT_MPI_CUDA_AWARE='maybe' is neither 0 nor 1"),
    ({"DDPKIT_MPIRUN": "/nonexistent/mpirun"}, "DDPKIT_MPIRUN='/nonexistent/mpirun' is not a program on PATH"),
]


@pytest.mark.parametrize(("env", "message"), BAD)
def test_each_bad_value_is_named_with_the_fix(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        variables.check_environment(env)


def test_good_values_and_unset_ones_pass() -> None:
    variables.check_environment({})
    variables.check_environment({"DDPKIT_TIMEOUT": "30", "DDPKIT_STALL_WARN": "0", "DDPKIT_BACKEND": "gloo",
                                 "DDPKIT_RDZV_ROUND": "3", "TORCHELASTIC_RESTART_COUNT": "0",
                                 "GLOO_SOCKET_IFNAME": "lo", "DDPKIT_JOB_TOKEN": "anything"})
    assert variables.timeout_seconds({"DDPKIT_TIMEOUT": "2.5"}) == 2.5
    assert variables.stall_warn_seconds({}, 60.0) == 60.0
    assert variables.mpi_cuda_aware({"DDPKIT_MPI_CUDA_AWARE": "0"}) is False
    assert variables.mpi_cuda_aware({}) is None
    assert variables.mpirun_program({"DDPKIT_MPIRUN": sys.executable}) == sys.executable


@pytest.mark.parametrize("command", ["launch", "train"])
@pytest.mark.parametrize(("env", "message"), [BAD[0], BAD[3], BAD[-1]])
def test_the_commands_refuse_a_bad_variable_in_one_line_before_any_worker(
        command: str, env: dict[str, str], message: str, tmp_path) -> None:
    argv = (["launch", "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "report_env.py")] if command == "launch"
            else ["train", "--output-dir", str(tmp_path / "run"), "--epochs", "1"])
    done = subprocess.run([sys.executable, "-m", "ddpkit", *argv], env=base_env(**env), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [f"ddpkit {command}: error: {message}" + lines[0].split(message, 1)[1]], done.stderr
    assert "Traceback" not in done.stderr and "REPORT" not in done.stdout  # no worker ran
    assert not (tmp_path / "run").exists()


def test_ddpkit_train_refuses_a_bad_variable_before_it_imports_the_training_code(tmp_path) -> None:
    # The refusal comes in a fifth of a second, not after torch and the training code (2.5 s): nothing of torch
    # is imported when it is said.
    probe = ("import sys\nfrom ddpkit.cli import main\n"
             f"code = main(['train', '--output-dir', {str(tmp_path / 'run')!r}, '--epochs', '1'])\n"
             "print(code, 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], env=base_env(DDPKIT_TIMEOUT="abc"), capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr
    assert "DDPKIT_TIMEOUT='abc' is not a number of seconds" in done.stderr
