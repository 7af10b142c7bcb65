"""The gradient-synchronisation engine behind :class:`ddpkit.DistributedDataParallel`: one backward's state machine.

The parts it drives each have a module: the buckets and their assignment
(:mod:`ddpkit.parallel.buckets`, caps in :mod:`ddpkit.parallel.bucket_caps`),
gradients into buckets and averages back (:mod:`ddpkit.parallel.staging`),
``static_graph`` (:mod:`ddpkit.parallel.static_graph`), a joined rank's side
(:mod:`ddpkit.parallel.join`), and the events observers see
(:mod:`ddpkit.parallel.observer`).

States of one synchronised backward
-----------------------------------
armed
    A forward that will be followed by a synchronised backward calls
    :meth:`Reducer.prepare_for_backward` (the bucket rebuild, if due, happens
    there or at any forward with grad enabled, ``no_sync()`` ones too).
ready
    A parameter is ready when autograd has accumulated its gradient for this
    backward (``Tensor.register_post_accumulate_grad_hook``; with a static
    graph, its last gradient). Large parameters are copied into their bucket
    at once; when the last parameter of a bucket is ready the rest are, and
    the bucket is *launched*: an asynchronous all-reduce, or the comm hook's
    future.
launch order
    Buckets are launched strictly in index order (a ready bucket waits for
    its predecessors), so every rank issues the same collectives in the same
    order whatever order its gradients arrive in.
finalisation
    At the end of backward (the autograd engine's queued callback, queued by
    the first gradient or by DDP's output sink) the reducer launches whatever
    is left, waits for every bucket and writes the averaged result into
    ``.grad``. A pass in which no parameter's hook ran (``torch.autograd.grad``
    through the model) is not the synchronised backward: the reducer stays armed.
rebuild
    After the first synchronised backward (a static graph: the second) the
    buckets are assigned again in the order gradients arrived on rank 0
    (broadcast so every rank agrees), which lets communication overlap the
    rest of backward. Never with ``find_unused_parameters`` and no static
    graph (torch's rule). ``DDP_SET_LAST_BUCKET_CAP=1`` (torch's switch) fills
    buckets from the last gradient backwards, so the small first limit lands
    on the bucket reduced last.
deferred completion
    With ``complete_at_end_of_backward=False`` (``DistributedOptimizer``) the
    end of backward only launches what is left; the reductions run on while
    the caller does other work, and :meth:`Reducer.complete` waits and writes
    ``.grad``. :meth:`Reducer.launch_now` reduces whatever ``.grad`` holds
    when no synchronised backward ran. A gradient that arrives while a
    reduction is in flight calls ``on_overrun``.

Failure modes
-------------
* A parameter that gets no gradient in a synchronised backward, without
  ``find_unused_parameters=True``: its bucket is reduced with zeros for it
  (so every rank still issues the same collectives and none hangs) and the
  backward raises :class:`UnusedParametersError` naming the parameters.
* A parameter ready twice in one backward without ``static_graph`` (a second
  backward through a retained graph before the next forward, a module used
  twice under checkpointing): RuntimeError.
* A sparse gradient where none is expected (only parameters of
  ``nn.Embedding`` / ``nn.EmbeddingBag(sparse=True)`` have sparse buckets,
  torch's rule), or a dense one where a sparse one is: RuntimeError naming
  the parameter.
* A model cast or moved after wrapping: RuntimeError at its first backwards.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ddpkit.comm.bucket import CommHook, GradBucket
from ddpkit.parallel import static_graph as sg
from ddpkit.parallel.bucket_caps import bucket_limits
from ddpkit.parallel.buckets import BucketSet, assign_buckets, initial_buckets
from ddpkit.parallel.observer import Observer, ObserverHandle, Observers
from ddpkit.parallel.staging import Staging
from ddpkit.runtime import events
from ddpkit.runtime.group import settle_at_exit

__all__ = ["Reducer", "UnusedParametersError"]

_UNBOUNDED = sys.maxsize


class UnusedParametersError(RuntimeError):
    """Parameters got no gradient in a synchronised backward without ``find_unused_parameters``."""


def _hook_params(reducer: Reducer) -> None:
    """Call ``reducer.on_gradient(index, param)`` each time a parameter's gradient has been accumulated.

    One hook function serves every parameter and holds the reducer weakly, so
    a model wrapped again (or a wrapper dropped) does not keep the old reducer
    and its buckets alive through its parameters; once the reducer is gone its
    hooks are removed, as torch's reducer removes its own when destroyed.
    """
    ref = weakref.ref(reducer)
    index = {id(p): i for i, p in enumerate(reducer.params)}

    def hook(param: torch.Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner.on_gradient(index[id(param)], param)

    # Only each hook's key is kept (torch's RemovableHandle, a weak reference and a dict per parameter,
    # would be most of what the reducer holds per parameter on a model of many small ones).
    keys = [p.register_post_accumulate_grad_hook(hook).id for p in reducer.params]
    weakref.finalize(reducer, _remove_hooks, reducer.params, keys).atexit = False


def _remove_hooks(params: list[torch.Tensor], keys: list[int]) -> None:
    for param, key in zip(params, keys):
        if param._post_accumulate_grad_hooks:
            param._post_accumulate_grad_hooks.pop(key, None)  # what RemovableHandle.remove() does


_warned_nothing_unused = False


def _warn_nothing_unused() -> None:
    """torch's warning, once per process, that ``find_unused_parameters=True`` found nothing unused."""
    global _warned_nothing_unused
    if not _warned_nothing_unused:
        _warned_nothing_unused = True
        warnings.warn(
            "find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters "
            "in the forward pass. This flag results in an extra traversal of the autograd graph every iteration,  "
            "which can adversely affect performance. If your model indeed never has any unused parameters in the "
            "forward pass, consider turning this flag off. Note that this warning may be a false positive if your "
            "model has flow control causing later iterations to have unused parameters.", stacklevel=2)


