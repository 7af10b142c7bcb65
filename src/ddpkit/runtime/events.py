"""Every collective ddpkit issues announces itself here first; the stall inspector and observers read it.

Definitions
-----------
announcement
    :func:`collective` is called right before a collective, on every rank, in
    the same order: a name (a ``str.format`` template with its arguments,
    formatted only when read), the training step it belongs to, and the
    payload in bytes this rank hands to it. Its cost, with no observer
    attached, is a counter, a clock read and two tuple stores.
record
    The last :data:`HISTORY` announcements and the one this rank is in now
    (:func:`snapshot`). The stall inspector (:mod:`ddpkit.runtime.stall`)
    publishes it, so every rank can see which collective the others reached.
observer
    A callable attached with :func:`observe` gets a :class:`CollectiveEvent`
    for every announcement while it is attached: :class:`ByteCounter` counts
    the payload of a stretch of training this way. Nothing is formatted or
    allocated for observers while none is attached.

Per-bucket events of the gradient engine (a bucket ready, launched, reduced,
and the wait at the end of backward) are the engine's own:
:mod:`ddpkit.parallel.common.observer`.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["HISTORY", "ByteCounter", "CollectiveEvent", "collective", "observe", "snapshot"]

HISTORY = 8
"""How many recent collectives the record keeps (to name a mismatch between ranks)."""


@dataclass(frozen=True)
class CollectiveEvent:
    """One announced collective, as an observer sees it."""

    name: str
    """What it is, formatted (``"DDP bucket 0 all-reduce"``)."""
    nbytes: int
    """Payload this rank hands to it (0 where the announcer does not know it, e.g. a comm hook's call)."""
    step: int | None
    """The training step it belongs to, where the announcer counts steps."""
    time: float
    """``time.perf_counter()`` at the announcement."""
    seq: int
    """Its number among this process's announcements (1, 2, ...)."""


class _Record:
    """This rank's collectives so far; written by the training thread, read by the stall inspector."""

    def __init__(self) -> None:
        self.current: tuple[int, str, tuple, int | None, float] = (0, "", (), None, time.time())
        self.recent: list[tuple[int, str, tuple, int | None] | None] = [None] * HISTORY


_record = _Record()
_observers: list[Callable[[CollectiveEvent], None]] = []


def collective(name: str, *args: Any, step: int | None = None, nbytes: int = 0) -> None:
    """Announce that this rank is entering its next collective.

    Args:
        name: a ``str.format`` template naming the operation.
        args: its arguments (formatted only when the record is read).
        step: the training step it belongs to, shown after the name (ranks
            that count steps differently have issued different collectives).
        nbytes: the payload this rank hands to the collective.
    """
    seq = _record.current[0] + 1
    _record.current = (seq, name, args, step, time.time())
    _record.recent[seq % HISTORY] = (seq, name, args, step)
    if _observers:
        event = CollectiveEvent(fmt(name, args), nbytes, step, time.perf_counter(), seq)
        for observer in list(_observers):
            observer(event)


def fmt(name: str, args: tuple, step: int | None = None) -> str:
    """An announcement's name with its arguments (and step) filled in."""
    try:
        text = name.format(*args)
    except (IndexError, KeyError, ValueError):
        text = name
    return text if step is None else f"{text}, step {step}"


def sequence() -> int:
    """How many collectives this process has announced."""
    return _record.current[0]


def snapshot() -> dict[str, Any]:
    """This rank's record as the stall inspector publishes it: sequence number, recent collectives, times."""
    seq, name, args, step, since = _record.current
    recent = sorted([s, fmt(n, a, st)] for s, n, a, st in [r for r in list(_record.recent) if r])
    return {"seq": seq, "op": fmt(name, args, step) if seq else "", "since": since, "wall": time.time(),
            "recent": recent, "host": socket.gethostname(), "pid": os.getpid()}


@contextmanager
def observe(observer: Callable[[CollectiveEvent], None]) -> Iterator[None]:
    """Call ``observer(event)`` for every collective this process announces inside the block.

    The observer runs on the training thread, before the collective: keep it
    short, and do not issue collectives from it.

    Example::

        with ddpkit.runtime.events.observe(lambda e: print(e.name, e.nbytes)):
            loss.backward()
    """
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


class ByteCounter:
    """Counts the payload (bytes) of the collectives this process announces while :meth:`counting`.

    Every collective ddpkit issues is counted: the gradient buckets, buffer
    broadcasts, parameter averages, ddpkit's own comm hooks' messages, and the
    training command's evaluations and checkpoints. A comm hook of your own
    (or torch's) is counted as the bucket it was handed, not what it sends.
    """

    def __init__(self) -> None:
        self.total = 0
        self.count = 0

    def __call__(self, event: CollectiveEvent) -> None:
        self.total += event.nbytes
        self.count += 1

    @contextmanager
    def counting(self) -> Iterator[ByteCounter]:
        with observe(self):
            yield self
