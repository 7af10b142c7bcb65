"""The gradient-synchronisation engine behind :class:`ddpkit.DistributedDataParallel`.

Definitions
-----------
bucket
    A flat tensor holding the gradients of several parameters of one dtype and
    device, reduced with a single collective. The layout is torch's DDP's
    (:func:`assign_buckets`): a bucket closes once it holds at least its
    limit. Until the rebuild every parameter shares one bucket per dtype and
    device (with ``find_unused_parameters``: registration order, limits as
    below, bucket 0 holding the last parameters); the rebuild then fills
    buckets in gradient arrival order, the first up to :data:`FIRST_BUCKET_MB`
    when ``bucket_cap_mb`` is left at ``None`` (torch's rule; a value given
    caps it too) so the first gradients go out early, the others
    ``bucket_cap_mb``.
ready
    A parameter is ready when autograd has accumulated its gradient for this
    backward (``Tensor.register_post_accumulate_grad_hook``). When the last
    parameter of a bucket is ready, the bucket's gradients are copied into it
    (pre-scaled by ``1 / world_size`` when no comm hook is registered: fused
    into the copy for large parameters, one fused copy and one fused scale for
    all the small ones) and the bucket is launched: an asynchronous
    all-reduce, or the comm hook's future.
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
    As in torch: with ``find_unused_parameters`` (and no static graph) never,
    and with a static graph after the second backward (the first only counts).
    It happens at the next forward with grad enabled, a ``no_sync()`` one
    too. ``DDP_SET_LAST_BUCKET_CAP=1`` (torch's switch) fills buckets from
    the last gradient backwards, so the small first limit lands on the
    bucket reduced last.

static graph
    With ``static_graph=True`` the first synchronised backward only counts the
    gradients each parameter gets and reduces every bucket at its end (so
    reentrant checkpointing, where gradients arrive inside a nested backward,
    and parameters used several times both work). From then on a parameter
    is ready after as many gradients as it got then, parameters unused then
    are ready at once (no search), and a parameter that gets more, or fewer,
    gradients raises torch's "training graph has changed" error.
join
    A rank that has run out of inputs calls :meth:`Reducer.shadow_backward`
    once per backward the others still run: the same collectives, in the same
    order, with zeros.
deferred completion
    With ``complete_at_end_of_backward=False`` (``DistributedOptimizer``) the
    end of backward only launches what is left; the reductions run on while
    the caller does other work, and :meth:`Reducer.complete` waits and writes
    ``.grad`` (``synchronize()``). :meth:`Reducer.launch_now` reduces whatever
    ``.grad`` holds when no synchronised backward ran. A gradient that arrives
    while a reduction is in flight calls ``on_overrun``.

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

sparse buckets
    A parameter that expects a sparse gradient has a bucket of its own with no
    memory: its gradient is divided by the world size (without a comm hook)
    and all-reduced itself, and stays sparse in ``.grad``, as in torch. One
    without a gradient sends an empty sparse tensor.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ddpkit.comm.bucket import CommHook, GradBucket
from ddpkit.runtime import stall
from ddpkit.runtime.group import settle_at_exit

DEFAULT_BUCKET_CAP_MB = 25.0
"""torch's default bucket cap in MiB."""
FIRST_BUCKET_MB = 1.0
"""Cap of the first bucket (per dtype and device) in MiB when the cap is left at its default (torch's)."""
_UNBOUNDED = sys.maxsize
_MIB = 1024 * 1024
_FUSED_MAX_BYTES = 64 * 1024
"""Parameters up to this size are staged into their bucket by one fused copy per bucket."""

class UnusedParametersError(RuntimeError):
    """Parameters got no gradient in a synchronised backward without ``find_unused_parameters``."""


