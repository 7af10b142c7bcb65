"""Gradient buckets: which parameters share one, in what order, and how each is laid out in memory.

Definitions
-----------
bucket
    A flat tensor holding the gradients of several parameters of one dtype and
    device, reduced with a single collective (:class:`ddpkit.comm.bucket.GradBucket`).
    The assignment is torch's DDP's (:func:`assign_buckets`): a bucket closes
    once it holds at least its limit (:func:`ddpkit.parallel.common.bucket_caps.bucket_limits`).
initial assignment
    Before any gradient has been seen (:func:`initial_buckets`): registration
    order, buckets reversed so the last parameters, whose gradients come
    first, are in bucket 0. Until the rebuild torch puts every parameter in
    one bucket per dtype and device (unless it searches for unused
    parameters), which the reducer asks for with an unbounded limit.
rebuild
    After the first synchronised backward the buckets are assigned again in
    the order gradients actually arrived (see the reducer), which is what
    lets communication overlap the rest of backward.
sparse bucket
    A parameter that expects a sparse gradient (``nn.Embedding(sparse=True)``)
    has a bucket of its own with no memory: its gradient itself is reduced.
staging plan
    How a bucket's gradients get in (:class:`BucketSet`): parameters up to
    :data:`FUSED_MAX_BYTES` together by one fused copy when the bucket is
    complete (the Python cost per parameter would dominate), larger ones as
    soon as each is ready, while its gradient is still in cache.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ddpkit.comm.bucket import GradBucket
from ddpkit.runtime import events
from ddpkit.runtime.devices import comm_device

__all__ = ["FUSED_MAX_BYTES", "BucketLayout", "BucketSet", "StagingPlan", "assign_buckets", "initial_buckets",
           "payload", "sparse_zeros"]

FUSED_MAX_BYTES = 64 * 1024
"""Parameters up to this size are staged into their bucket by one fused copy per bucket."""


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


def sparse_zeros(param: torch.Tensor) -> torch.Tensor:
    """An empty sparse gradient for ``param``, laid out as an embedding's (one sparse dimension, rows dense)."""
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long, device=param.device),
                                   torch.empty(0, *param.shape[1:], dtype=param.dtype, device=param.device),
                                   param.shape, check_invariants=False)


class StagingPlan:
    """How one bucket's gradients are copied in (see the module notes)."""

    __slots__ = ("each", "eager", "fused_params", "fused_views")

    def __init__(self, bucket: GradBucket, as_view: bool) -> None:
        small = [p.numel() * p.element_size() <= FUSED_MAX_BYTES for p in bucket.params]
        self.fused_params = [p for p, f in zip(bucket.params, small) if f]
        self.fused_views = [v for v, f in zip(bucket.views, small) if f]
        self.each = [s for s, f in enumerate(small) if not f]
        """Positions staged one by one."""
        # A bucket of one is staged when it is ready, which is when its one gradient is; under
        # gradient_as_bucket_view the gradients already live in the bucket.
        self.eager = frozenset(self.each if len(bucket.params) > 1 and not as_view else ())
        """Positions staged the moment their gradient is ready."""


class BucketSet:
    """The buckets of one assignment, and for each parameter its bucket and its position there.

    Args:
        params: every parameter the reducer manages.
        indices: the assignment (lists of indices into ``params``), in launch order.
        sparse: per parameter, whether it expects a sparse gradient.
        as_view: ``gradient_as_bucket_view``: with ``previous``, gradients
            living in the previous set's buckets move into this one's.
        previous: the set this one replaces (a rebuild).
        materialize: give each bucket its memory now (else its engine does, and no staging plans are made).
    """

    def __init__(self, params: Sequence[torch.Tensor], indices: list[list[int]], sparse: Sequence[bool],
                 as_view: bool, previous: BucketSet | None = None, materialize: bool = True) -> None:
        self.buckets = [GradBucket(k, [params[i] for i in idx], idx, sparse=len(idx) == 1 and sparse[idx[0]],
                                   materialize=materialize)
                        for k, idx in enumerate(indices)]
        self.buckets[-1].last = True
        self.plans = [StagingPlan(b, as_view) for b in self.buckets] if materialize else []
        self.slot: list[GradBucket] = [None] * len(params)  # type: ignore[list-item]
        """Each parameter's bucket."""
        self.pos = [0] * len(params)
        """Each parameter's position in its bucket."""
        for bucket in self.buckets:
            for s, i in enumerate(bucket.indices):
                self.slot[i], self.pos[i] = bucket, s
        self.dtypes = [(p, bucket.flat.dtype) for bucket in self.buckets for p in bucket.params]
        """Each parameter and its bucket's dtype (:meth:`check_dtypes`)."""
        eager = [plan.eager for plan in self.plans] or [frozenset()] * len(self.buckets)
        self.route = [(b, s if s in eager[b.index()] else None) for b, s in zip(self.slot, self.pos)]
        """Each parameter's bucket, and its position there if it is staged the moment it is ready (what a
        gradient hook reads, in one look-up)."""
        if previous is not None and as_view:
            self._adopt(params, previous)

    def _adopt(self, params: Sequence[torch.Tensor], previous: BucketSet) -> None:
        """Gradients living in ``previous``'s buckets move into this set's."""
        for i, p in enumerate(params):
            was, now = previous.slot[i], self.slot[i]
            if was.sparse or now.sparse:
                continue
            if p.grad is not None and p.grad.data_ptr() == was.views[previous.pos[i]].data_ptr():
                view = now.views[self.pos[i]]
                view.copy_(p.grad)
                p.grad = view

    def indices(self) -> list[list[int]]:
        """The assignment: for each bucket, the indices of its parameters."""
        return [list(b.indices) for b in self.buckets]

    def reset(self) -> None:
        """Every bucket back to its state before a backward: nothing staged, launched or reduced."""
        for b in self.buckets:
            b.pending = len(b.indices)
            b.staged = set()
            b.work = None
            b.future = None
            b.target = b.flat
            b.set_buffer(b.flat)

    def check_dtypes(self, names: Sequence[str]) -> None:
        """:meth:`check_unchanged`, looking at dtypes only (cheap enough for every step)."""
        for p, dtype in self.dtypes:
            if p.dtype is not dtype:
                self.check_unchanged(names)

    def check_unchanged(self, names: Sequence[str]) -> None:
        """Raise if a parameter changed dtype or device since its bucket was made (a model cast or moved after
        wrapping: its bucket would convert its gradient, and torch's DDP stops averaging it without a word)."""
        for bucket in self.buckets:
            for p, i in zip(bucket.params, bucket.indices):
                if p.dtype != bucket.flat.dtype or p.device != bucket.flat.device:
                    raise RuntimeError(
                        f"DistributedDataParallel: parameter {names[i]!r} is {p.dtype} on {p.device}, but was "
                        f"{bucket.flat.dtype} on {bucket.flat.device} when the model was wrapped: cast or move the "
                        "model (.double(), .to(...)) before wrapping it, not after"
                    )


