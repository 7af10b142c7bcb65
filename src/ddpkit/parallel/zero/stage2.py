"""ZeRO stage 2 in the reducer: each bucket reduce-scattered during backward, each rank keeping its shard only.

:class:`ShardedReducer` is the reducer of ``DistributedDataParallel(module,
zero_stage=2)``. It keeps the reducer's state machine (armed, ready, launch
order, finalisation; unused parameters, ``no_sync``) and changes what a
bucket's reduction is and where its result goes.

Layout
    The buckets are those DDP makes with ``find_unused_parameters`` before
    its rebuild (registration order reversed, the first bucket small, then
    ``bucket_cap_mb``), and they are never rebuilt: a rebuild would move the
    shards. A bucket's gradients, each parameter's elements in their logical
    order, concatenated and padded with zeros to a multiple of the world size
    ``W``, are cut into ``W`` equal chunks: rank ``r`` owns chunk ``r`` of
    every bucket. The parts of parameters that fall in a rank's chunks are its
    *segments* (:class:`Segment`). The parameters themselves are laid out the
    same way: each is a view of its place in its bucket's flat buffer (its
    ``.data`` moved there at wrapping, as DeepSpeed's stage 2 does), so this
    rank's chunk of that buffer is its parameter shard, the very memory the
    model reads, with no copy beside it. A parameter whose memory cannot move
    (not contiguous, e.g. a channels-last weight; or sharing its storage)
    keeps its own and is copied into the shard before each step and out of
    the buffer after it; one whose ``.data`` is replaced later is moved back
    at the next step.
Backward (synchronised)
    When a bucket's gradients are all ready (buckets go out in index order, as
    DDP's), they are copied, averaged by pre-scaling as DDP's are, into a
    buffer made for this bucket, each parameter's ``.grad`` is dropped, and
    the buffer is reduce-scattered: this rank receives the averaged chunk it
    owns into its persistent gradient shard. On NCCL that is NCCL's
    reduce-scatter; on gloo, whose reduce-scatter takes 2.5 times its
    all-reduce (100 MB at world 2 here: 270 ms against 110 ms), the buffer is
    all-reduced and this rank keeps its chunk (the bytes DDP sends, and the
    very sums; the direct reduce-scatter stage 3 uses on gloo would need a
    scratch of ``(W - 1) / W`` of a bucket, and it gained nothing measurable
    here on buckets this large). At most :data:`IN_FLIGHT` such
    buffers exist at once (launching one more waits for the oldest and frees
    it), so the gradient memory of a rank is its shards (``1/W`` of the
    gradients) and a couple of buckets, plus what autograd holds at a time.
    At the end of backward every ``.grad`` of the model is ``None``.
The step
    :class:`ddpkit.ZeroRedundancyOptimizer` over the model's parameters finds
    this reducer (:func:`sharded_reducer`) and steps this rank's segments
    (views of its parameter shards) with their averaged gradients;
    :meth:`ShardedReducer.gather_params` then all-gathers every bucket in
    place (each rank's shard is its chunk of the buffer; NCCL's all-gather; on
    gloo direct messages, where gloo's own all-gather is 1.4-2.7 times
    slower), so every replica ends the step identical.
``no_sync`` and gradient accumulation
    As under DDP: the gradients of a backward outside synchronisation stay in
    ``.grad`` (full size, locally), and the next synchronised backward reduces
    the sum.
``find_unused_parameters``
    A parameter that got no gradient here contributes zeros; one that no rank
    used gets no gradient in its segments, so the optimizer leaves it (and its
    state) alone, as an unsharded optimizer leaves a parameter whose ``.grad``
    is ``None``.

Refused, each with the reason: a comm hook (it would need whole buckets),
sparse gradients, ``gradient_as_bucket_view`` (the buckets do not persist),
``static_graph``, and ``join()``.
"""

from __future__ import annotations

import collections
import math
import time
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.comm.bucket import CommHook, GradBucket
from ddpkit.parallel.common.buckets import BucketLayout, payload
from ddpkit.parallel.common.reducer import Reducer
from ddpkit.parallel.common.unused import refuse_unused
from ddpkit.parallel.zero.flat import all_gather_flat
from ddpkit.runtime import events
from ddpkit.runtime.compat import reduce_scatter_tensor

__all__ = ["IN_FLIGHT", "Segment", "ShardedReducer", "sharded_reducer"]

IN_FLIGHT = 2
"""Gradient buffers that may exist at once (being reduced)."""

_BY_PARAM: dict[int, tuple[weakref.ref, weakref.ref]] = {}
"""id(parameter) -> (the parameter, its stage-2 reducer), both held weakly (a tensor cannot be a dict key)."""


