"""Per-rank timelines of training steps, as Chrome trace JSON, and the overlap measured from them.

One track group per rank (``pid`` = rank), with these spans (``tid``):

``ENGINE step``
    ``forward``, ``backward`` (from ``loss.backward()`` to its return: the
    end-of-backward wait and the write-back included), ``optimizer``, and
    ``data`` where a step loads data;
``ENGINE gradients``
    ``computing gradients``: from the start of backward to the moment the
    last gradient was accumulated (a post-accumulate-grad hook on every
    parameter), the part of backward communication can hide behind;
``ENGINE bucket K``
    each bucket's all-reduce, from its launch to its completion (a callback
    on the collective's future, run the moment it completes);
``ddpkit wait``
    ddpkit's end-of-backward wait for its buckets.

ddpkit's engine is traced as an observer of its reducer
(:meth:`ddpkit.DistributedDataParallel.register_observer`: each bucket's
launch and completion, and the wait); torch's DDP through a comm hook that
does what its default hook does (divide, all-reduce) and records the same two
moments, so both engines' spans mean the same thing. Tracing perturbs the steps it records, so
``ddpkit bench`` traces extra steps after its timed ones.

Overlap, per step: the time an all-reduce was running while gradients were
still being computed, divided by the time any all-reduce was running (the
union of the bucket spans); the figure is the median over the traced steps.
Open the file in https://ui.perfetto.dev or ``chrome://tracing``. ``ddpkit
train --trace`` records its first optimizer steps the same way, with the
``data`` phase (taking the batch) besides.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.parallel.common.observer import BucketEvent, Observer, WaitEvent

_OFFSET = time.time() - time.perf_counter()
"""Maps this process's monotonic clock to wall-clock seconds, shared by the ranks of one machine."""


def now() -> float:
    return time.perf_counter() + _OFFSET


def merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``spans`` as disjoint, sorted intervals."""
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def overlap(comm: list[tuple[float, float]], compute: tuple[float, float]) -> float | None:
    """Share of the time any all-reduce ran that fell inside ``compute`` (None: no communication)."""
    union = merge(comm)
    total = sum(b - a for a, b in union)
    if total <= 0:
        return None
    inside = sum(max(0.0, min(b, compute[1]) - max(a, compute[0])) for a, b in union)
    return inside / total


class Recorder(Observer):
    """The spans of one engine on this rank; :meth:`step` runs and records one training step.

    Attached to ddpkit's engine as an observer, it records each bucket's
    all-reduce from its launch to its completion, and the end-of-backward wait.
    """

    def __init__(self, engine: str, model: nn.Module, rank: int) -> None:
        self.engine, self.rank = engine, rank
        self.events: list[dict[str, Any]] = []
        self.overlaps: list[float] = []
        self.enabled = True
        """False: record nothing more (the traced steps are over)."""
        self._comm: list[tuple[float, float]] = []
        self._last_grad = 0.0
        self._launched: dict[int, float] = {}
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_done)

    def _grad_done(self, _: torch.Tensor) -> None:
        self._last_grad = now()

    # ddpkit's engine, observed (perf_counter times, mapped to the trace's clock).

    def on_launch(self, event: BucketEvent) -> None:
        self._launched[event.bucket] = event.time + _OFFSET

    def on_done(self, event: BucketEvent) -> None:
        start = self._launched.pop(event.bucket, None)
        if start is None or not self.enabled:
            return
        end = event.time + _OFFSET
        self._comm.append((start, end))
        self.span(f"all-reduce bucket {event.bucket}", f"bucket {event.bucket}", start, end)

    def on_wait(self, event: WaitEvent) -> None:
        self.span("wait for buckets", "wait", event.start + _OFFSET, event.end + _OFFSET)

    def span(self, name: str, track: str, start: float, end: float, **args: Any) -> None:
        if not self.enabled:
            return
        self.events.append({"name": name, "ph": "X", "pid": self.rank, "tid": f"{self.engine} {track}",
                            "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6, "args": args})

    def all_reduce_done(self, bucket: int, launched: float) -> Callable[[Any], Any]:
        """A future callback recording bucket ``bucket``'s all-reduce from ``launched`` to now."""
        def done(fut: Any) -> Any:
            if not self.enabled:
                return fut.value()
            end = now()
            self._comm.append((launched, end))
            self.span(f"all-reduce bucket {bucket}", f"bucket {bucket}", launched, end)
            return fut.value()
        return done

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = now()
        yield
        self.span(name, "step", start, now())

    def backward(self, run: Callable[[], None]) -> None:
        """Run one backward (``run``) as the ``backward`` phase; record its gradient span and overlap.

        Every bucket's completion is recorded by the time ``run`` returns: ddpkit's engine reports them before
        its wait ends, and torch's waits for the comm hook's future, whose last callback records it.
        """
        self._comm = []
        start = now()
        with self.phase("backward"):
            run()
        self.span("computing gradients", "gradients", start, self._last_grad)
        if (share := overlap(self._comm, (start, self._last_grad))) is not None:
            self.overlaps.append(share)

    def step(self, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
        """One SGD step with its phases, gradient span and overlap recorded."""
        opt.zero_grad()
        with self.phase("forward"):
            loss = nn.functional.cross_entropy(model(x), y)
        self.backward(loss.backward)
        with self.phase("optimizer"):
            opt.step()


class Untraced:
    """What a training loop records with when it is not tracing: every phase runs as it is, unrecorded."""

    enabled = False

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def backward(self, run: Callable[[], None]) -> None:
        run()


UNTRACED = Untraced()


def trace_torch(model: Any, recorder: Recorder) -> None:
    """Record each bucket's all-reduce of torch's DDP ``model`` through a comm hook equal to its default one."""
    world = dist.get_world_size()

    def hook(_, bucket):  # type: ignore[no-untyped-def]  # torch checks annotations, and these would be strings
        start = now()
        fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
        record = recorder.all_reduce_done(bucket.index(), start)
        return fut.then(lambda f: record(f)[0])

    model.register_comm_hook(None, hook)


def instrument(model: nn.Module, engine: str, rank: int, reducer_owner: Any = None) -> Recorder:
    """A recorder for ``model`` wrapped by ``engine`` (``ddpkit``, ``torch``, else phases only).

    ``reducer_owner``: what drives ddpkit's engine, when not ``model`` (a DistributedOptimizer).
    """
    recorder = Recorder(engine, model, rank)
    if engine == "ddpkit":
        (reducer_owner if reducer_owner is not None else model).register_observer(recorder)
    elif engine == "torch":
        trace_torch(model, recorder)
    return recorder


def median_overlap(recorder: Recorder) -> float | None:
    return statistics.median(recorder.overlaps) if recorder.overlaps else None


def write(path: str | Path, recorders: list[Recorder]) -> None:
    """Gather every rank's spans on rank 0 and write them as one Chrome trace (a collective)."""
    mine = [e for r in recorders for e in r.events]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        names = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}}]
        Path(path).write_text(json.dumps({"traceEvents": names + mine, "displayTimeUnit": "ms"}) + "\n")
        return
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, parts if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return
    events = [e for part in parts for e in part]
    names = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}
             for r in range(dist.get_world_size())]
    Path(path).write_text(json.dumps({"traceEvents": names + events, "displayTimeUnit": "ms"}) + "\n")