class BucketLayout:
    """A reducer's buckets over time: torch's first assignment, then (once) the rebuild in arrival order.

    Args:
        params: every parameter the reducer manages.
        sparse: per parameter, whether it expects a sparse gradient.
        as_view: ``gradient_as_bucket_view`` (gradients move with a rebuild).
        limits: bucket size limits in bytes of the rebuild (see :func:`assign_buckets`).
        first_limits: the limits of the first assignment.
        final: the first assignment is final (no rebuild comes).
        materialize: see :class:`BucketSet`.
    """

    @classmethod
    def for_ddp(cls, params: Sequence[torch.Tensor], sparse: Sequence[bool], as_view: bool, limits: list[int],
                caps_given: bool, find_unused: bool, static_graph: bool) -> BucketLayout:
        """torch's first assignment: one bucket per dtype and device unless unused parameters are searched
        for (or caps given), and then no rebuild ever comes (without a static graph)."""
        one = static_graph or not find_unused
        return cls(params, sparse, as_view, limits, [sys.maxsize] if one and not caps_given else limits,
                   final=find_unused and not static_graph)

    def __init__(self, params: Sequence[torch.Tensor], sparse: Sequence[bool], as_view: bool, limits: list[int],
                 first_limits: list[int], final: bool, materialize: bool = True) -> None:
        self.params, self.sparse, self.as_view, self.limits = params, sparse, as_view, limits
        self.materialize = materialize
        self.set: BucketSet | None = None
        self.arrival: list[int] = []
        """Parameter indices in the order their gradients arrived, until the rebuild."""
        self.final = final
        """Whether the buckets are final: after the rebuild, or from the start when none comes."""
        self.build(initial_buckets(params, first_limits, sparse))

    def build(self, indices: list[list[int]]) -> BucketSet:
        """Make the buckets of ``indices``, the old ones freed first (one set at a time, as in torch), except
        under ``gradient_as_bucket_view``, where the gradients in them move to the new ones."""
        previous = self.set if self.as_view else None
        self.set = None
        self.set = BucketSet(self.params, indices, self.sparse, self.as_view, previous, self.materialize)
        return self.set

    def rebuild_due(self, step: int, static_graph: bool) -> bool:
        """Whether the forward after ``step`` synchronised backwards rebuilds: after the first, a static graph's
        second; never once final."""
        return not self.final and step >= (2 if static_graph else 1)

    def order(self) -> list[int]:
        """The rebuild's order as this rank saw it: the arrivals, then the rest, last parameters first."""
        seen = set(self.arrival)
        return self.arrival + [i for i in reversed(range(len(self.params))) if i not in seen]

    def agreed_order(self, group: dist.ProcessGroup | None, owner: str, step: int) -> list[int]:
        """Rank 0's :meth:`order`, broadcast so every rank agrees (a collective over ``group``; this rank's own
        in a world of one)."""
        if group is None or dist.get_world_size(group) == 1:
            return self.order()
        t = torch.tensor(self.order(), dtype=torch.int64, device=comm_device(group, like=self.params[0]))
        events.collective("{} bucket rebuild: broadcast rank 0's gradient order", owner, step=step,
                          nbytes=t.numel() * t.element_size())
        dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
        return t.tolist()

    def rebuild(self, order: list[int], last_bucket_cap: bool = False) -> BucketSet:
        """Assign again in ``order`` (every rank's: rank 0's, broadcast); the buckets are final from now on.

        ``last_bucket_cap``: torch's ``DDP_SET_LAST_BUCKET_CAP=1``, buckets filled from the last gradient
        backwards, so the small first limit lands on the bucket reduced last.
        """
        self.final = True
        self.arrival = []
        if last_bucket_cap:
            indices = assign_buckets(self.params, order[::-1], self.limits, self.sparse)[::-1]
        else:
            indices = assign_buckets(self.params, order, self.limits, self.sparse)
        assert self.set is not None
        return self.set if indices == self.set.indices() else self.build(indices)


def payload(bucket: GradBucket) -> int:
    """Bytes the bucket's reduction hands to the collective."""
    t = bucket.target
    if t.is_sparse:
        return t._values().numel() * t.element_size() + t._indices().numel() * t._indices().element_size()
    return t.numel() * t.element_size()
