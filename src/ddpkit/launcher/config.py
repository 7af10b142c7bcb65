"""The launch configuration: one typed, validated dataclass shared by CLI and API."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ddpkit.runtime.discovery import DEFAULT_PORT, LOOPBACK
from ddpkit.runtime.options import ConfigError, option
from ddpkit.runtime.process import GRACE_S


def nproc_for(kind: str) -> int:
    """Workers for ``--nproc-per-node cpu|gpu|auto``, as torchrun counts them.

    ``cpu``: one per CPU core this process may use; ``gpu``: one per visible
    GPU (an error without CUDA); ``auto``: one per GPU, else one per core.

    Raises:
        ConfigError: ``gpu`` without CUDA, or another word.
    """
    if kind == "cpu":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if kind not in ("gpu", "auto"):
        raise ConfigError(f"--nproc-per-node {kind!r} is not a number: use a positive integer, cpu, gpu or auto")
    import torch  # only here: the launcher itself needs no torch otherwise

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    if kind == "gpu":
        raise ConfigError("--nproc-per-node gpu: CUDA is not available here; use a number, cpu or auto")
    return nproc_for("cpu")


@dataclass(kw_only=True)
class LaunchConfig:
    """Everything ``ddpkit launch`` needs to start and supervise one node's workers."""

    program: str = option(help="the training script (or module name with -m)", positional=True)
    args: list[str] = option(
        help="arguments for the script", factory=list, positional=True, nargs="...", metavar="args"
    )
    module: bool = option(False, "run PROGRAM as a module, like python -m", flags=["-m", "--module"])
    nproc_per_node: int | str = option(
        1, "workers on this node: an integer, cpu (one per core), gpu (one per GPU) or auto (per GPU, else per "
        "core), as torchrun", metavar="N|cpu|gpu|auto"
    )
    nnodes: int = option(1, "number of nodes (one launcher per node)")
    node_rank: int = option(0, "this node's index in 0..nnodes-1; node 0 hosts the rendezvous")
    master_addr: str = option(LOOPBACK, "node 0's address, where rank 0 serves the rendezvous store")
    master_port: int | None = option(None, f"rendezvous port on node 0 (default: {DEFAULT_PORT})")
    standalone: bool = option(False, "single node: pick a free port, rendezvous on loopback")
    max_restarts: int = option(0, "restart the whole group up to this many times after a failure")
    rdzv_id: str | None = option(
        None, "the job's id and secret, the same on every node: only processes started with it may join "
        "(default: DDPKIT_JOB_TOKEN, else a random one for a single-node job)", metavar="ID",
    )
    local_rank_arg: bool = option(
        False, "also pass --local_rank=N to the script (torch.distributed.launch style)"
    )
    prefix_output: bool = option(
        True, "prefix each worker output line with [rankN]: ", negate="--no-prefix", negate_only=True
    )
    log_dir: Path | None = option(None, "also save each rank's output to LOG_DIR/attempt_K/rankN.log")
    no_python: bool = option(False, "run PROGRAM directly, not with python (a binary or a script with a shebang)")
    role: str = option("default", "the workers' role (ROLE_NAME), as torchrun")
    grace_period_s: float = option(
        GRACE_S, "seconds between SIGTERM and SIGKILL when workers are stopped",
        flags=["--shutdown-timeout", "--shutdown_timeout"], metavar="SECONDS",
    )
    monitor_interval: float = option(
        0.1, "accepted for torchrun's command lines; ddpkit learns of a worker's exit the moment it happens"
    )
    start_method: str = option(
        "spawn", "accepted for torchrun's command lines; every worker is a new process running PROGRAM",
        choices=["spawn", "fork", "forkserver"],
    )
    python: str = option(sys.executable, "interpreter that runs the workers", cli=False)

    def __post_init__(self) -> None:
        try:
            self.nproc_per_node = int(self.nproc_per_node)
        except (TypeError, ValueError):
            self.nproc_per_node = nproc_for(str(self.nproc_per_node))
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node} must be at least 1 (or cpu, gpu, auto)")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes {self.nnodes} must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}: "
                f"use 0..{self.nnodes - 1}"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts} must be 0 or more")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port {self.master_port} is not a TCP port: use 1..65535")
        if self.standalone:
            if self.nnodes != 1:
                raise ConfigError(f"--standalone runs a single node, but --nnodes is {self.nnodes}: drop one of them")
            self.master_addr = LOOPBACK
        if self.rdzv_id is not None and not self.rdzv_id.strip():
            raise ConfigError("--rdzv-id is empty: give the job an id (the same on every node), or leave it out")
        if self.grace_period_s < 0:
            raise ConfigError(f"--shutdown-timeout {self.grace_period_s} must be 0 or more seconds")
        if not self.monitor_interval > 0:
            raise ConfigError(f"--monitor-interval {self.monitor_interval} must be a positive number of seconds")
        if self.no_python and self.module:
            raise ConfigError("--no-python and -m cannot go together: -m runs a module with python")
        if not self.role.strip():
            raise ConfigError("--role is empty: give the workers' role a name (default: default)")
        if self.log_dir is not None:
            self.log_dir = Path(self.log_dir)
        self._check_program()

    def notes(self) -> list[str]:
        """One line for each torchrun flag given here that changes nothing in ddpkit."""
        notes = []
        if self.monitor_interval != 0.1:
            notes.append(f"--monitor-interval {self.monitor_interval:g}: not needed, ddpkit learns of a worker's "
                         "exit the moment it happens")
        if self.start_method != "spawn":
            notes.append(f"--start-method {self.start_method}: every worker is a new process running the program "
                         "(torchrun's start method matters only for function entry points)")
        return notes

    def _check_program(self) -> None:
        if self.no_python:
            if not (Path(self.program).is_file() or shutil.which(self.program)):
                raise ConfigError(f"--no-python: {self.program!r} is neither a file nor a command on PATH")
            return
        if self.module:
            # Workers run `python -m`, which puts the working directory first on sys.path.
            sys.path.insert(0, os.getcwd())
            try:
                found = importlib.util.find_spec(self.program) is not None
            except (ImportError, ValueError):
                found = False
            finally:
                sys.path.pop(0)
            if not found:
                raise ConfigError(f"module {self.program!r} cannot be found: check the name and PYTHONPATH")
        elif not Path(self.program).is_file():
            raise ConfigError(
                f"script {self.program!r} does not exist (looked in {os.getcwd()}): check the path, "
                "or pass -m to run a module"
            )

    @property
    def world_size(self) -> int:
        return int(self.nproc_per_node) * self.nnodes

    @property
    def hosts_rendezvous(self) -> bool:
        """Node 0's rank 0 serves the store, so this launcher must find its port free."""
        return self.node_rank == 0

    def port(self) -> int:
        return self.master_port if self.master_port is not None else DEFAULT_PORT
