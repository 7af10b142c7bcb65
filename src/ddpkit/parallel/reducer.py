"""The gradient-synchronisation engine behind :class:`ddpkit.DistributedDataParallel`.

Definitions
-----------
bucket
    A flat tensor holding the gradients of several parameters of one dtype and
    device, reduced with a single collective. Parameters are assigned in
    reverse registration order (the order backward usually produces their
    gradients), the first bucket capped at :data:`FIRST_BUCKET_MB` so the last
    gradients of backward go out early, the others at ``bucket_cap_mb``.
ready
    A parameter is ready when autograd has accumulated its gradient for this
    backward (``Tensor.register_post_accumulate_grad_hook``). Its gradient is
    then copied into its bucket (pre-scaled by ``1 / world_size`` when no comm
    hook is registered, fused into the copy). A bucket whose parameters are all
    ready is launched: an asynchronous all-reduce, or the comm hook's future.
launch order
    Buckets are launched strictly in index order (a ready bucket waits for
    its predecessors), so every rank issues the same collectives in the same
    order whatever order its gradients arrive in.
finalisation
    At the end of backward (the autograd engine's queued callback) the
    reducer launches whatever is left, waits for every bucket and writes the
    averaged result into ``.grad``.
rebuild
    After the first synchronised backward the buckets are rebuilt once in
    the order gradients actually arrived on rank 0 (broadcast so every rank
    agrees), which is what lets communication overlap the rest of backward.

Failure modes
-------------
* A parameter that gets no gradient in a synchronised backward, without
  ``find_unused_parameters=True``: its bucket is reduced with zeros for it
  (so every rank still issues the same collectives and none hangs) and the
  backward raises :class:`UnusedParametersError` naming the parameters.
* A parameter ready twice in one backward (reentrant checkpointing, a second
  backward through a retained graph before the next forward): RuntimeError.
* Sparse gradients are not supported: RuntimeError naming the parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ddpkit.comm.bucket import CommHook, GradBucket

FIRST_BUCKET_MB = 1.0
"""Cap of the first bucket (per dtype and device) in MiB."""
_MIB = 1024 * 1024

class UnusedParametersError(RuntimeError):
    """Parameters got no gradient in a synchronised backward without ``find_unused_parameters``."""


def assign_buckets(
    params: Sequence[torch.Tensor], order: Sequence[int], cap_bytes: int, first_cap_bytes: int
) -> list[list[int]]:
    """Group parameters into buckets, walking them in ``order``.

    Each (dtype, device) has its own open bucket, capped at ``first_cap_bytes``
    for the first bucket of that key and ``cap_bytes`` after. A parameter that
    would overflow a non-empty bucket starts the next one, so a parameter
    larger than the cap gets a bucket of its own (reduced in place, no copy).
    Buckets are returned sorted by the position of their first parameter in
    ``order``, so bucket 0 holds the first gradients to arrive.

    Args:
        params: the parameters; only their numel, element size, dtype and
            device are read.
        order: indices into ``params``, in expected gradient arrival order.
        cap_bytes: cap of every bucket but the first of each key.
        first_cap_bytes: cap of the first bucket of each key.

    Returns:
        A list of buckets, each a list of indices into ``params``.
    """
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed_count: dict[tuple, int] = {}
    done: list[list[int]] = []

    def close(key: tuple) -> None:
        done.append(open_buckets.pop(key))
        open_bytes[key] = 0
        closed_count[key] = closed_count.get(key, 0) + 1

    for i in order:
        p = params[i]
        key = (p.dtype, p.device)
        size = p.numel() * p.element_size()
        cap = first_cap_bytes if closed_count.get(key, 0) == 0 else cap_bytes
        if open_buckets.get(key) and open_bytes[key] + size > cap:
            close(key)
            cap = cap_bytes
        open_buckets.setdefault(key, []).append(i)
        open_bytes[key] = open_bytes.get(key, 0) + size
        if open_bytes[key] >= cap:
            close(key)
    done.extend(b for b in open_buckets.values() if b)
    position = {i: k for k, i in enumerate(order)}
    done.sort(key=lambda b: position[b[0]])
    return done


class Reducer:
    """Buckets the gradients of ``named_params`` and all-reduces them during backward.

    Args:
        named_params: (name, parameter) of every parameter that requires grad,
            identical in order and shape on every rank.
        process_group: the group to reduce over; ``None`` for a world of one
            without a process group (no communication).
        bucket_cap_mb: cap of every bucket but the first, in MiB.
        find_unused_parameters: reduce zeros for parameters without a gradient
            instead of raising; parameters unused on every rank keep ``.grad``.
        gradient_as_bucket_view: make each ``.grad`` a view into bucket memory.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        *,
        process_group: dist.ProcessGroup | None,
        bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
    ) -> None:
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        self.cap_bytes = int(bucket_cap_mb * _MIB)
        self.first_cap_bytes = min(int(FIRST_BUCKET_MB * _MIB), self.cap_bytes)
        self.find_unused = find_unused_parameters
        self.as_view = gradient_as_bucket_view
        self.comm_hook: CommHook | None = None
        self.comm_state: Any = None
        self.buckets: list[GradBucket] = []
        self._slot: list[tuple[GradBucket, int]] = []
        self._build(list(reversed(range(len(self.params)))))
        self._arrival: list[int] = []
        self._rebuilt = False
        self._rebuild_due = False
        # Per-iteration state, reset by prepare_for_backward().
        self._armed = False
        self._ready = [False] * len(self.params)
        self._used_since_sync = [False] * len(self.params)
        self._next_launch = 0
        self._callback_queued = False
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
        ]

    # -- buckets -------------------------------------------------------------

    def _build(self, order: list[int]) -> None:
        old = list(self._slot)
        indices = assign_buckets(self.params, order, self.cap_bytes, self.first_cap_bytes)
        self.buckets = [
            GradBucket(k, [self.params[i] for i in idx], idx) for k, idx in enumerate(indices)
        ]
        self.buckets[-1]._is_last = True
        self._slot = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            for s, i in enumerate(bucket.indices):
                self._slot[i] = (bucket, s)
        if self.as_view and old:
            # Gradients living in the old buckets move to the new ones.
            for i, p in enumerate(self.params):
                bucket, s = old[i]
                if p.grad is not None and p.grad.data_ptr() == bucket.views[s].data_ptr():
                    view = self._slot[i][0].views[self._slot[i][1]]
                    view.copy_(p.grad)
                    p.grad = view

    def bucket_indices(self) -> list[list[int]]:
        """The current assignment: for each bucket, the indices of its parameters."""
        return [list(b.indices) for b in self.buckets]

    def _rebuild(self) -> None:
        """Rebuild buckets in rank 0's gradient arrival order (a collective: every rank calls it)."""
        order = self._arrival
        seen = set(order)
        order = order + [i for i in reversed(range(len(self.params))) if i not in seen]
        if self.group is not None and self.world_size > 1:
            device = self.params[0].device if dist.get_backend(self.group) == "nccl" else "cpu"
            t = torch.tensor(order, dtype=torch.int64, device=device)
            dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
            order = t.tolist()
        self._rebuilt = True
        self._arrival = []
        if assign_buckets(self.params, order, self.cap_bytes, self.first_cap_bytes) != self.bucket_indices():
            self._build(order)

    # -- iteration -----------------------------------------------------------

    def prepare_for_backward(self) -> None:
        """Arm the hooks for the next backward; called by every forward that syncs."""
        if self._rebuild_due:
            self._rebuild_due = False
            self._rebuild()
        self._reset()
        self._armed = True

    def disarm(self) -> None:
        """Let the next backward accumulate locally (``no_sync``)."""
        self._reset()

    def _reset(self) -> None:
        self._armed = False
        self._callback_queued = False
        self._next_launch = 0
        self._ready = [False] * len(self.params)
        for b in self.buckets:
            b.pending = len(b.indices)
            b.work = None
            b.future = None
            b._buffer = b.target = b.flat

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self._armed:
                self._on_ready(index, param)
            elif self.find_unused:
                # Used in a no_sync() backward: its accumulated gradient must
                # be reduced by the next synchronised backward even if that one
                # does not use it (torch records local use the same way).
                self._used_since_sync[index] = True

        return hook

    def _on_ready(self, index: int, param: torch.Tensor) -> None:
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        if self._ready[index]:
            raise RuntimeError(
                f"parameter {self.names[index]!r} received a gradient twice in one synchronised "
                "backward (reentrant checkpointing, or two backward passes through one forward): "
                "run a forward before each backward, or use no_sync() for all but the last"
            )
        self._ready[index] = True
        if not self._rebuilt:
            self._arrival.append(index)
        bucket, s = self._slot[index]
        self._stage(bucket, s, param)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _stage(self, bucket: GradBucket, s: int, param: torch.Tensor) -> None:
        """Put ``param.grad`` into its place in the bucket."""
        view = bucket.views[s]
        grad = param.grad
        scale = self.comm_hook is None and self.world_size > 1
        if grad.is_sparse:
            raise RuntimeError(
                f"parameter {self.names[bucket.indices[s]]!r} has a sparse gradient, which "
                "ddpkit's DistributedDataParallel does not reduce: use a dense layer "
                "(e.g. nn.Embedding(sparse=False))"
            )
        if grad.data_ptr() == view.data_ptr():
            if scale:
                view.div_(self.world_size)
            return
        grad = grad.detach()
        if len(bucket.indices) == 1 and not self.as_view and grad.is_contiguous() and grad.dtype == view.dtype:
            # A bucket of one: reduce the gradient where it lies, saving the
            # copy into the bucket and the copy back (a full pass each way).
            bucket.target = bucket._buffer = grad.view(-1)
            if scale:
                grad.div_(self.world_size)
            return
        if scale:
            # The no-hook path averages by pre-scaling, fused into the copy.
            torch.mul(grad, 1.0 / self.world_size, out=view)
        else:
            view.copy_(grad)
        if self.as_view:
            param.grad = view

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: GradBucket) -> None:
        # Reached in bucket index order on every rank (see _launch_ready): the
        # collectives match across ranks whatever order gradients arrive in.
        if self.comm_hook is not None:
            bucket.future = self.comm_hook(self.comm_state, bucket)
        elif self.world_size > 1:
            bucket.work = dist.all_reduce(bucket.target, group=self.group, async_op=True)

    def _finish_backward(self) -> None:
        """End of backward: launch the rest, wait, write ``.grad``."""
        try:
            self._finalize()
        finally:
            self._rebuild_due = not self._rebuilt
            self._reset()

    def _finalize(self) -> None:
        accumulated = self._used_since_sync
        self._used_since_sync = [False] * len(self.params)
        missing = [i for i, r in enumerate(self._ready) if not r]
        saved: dict[int, torch.Tensor] = {}
        for i in missing:
            bucket, s = self._slot[i]
            grad = self.params[i].grad
            if accumulated[i] and grad is not None:
                # Unused in this backward but used under no_sync(): its
                # accumulated gradient is this rank's contribution.
                self._ready[i] = True
                self._stage(bucket, s, self.params[i])
                bucket.pending -= 1
                continue
            if grad is not None and grad.data_ptr() == bucket.views[s].data_ptr():
                saved[i] = grad.clone()  # .grad is bucket memory: keep it for a global miss
            bucket.views[s].zero_()
            bucket.pending -= 1
        missing = [i for i in missing if not self._ready[i]]
        self._launch_ready()
        assert self._next_launch == len(self.buckets), "every bucket must be launched by now"
        used = None
        if self.find_unused and self.group is not None and self.world_size > 1:
            # Every rank issues it, whether or not it missed a gradient itself,
            # and after all of its buckets: the collectives line up everywhere.
            flags = torch.tensor(self._ready, dtype=torch.int32, device=self.buckets[0].flat.device)
            dist.all_reduce(flags, group=self.group)
            used = flags.bool().tolist()
        elif missing:
            used = list(self._ready)
        self._wait_all()
        missing_set = set(missing)
        for bucket in self.buckets:
            for s, i in enumerate(bucket.indices):
                p = self.params[i]
                if i in missing_set and not used[i]:  # type: ignore[index]
                    if i in saved:
                        p.grad.copy_(saved[i])  # type: ignore[union-attr]
                    continue
                view = bucket.views[s]
                if bucket.target is not bucket.flat:
                    continue  # reduced in place: .grad holds the average already
                if self.as_view:
                    if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view
                elif p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
        if missing and not self.find_unused:
            names = ", ".join(repr(self.names[i]) for i in missing)
            raise UnusedParametersError(
                f"DistributedDataParallel: {len(missing)} parameter(s) got no gradient in this "
                f"backward: {names}. Every parameter that requires grad must take part in the "
                "loss of every synchronised step; if some legitimately do not (branches, frozen "
                "heads), construct DistributedDataParallel(..., find_unused_parameters=True), "
                "or set requires_grad=False on them before wrapping"
            )

    def _wait_all(self) -> None:
        """Block until every bucket's reduction is done (the exposed part of communication)."""
        for bucket in self.buckets:
            self._wait(bucket)

    def _wait(self, bucket: GradBucket) -> None:
        if bucket.future is not None:
            result = bucket.future.wait()
            if isinstance(result, (list, tuple)):
                result = result[0]
            if result.data_ptr() != bucket.target.data_ptr():
                bucket.target.copy_(result.view(-1))
        elif bucket.work is not None:
            bucket.work.wait()

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Let ``hook(state, bucket)`` reduce each bucket; see :mod:`ddpkit.hooks`."""
        if self.comm_hook is not None:
            raise RuntimeError("register_comm_hook() may be called only once per model")
        if not callable(hook):
            raise TypeError(f"comm hook {hook!r} is not callable: pass hook(state, bucket) -> Future")
        self.comm_hook = hook
        self.comm_state = state
