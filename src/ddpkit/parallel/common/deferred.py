"""A reducer whose end of backward only launches: the reductions run on until the caller collects them.

``DistributedOptimizer`` (Horovod's way) drives the engine like this: the
buckets go out during backward as under DDP, but backward returns without
waiting, so the caller can do other work (more micro-batches, the optimizer's
own bookkeeping) while the all-reduces run; :meth:`DeferredReducer.complete`
(its ``synchronize()``) waits and writes the averages into ``.grad``.
:meth:`DeferredReducer.launch_now` reduces whatever ``.grad`` holds when no
synchronised backward launched it (fewer backward passes than expected).

A gradient that arrives while a reduction is in flight (one backward pass too
many before the step) calls ``on_overrun``, which is expected to raise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd import Variable

from ddpkit.parallel.common.reducer import Phase, Reducer

__all__ = ["DeferredReducer"]


class DeferredReducer(Reducer):
    """:class:`~ddpkit.parallel.common.reducer.Reducer` with deferred completion (see the module notes).

    Takes the reducer's arguments.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_local_backward: Callable[[], None] | None = None
        """Called at the end of each backward that produced gradients while not armed."""
        self.on_overrun: Callable[[str], None] | None = None
        """Called (and expected to raise) when a gradient arrives while a reduction is in flight."""
        self._local_task = -1

    @property
    def in_flight(self) -> bool:
        """The reductions of a backward are launched and not yet collected."""
        return self.phase is Phase.IN_FLIGHT

    def _unarmed_gradient(self, index: int, param: torch.Tensor) -> None:
        if self.in_flight:
            if self.on_overrun is not None:
                self.on_overrun(self.names[index])
            raise RuntimeError(
                f"parameter {self.names[index]!r} received a gradient while the previous backward's "
                "reduction is still in flight: collect it (complete()) before the next backward"
            )
        super()._unarmed_gradient(index, param)
        if self.on_local_backward is not None:
            task = torch._C._current_graph_task_id()
            if task != self._local_task:  # once per backward
                self._local_task = task
                Variable._execution_engine.queue_callback(self.on_local_backward)

    def _end_of_backward(self) -> None:
        if self.phase is Phase.IN_FLIGHT:
            return  # launch_now() during this backward (synchronize() from a hook) launched it already
        self._launch_deferred()

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] = ()) -> None:
        if self.in_flight:
            raise RuntimeError(f"{self.owner}: prepare_for_backward() while the last backward's reduction is in "
                               "flight: collect it (complete()) first")
        super().prepare_for_backward(outputs)

    def disarm(self) -> None:
        if self.in_flight:
            raise RuntimeError(f"{self.owner}: disarm() while the last backward's reduction is in flight: collect "
                               "it (complete()) first")
        super().disarm()

    def launch_now(self) -> None:
        """Reduce what ``.grad`` holds now, when no synchronised backward has launched it.

        :meth:`complete` collects it. Every rank must call it at the same
        point (it issues the collectives).
        """
        if self.in_flight:
            return
        if self.phase is Phase.IDLE:
            self.prepare_for_backward()
        self._launch_deferred()

    def _launch_deferred(self) -> None:
        try:
            self._launch_rest()
        except BaseException:
            self._end_step()
            raise
        self._become(Phase.IN_FLIGHT)

    def complete(self) -> None:
        """Wait for the launched reductions and write the averages into ``.grad``."""
        if not self.in_flight:
            raise RuntimeError("complete(): no reduction is in flight (call launch_now() first)")
        try:
            self._complete()
        finally:
            self._end_step()