def _payload(bucket: GradBucket) -> int:
    """Bytes the bucket's reduction hands to the collective."""
    t = bucket.target
    if t.is_sparse:
        return t._values().numel() * t.element_size() + t._indices().numel() * t._indices().element_size()
    return t.numel() * t.element_size()


class Reducer:
    """Buckets the gradients of ``named_params`` and all-reduces them during backward.

    Args:
        named_params: (name, parameter) of every parameter that requires grad,
            identical in order and shape on every rank.
        process_group: the group to reduce over; ``None`` for a world of one
            without a process group (no communication).
        bucket_cap_mb: bucket cap in MiB. ``None``: torch's default, 25 MiB
            with a first bucket of 1 MiB; a value given caps the first bucket
            too (torch's rule).
        bucket_caps_mb: one cap per bucket in MiB, the last for every bucket
            after (torch's ``bucket_cap_mb_list``); replaces ``bucket_cap_mb``,
            before the rebuild too.
        find_unused_parameters: reduce zeros for parameters without a gradient
            instead of raising; parameters unused on every rank keep ``.grad``.
        gradient_as_bucket_view: make each ``.grad`` a view into bucket memory.
        static_graph: see :mod:`ddpkit.parallel.static_graph`.
        reduce_missing: a parameter without a gradient is reduced as zeros and
            gets the average as ``.grad`` (Horovod's rule), with no search and
            no error.
        complete_at_end_of_backward: ``False`` to defer the wait and the
            write-back to :meth:`complete` (see the module notes).
        expect_sparse: per parameter, whether its gradient is sparse (torch's
            ``expect_sparse_gradient``): it gets a bucket of its own, and the
            sparse gradient itself is averaged.
        sparse_as_dense: a sparse gradient where a dense one is expected is
            made dense in ``.grad`` and reduced as such (Horovod's option).
        owner: who drives this reducer, as errors and the stall inspector name it.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        *,
        process_group: dist.ProcessGroup | None,
        bucket_cap_mb: float | None = None,
        bucket_caps_mb: Sequence[float] | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        reduce_missing: bool = False,
        complete_at_end_of_backward: bool = True,
        expect_sparse: Sequence[bool] | None = None,
        sparse_as_dense: bool = False,
        owner: str = "DDP",
    ) -> None:
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.sparse = list(expect_sparse) if expect_sparse is not None else [False] * len(self.params)
        self.group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        if self.world_size > 1:
            settle_at_exit()  # this reducer's collectives' tensors are Python's: see settle_at_exit
        self.div_factor = self.world_size
        """What the no-hook path divides gradients by: the world size, or under
        ``join(divide_by_initial_world_size=False)`` the ranks not yet joined."""
        self.limits = bucket_limits(bucket_cap_mb, bucket_caps_mb)
        """Bucket size limits in bytes of the rebuild, in the order buckets close (see :func:`assign_buckets`)."""
        self.find_unused = find_unused_parameters
        self.as_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.reduce_missing = reduce_missing
        self.complete_at_end_of_backward = complete_at_end_of_backward
        self.owner = owner
        self.staging = Staging(self.names, owner, gradient_as_bucket_view, sparse_as_dense)
        self.observers = Observers(owner)
        """Attached with :meth:`add_observer`; see :mod:`ddpkit.parallel.observer`."""
        self.in_flight = False
        """Deferred completion: the reductions of a backward are launched and not yet collected."""
        self.on_local_backward: Callable[[], None] | None = None
        """Called at the end of each backward that produced gradients while not armed."""
        self.on_overrun: Callable[[str], None] | None = None
        """Called (and expected to raise) when a gradient arrives while a reduction is in flight."""
        self._local_task = -1
        self.comm_hook: CommHook | None = None
        self.comm_state: Any = None
        self.buckets: list[GradBucket] = []
        self._set: BucketSet | None = None
        # torch's first assignment: one bucket per dtype and device unless
        # unused parameters are searched for (the rebuild then never comes).
        one = static_graph or not find_unused_parameters
        self._build(initial_buckets(self.params, [_UNBOUNDED] if one and not bucket_caps_mb else self.limits,
                                    self.sparse))
        self._arrival: list[int] = []
        self.step = 0
        """Synchronised backwards so far (named in the stall inspector's reports and in events)."""
        self._rebuilt = find_unused_parameters and not static_graph
        """Whether the buckets are final: after the rebuild, or from the start when none comes (torch's rule:
        no rebuild while searching for unused parameters without a static graph)."""
        self._rebuild_due = False
        self.static = sg.StaticGraph()
        self.last_used_flags: torch.Tensor | None = None
        """The used-parameter map of the last backward (a joined rank sends it while it shadows)."""
        self._reset()
        self._used_since_sync = [False] * len(self.params)
        _hook_params(self)

    # -- buckets -------------------------------------------------------------

    def _build(self, indices: list[list[int]]) -> None:
        # The old buckets go before the new ones are made, so there is one set at a time (as in torch), except
        # under gradient_as_bucket_view, where the gradients in them move to the new ones.
        previous = self._set if self.as_view else None
        self._set, self.buckets = None, []
        self._set = BucketSet(self.params, indices, self.sparse, self.as_view, previous)
        self.buckets = self._set.buckets
        self._slot, self._pos, self._plans = self._set.slot, self._set.pos, self._set.plans

    def bucket_indices(self) -> list[list[int]]:
        """The current assignment: for each bucket, the indices of its parameters."""
        return self._set.indices()  # type: ignore[union-attr]

    def _rebuild(self) -> None:
        """Rebuild buckets in rank 0's gradient arrival order (a collective: every rank calls it)."""
        order = self._arrival
        seen = set(order)
        order = order + [i for i in reversed(range(len(self.params))) if i not in seen]
        if self.group is not None and self.world_size > 1:
            t = torch.tensor(order, dtype=torch.int64, device=self.comm_device())
            events.collective("{} bucket rebuild: broadcast rank 0's gradient order", self.owner, step=self.step,
                              nbytes=t.numel() * t.element_size())
            dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
            order = t.tolist()
        self._rebuilt = True
        self._arrival = []
        if os.environ.get("DDP_SET_LAST_BUCKET_CAP") == "1":
            # torch's switch: the small first limit goes to the bucket reduced last instead.
            indices = assign_buckets(self.params, order[::-1], self.limits, self.sparse)[::-1]
        else:
            indices = assign_buckets(self.params, order, self.limits, self.sparse)
        if indices != self.bucket_indices():
            self._build(indices)

    def comm_device(self) -> torch.device:
        """Where small bookkeeping tensors go for a collective: NCCL needs the GPU."""
        return self.params[0].device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def rebuild_if_due(self) -> None:
        """Rebuild the buckets if the rebuild is due (a collective: every rank calls it at the same point).

        DDP calls it at every forward with grad enabled, ``no_sync()`` ones
        included, as torch's DDP does; :meth:`prepare_for_backward` too.
        """
        if self._rebuild_due:
            self._rebuild_due = False
            self._rebuild()

    # -- observers -----------------------------------------------------------

    def add_observer(self, observer: Observer) -> ObserverHandle:
        """Call ``observer``'s methods at this reducer's events (see :mod:`ddpkit.parallel.observer`)."""
        return self.observers.add(observer)

    # -- iteration -----------------------------------------------------------

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] = ()) -> None:
        """Arm the hooks for the next backward; called by every forward that syncs.

        ``outputs`` is accepted for torch's signature (Accelerate's
        ``trigger_sync_in_backward`` calls ``model.reducer.prepare_for_backward([])``
        to make a ``no_sync`` forward's backward synchronise); unused
        parameters are found at the end of backward, so it is not needed.
        """
        del outputs
        self.rebuild_if_due()
        if self.step < 2:
            self._check_params_unchanged()
        self._reset()
        self._armed = True

    def _check_params_unchanged(self) -> None:
        """Raise if a parameter changed dtype or device after wrapping (its bucket would convert its gradient).

        Checked at the first synchronised backwards, where a cast or move
        after wrapping shows; torch's DDP stops averaging such a parameter
        without a word.
        """
        for bucket in self.buckets:
            for p, i in zip(bucket.params, bucket.indices):
                if p.dtype != bucket.flat.dtype or p.device != bucket.flat.device:
                    raise RuntimeError(
                        f"DistributedDataParallel: parameter {self.names[i]!r} is {p.dtype} on {p.device}, but was "
                        f"{bucket.flat.dtype} on {bucket.flat.device} when the model was wrapped: cast or move the "
                        "model (.double(), .to(...)) before wrapping it, not after"
                    )

    def disarm(self) -> None:
        """Let the next backward accumulate locally (``no_sync``)."""
        self._reset()

    def _reset(self) -> None:
        self._armed = False
        self._started = False
        self._callback_queued = False
        self._next_launch = 0
        self._ready = [False] * len(self.params)
        self._hits = [0] * len(self.params)
        self._saved: dict[int, torch.Tensor] = {}
        self._undefined: set[int] = set()
        """Parameters whose hook ran without a gradient in this backward (see :meth:`on_gradient`)."""
        self.static.reset()
        for b in self.buckets:
            b.pending = len(b.indices)
            b.staged = set()
            b.work = None
            b.future = None
            b.target = b.flat
            b.set_buffer(b.flat)

    def on_gradient(self, index: int, param: torch.Tensor) -> None:
        """Parameter ``index``'s gradient has been accumulated (its post-accumulate-grad hook)."""
        # Autograd also calls the hook with no gradient (an output the loss
        # left out passes None through DDP's sink): the parameter is ready
        # but, as torch counts it, used only if it holds a gradient.
        if self._armed:
            # Counted only where torch keeps a used-map: unused parameters searched for, or a
            # static graph's first backward. Plain DDP reduces zeros for it and writes them back.
            if (self.find_unused or self.static_graph) and not self.static.counted and param.grad is None:
                self._undefined.add(index)
            self._on_ready(index)
            return
        if self.in_flight:
            self._overrun(index)
        if self.find_unused and param.grad is not None:
            # Used in a no_sync() backward: its accumulated gradient must
            # be reduced by the next synchronised backward even if that one
            # does not use it (torch records local use the same way).
            self._used_since_sync[index] = True
        if self.on_local_backward is not None:
            task = torch._C._current_graph_task_id()
            if task != self._local_task:  # once per backward
                self._local_task = task
                Variable._execution_engine.queue_callback(self.on_local_backward)

    def _overrun(self, index: int) -> None:
        if self.on_overrun is not None:
            self.on_overrun(self.names[index])
        raise RuntimeError(
            f"parameter {self.names[index]!r} received a gradient while the previous backward's "
            "reduction is still in flight: collect it (complete()) before the next backward"
        )

    def expect_backward(self) -> None:
        """Queue the end-of-backward callback on the backward now running.

        Called from the output of the forward (the sink, a static graph's
        anchors), so the callback belongs to the outer backward even when the
        first gradients arrive inside a reentrant (checkpointing) backward
        nested in it.
        """
        if self._armed and not self._callback_queued:
            Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True

    def _on_ready(self, index: int) -> None:
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        if self.static_graph:
            self._hits[index] += 1
            if not self.static.counted:
                return  # the first backward counts only; everything is reduced at its end
            if not self._started:
                self._started = True
                self._mark_static_unused()
            # Too many is raised at the end of this backward, once every bucket is out: the other
            # ranks, whose graph may not have changed, are waiting in those all-reduces.
            if self.static.count(index, self._hits[index]) != sg.READY:
                return
        elif self._ready[index]:
            raise RuntimeError(
                f"parameter {self.names[index]!r} received a gradient twice in one synchronised "
                "backward (reentrant checkpointing, or two backward passes through one forward): "
                "run a forward before each backward, use no_sync() for all but the last, or "
                "construct DistributedDataParallel(..., static_graph=True) if the model is the same "
                "every iteration"
            )
        if not self._rebuilt:
            self._arrival.append(index)
        if self._mark_ready(index):
            self._launch_ready()

    def _divide(self) -> int | None:
        """What staging averages over: ``div_factor`` without a comm hook (None: nothing to divide)."""
        return self.div_factor if self.comm_hook is None and self.div_factor != 1 else None

    def _mark_ready(self, index: int) -> bool:
        """Count ``index`` in; stage its bucket if that completes it (returns whether it did)."""
        self._ready[index] = True
        bucket, s = self._slot[index], self._pos[index]
        plan = self._plans[bucket.index()]
        if s in plan.eager:
            self.staging.stage_one(bucket, s, self._divide())
            bucket.staged.add(s)
        bucket.pending -= 1
        if bucket.pending:
            return False
        self._stage(bucket)
        return True

    def _stage(self, bucket: GradBucket) -> None:
        self.staging.stage(bucket, self._plans[bucket.index()], self._divide())
        if self.observers.ready:
            self.observers.bucket_ready(bucket.index(), _payload(bucket), self.step)

    def _mark_static_unused(self) -> None:
        """Static graph: parameters without gradients in the first backward are ready at once."""
        for i in self.static.unused_in_first():
            grad = self.params[i].grad
            if grad is not None and not self._used_since_sync[i]:
                self._saved[i] = grad.clone()  # kept if no rank uses it (see the write-back)
            self._mark_ready(i)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self.launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def launch(self, bucket: GradBucket) -> None:
        """Start the bucket's reduction: the comm hook, or an all-reduce (every rank, in bucket index order)."""
        # Reached in bucket index order on every rank (see _launch_ready): the
        # collectives match across ranks whatever order gradients arrive in.
        if self.world_size > 1:
            events.collective("{} bucket {} all-reduce", self.owner, bucket.index(), step=self.step,
                              nbytes=0 if self.comm_hook is not None else _payload(bucket))
        if self.comm_hook is not None:
            future = self.comm_hook(self.comm_state, bucket)
            if not isinstance(future, torch._C.Future):  # torch.futures.Future, or a collective's own
                hook = getattr(self.comm_hook, "__qualname__", None) or repr(self.comm_hook)
                raise RuntimeError(
                    f"comm hook {hook} returned {type(future).__name__} for bucket {bucket.index()}; a comm hook "
                    "must return a torch.futures.Future object holding the reduced bucket, e.g. "
                    "dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])"
                )
            bucket.future = future
        elif self.world_size > 1:
            bucket.work = dist.all_reduce(bucket.target, group=self.group, async_op=True)
        if self.observers.launch:
            self.observers.launched(bucket.index(), _payload(bucket), self.step)
        if self.observers.done:
            pending = bucket.future if bucket.future is not None else (
                bucket.work.get_future() if bucket.work is not None else None)
            if pending is not None:
                self.observers.watch(pending, bucket.index(), _payload(bucket), self.step)

    def _finish_backward(self) -> None:
        """End of backward: launch the rest; unless deferred, wait and write ``.grad``."""
        if not self._undefined and not any(self._ready) and not any(self._hits):
            self._callback_queued = False  # no hook ran: not the synchronised backward (see the module notes)
            return
        if not self.complete_at_end_of_backward:
            self._launch_deferred()
            return
        try:
            self._launch_rest()
            self._complete()
        finally:
            self._end_step()

    def launch_now(self) -> None:
        """Reduce what ``.grad`` holds now, when no synchronised backward has launched it.

        Deferred completion only; :meth:`complete` collects it. Every rank
        must call it at the same point (it issues the collectives).
        """
        if self.in_flight:
            return
        if not self._armed:
            self.prepare_for_backward()
        self._launch_deferred()

    def _launch_deferred(self) -> None:
        try:
            self._launch_rest()
        except BaseException:
            self._end_step()
            raise
        self._armed = False
        self.in_flight = True

    def complete(self) -> None:
        """Deferred completion: wait for the launched reductions and write the averages into ``.grad``."""
        if not self.in_flight:
            raise RuntimeError("complete(): no reduction is in flight (call launch_now() first)")
        try:
            self._complete()
        finally:
            self.in_flight = False
            self._end_step()

    def _end_step(self) -> None:
        self.step += 1
        self._rebuild_due = self._wants_rebuild()
        self._reset()

    def _wants_rebuild(self) -> bool:
        """Whether the next synchronised forward rebuilds: after the first backward, a static graph's second."""
        return not self._rebuilt and self.step >= (2 if self.static_graph else 1)

    def set_static_graph(self) -> None:
        """Turn on ``static_graph`` before the first synchronised backward (torch's ``_set_static_graph``)."""
        if self.step or self._armed:
            raise RuntimeError(
                "_set_static_graph() must be called before the first backward: pass "
                "DistributedDataParallel(..., static_graph=True) instead"
            )
        self.static_graph = True
        self._rebuilt = False  # a static graph is rebuilt, even with find_unused_parameters

    def searches_unused(self) -> bool:
        """Whether this backward all-reduces a used-parameter map: unused parameters are searched for
        (without a static graph), or it is a static graph's first backward."""
        return (self.find_unused and not self.static_graph) or (self.static_graph and not self.static.counted)

    def _launch_rest(self) -> None:
        """Launch every bucket not launched yet and settle which parameters were used (for _complete)."""
        first_static = self.static_graph and not self.static.counted
        searched = self.searches_unused()
        if first_static:
            self._ready = self.static.first_done(self._hits)  # the first backward of a static graph reduces here
        elif self.static_graph and not self._started:
            self._started = True
            self._mark_static_unused()
        undefined = self._undefined
        local_used = [(r and i not in undefined) or u
                      for i, (r, u) in enumerate(zip(self._ready, self._used_since_sync))]
        self._used_since_sync = [False] * len(self.params)
        missing = [i for i, r in enumerate(self._ready) if not r]
        if not self.reduce_missing:
            for i in missing:
                grad = self.params[i].grad
                if grad is not None and not local_used[i]:
                    self._saved[i] = grad.clone()  # the bucket may reduce it in place: kept for a global miss
        for bucket in self.buckets[self._next_launch :]:
            if bucket.pending:
                bucket.pending = 0
                self._stage(bucket)
        self._launch_ready()
        assert self._next_launch == len(self.buckets), "every bucket must be launched by now"
        used = None
        if self.reduce_missing:
            used = [True] * len(self.params)
        elif searched:
            if not first_static and all(local_used):
                _warn_nothing_unused()
            used = self._all_ranks_used(local_used)
            if first_static:
                self.static.used = used
        elif self.static_graph:
            used = self.static.used
        elif missing:
            used = local_used
        self._launched = (first_static, missing, used)

    def _all_ranks_used(self, local_used: list[bool]) -> list[bool]:
        """Which parameters some rank used: the used-map all-reduced (every rank, after all of its buckets)."""
        if self.group is None or self.world_size == 1:
            return local_used
        flags = torch.tensor(local_used, dtype=torch.int32, device=self.comm_device())
        self.all_reduce_used_map(flags)
        self.last_used_flags = flags
        return flags.bool().tolist()

    def all_reduce_used_map(self, flags: torch.Tensor) -> None:
        """All-reduce a used-parameter map (a joined rank sends its last one; see :mod:`ddpkit.parallel.join`)."""
        events.collective("DDP all-reduce of the used-parameter map", step=self.step,
                          nbytes=flags.numel() * flags.element_size())
        dist.all_reduce(flags, group=self.group)

    def _complete(self) -> None:
        first_static, missing, used = self._launched
        self.wait_all()
        unused_here = set(missing) | self._undefined
        later_static = self.static_graph and not first_static
        short = self.static.short(missing) if later_static else []
        if later_static:
            unused_here |= self.static.unused_here()
        if short and used is not None:
            # The backward raises below: a parameter that got no gradient here keeps none (not the zeros it sent).
            used = [u and not (i in short and self.params[i].grad is None) for i, u in enumerate(used)]
        self.staging.write_back(self.buckets, self.params, unused_here, used, self._saved)
        if later_static or self.static.overcounted:
            self.static.check(self.names, self._hits, short)
        elif missing and not self.find_unused and not self.static_graph and not self.reduce_missing:
            names = ", ".join(repr(self.names[i]) for i in missing)
            raise UnusedParametersError(
                f"DistributedDataParallel: {len(missing)} parameter(s) got no gradient in this "
                f"backward: {names}. Every parameter that requires grad must take part in the "
                "loss of every synchronised step; if some legitimately do not (branches, frozen "
                "heads), construct DistributedDataParallel(..., find_unused_parameters=True), "
                "or set requires_grad=False on them before wrapping"
            )

    def wait_all(self) -> None:
        """Block until every bucket's reduction is done (the exposed part of communication)."""
        observed = self.observers.wait or self.observers.done
        start = time.perf_counter() if observed else 0.0
        for bucket in self.buckets:
            self.staging.collect(bucket)
        if observed:
            self.observers.waited(start, time.perf_counter(), self.step)

    def begin_shadow(self) -> None:
        """A joined rank's side of a backward begins (see :func:`ddpkit.parallel.join.shadow_backward`)."""
        self.rebuild_if_due()
        self._reset()
        if not self._rebuilt and not self._arrival:
            self._arrival = list(range(len(self.params)))  # torch's joined rank offers every parameter in order

    def end_shadow(self) -> None:
        """A joined rank's side of a backward is over: count it as this rank's step."""
        self.wait_all()
        self._end_step()

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Let ``hook(state, bucket)`` reduce each bucket; see :mod:`ddpkit.hooks`."""
        if self.comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once. (torch's "
                               "rule: one comm hook per model; to combine two, call one from the other)")
        if not callable(hook):
            raise TypeError(f"comm hook {hook!r} is not callable: pass hook(state, bucket) -> Future")
        self.comm_hook = hook
        self.comm_state = state
