"""The summed (default) mode's reduction: each rank adds its shards' weighted gradients into one send buffer, and
the buffer is all-reduced, or handed bucket by bucket to the wrapper's comm hook.

The buffer is the gradients' words (the parameters in order), then the step's bookkeeping (see
:meth:`FaultTolerance.new_buffer <ddpkit.parallel.fault_tolerance.steps.FaultTolerance.new_buffer>`). Its buckets
go out during the rank's last micro-batch's backward (:mod:`.overlap`), or, where that is off (a step found dirty,
``overlap=False``, a world of one), after the loop body: then the gradients with the bookkeeping in one
all-reduce, or the gradients through the hook (:class:`.hook_reduction.HookReduction`) and the bookkeeping apart.
Two buffers take turns, so the words a parameter no micro-batch wrote hold an older step's numbers: they are zeroed
before they go out (:attr:`AllReducedSum.written`).

The step's collectives are the caller's: it hands in how to tell the observers of one (``announce``) and how to
wait for one (``wait``, which ends when the membership changes), as for :class:`.ordered_sum.OrderedSum`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ddpkit.comm.bucket import CommHook, GradBucket, check_hook_future
from ddpkit.parallel.fault_tolerance.hook_reduction import HookReduction, hook_state
from ddpkit.parallel.fault_tolerance.overlap import Overlap

__all__ = ["AllReducedSum", "InFlight", "check_dense"]


def check_dense(grad: torch.Tensor) -> None:
    """Refuse a sparse gradient (the mode reduces dense ones)."""
    if grad.is_sparse:
        raise ValueError("FaultTolerance reduces dense gradients; a parameter has a sparse one "
                         "(nn.Embedding(sparse=True)?): make it dense (sparse=False)")


class InFlight(Protocol):
    """What the reduction reads of the step in flight."""

    index: int
    aborted: bool


class AllReducedSum:
    """The summed mode's reduction, one step at a time (see the module notes).

    Args:
        params: the parameters the mode reduces, in order (the buffer's gradients follow them).
        device: where the buffers are.
        wrapper: the ``ddpkit.DistributedDataParallel`` whose comm hook reduces the buckets, or None.
        overlap: the buckets sent during the last backward (:mod:`.overlap`), or None: after the loop body always.
        announce: ``announce(what, payload)`` tells the collectives' observers that one of the step's starts.
        wait: ``wait(work)`` waits for one of the step's collectives in the current view.
        in_flight: the step in flight, or None.
    """

    def __init__(self, params: Sequence[torch.Tensor], device: torch.device, wrapper: Any, overlap: Overlap | None,
                 announce: Callable[[str, torch.Tensor], None], wait: Callable[[Any], None],
                 in_flight: Callable[[], InFlight | None]) -> None:
        self.params = list(params)
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets[-1]
        self.device = device
        self.wrapper = wrapper
        self.overlap = overlap
        self.overlap_off = False
        """A step's gradients changed after its backward took them: the buckets go out after the loop body (until
        the next membership change, :meth:`new_view`)."""
        self.written: set[int] = set()
        """The parameters whose gradient a micro-batch of this step wrote into its buffer."""
        self.group: dist.ProcessGroup | None = None
        """The members' group of the step under way (:meth:`start`)."""
        self._announce = announce
        self._wait = wait
        self._in_flight = in_flight
        self._hooked: HookReduction | None = None
        """The wrapper's buckets as its comm hook sees them (:meth:`_reduce_through`), made anew after a
        membership change (an abandoned hook may still write them)."""
        self._wrapper_checked = False
        """The wrapper's parameters were found to be the module's in the current view (:meth:`wrapper_buckets`)."""

    # -- the step's buffer

    def start(self, group: dist.ProcessGroup | None) -> None:
        """A new step's buffer, reduced over ``group``: nothing written, no bucket out."""
        self.group = group
        self.written = set()
        if self.overlap is not None:
            self.overlap.reset()

    def take(self, buffer: torch.Tensor, i: int, grad: torch.Tensor, weight: float) -> None:
        """Parameter ``i``'s ``grad``, times ``weight``, into the step's sum (the late gradients where its bucket
        has gone out, :mod:`.overlap`)."""
        check_dense(grad)
        lo, hi = self.offsets[i], self.offsets[i + 1]
        overlap = self.overlap
        if overlap is not None and overlap.buffer is buffer and overlap.is_sent(i):
            if overlap.late is None:
                overlap.late = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
            overlap.late[lo:hi].add_(grad.reshape(-1), alpha=weight)
        elif i not in self.written:  # the first gradient here: write, not add
            torch.mul(grad.reshape(-1), weight, out=buffer[lo:hi])
            self.written.add(i)
        else:
            buffer[lo:hi].add_(grad.reshape(-1), alpha=weight)

    def taken_during_backward(self, buffer: torch.Tensor) -> Overlap | None:
        """The overlap, where ``buffer``'s last micro-batch handed it gradients during backward (they stay in
        ``.grad`` and are checked, not taken again)."""
        return self.overlap if self.overlap is not None and self.overlap.buffer is buffer else None

    def zero_unwritten(self, buffer: torch.Tensor) -> None:
        """Zero the gradients' words of what no micro-batch of this step wrote (a parameter without a gradient)."""
        for i in range(len(self.params)):
            if i not in self.written:
                buffer[self.offsets[i] : self.offsets[i + 1]] = 0

    # -- the buckets during the last backward

    def begin_overlap(self, buffer: torch.Tensor, world_size: int) -> bool:
        """Whether the step's buckets go out as its last micro-batch's gradients come in (with members to reduce
        with): then they go from ``buffer``."""
        if self.overlap is None or self.overlap_off or self.group is None or world_size == 1:
            return False
        if self.comm_hook_function() is not None and not self._wrapper_checked:
            self.wrapper_buckets()  # its parameters still the wrapper's (checked once a view)
            self._wrapper_checked = True
        self.overlap.begin(buffer)
        return True

    @contextlib.contextmanager
    def overlapping(self, buffer: torch.Tensor, weight: float, marks: int) -> Iterator[None]:
        """Around this rank's last micro-batch of the step (where the step overlaps): each gradient is weighted
        into ``buffer`` as autograd accumulates it (counted in the parameter marks from word ``marks``) and each
        complete bucket goes out."""
        overlap = self.overlap
        if overlap is None:
            yield
            return

        def take(i: int, param: torch.Tensor) -> None:
            self.take(buffer, i, param.grad, weight)  # (left in .grad: checked at the end)
            buffer[marks + i] += 1

        overlap.arm(take, lambda b: self._send(buffer, b))
        try:
            yield
        finally:
            overlap.disarm()

    def send_rest(self, buffer: torch.Tensor) -> None:
        """Send the buckets of ``buffer`` that no backward completed (once the rank's micro-batches are done)."""
        if self.overlap is not None and self.overlap.buffer is buffer:
            self.overlap.flush(lambda b: self._send(buffer, b))

    def _send(self, buffer: torch.Tensor, b: int) -> None:
        """Bucket ``b`` of the step's ``buffer`` out: an asynchronous all-reduce of its stretch, or the wrapper's
        comm hook on it (nothing after the step was aborted: it is discarded)."""
        assert self.overlap is not None and self.group is not None
        step = self._in_flight()
        if step is not None and step.aborted:
            return
        lo, hi, indices = self.overlap.buckets[b]
        for i in indices:
            if i not in self.written:  # no gradient for it in this step: its stretch holds an older step's
                buffer[self.offsets[i] : self.offsets[i + 1]] = 0
        flat = buffer[lo:hi]
        hooked = self.comm_hook()
        try:
            if hooked is None:
                self._announce(f"all-reduce of bucket {b}", flat)
                future = self.group.allreduce([flat]).get_future()
            else:
                hook, state = hooked
                bucket = GradBucket(b, [self.params[i] for i in indices], list(indices), materialize=False)
                bucket.set_buffer(flat)
                bucket.last = b == len(self.overlap.buckets) - 1
                self._announce(f"the comm hook's reduction of bucket {b}", flat[:0])  # (the hook counts its bytes)
                future = hook(state, bucket)
        except RuntimeError as e:  # a group a death broke may refuse the launch: met at the step's wait, as a
            future = torch.futures.Future()  # collective that failed there (never raised inside backward)
            future.set_exception(e)
        else:
            if hooked is not None:
                future = check_hook_future(hooked[0], future, bucket)
        self.overlap.futures.append((flat, future))

    def reduce_overlapped(self, buffer: torch.Tensor, late_word: int, dirty_word: int, world_size: int) -> bool:
        """The step when its buckets went out during backward: the rest of them, the bookkeeping (``buffer``
        after the gradients, with whether this rank has late gradients at ``late_word`` and a dirty step at
        ``dirty_word``) summed, all waited for in the current view; then the late gradients, if any member has
        some. False: a member's step is dirty (a gradient changed after it was taken), and the step must be
        trained again."""
        assert self.overlap is not None and self.group is not None
        overlap = self.overlap
        self.send_rest(buffer)  # (a loop that left the step's micro-batches early)
        buffer[late_word] = float(overlap.late is not None)
        buffer[dirty_word] = float(overlap.dirty)
        payload = buffer[self.numel :]
        self._announce("all-reduce of the step's counts and values", payload)
        futures = [future for _, future in overlap.futures] + [self.group.allreduce([payload]).get_future()]
        self._wait(torch.futures.collect_all(futures))
        for future in futures:
            future.wait()  # (on a GPU: the current stream waits for each, which the combined future does not do)
        if buffer[dirty_word] > 0:
            return False
        for flat, future in overlap.futures:
            value = future.value()
            reduced = (value[0] if isinstance(value, list) else value).reshape(-1)
            if reduced.data_ptr() != flat.data_ptr():
                flat.copy_(reduced)
        if buffer[late_word] > 0:  # a member's gradient came after its bucket went out: every member adds its own
            late = overlap.late if overlap.late is not None else torch.zeros(self.numel, dtype=torch.float32,
                                                                             device=self.device)
            self._announce("all-reduce of the gradients that came after their bucket", late)
            self._wait(self.group.allreduce([late]))
            if self.comm_hook() is not None:
                late.div_(world_size)  # weighted for a hook, which divides by the world size
            buffer[: self.numel].add_(late)
        overlap.reset()
        return True

    # -- after the loop body

    def reduce_after(self, buffer: torch.Tensor, world_size: int) -> None:
        """The step when its buckets did not go out during backward: the gradients through the wrapper's comm hook
        (a world of one too, as DDP's) and the bookkeeping summed apart, or all of ``buffer`` in one all-reduce."""
        self.zero_unwritten(buffer)
        hooked = self.comm_hook()
        if hooked is not None:
            if self._hooked is None:
                self._hooked = HookReduction(self.params, self.wrapper_buckets())
            hook, state = hooked
            step = self._in_flight()
            self._hooked(hook, state, buffer[: self.numel], self._wait, step.index if step is not None else None)
        if self.group is not None and world_size > 1:  # the bookkeeping summed (with the gradients)
            payload = buffer[self.numel :] if hooked else buffer
            self._announce("all-reduce of the step", payload)
            self._wait(self.group.allreduce([payload]))

    # -- the wrapper's comm hook

    def comm_hook_function(self) -> CommHook | None:
        """The wrapper's comm hook, or None."""
        return self.wrapper.reducer.comm_hook if self.wrapper is not None else None

    def comm_hook(self) -> tuple[CommHook, Any] | None:
        """The wrapper's comm hook and the state to call it with (the step's group where the user gave None, or
        an ``AllReduceState`` without a group), or None: no wrapper, no hook, or nothing to reduce with."""
        if self.wrapper is None or self.wrapper.reducer.comm_hook is None or self.group is None:
            return None
        return self.wrapper.reducer.comm_hook, hook_state(self.wrapper.comm_state, self.group)

    def wrapper_buckets(self) -> list[list[int]]:
        """The wrapper's buckets, which its comm hook reduces: each its parameters' indices.

        Raises:
            ValueError: the parameters that require grad are not the wrapper's (changed after wrapping).
        """
        assert self.wrapper is not None
        groups = self.wrapper.bucket_indices()
        if (sorted(i for idx in groups for i in idx) != list(range(len(self.params)))
                or any(a is not b for a, b in zip(self.wrapper.reducer.params, self.params))):
            raise ValueError("FaultTolerance over a DistributedDataParallel whose parameters that require grad "
                             "are not the module's now (requires_grad changed after wrapping?): its buckets "
                             "would reduce other gradients; set requires_grad before wrapping the module")
        return groups

    # -- membership

    def drop(self) -> None:
        """The step's gradients discarded (its buckets abandoned with the buffers, the hook's buckets with them)."""
        self._hooked = None
        self._wrapper_checked = False
        if self.overlap is not None:
            self.overlap.reset()

    def new_view(self) -> None:
        """A new view's group: every member starts alike (the buckets during backward, as a replacement knows of
        no dirty step; the wrapper's parameters checked again)."""
        self.overlap_off = self._wrapper_checked = False

    def train_again(self) -> None:
        """A dirty step: its buckets abandoned, and from now on they go out after the loop body."""
        assert self.overlap is not None
        self.overlap.reset()
        self.overlap_off = True
