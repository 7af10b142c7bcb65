"""What ``ddpkit bench`` tells while it runs, and the machine it ran on (for the report)."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.bench.bench_config import BenchConfig
from ddpkit.runtime.process import rank_bar

__all__ = ["machine", "progress_bar", "say"]


def say(cfg: BenchConfig, message: str) -> None:
    """A progress line on stderr, from rank 0 only (``--no-progress``: none)."""
    if cfg.progress and dist.get_rank() == 0:
        print(f"ddpkit bench: {message}", file=sys.stderr, flush=True)


def progress_bar(name: str, cfg: BenchConfig) -> Any:
    """Rank 0's bar over the timed steps, on a terminal only (a redirected log gets the per-workload lines)."""
    shown = cfg.progress and dist.get_rank() == 0 and sys.stderr.isatty()
    return rank_bar(total=cfg.steps, desc=name, unit="step", leave=False, disable=not shown, file=sys.stderr)


def machine() -> dict[str, Any]:
    """What a later run needs to compare with this one: versions, CPUs, and the load now."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("ddpkit")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        ours = "0+unknown"
    return {"torch": torch.__version__, "ddpkit": ours, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
