"""What an engine does per step beyond the plain model: the operations it dispatches, and its time.

``--engine-cost`` runs each engine with the same no-op comm hook (no
communication on either side) beside the plain model, in the same rounds.
Two figures come of it per engine:

* *time*: the median over rounds of (the engine's step - the plain model's
  step of the same round), in µs, and that divided by the model's parameter
  tensors and by the engine's buckets: the engine's own bookkeeping (its
  gradient hooks, readiness counting, copies into and out of buckets).
* *operations*: the aten operations one step dispatches, counted under
  torch's profiler, minus the plain model's. Only operations dispatched from
  outside any other aten operation count (an ``aten::add_`` once, not with
  the ``aten::empty`` it calls inside), so the figure is what the engine
  asks for, whichever kernels torch picks to do it. It does not depend on
  the machine's speed: an engine that works per bucket dispatches a number
  that grows with the buckets, one that works per parameter with the
  parameters.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["engine_us", "top_level_ops"]


def top_level_ops(step: Callable[[], Any]) -> int:
    """The aten operations one call of ``step`` dispatches from outside any other aten operation."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        # torch 2.11 warns, once, that a profiler's events end with its cycle: this one has a single cycle.
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    return sum(1 for event in prof.events() if event.name.startswith("aten::") and not _inside_aten(event))


def _inside_aten(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def engine_us(engine: list[float], plain: list[float]) -> float:
    """Median over rounds of ``engine``'s step minus the plain model's step of the same round, in µs."""
    return statistics.median(e - p for e, p in zip(engine, plain)) * 1e6