def _owner(param: torch.Tensor) -> ShardedReducer | None:
    entry = _BY_PARAM.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def sharded_reducer(params: Sequence[torch.Tensor]) -> ShardedReducer | None:
    """The stage-2 reducer whose gradients ``params`` are (``None``: none of them is sharded).

    Raises:
        ValueError: the parameters belong to several sharded models, or to one and to none.
    """
    found = {id(r): r for p in params if (r := _owner(p)) is not None}
    if not found:
        return None
    if len(found) > 1:
        raise ValueError("these parameters belong to several DistributedDataParallel(zero_stage=2) models: give "
                         "each model its own ZeroRedundancyOptimizer")
    return next(iter(found.values()))


def _forget(ids: list[int], reducer: weakref.ref) -> None:
    for i in ids:
        if i in _BY_PARAM and _BY_PARAM[i][1] is reducer:
            del _BY_PARAM[i]


@dataclass(frozen=True)
class Segment:
    """The part of one parameter that falls in this rank's chunk of one bucket."""

    param: int
    """The parameter's index in the reducer."""
    bucket: int
    start: int
    """First element of the parameter (logical order) in the segment."""
    stop: int
    offset: int
    """Where the segment starts in the bucket's shard."""


class ShardedReducer(Reducer):
    """ZeRO stage 2's reducer (see the module notes); the arguments are :class:`Reducer`'s that apply."""

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], *, process_group: dist.ProcessGroup | None,
                 bucket_cap_mb: float | None = None, bucket_cap_mb_list: Sequence[float] | None = None,
                 find_unused_parameters: bool = False, expect_sparse: Sequence[bool] | None = None,
                 owner: str = "DDP") -> None:
        sparse = [n for (n, _), s in zip(named_params, expect_sparse or [False] * len(named_params)) if s]
        if sparse:
            raise ValueError(f"zero_stage=2 cannot shard sparse gradients ({', '.join(sparse)}): use "
                             "sparse=False embeddings, or zero_stage=0 with ZeroRedundancyOptimizer (stage 1)")
        super().__init__(named_params, process_group=process_group, bucket_cap_mb=bucket_cap_mb,
                         bucket_cap_mb_list=bucket_cap_mb_list, find_unused_parameters=find_unused_parameters,
                         owner=owner)
        self.rank = 0 if process_group is None else dist.get_rank(process_group)
        self.chunks = [math.ceil(b.numel / self.world_size) for b in self.buckets]
        """Each bucket's chunk: the elements of its shard on every rank."""
        self.offsets: dict[int, tuple[int, int]] = {}
        """Each parameter's bucket and its first element there."""
        for b in self.buckets:
            offset = 0
            for i, p in zip(b.indices, b.params):
                self.offsets[i] = (b.index(), offset)
                offset += p.numel()
        like = [b.params[0] for b in self.buckets]
        self.grad_shards = [torch.zeros(c, dtype=p.dtype, device=p.device) for c, p in zip(self.chunks, like)]
        """This rank's averaged gradients: its chunk of each bucket."""
        self.flats = [torch.zeros(c * self.world_size, dtype=p.dtype, device=p.device)
                      for c, p in zip(self.chunks, like)]
        """Each bucket's parameters, flat and padded: the memory of the parameters that live in it (see
        :meth:`_home`), all-gathered in place after each step."""
        self.param_shards = [f[self.rank * c : (self.rank + 1) * c] for f, c in zip(self.flats, self.chunks)]
        """This rank's parameters: its chunk of each bucket's flat buffer (the optimizer's tensors)."""
        self.segments = self.segments_of(self.rank)
        users = collections.Counter(q.untyped_storage().data_ptr() for q in self.params)
        self._homes = [self._home(i, users[p.untyped_storage().data_ptr()] > 1) for i, p in enumerate(self.params)]
        """Each parameter's view of its bucket's flat buffer if it lives there, else ``None`` (copied in and
        out at each step)."""
        self._copied = [seg for seg in self.segments if self._homes[seg.param] is None]
        self.used: list[bool] = [True] * len(self.params)
        """Which parameters got a gradient on some rank in the last synchronised backward."""
        self.fresh = False
        """A synchronised backward has filled the gradient shards since the last step."""
        self._warned_unstepped = False
        self._in_flight: collections.deque[GradBucket] = collections.deque()
        self._spare: list[torch.Tensor] = []
        """Bucket-sized buffers given back, reused by the next ones (see :meth:`_buffer`)."""
        self.native = process_group is not None and dist.get_backend(process_group) == "nccl"
        """Reduce-scatter with the backend's own collective (NCCL), else see the module notes."""
        self.load_param_shards()
        me = weakref.ref(self)
        for p in self.params:
            _BY_PARAM[id(p)] = (weakref.ref(p), me)
        weakref.finalize(self, _forget, [id(p) for p in self.params], me)

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] = ()) -> None:
        if self.fresh and not self._warned_unstepped:
            # Not an error: a step skipped on purpose (a NaN check) is the same loss under any stage.
            self._warned_unstepped = True
            warnings.warn(
                f"{self.owner}(zero_stage=2): the gradients of the last synchronised backward were not stepped on "
                "before this forward, and the next backward replaces them. Stage 2 keeps only this rank's shard of "
                "each gradient (every .grad is None), which only ddpkit.ZeroRedundancyOptimizer(model.parameters(), "
                "optimizer_class, ...) steps on: a torch optimizer over the parameters finds no gradient and does "
                "nothing. To accumulate over several backwards, run all but the last under no_sync()",
                RuntimeWarning, stacklevel=3)
        super().prepare_for_backward(outputs)

    def _make_layout(self, sparse: list[bool], as_view: bool, caps_given: bool) -> BucketLayout:
        del as_view, caps_given
        return BucketLayout(self.params, sparse, False, self.limits, self.limits, final=True, materialize=False)

    # -- the shards -----------------------------------------------------------------------------

    def segments_of(self, rank: int) -> list[Segment]:
        """The segments rank ``rank`` owns, bucket by bucket, in bucket order."""
        out = []
        for b in self.buckets:
            k = b.index()
            low, high = rank * self.chunks[k], (rank + 1) * self.chunks[k]
            for i, p in zip(b.indices, b.params):
                start = self.offsets[i][1]
                a, z = max(start, low), min(start + p.numel(), high)
                if a < z:
                    out.append(Segment(i, k, a - start, z - start, a - low))
        return out

    def segment_view(self, shards: list[torch.Tensor], seg: Segment) -> torch.Tensor:
        return shards[seg.bucket][seg.offset : seg.offset + seg.stop - seg.start]

    def _home(self, index: int, shared: bool = False) -> torch.Tensor | None:
        """Make parameter ``index`` a view of its place in its bucket's flat buffer (its values copied there);
        the view, or ``None`` for a parameter that keeps its own memory: a strided layout other than the
        contiguous one (a channels-last weight keeps its layout, as under DDP), or memory it does not own alone
        (``shared`` with another parameter: a tie the move would cut; or a view of a larger tensor)."""
        p = self.params[index]
        if shared or not p.is_contiguous() or p.untyped_storage().nbytes() != p.numel() * p.element_size():
            return None
        k, offset = self.offsets[index]
        home = self.flats[k][offset : offset + p.numel()].view(p.shape)
        with torch.no_grad():
            home.copy_(p)
        p.data = home
        return home

    @torch.no_grad()
    def load_param_shards(self) -> None:
        """Bring the parameters' values into this rank's shards (before each step).

        A parameter living in its bucket's buffer is there already; one whose memory was replaced since
        (``param.data = ...``) is moved back, its new values with it; the others are copied in.
        """
        moved = [i for i, home in enumerate(self._homes) if home is not None and self.params[i].data_ptr() !=
                 home.data_ptr()]
        for i in moved:
            self._homes[i] = self._home(i)
        if moved:
            self._copied = [seg for seg in self.segments if self._homes[seg.param] is None]
        for seg in self._copied:
            flat = self.params[seg.param].detach().reshape(-1)
            self.segment_view(self.param_shards, seg).copy_(flat[seg.start : seg.stop])

    def take_gradients(self) -> list[bool] | None:
        """The used flags of the synchronised backward since the last step (``None``: there was none)."""
        if not self.fresh:
            return None
        self.fresh = False
        return self.used

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather every bucket's parameter shards in place, into the bucket's flat buffer (a collective,
        bucket by bucket); the parameters that keep their own memory are copied out of it."""
        works = []
        for b in self.buckets:
            k = b.index()
            work = None
            if self.world_size > 1:
                events.collective("{} bucket {} all-gather of the parameters", self.owner, k,
                                  nbytes=self.param_shards[k].numel() * self.param_shards[k].element_size())
                work = all_gather_flat(self.flats[k], self.param_shards[k], self.group, async_op=True)
            works.append((b, work))
        for b, work in works:
            if work is not None:
                work.wait()
            self._copy_out(b)
        # Changed in place through the buffer, which autograd does not see: as a copy into each would (and
        # as an optimizer stepping it would), so a graph that saved one before the step refuses to use it.
        torch.autograd.graph.increment_version([p for p, home in zip(self.params, self._homes) if home is not None])

    @torch.no_grad()
    def _copy_out(self, bucket: GradBucket) -> None:
        """The parameters of ``bucket`` that keep their own memory get their gathered values."""
        flat = self.flats[bucket.index()]
        for i, p in zip(bucket.indices, bucket.params):
            if self._homes[i] is None:
                offset = self.offsets[i][1]
                p.copy_(flat[offset : offset + p.numel()].view(p.shape))

    def _buffer(self, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of bucket ``k``'s padded size: one given back earlier if there is one, else new.

        New memory costs its page faults on every use (glibc maps each large block afresh and unmaps it when
        freed): a 100 MB bucket's buffer 90 ms here, more than its all-reduce. The buffers given back are reused
        within one backward and dropped at its end.
        """
        n = self.chunks[k] * self.world_size
        for i, t in enumerate(self._spare):
            if t.numel() == n and t.dtype == dtype and t.device == device:
                return self._spare.pop(i)
        return torch.empty(n, dtype=dtype, device=device)

    def _give_back(self, flat: torch.Tensor) -> None:
        """Keep ``flat`` for :meth:`_buffer`: at most as many as are ever alive at once (the newest)."""
        if flat.numel():
            self._spare.append(flat)
            del self._spare[: -(IN_FLIGHT + 1)]

    # -- the reducer's steps, sharded ----------------------------------------------------------

    @torch.no_grad()
    def _stage(self, bucket: GradBucket) -> None:
        """The bucket's gradients, averaged, into a buffer of its own; every ``.grad`` of the bucket dropped."""
        k = bucket.index()
        first = bucket.params[0]
        flat = self._buffer(k, first.dtype, first.device)
        divide = self._divide()
        offset = 0
        for s, p in enumerate(bucket.params):
            view = flat[offset : offset + p.numel()].view(p.shape)
            grad = p.grad
            if grad is None:
                view.zero_()
            elif grad.is_sparse:
                raise RuntimeError(f"parameter {self.names[bucket.indices[s]]!r} has a sparse gradient, which "
                                   "zero_stage=2 cannot shard: make it dense")
            elif divide is not None:
                torch.mul(grad, 1.0 / divide, out=view)  # DDP's averaging by pre-scaling: the same products
            else:
                view.copy_(grad)
            offset += p.numel()
            p.grad = None
        flat[offset:].zero_()
        bucket.flat = bucket.target = flat
        bucket.set_buffer(flat)
        if self.observers.ready:
            self.observers.bucket_ready(k, payload(bucket), self.step)

    def launch(self, bucket: GradBucket) -> None:
        """Reduce-scatter the bucket's buffer into this rank's gradient shard (asynchronous)."""
        while len(self._in_flight) >= IN_FLIGHT:
            self._release(self._in_flight.popleft())
        k = bucket.index()
        if self.world_size == 1:
            self.grad_shards[k].copy_(bucket.flat)
        elif self.native:
            events.collective("{} bucket {} reduce-scatter", self.owner, k, step=self.step, nbytes=payload(bucket))
            bucket.work = reduce_scatter_tensor(self.grad_shards[k], bucket.flat, group=self.group, async_op=True)
        else:
            events.collective("{} bucket {} all-reduce (kept: this rank's chunk)", self.owner, k, step=self.step,
                              nbytes=payload(bucket))
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
        self._in_flight.append(bucket)
        if self.observers.launch or self.observers.done:
            self.observers.launched(bucket, payload(bucket), self.step)

    def _release(self, bucket: GradBucket) -> None:
        """Wait for the bucket's reduction, keep this rank's chunk, free the buffer."""
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
            if not self.native:
                k = bucket.index()
                self.grad_shards[k].copy_(bucket.flat[self.rank * self.chunks[k] : (self.rank + 1) * self.chunks[k]])
        self._give_back(bucket.flat)
        empty = bucket.flat.new_empty(0)
        bucket.flat = bucket.target = empty
        bucket.set_buffer(empty)

    def wait_all(self) -> None:
        observed = self.observers.wait or self.observers.done
        start = time.perf_counter() if observed else 0.0
        while self._in_flight:
            self._release(self._in_flight.popleft())
        if observed:
            self.observers.waited(start, time.perf_counter(), self.step)

    def _complete(self) -> None:
        _, missing, used = self._launched
        self.wait_all()
        self._spare.clear()  # nothing reuses them before the next backward: not held through the step
        for p in self.params:
            p.grad = None  # a parameter missing here was staged at the end, its gradient with it
        if missing and not self.find_unused and not self.reduce_missing:
            refuse_unused(self.names, missing)
        self.used = list(used) if used is not None else [True] * len(self.params)
        self.fresh = True

    # -- what stage 2 cannot do ----------------------------------------------------------------

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        raise RuntimeError("a comm hook reduces whole buckets, and zero_stage=2 reduce-scatters them: use "
                           "zero_stage=0 (with ZeroRedundancyOptimizer for stage 1) to use a comm hook")

    def set_static_graph(self) -> None:
        raise RuntimeError("static_graph is not supported with zero_stage=2: drop one of them")

    def begin_shadow(self) -> None:
        raise RuntimeError("join() is not supported with zero_stage=2")
