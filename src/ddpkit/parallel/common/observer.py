"""Public events of the gradient engine: a bucket ready, launched and reduced, and the end-of-backward wait.

What torch's DDP tells its logger, ddpkit tells any number of observers:
attach one with :meth:`ddpkit.DistributedDataParallel.register_observer` (or
:meth:`ddpkit.DistributedOptimizer.register_observer`) and it is called with

``on_bucket_ready(event)``
    the last gradient of a bucket has been accumulated and copied in;
``on_launch(event)``
    the bucket's all-reduce (or comm hook) has been started. Buckets launch
    in index order, so a ready bucket may wait for its predecessors;
``on_done(event)``
    its reduction has finished. Called from whichever thread completes the
    collective (the backend's), always before the ``on_wait`` of its backward;
``on_wait(event)``
    the end of backward waited from ``start`` to ``end`` for the reductions
    still running: the part of communication that backward did not hide.

Times are ``time.perf_counter()`` seconds. An engine only does the work of
the events some observer overrides: with none attached it checks one list per
bucket and per backward and builds no event, and the completion of a
reduction is watched (a callback on its future) only for an ``on_done``.
The tracing of ``ddpkit train --trace`` and ``ddpkit bench`` is such an
observer (:mod:`ddpkit.parallel.common.trace`), as is the bench's figure of the
exposed wait.

Example::

    class Printer(ddpkit.parallel.common.observer.Observer):
        def on_launch(self, event):
            print(f"bucket {event.bucket}: {event.nbytes} bytes at {event.time:.6f}")

    handle = model.register_observer(Printer())
    ...
    handle.remove()
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

__all__ = ["BucketEvent", "Observer", "ObserverHandle", "Observers", "WaitEvent"]


@dataclass(frozen=True)
class BucketEvent:
    """A bucket reached a point of its life in one backward."""

    owner: str
    """Who drives the engine: ``"DDP"``, ``"DistributedOptimizer"``."""
    bucket: int
    """The bucket's index (bucket 0 launches first)."""
    nbytes: int
    """The bucket's gradient bytes (what an all-reduce without a comm hook sends)."""
    step: int
    """Synchronised backwards before this one."""
    time: float
    """When it happened (``time.perf_counter()``)."""


@dataclass(frozen=True)
class WaitEvent:
    """The end of one backward waited for the reductions still running."""

    owner: str
    step: int
    start: float
    end: float


class Observer:
    """Base class of an engine observer: override the events you need (each does nothing here).

    Observers run on the training thread (``on_done``: the backend's) in the
    middle of backward: keep them short, and never issue collectives there.
    """

    def on_bucket_ready(self, event: BucketEvent) -> None:
        """The last gradient of ``event.bucket`` is in the bucket."""

    def on_launch(self, event: BucketEvent) -> None:
        """``event.bucket``'s reduction has been started."""

    def on_done(self, event: BucketEvent) -> None:
        """``event.bucket``'s reduction has finished."""

    def on_wait(self, event: WaitEvent) -> None:
        """The end of backward waited for communication from ``event.start`` to ``event.end``."""


class ObserverHandle:
    """What ``register_observer`` returns: :meth:`remove` detaches the observer."""

    def __init__(self, observers: Observers, observer: Observer) -> None:
        # Weak: an observer that keeps its handle (DDP's logging data) would otherwise make a cycle with the
        # engine's observers, and live on after its engine until a garbage collection. (An observer that cannot
        # be weakly referenced, one that mixes in a tuple, is held as it is.)
        self._observers = weakref.ref(observers)
        try:
            self._observer: Any = weakref.ref(observer)
        except TypeError:
            self._observer = lambda: observer

    def remove(self) -> None:
        """Detach the observer (again, or after its engine or the observer itself is gone: nothing)."""
        observers, observer = self._observers(), self._observer()
        if observers is not None and observer is not None:
            observers.remove(observer)


def _overrides(observer: Observer, name: str) -> bool:
    return getattr(type(observer), name) is not getattr(Observer, name)


class Observers:
    """The observers of one engine, kept by the events each overrides, and the calls to them.

    An engine tests the list of an event (``ready``, ``launch``, ``done``,
    ``wait``) before it builds the event, so an event nobody observes costs
    one test.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.ready: list[Observer] = []
        self.launch: list[Observer] = []
        self.done: list[Observer] = []
        self.wait: list[Observer] = []
        self._watched: list[Any] = []

    def add(self, observer: Observer) -> ObserverHandle:
        """Attach ``observer`` (see the module notes)."""
        if not isinstance(observer, Observer):
            raise TypeError(f"observer {observer!r} is not a ddpkit.parallel.common.observer.Observer: subclass it and "
                            "override the events you need")
        handle = ObserverHandle(self, observer)
        for kind in ("ready", "launch", "done", "wait"):
            if _overrides(observer, f"on_{'bucket_ready' if kind == 'ready' else kind}"):
                getattr(self, kind).append(observer)
        return handle

    def remove(self, observer: Observer) -> None:
        for kind in ("ready", "launch", "done", "wait"):
            members = getattr(self, kind)
            if observer in members:
                members.remove(observer)

    def bucket_ready(self, bucket: int, nbytes: int, step: int) -> None:
        event = BucketEvent(self.owner, bucket, nbytes, step, time.perf_counter())
        for observer in list(self.ready):
            observer.on_bucket_ready(event)

    def launched(self, bucket: Any, nbytes: int, step: int) -> None:
        """``bucket`` (a :class:`~ddpkit.comm.bucket.GradBucket`) was launched: ``on_launch`` now, ``on_done`` when
        its reduction completes."""
        index = bucket.index()
        if self.launch:
            event = BucketEvent(self.owner, index, nbytes, step, time.perf_counter())
            for observer in list(self.launch):
                observer.on_launch(event)
        if self.done:
            pending = bucket.future if bucket.future is not None else (
                bucket.work.get_future() if bucket.work is not None else None)
            if pending is not None:
                self._watch(pending, index, nbytes, step)

    def _watch(self, future: Any, bucket: int, nbytes: int, step: int) -> None:
        """Call ``on_done`` when ``future`` (a bucket's reduction) completes, on the thread that completes it."""
        def done(_: Any) -> None:
            event = BucketEvent(self.owner, bucket, nbytes, step, time.perf_counter())
            for observer in list(self.done):
                observer.on_done(event)

        self._watched.append(future.then(done))

    def waited(self, start: float, end: float, step: int) -> None:
        """The end of backward waited from ``start`` to ``end``: first every pending ``on_done``, then ``on_wait``."""
        for future in self._watched:  # callbacks that may run just after the wait returned
            future.wait()
        self._watched = []
        event = WaitEvent(self.owner, step, start, end)
        for observer in list(self.wait):
            observer.on_wait(event)
