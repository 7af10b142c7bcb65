"""The summed mode's buckets, each sent as soon as this rank's last micro-batch of the step has its gradients in:
the step's reduction overlapped with that micro-batch's backward, as DDP's buckets overlap its backward.

A rank's earlier micro-batches of a step accumulate into the step's send buffer after each backward
(:meth:`FaultTolerance.harvest`). During its last micro-batch's backward each parameter's gradient is weighted
into the buffer as autograd accumulates it (a post-accumulate-grad hook, :meth:`Overlap.on_gradient`), and a
bucket (a contiguous stretch of the buffer, torch's assignment by size over the parameters in reverse order) whose
parameters are all in goes out: an asynchronous all-reduce of its stretch, or the wrapper's comm hook on it.
Buckets go out strictly in order (a complete bucket waits for those before it), so every member issues the same
collectives in the same order; those a backward leaves (parameters without a gradient in it, a rank with no
samples in the step) go out once the rank's micro-batches are done. Nothing waits inside backward:
``step.sync()`` waits for the buckets as for any collective of the step, so a death abandons them and the step
comes again.

The step's gradient must stay the one a reduction after the loop body makes, whatever the body does with ``.grad``.
A gradient taken is left in ``.grad`` (readable: SAM reads it) and remembered with its version; once the micro-batch
is over (:meth:`FaultTolerance.harvest`) each must be unchanged. A gradient that changed after it was taken (a
second backward accumulating into it, ``zero_grad()`` and another backward as in FGSM, clipping inside the body, a
parameter that two reentrant-checkpointed segments use) makes the step *dirty*: the members learn it with the step's
bookkeeping, discard the step's gradients and train the step again, and from then on (until the next change of
membership) the buckets go out after the loop body (one line says so). A change made in place through ``.data``
moves no version and is not seen (``FaultTolerance(overlap=False)`` reduces after the loop body). A gradient for a
parameter whose bucket went out without it (the backward gave it none, and the body set ``.grad`` by hand) is
*late*: the members learn that too, and then all sum their late gradients (one more collective, the gradient's size)
and add them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd import Variable

from ddpkit.parallel.common.bucket_caps import bucket_limits
from ddpkit.parallel.common.buckets import initial_buckets
from ddpkit.parallel.common.grad_hooks import hook_gradients

__all__ = ["Overlap", "spans"]


def spans(params: Sequence[torch.Tensor], bucket_cap_mb: float | None) -> list[tuple[int, int, list[int]]]:
    """The buckets over ``params`` in the order they go out: each its first and last word in the flat gradient
    (the parameters in order) and its parameters' indices; torch's assignment by size (``bucket_cap_mb`` as
    DDP's: None, 25 MiB with a first bucket of 1 MiB) over the parameters in registration order, the last first.
    A bucket holds a run of consecutive parameters, so its stretch of the flat gradient is contiguous."""
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    # One key for all: the flat gradient is one float32 tensor, whatever the parameters' dtypes.
    sized = [torch.empty(p.numel(), dtype=torch.float32, device="meta") for p in params]
    return [(offsets[min(group)], offsets[max(group) + 1], sorted(group))
            for group in initial_buckets(sized, bucket_limits(bucket_cap_mb))]


class Overlap:
    """Which parameters of the last micro-batch are in, and which buckets have gone out (see the module notes).

    Args:
        params: the parameters the mode reduces (a post-accumulate-grad hook on each, idle unless armed).
        buckets: :func:`spans` of them.
    """

    def __init__(self, params: Sequence[torch.Tensor], buckets: Sequence[tuple[int, int, list[int]]]) -> None:
        self.buckets = list(buckets)
        self.bucket_of = [0] * len(params)
        for b, (_, _, indices) in enumerate(self.buckets):
            for i in indices:
                self.bucket_of[i] = b
        self.buffer: torch.Tensor | None = None
        """The step's send buffer while its buckets are this object's to send (:meth:`begin` to :meth:`reset`)."""
        self.sent = 0
        """Buckets gone out this step (0 .. sent-1)."""
        self.late: torch.Tensor | None = None
        """Weighted gradients that came after their bucket went out (zeros elsewhere), or None."""
        self.futures: list[tuple[torch.Tensor, torch.futures.Future]] = []
        """Each bucket sent: its stretch of the buffer and the future of its reduction."""
        self._take: Callable[[int, torch.Tensor], None] | None = None
        self._send: Callable[[int], None] | None = None
        self._waiting: list[int] = []
        self._in: list[bool] = []
        self._came: list[bool] = []
        self._came_before = [True] * len(params)
        self.taken: list[tuple[torch.Tensor, int, int] | None] = []
        """Each gradient taken in the last micro-batch: the tensor ``.grad`` held, its memory and its version at
        the end of the backward that took it (gradients handed out as views of one buffer share a version
        counter, which the backward's later gradients move on)."""
        self._task = -1
        """The backward whose end re-reads the taken gradients' versions (:meth:`_backward_ends`)."""
        self.dirty = False
        """A gradient changed after it was taken: the step cannot stand (see the module notes)."""
        self.expected = [True] * len(params)
        """Whether each parameter's gradient is waited for: it came in the last micro-batch's backward of one of
        the last two steps (a parameter the graph leaves out does not hold its bucket back; one used every other
        step is waited for, where a late gradient would cost a whole reduction more)."""
        hook_gradients(self, params)
        self.reset()

    def reset(self) -> None:
        """Forget the step (its buckets are abandoned or collected)."""
        self.buffer, self.sent, self.late, self.futures = None, 0, None, []
        self._take = self._send = None
        self._waiting = [len(indices) for _, _, indices in self.buckets]
        self._in = [False] * len(self.bucket_of)
        self._came = [False] * len(self.bucket_of)
        self.taken = [None] * len(self.bucket_of)
        self.dirty = False
        self._task = -1

    def begin(self, buffer: torch.Tensor) -> None:
        """A step whose buckets go out from ``buffer``."""
        self.reset()
        self.buffer = buffer

    def arm(self, take: Callable[[int, torch.Tensor], None], send: Callable[[int], None]) -> None:
        """The last micro-batch's backward comes: ``take(index, param)`` each gradient as it is accumulated,
        ``send(bucket)`` each bucket once complete, in order; a bucket of parameters not expected
        (:attr:`expected`) at once."""
        self._take, self._send = take, send
        for i, expected in enumerate(self.expected):
            if not expected:
                self._count_in(i)
        self._send_ready()

    def disarm(self) -> None:
        """The last micro-batch is over: what came in it (and in the step before) is what the next step waits
        for (unchanged when nothing came: a micro-batch without a backward)."""
        if self._take is not None and any(self._came):
            self.expected = [now or before for now, before in zip(self._came, self._came_before)]
            self._came_before = list(self._came)
        self._take = None

    def check(self, index: int, grad: torch.Tensor | None) -> None:
        """Parameter ``index``'s ``grad`` after the micro-batch must be the one taken, in the same memory, at the
        version the backward left it (else the step is dirty); the taken gradient is let go. (A change made
        through ``.data`` in place moves no version: it is not seen.)"""
        taken = self.taken[index]
        self.taken[index] = None
        if taken is not None and (grad is not taken[0] or grad.data_ptr() != taken[1] or grad._version != taken[2]):
            self.dirty = True

    def is_sent(self, index: int) -> bool:
        """Whether parameter ``index``'s bucket has gone out (a gradient for it now is late)."""
        return self.bucket_of[index] < self.sent

    def on_gradient(self, index: int, param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated (its hook): idle unless armed."""
        take = self._take
        if take is None:
            return
        self._came[index] = True
        grad = param.grad
        if grad is not None:
            if self.taken[index] is not None:  # a second gradient into the one taken: the step is dirty
                self.dirty = True
                return
            take(index, param)
            self.taken[index] = (grad, grad.data_ptr(), grad._version)
            task = torch._C._current_graph_task_id()
            if task != self._task:  # the versions are read again once this backward is over
                self._task = task
                Variable._execution_engine.queue_callback(self._backward_ends)
        if not self._in[index]:
            self._count_in(index)
            self._send_ready()

    def _backward_ends(self) -> None:
        """Each taken gradient's version as the backward leaves it (what the loop body must not change)."""
        self.taken = [None if t is None else (t[0], t[1], t[0]._version) for t in self.taken]

    def _count_in(self, index: int) -> None:
        self._in[index] = True
        self._waiting[self.bucket_of[index]] -= 1

    def _send_ready(self) -> None:
        send = self._send
        while self.sent < len(self.buckets) and self._waiting[self.sent] == 0 and send is not None:
            self.sent += 1
            send(self.sent - 1)

    def flush(self, send: Callable[[int], None]) -> None:
        """Send every bucket not yet sent, in order (the rank's micro-batches are done)."""
        self._take = None
        while self.sent < len(self.buckets):
            self.sent += 1
            send(self.sent - 1)
