"""The launch configuration: one typed, validated dataclass shared by CLI and API."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ddpkit.runtime.discovery import DEFAULT_PORT, LOOPBACK
from ddpkit.runtime.process import GRACE_S


def auto_nproc() -> int:
    """``--nproc-per-node auto``: one process per visible GPU, else one."""
    import torch  # only here: the launcher itself needs no torch otherwise

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


@dataclass(kw_only=True)
class LaunchConfig:
    """Everything ``ddpkit launch`` needs to start and supervise one node's workers."""

    program: str
    """The script path, or the module name when ``module`` is set."""
    args: list[str] = field(default_factory=list)
    """Arguments passed on to every worker's program."""
    module: bool = False
    """Run ``program`` as a module (``python -m program``)."""
    nproc_per_node: int | str = 1
    """Workers on this node; ``"auto"`` means one per GPU, else one."""
    nnodes: int = 1
    """Number of nodes (one launcher per node)."""
    node_rank: int = 0
    """This node's index, ``0 <= node_rank < nnodes``; node 0 hosts the rendezvous."""
    master_addr: str = LOOPBACK
    """Host of node 0, where rank 0 serves the rendezvous store."""
    master_port: int | None = None
    """Rendezvous port; default 29500, or a free one with ``standalone``."""
    standalone: bool = False
    """Single node: pick a free port and bind the rendezvous to loopback."""
    max_restarts: int = 0
    """Restart the whole worker group up to this many times after a failure."""
    local_rank_arg: bool = False
    """Also pass ``--local_rank=N`` (scripts written for torch.distributed.launch)."""
    prefix_output: bool = True
    """Prefix each worker output line with ``[rankN]: ``."""
    log_dir: Path | None = None
    """Also save each rank's output to ``log_dir/attempt_K/rankN.log``."""
    grace_period_s: float = GRACE_S
    """Seconds between SIGTERM and SIGKILL when tearing the group down."""
    python: str = sys.executable
    """Interpreter that runs the workers."""

    def __post_init__(self) -> None:
        if self.nproc_per_node == "auto":
            self.nproc_per_node = auto_nproc()
        try:
            self.nproc_per_node = int(self.nproc_per_node)
        except (TypeError, ValueError):
            raise ValueError(
                f"--nproc-per-node {self.nproc_per_node!r} is not a number: use a positive integer or 'auto'"
            ) from None
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node {self.nproc_per_node} must be at least 1 (or 'auto')")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes {self.nnodes} must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}: "
                f"use 0..{self.nnodes - 1}"
            )
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts {self.max_restarts} must be 0 or more")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port {self.master_port} is not a TCP port: use 1..65535")
        if self.standalone:
            if self.nnodes != 1:
                raise ValueError(f"--standalone runs a single node, but --nnodes is {self.nnodes}: drop one of them")
            self.master_addr = LOOPBACK
        if self.grace_period_s < 0:
            raise ValueError(f"grace period {self.grace_period_s} must be 0 or more seconds")
        if self.log_dir is not None:
            self.log_dir = Path(self.log_dir)
        self._check_program()

    def _check_program(self) -> None:
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
                raise ValueError(f"module {self.program!r} cannot be found: check the name and PYTHONPATH")
        elif not Path(self.program).is_file():
            raise ValueError(
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
