"""Workers that start with torch imported: ``ddpkit train`` forks its own from a forkserver started first thing.

A worker started fresh spends seconds importing torch and the training
code (torch, then ``torch._dynamo`` that the first optimizer, and DDP's
compile support, pull in) before it trains. Started by
:func:`start_early`, a forkserver does those imports once, in parallel with
the parent's own checks (settings, data, run directory); each worker is then
a fork of it, ready at once: :func:`ddpkit.runtime.spawn.spawn`'s workers,
and under ``--on-failure continue`` the workers and parameter servers its
launcher starts, a replacement included (:mod:`ddpkit.runtime.preloaded`).
Torch-free: the CLI calls it before importing anything heavy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ddpkit.runtime.discovery import discover
from ddpkit.runtime.spawn import start_forkserver
from ddpkit.train.train_config import SERVER_STRATEGIES, TrainConfig

__all__ = ["FAULT_TOLERANT_PRELOAD", "PRELOAD", "preload_for", "start_early", "starts_workers"]

PRELOAD = ("torch", "ddpkit.train.loop")
"""What the forkserver imports for every worker."""
FAULT_TOLERANT_PRELOAD = ("torch", "ddpkit.train.fault_tolerant_loop")
"""What it imports for the workers of ``--on-failure continue`` (``python -m ddpkit.train.fault_tolerant_loop``)."""


def preload_for(config: TrainConfig) -> tuple[str, ...]:
    return FAULT_TOLERANT_PRELOAD if config.on_failure == "continue" else PRELOAD


def starts_workers(config: TrainConfig, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``ddpkit train`` with ``config`` will fork worker processes of its own (not under a launcher):
    under ``--on-failure continue`` always (its launcher, in this process, starts every worker)."""
    if discover(environ, master_needed=False).scheme != "single" or config.engine in ("single", "dp"):
        return False
    if config.on_failure == "continue":
        return True
    return config.nproc_per_node != 1 or config.max_restarts > 0 or config.strategy in SERVER_STRATEGIES


def start_early(config: TrainConfig, environ: Mapping[str, str] = os.environ) -> None:
    """Start the forkserver the workers will be forked from, if there will be workers (see the module notes)."""
    if starts_workers(config, environ):
        start_forkserver(preload_for(config))
