"""Workers that start with torch imported: ``ddpkit train`` forks its own from a forkserver started first thing.

A worker started fresh spends seconds importing torch and the training
code (torch, then ``torch._dynamo`` that the first optimizer, and DDP's
compile support, pull in) before it trains. Started by
:func:`start_early`, a forkserver does those imports once, in parallel with
the parent's own checks (settings, data, run directory); each worker is then
a fork of it, ready at once. Torch-free: the CLI calls it before importing
anything heavy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ddpkit.runtime.discovery import discover
from ddpkit.runtime.spawn import start_forkserver
from ddpkit.train.train_config import SERVER_STRATEGIES, TrainConfig

__all__ = ["PRELOAD", "start_early", "starts_workers"]

PRELOAD = ("torch", "ddpkit.train.loop")
"""What the forkserver imports for every worker."""


def starts_workers(config: TrainConfig, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``ddpkit train`` with ``config`` will fork worker processes of its own (not under a launcher).

    Not under ``--on-failure continue``: that mode's launcher starts its workers as processes of their own
    (``python -m ddpkit.train.fault_tolerant_loop``), which it waits for, so a forkserver would import torch for
    nothing, on a core the run's own imports need."""
    if discover(environ, master_needed=False).scheme != "single" or config.engine in ("single", "dp"):
        return False
    if config.on_failure == "continue":
        return False
    return config.nproc_per_node != 1 or config.max_restarts > 0 or config.strategy in SERVER_STRATEGIES


def start_early(config: TrainConfig, environ: Mapping[str, str] = os.environ) -> None:
    """Start the forkserver the workers will be forked from, if there will be workers (see the module notes)."""
    if starts_workers(config, environ):
        start_forkserver(PRELOAD)