def assign_buckets(params: Sequence[torch.Tensor], order: Sequence[int], limits: Sequence[int],
                   sparse: Sequence[bool] | None = None) -> list[list[int]]:
    """Group parameters into buckets, walking them in ``order``: torch's ``compute_bucket_assignment_by_size``.

    Each (dtype, device) has its own open bucket. A parameter joins its open
    bucket, and the bucket closes once it holds at least its limit: the first
    bucket of each key ``limits[0]``, the second ``limits[1]``, and so on, the
    last limit for every bucket after. So a bucket may end larger than its
    limit by its last parameter, and a parameter larger than the limit shares
    its bucket with those before it.

    Args:
        params: the parameters; only their numel, element size, dtype and
            device are read.
        order: indices into ``params``: the order to fill buckets in.
        limits: bucket size limits in bytes, in the order buckets close.
        sparse: per parameter, whether its gradient is sparse: such a
            parameter gets a bucket of its own, closed at once.

    Returns:
        The buckets (lists of indices into ``params``) in the order they
        closed, then the ones left open, the key seen last first (torch's
        order).
    """
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed: dict[tuple, int] = {}
    done: list[list[int]] = []
    for i in order:
        if sparse and sparse[i]:
            done.append([i])
            continue
        p = params[i]
        key = (p.dtype, p.device)
        open_buckets.setdefault(key, []).append(i)
        open_bytes[key] = open_bytes.get(key, 0) + p.numel() * p.element_size()
        if open_bytes[key] >= limits[min(closed.get(key, 0), len(limits) - 1)]:
            done.append(open_buckets.pop(key))
            open_bytes[key] = 0
            closed[key] = closed.get(key, 0) + 1
    # torch emits the buckets left open by walking its hash map of keys, which
    # (libstdc++) holds them newest key first.
    done.extend(open_buckets[k] for k in reversed(list(open_bytes)) if open_buckets.get(k))
    return done


def initial_buckets(params: Sequence[torch.Tensor], limits: Sequence[int],
                    sparse: Sequence[bool] | None = None) -> list[list[int]]:
    """The assignment before any gradient has been seen, as torch's DDP makes it.

    Parameters are grouped in registration order (each bucket keeps that
    order inside), and the buckets are then reversed, so the last parameters,
    whose gradients usually come first, are in bucket 0. The first limit
    therefore applies to the bucket of the *first* parameters: their
    gradients come last, and a small bucket for them leaves little to reduce
    after backward.
    """
    buckets = assign_buckets(params, range(len(params)), limits, sparse)
    buckets.sort(key=lambda b: b[0])
    return buckets[::-1]


def _sparse_zeros(param: torch.Tensor) -> torch.Tensor:
    """An empty sparse gradient for ``param``, laid out as an embedding's (one sparse dimension, rows dense)."""
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long, device=param.device),
                                   torch.empty(0, *param.shape[1:], dtype=param.dtype, device=param.device),
                                   param.shape, check_invariants=False)


def _hook_params(reducer: Reducer) -> None:
    """Call ``reducer._on_hook(index, param)`` each time a parameter's gradient has been accumulated.

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
            owner._on_hook(index[id(param)], param)

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


class Reducer:
    """Buckets the gradients of ``named_params`` and all-reduces them during backward.

    Args:
        named_params: (name, parameter) of every parameter that requires grad,
            identical in order and shape on every rank.
        process_group: the group to reduce over; ``None`` for a world of one
            without a process group (no communication).
        bucket_cap_mb: bucket cap in MiB. ``None``: torch's default, 25 MiB
            with a first bucket of :data:`FIRST_BUCKET_MB`; a value given caps
            the first bucket too (torch's rule).
        bucket_caps_mb: one cap per bucket in MiB, the last for every bucket
            after (torch's ``bucket_cap_mb_list``); replaces ``bucket_cap_mb``,
            before the rebuild too.
        find_unused_parameters: reduce zeros for parameters without a gradient
            instead of raising; parameters unused on every rank keep ``.grad``.
        gradient_as_bucket_view: make each ``.grad`` a view into bucket memory.
        static_graph: the first synchronised backward fixes how many
            gradients each parameter gets per backward (see the module notes).
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
    ) -> None:
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.sparse = list(expect_sparse) if expect_sparse is not None else [False] * len(self.params)
        self.sparse_as_dense = sparse_as_dense
        self.group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        self.div_factor = self.world_size
        if self.world_size > 1:
            settle_at_exit()  # this reducer's collectives' tensors are Python's: see settle_at_exit
        """What the no-hook path divides gradients by: the world size, or under
        ``join(divide_by_initial_world_size=False)`` the ranks not yet joined."""
        if bucket_caps_mb:
            self.limits = [int(c * _MIB) for c in bucket_caps_mb]
        else:
            cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * _MIB)
            first = int(FIRST_BUCKET_MB * _MIB) if bucket_cap_mb is None else cap
            self.limits = [first, cap] if first < cap else [cap]
        """Bucket size limits in bytes of the rebuild, in the order buckets close (see :func:`assign_buckets`)."""
        self.find_unused = find_unused_parameters
        self.as_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.reduce_missing = reduce_missing
        self.complete_at_end_of_backward = complete_at_end_of_backward
        self.in_flight = False
        """Deferred completion: the reductions of a backward are launched and not yet collected."""
        self.on_local_backward: Callable[[], None] | None = None
        """Called at the end of each backward that produced gradients while not armed."""
        self.on_overrun: Callable[[str], None] | None = None
        """Called (and expected to raise) when a gradient arrives while a reduction is in flight."""
        self._local_task = -1
        self.owner = "DDP"
        """Who drives this reducer, as the stall inspector names its collectives."""
        self.comm_hook: CommHook | None = None
        self.comm_state: Any = None
        self.buckets: list[GradBucket] = []
        self._slot: list[GradBucket] = []
        """Each parameter's bucket, and (``_pos``) its position there."""
        self._pos: list[int] = []
        # torch's first assignment: one bucket per dtype and device unless
        # unused parameters are searched for (the rebuild then never comes).
        one = static_graph or not find_unused_parameters
        self._build(initial_buckets(self.params, [_UNBOUNDED] if one and not bucket_caps_mb else self.limits,
                                    self.sparse))
        self._arrival: list[int] = []
        self._step = 0
        """Synchronised backwards so far (named in the stall inspector's reports)."""
        self._rebuilt = find_unused_parameters and not static_graph
        """Whether the buckets are final: after the rebuild, or from the start when none comes (torch's rule:
        no rebuild while searching for unused parameters without a static graph)."""
        self._rebuild_due = False
        # Static graph: gradients per parameter per backward, and which
        # parameters were used on some rank, both from the first backward.
        self._expected: list[int] | None = None
        self._static_used: list[bool] | None = None
        self._last_used_flags: torch.Tensor | None = None
        # Per-iteration state, reset by _reset().
        self._armed = False
        self._started = False
        self._ready = [False] * len(self.params)
        self._hits = [0] * len(self.params)
        self._used_since_sync = [False] * len(self.params)
        self._next_launch = 0
        self._callback_queued = False
        _hook_params(self)

    # -- buckets -------------------------------------------------------------

    def _build(self, indices: list[list[int]]) -> None:
        # The old buckets go before the new ones are made, so there is one set at a time (as in torch), except
        # under gradient_as_bucket_view, where the gradients in them move to the new ones below.
        old = (self._slot, self._pos) if self.as_view and self._slot else None
        self.buckets, self._slot = [], []
        self.buckets = [
            GradBucket(k, [self.params[i] for i in idx], idx, sparse=len(idx) == 1 and self.sparse[idx[0]])
            for k, idx in enumerate(indices)
        ]
        self.buckets[-1]._is_last = True
        self._slot = [None] * len(self.params)  # type: ignore[list-item]
        self._pos = [0] * len(self.params)
        for bucket in self.buckets:
            for s, i in enumerate(bucket.indices):
                self._slot[i], self._pos[i] = bucket, s
            # Small parameters are staged together when the bucket completes,
            # one fused copy for all of them (the Python cost per parameter
            # would dominate); large ones as soon as they are ready, while
            # their gradient is still in cache, scaled on the way in (one pass).
            small = [p.numel() * p.element_size() <= _FUSED_MAX_BYTES for p in bucket._params]
            bucket._fused = (
                [p for p, f in zip(bucket._params, small) if f], [v for v, f in zip(bucket.views, small) if f],
                [s for s, f in enumerate(small) if not f],
            )
            # A bucket of one is reduced in place instead (see _stage).
            bucket._eager = frozenset(bucket._fused[2] if len(bucket._params) > 1 and not self.as_view else ())
        if old is not None:
            # Gradients living in the old buckets move to the new ones.
            for i, p in enumerate(self.params):
                was, now = old[0][i].views, self._slot[i]
                if old[0][i].sparse or now.sparse:
                    continue
                if p.grad is not None and p.grad.data_ptr() == was[old[1][i]].data_ptr():
                    view = now.views[self._pos[i]]
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
            t = torch.tensor(order, dtype=torch.int64, device=self._comm_device())
            stall.enter("{} bucket rebuild: broadcast rank 0's gradient order", self.owner, step=self._step)
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

    def _comm_device(self) -> torch.device:
        """Where small bookkeeping tensors go for a collective: NCCL needs the GPU."""
        return self.params[0].device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

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
        if self._step < 2:
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
            for p, i in zip(bucket._params, bucket.indices):
                if p.dtype != bucket.flat.dtype or p.device != bucket.flat.device:
                    raise RuntimeError(
                        f"DistributedDataParallel: parameter {self.names[i]!r} is {p.dtype} on {p.device}, but was "
                        f"{bucket.flat.dtype} on {bucket.flat.device} when the model was wrapped: cast or move the "
                        "model (.double(), .to(...)) before wrapping it, not after"
                    )

    def rebuild_if_due(self) -> None:
        """Rebuild the buckets if the rebuild is due (a collective: every rank calls it at the same point).

        DDP calls it at every forward with grad enabled, ``no_sync()`` ones
        included, as torch's DDP does; :meth:`prepare_for_backward` too.
        """
        if self._rebuild_due:
            self._rebuild_due = False
            self._rebuild()

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
        """Parameters whose hook ran without a gradient in this backward (see the hook)."""
        self._overcounted: dict[int, int] = {}
        """Static graph: parameters that got more gradients than in the first backward (index: how many)."""
        for b in self.buckets:
            b.pending = len(b.indices)
            b.staged = set()
            b.work = None
            b.future = None
            b._buffer = b.target = b.flat

    def _on_hook(self, index: int, param: torch.Tensor) -> None:
        """Parameter ``index``'s gradient has been accumulated (see :func:`_hook_params`)."""
        # Autograd also calls the hook with no gradient (an output the loss
        # left out passes None through DDP's sink): the parameter is ready
        # but, as torch counts it, used only if it holds a gradient.
        if self._armed:
            # Counted only where torch keeps a used-map: unused parameters searched for, or a
            # static graph's first backward. Plain DDP reduces zeros for it and writes them back.
            if (self.find_unused or self.static_graph) and self._expected is None and param.grad is None:
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
            hits = self._hits[index] = self._hits[index] + 1
            if self._expected is None:
                # First backward: count only; everything is reduced at its end.
                return
            if not self._started:
                self._started = True
                self._mark_static_unused()
            if hits > self._expected[index]:
                # Raised at the end of this backward, once every bucket is out: the other ranks, whose graph
                # may not have changed, are waiting in those all-reduces.
                self._overcounted.setdefault(index, hits)
                return
            if hits < self._expected[index]:
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

    def _mark_ready(self, index: int) -> bool:
        """Count ``index`` in; stage its bucket if that completes it (returns whether it did)."""
        self._ready[index] = True
        bucket, s = self._slot[index], self._pos[index]
        if s in bucket._eager:
            self._stage_one(bucket, s, self._factor())
            bucket.staged.add(s)
        bucket.pending -= 1
        if bucket.pending:
            return False
        self._stage(bucket)
        return True

    def _mark_static_unused(self) -> None:
        """Static graph: parameters without gradients in the first backward are ready at once."""
        for i, n in enumerate(self._expected or ()):
            if n == 0:
                grad = self.params[i].grad
                if grad is not None and not self._used_since_sync[i]:
                    self._saved[i] = grad.clone()  # kept if no rank uses it (see _write_back)
                self._mark_ready(i)
        self._launch_ready()

    def _stage(self, bucket: GradBucket) -> None:
        """Put the bucket's gradients into the bucket, scaled by ``1 / div_factor`` without a hook.

        A parameter without ``.grad`` contributes zeros; one whose gradient
        did not arrive in this backward contributes the gradient it holds
        (accumulated under ``no_sync``), as torch's reducer does.
        """
        if bucket.sparse:
            self._stage_sparse(bucket)
            return
        factor = self._factor()
        params = bucket._params
        if len(params) == 1 and not self.as_view:
            grad = params[0].grad
            if grad is not None and not grad.is_sparse and grad.is_contiguous() and grad.dtype == bucket.flat.dtype:
                # A bucket of one: reduce the gradient where it lies, saving the
                # copy into the bucket and the copy back (a full pass each way).
                bucket.target = bucket._buffer = grad.detach().view(-1)
                if factor is not None:
                    grad.mul_(factor)
                return
        each: Sequence[int] = range(len(params))
        if not self.as_view:
            fused_params, fused_views, each = bucket._fused
            if fused_params:
                grads = [p.grad for p in fused_params]
                if any(g is None or g.is_sparse for g in grads):
                    each = range(len(params))
                else:
                    torch._foreach_copy_(fused_views, grads)
                    if factor is not None:
                        if len(fused_views) == len(params):
                            bucket.flat.mul_(factor)  # the same products, one kernel
                        else:
                            torch._foreach_mul_(fused_views, factor)
        for s in each:
            if s not in bucket.staged:
                self._stage_one(bucket, s, factor)

    def _stage_sparse(self, bucket: GradBucket) -> None:
        """A sparse gradient is reduced itself, divided first when no comm hook averages it (torch's rule).

        A parameter without a gradient contributes an empty sparse tensor (zeros), where torch's reducer
        would stop with "Expected sparse gradient to be defined".
        """
        param, index = bucket._params[0], bucket.indices[0]
        grad = param.grad
        if grad is None:
            grad = _sparse_zeros(param)
        elif not grad.is_sparse:
            raise RuntimeError(
                f"parameter {self.names[index]!r} belongs to an embedding with sparse=True but got a dense "
                "gradient: keep its gradients sparse, or construct the embedding with sparse=False"
            )
        elif self.comm_hook is None and self.div_factor != 1:
            grad.div_(self.div_factor)
        bucket.target = bucket._buffer = grad

    def _factor(self) -> float | None:
        """What staging scales gradients by: ``1 / div_factor`` without a comm hook."""
        return 1.0 / self.div_factor if self.comm_hook is None and self.div_factor != 1 else None

    def _stage_one(self, bucket: GradBucket, s: int, factor: float | None) -> None:
        view = bucket.views[s]
        param = bucket._params[s]
        grad = param.grad
        if grad is None:
            view.zero_()
            return
        if grad.is_sparse and self.sparse_as_dense:
            grad = param.grad = grad.to_dense()
        elif grad.is_sparse:
            name = self.names[bucket.indices[s]]
            if self.owner != "DDP":
                raise RuntimeError(f"parameter {name!r} has a sparse gradient, which {self.owner} reduces only "
                                   "made dense: pass sparse_as_dense=True (Horovod's option)")
            raise RuntimeError(
                f"parameter {name!r} has a sparse gradient, but DDP expects sparse gradients only from "
                "nn.Embedding / nn.EmbeddingBag(sparse=True) (torch's rule): make the gradient dense, or "
                "produce it with one of those"
            )
        if grad.data_ptr() == view.data_ptr():
            if factor is not None:
                view.div_(self.div_factor)
            return
        if factor is not None:
            # The no-hook path averages by pre-scaling, fused into the copy.
            torch.mul(grad.detach(), factor, out=view)
        else:
            view.copy_(grad.detach())
        if self.as_view:
            param.grad = view

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: GradBucket) -> None:
        # Reached in bucket index order on every rank (see _launch_ready): the
        # collectives match across ranks whatever order gradients arrive in.
        if self.world_size > 1:
            stall.enter("{} bucket {} all-reduce", self.owner, bucket._index, step=self._step)
        if self.comm_hook is not None:
            future = self.comm_hook(self.comm_state, bucket)
            if not isinstance(future, torch._C.Future):  # torch.futures.Future, or a collective's own
                hook = getattr(self.comm_hook, "__qualname__", None) or repr(self.comm_hook)
                raise RuntimeError(
                    f"comm hook {hook} returned {type(future).__name__} for bucket {bucket._index}; a comm hook "
                    "must return a torch.futures.Future object holding the reduced bucket, e.g. "
                    "dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])"
                )
            bucket.future = future
        elif self.world_size > 1:
            bucket.work = dist.all_reduce(bucket.target, group=self.group, async_op=True)

    def _finish_backward(self) -> None:
        """End of backward: launch the rest; unless deferred, wait and write ``.grad``.

        A pass through the outputs in which no parameter's hook ran (a
        ``torch.autograd.grad`` through the model for a gradient penalty, which
        accumulates nothing) is not the synchronised backward: the reducer
        stays armed for the ``backward()`` that follows, as torch's does.
        """
        if not self._undefined and not any(self._ready) and not any(self._hits):
            self._callback_queued = False
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
        self._step += 1
        self._rebuild_due = self._wants_rebuild()
        self._reset()

    def _wants_rebuild(self) -> bool:
        """Whether the next synchronised forward rebuilds: after the first backward, a static graph's second."""
        return not self._rebuilt and self._step >= (2 if self.static_graph else 1)

    @property
    def static_counted(self) -> bool:
        """Static graph: whether the first synchronised backward has counted each parameter's gradients."""
        return self._expected is not None

    def set_static_graph(self) -> None:
        """Turn on ``static_graph`` before the first synchronised backward (torch's ``_set_static_graph``)."""
        if self._step or self._armed:
            raise RuntimeError(
                "_set_static_graph() must be called before the first backward: pass "
                "DistributedDataParallel(..., static_graph=True) instead"
            )
        self.static_graph = True
        self._rebuilt = False  # a static graph is rebuilt, even with find_unused_parameters

    def _launch_rest(self) -> None:
        """Launch every bucket not launched yet and settle which parameters were used (for _complete)."""
        first_static = self.static_graph and self._expected is None
        if first_static:
            # The first backward of a static graph reduces everything here.
            self._expected = list(self._hits)
            self._ready = [h > 0 for h in self._hits]
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
        elif (self.find_unused and not self.static_graph) or first_static:
            if not first_static and all(local_used):
                _warn_nothing_unused()
            if self.group is not None and self.world_size > 1:
                # Every rank issues it, whether or not it missed a gradient itself,
                # and after all of its buckets: the collectives line up everywhere.
                flags = torch.tensor(local_used, dtype=torch.int32, device=self._comm_device())
                stall.enter("DDP all-reduce of the used-parameter map", step=self._step)
                dist.all_reduce(flags, group=self.group)
                self._last_used_flags = flags
                used = flags.bool().tolist()
            else:
                used = local_used
            if first_static:
                self._static_used = used
        elif self.static_graph:
            used = self._static_used
        elif missing:
            used = local_used
        self._launched = (first_static, missing, used)

    def _complete(self) -> None:
        first_static, missing, used = self._launched
        self._wait_all()
        unused_here = set(missing) | self._undefined
        if self.static_graph and not first_static:
            unused_here.update(i for i, n in enumerate(self._expected) if n == 0)  # type: ignore[arg-type]
            unused_here.update(i for i, u in enumerate(self._static_used or ()) if not u)
        short = [i for i in missing if self._expected[i] > 0] if self.static_graph and not first_static else []  # type: ignore[index]
        if short and used is not None:
            # The backward raises below: a parameter that got no gradient here keeps none (not the zeros it sent).
            used = [u and not (i in short and self.params[i].grad is None) for i, u in enumerate(used)]
        self._write_back(unused_here, used, self._saved)
        if self._overcounted:
            index, hits = next(iter(self._overcounted.items()))  # the first to get one gradient too many
            raise RuntimeError(
                f"DistributedDataParallel(static_graph=True): parameter {self.names[index]!r} got "
                f"gradient #{hits} in this backward but {self._expected[index]} in the first one. Your "  # type: ignore[index]
                "training graph has changed in this iteration, e.g., one parameter is unused in first "
                "iteration, but then got used in this iteration. this is not compatible with "
                "static_graph set to True"
            )
        if self.static_graph and not first_static:
            if short:
                names = ", ".join(f"{self.names[i]!r} ({self._hits[i]} of {self._expected[i]})" for i in short)  # type: ignore[index]
                raise RuntimeError(
                    f"DistributedDataParallel(static_graph=True): fewer gradients than in the first "
                    f"backward for {names}. Your training graph has changed in this iteration; "
                    "static_graph=True needs the same graph every iteration"
                )
        elif missing and not self.find_unused and not self.static_graph and not self.reduce_missing:
            names = ", ".join(repr(self.names[i]) for i in missing)
            raise UnusedParametersError(
                f"DistributedDataParallel: {len(missing)} parameter(s) got no gradient in this "
                f"backward: {names}. Every parameter that requires grad must take part in the "
                "loss of every synchronised step; if some legitimately do not (branches, frozen "
                "heads), construct DistributedDataParallel(..., find_unused_parameters=True), "
                "or set requires_grad=False on them before wrapping"
            )

    def _write_back(self, unused_here: set[int], used: list[bool] | None, saved: dict[int, torch.Tensor]) -> None:
        """Leave the averages in ``.grad``; a parameter no rank used keeps what it had."""
        for bucket in self.buckets:
            skip = [s for s, i in enumerate(bucket.indices) if i in unused_here and not used[i]] if unused_here else []  # type: ignore[index]
            for s in skip:
                i = bucket.indices[s]
                if i in saved:
                    self.params[i].grad.copy_(saved[i])  # type: ignore[union-attr]
            if bucket.sparse:
                param = bucket._params[0]
                if not skip and param.grad is None:
                    param.grad = bucket.target  # it had none: the zeros it sent came back as the average
                continue
            if bucket.target is not bucket.flat:
                continue  # reduced in place: .grad holds the average already
            if not self.as_view and not skip:
                grads = [p.grad for p in bucket._params]
                if not any(g is None for g in grads):
                    torch._foreach_copy_(grads, bucket.views)
                    continue
            for s, p in enumerate(bucket._params):
                if s in skip:
                    continue
                view = bucket.views[s]
                if self.as_view:
                    if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view
                elif p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)

    def _wait_all(self) -> None:
        """Block until every bucket's reduction is done (the exposed part of communication)."""
        for bucket in self.buckets:
            self._wait(bucket)

    def _wait(self, bucket: GradBucket) -> None:
        if bucket.future is not None:
            result = bucket.future.wait()
            if isinstance(result, (list, tuple)) and len(result) == 1:
                result = result[0]  # all_reduce's own future, returned as it is
            size = bucket.target.numel()
            if not isinstance(result, torch.Tensor) or (not bucket.sparse and result.numel() != size):
                what = f"a tensor of {result.numel()} elements" if isinstance(result, torch.Tensor) else \
                    type(result).__name__
                raise RuntimeError(
                    f"the comm hook's future for bucket {bucket._index} holds {what}; it must hold the reduced "
                    f"bucket, a tensor of {size} elements (bucket.buffer() after the reduction)"
                )
            if bucket.sparse:
                if result is not bucket.target:
                    bucket.target.copy_(result)
            elif result.data_ptr() != bucket.target.data_ptr():
                bucket.target.copy_(result.view(-1))
        elif bucket.work is not None:
            bucket.work.wait()

    def shadow_backward(self) -> None:
        """A joined rank's side of a synchronised backward that the other ranks run.

        Issues the same collectives in the same order as :meth:`_finalize`
        does on a rank that trains, contributing zeros (``Join``'s contract),
        and leaves this rank's gradients alone.
        """
        self.rebuild_if_due()
        self._reset()
        if not self._rebuilt and not self._arrival:
            self._arrival = list(range(len(self.params)))  # torch's joined rank offers every parameter in order
        for bucket in self.buckets:
            if bucket.sparse:
                bucket._buffer = bucket.target = _sparse_zeros(bucket._params[0])
            else:
                bucket._buffer = bucket.target = torch.zeros_like(bucket.flat)
            self._launch(bucket)
        first_static = self.static_graph and self._expected is None
        if ((self.find_unused and not self.static_graph) or first_static) and self.world_size > 1:
            # torch's joined rank sends the used-map of its own last backward.
            flags = self._last_used_flags
            if flags is None:
                flags = torch.zeros(len(self.params), dtype=torch.int32, device=self._comm_device())
            stall.enter("DDP all-reduce of the used-parameter map", step=self._step)
            dist.all_reduce(flags, group=self.group)
        self._wait_all()
        self._step += 1
        self._rebuild_due = self._wants_rebuild()
        self._reset()

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Let ``hook(state, bucket)`` reduce each bucket; see :mod:`ddpkit.hooks`."""
        if self.comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once. (torch's rule: one comm hook per model; to combine two, call one from the other)")
        if not callable(hook):
            raise TypeError(f"comm hook {hook!r} is not callable: pass hook(state, bucket) -> Future")
        self.comm_hook = hook
        self.comm_state = state
