"""The gradient-synchronisation engine behind :class:`ddpkit.DistributedDataParallel`: one backward's state machine.

Each part it drives has a module: buckets and their assignment
(:mod:`~ddpkit.parallel.common.buckets`, :mod:`~ddpkit.parallel.common.bucket_caps`),
gradients into buckets and back (:mod:`~ddpkit.parallel.common.staging`), unused
parameters (:mod:`~ddpkit.parallel.common.unused`), ``static_graph``
(:mod:`~ddpkit.parallel.common.static_graph`), a joined rank's side
(:mod:`~ddpkit.parallel.ddp.join`, over :mod:`~ddpkit.parallel.common.join_context`), deferred completion
(:mod:`~ddpkit.parallel.common.deferred`) and observers (:mod:`~ddpkit.parallel.common.observer`).

States of one synchronised backward
-----------------------------------
Each is a :class:`Phase`; the moves between them are :data:`MOVES` (any other raises).

idle
    No synchronised backward is expected: a gradient accumulates locally (``no_sync()``, or no forward armed it).
armed
    A forward that will be followed by a synchronised backward calls :meth:`Reducer.prepare_for_backward`. The
    hooks take the short path when nothing but the buckets is counted (buckets final, no unused-parameter search,
    no static graph, no logged iteration), chosen here.
queued
    The end-of-backward callback is queued on the backward now running: by the first gradient, or by DDP's output
    sink before any.
seeded
    A static graph's later backward: the parameters its first backward did not use are marked ready (once).
in flight
    Deferred completion only (:mod:`~ddpkit.parallel.common.deferred`): every bucket is launched, backward has
    returned, and the reductions run on until the caller collects them.
ready
    A parameter is ready when autograd has accumulated its gradient for this backward (with a static graph, its last
    gradient). Large parameters are copied into their bucket at once; when the last parameter of a bucket is ready
    the rest are, and the bucket is *launched*: an asynchronous all-reduce, or the comm hook's future.
launch order
    Buckets are launched strictly in index order (a ready bucket waits for its predecessors), so every rank issues
    the same collectives in the same order whatever order its gradients arrive in.
finalisation
    At the end of backward (the autograd engine's queued callback, queued by the first gradient or by DDP's output
    sink) the reducer launches whatever is left, waits for every bucket and writes the averages into ``.grad``. A
    pass in which no parameter's hook ran (``torch.autograd.grad`` through the model) is not the synchronised
    backward: the reducer stays armed.
rebuild
    After the first synchronised backward (a static graph: the second) the buckets are assigned again in rank 0's
    gradient arrival order, at the next forward with grad enabled (``no_sync()`` ones too). Never with
    ``find_unused_parameters`` and no static graph (torch's rules). Where the assignment stands is an
    :class:`Assignment`.

Failure modes, each naming the parameter: no gradient (see :mod:`~ddpkit.parallel.common.unused`); ready twice in one
backward without ``static_graph``; a sparse gradient where none is expected, or the reverse; a model cast after
wrapping (at any synchronised forward) or moved (at its first backward).
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ddpkit.comm.bucket import CommHook, GradBucket, check_hook_fits, check_hook_future, check_new_hook
from ddpkit.parallel.common import static_graph as sg
from ddpkit.parallel.common.bucket_caps import bucket_limits
from ddpkit.parallel.common.buckets import BucketLayout, payload
from ddpkit.parallel.common.grad_hooks import hook_gradients
from ddpkit.parallel.common.observer import Observer, ObserverHandle, Observers
from ddpkit.parallel.common.staging import Staging
from ddpkit.parallel.common.unused import UnusedParametersError, all_ranks_used, refuse_unused, warn_nothing_unused
from ddpkit.runtime import events
from ddpkit.runtime.group import finish_backend_at_exit
from ddpkit.runtime.states import check_move

__all__ = ["MOVES", "Assignment", "Phase", "Reducer", "UnusedParametersError"]


class Phase(enum.Enum):
    """Where one synchronised backward stands (the module notes' states); its moves are :data:`MOVES`."""

    IDLE = "idle"
    ARMED = "armed"
    QUEUED = "queued"
    SEEDED = "seeded"
    IN_FLIGHT = "in flight"

    @property
    def armed(self) -> bool:
        """A synchronised backward is expected or running: gradients go into buckets."""
        return self in (Phase.ARMED, Phase.QUEUED, Phase.SEEDED)


MOVES: dict[Phase, frozenset[Phase]] = {
    # Armed by a forward; idle again is idempotent (disarm(), a reset of a reducer that was not armed).
    Phase.IDLE: frozenset({Phase.IDLE, Phase.ARMED}),
    # The first gradient or DDP's sink queues the callback; launch_now() launches from here (deferred completion),
    # seeding a static graph first; disarm(), a new forward, or an error makes it idle.
    Phase.ARMED: frozenset({Phase.IDLE, Phase.QUEUED, Phase.SEEDED, Phase.IN_FLIGHT}),
    # A callback that finds no hook ran (torch.autograd.grad through the model) leaves it armed; the end of the
    # backward makes it idle, or in flight under deferred completion.
    Phase.QUEUED: frozenset({Phase.IDLE, Phase.ARMED, Phase.SEEDED, Phase.IN_FLIGHT}),
    Phase.SEEDED: frozenset({Phase.IDLE, Phase.IN_FLIGHT}),
    Phase.IN_FLIGHT: frozenset({Phase.IDLE}),  # collected (complete()), or given up by an error
}
"""The moves a reducer's :class:`Phase` may make; any other is a bug (:meth:`Reducer._become` raises)."""


class Assignment(enum.Enum):
    """Where the assignment of parameters to buckets stands (the module notes' *rebuild*)."""

    FIRST = "first"
    """The first assignment: a rebuild may come (:attr:`BucketLayout.final` says whether one will)."""
    DUE = "due"
    """The rebuild is due at the next forward with grad enabled."""
    REBUILT = "rebuilt"
    """Assigned again in the gradients' arrival order: final."""


ASSIGNMENT_MOVES: dict[Assignment, frozenset[Assignment]] = {
    Assignment.FIRST: frozenset({Assignment.DUE, Assignment.REBUILT}),  # REBUILT: one a checkpoint recorded
    Assignment.DUE: frozenset({Assignment.REBUILT}),
    Assignment.REBUILT: frozenset(),
}
"""The moves of :class:`Assignment`; any other is a bug (:meth:`Reducer._assign` raises)."""


class Reducer:
    """Buckets the gradients of ``named_params`` and all-reduces them during backward.

    Args:
        named_params: (name, parameter) of every parameter that requires grad, identical in order and shape on
            every rank.
        process_group: the group to reduce over; ``None`` for a world of one without a process group.
        bucket_cap_mb: the cap in MiB (see :func:`ddpkit.parallel.common.bucket_caps.bucket_limits`).
        bucket_cap_mb_list: one cap per bucket in MiB; replaces ``bucket_cap_mb``, before the rebuild too.
        find_unused_parameters: see :mod:`ddpkit.parallel.common.unused`.
        gradient_as_bucket_view: make each ``.grad`` a view into bucket memory.
        static_graph: see :mod:`ddpkit.parallel.common.static_graph`.
        reduce_missing: a parameter without a gradient is reduced as zeros and gets the average as ``.grad``
            (Horovod's rule), with no search and no error.
        expect_sparse: per parameter, whether its gradient is sparse (torch's ``expect_sparse_gradient``): it
            gets a bucket of its own.
        sparse_as_dense: a sparse gradient where a dense one is expected is made dense in ``.grad`` and reduced
            as such (Horovod's option).
        owner: who drives this reducer, as errors and the stall inspector name it.
        skip_unused: a bucket of unused parameters is not reduced (see :mod:`~ddpkit.parallel.common.unused`).
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        *,
        process_group: dist.ProcessGroup | None,
        bucket_cap_mb: float | None = None,
        bucket_cap_mb_list: Sequence[float] | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        reduce_missing: bool = False,
        expect_sparse: Sequence[bool] | None = None,
        sparse_as_dense: bool = False,
        owner: str = "DDP",
        skip_unused: bool = False,
    ) -> None:
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        if self.world_size > 1:
            finish_backend_at_exit()  # this reducer's collectives' tensors are Python's: see finish_backend_at_exit
        self.div_factor = self.world_size
        """What the no-hook path divides gradients by: the world size, or under
        ``join(divide_by_initial_world_size=False)`` the ranks not yet joined."""
        self.limits = bucket_limits(bucket_cap_mb, bucket_cap_mb_list)
        """Bucket size limits in bytes of the rebuild, in the order buckets close."""
        self.find_unused, self.static_graph, self.reduce_missing = find_unused_parameters, static_graph, reduce_missing
        self.owner = owner
        self.skip_unused = skip_unused
        self.staging = Staging(self.names, owner, gradient_as_bucket_view, sparse_as_dense)
        self.observers = Observers(owner)
        """Attached with :meth:`add_observer`; see :mod:`ddpkit.parallel.common.observer`."""
        self.comm_hook: CommHook | None = None
        self.comm_state: Any = None  # what register_comm_hook gave the hook
        sparse = list(expect_sparse) if expect_sparse is not None else [False] * len(self.params)
        self.layout = self._make_layout(sparse, gradient_as_bucket_view, bool(bucket_cap_mb_list))
        self._adopt_buckets()
        self.step = 0
        """Synchronised backwards so far (named in the stall inspector's reports and in events)."""
        self.assignment = Assignment.FIRST
        self.ready_order: list[int] | None = None
        """When a list, the indices of parameters as their gradients become ready (DDP's logging data)."""
        self.unused_here: list[int] = []
        """Parameters this rank did not use in the last backward that searched for them."""
        self.unused_searches = 0
        """Backwards that searched for unused parameters (:attr:`unused_here`) so far."""
        self.unreached: list[int] = []
        """Parameters the last backward that searched for unused ones did not reach at all (no hook ran: not in
        the graph of the forward's outputs), whatever a ``no_sync()`` backward used: the set torch's DDP searches
        its forward's outputs for."""
        self.static = sg.StaticGraph()
        self.last_used_flags: torch.Tensor | None = None
        """The used-parameter map of the last backward (a joined rank sends it while it shadows)."""
        self.phase = Phase.IDLE
        """Where the synchronised backward stands; changed by :meth:`_become` only."""
        cls = type(self)  # the paths are the class's functions: a bound method kept here would make a cycle, and
        # the reducer (its buckets, its gradient hooks) must go when its last reference does
        self._armed_path: Callable[[Reducer, int, torch.Tensor], None] = cls._counted_gradient
        """What a gradient does while armed: the short path or the counted one, chosen by each arming."""
        self._path: Callable[[Reducer, int, torch.Tensor], None] = cls._unarmed_gradient
        """What a gradient does in the current phase (:meth:`on_gradient`)."""
        self._reset()
        self._used_since_sync = [False] * len(self.params)
        self.outside: list[Any] = []  # the wrapper's own collectives still running (join's): see launch
        hook_gradients(self, self.params)

    def _make_layout(self, sparse: list[bool], as_view: bool, caps_given: bool) -> BucketLayout:
        """torch's first assignment (:meth:`BucketLayout.for_ddp`); ZeRO stage 2's reducer makes its own."""
        return BucketLayout.for_ddp(self.params, sparse, as_view, self.limits, caps_given, self.find_unused,
                                    self.static_graph)

    def _adopt_buckets(self) -> None:
        """Read the layout's current buckets into the fields the gradient hooks use."""
        current = self.layout.set
        assert current is not None
        self.buckets, self._slot, self._plans, self._route = current.buckets, current.slot, current.plans, current.route

    def rebuild_if_due(self) -> bool:
        """Rebuild the buckets if due (a collective, at every forward with grad enabled); whether it did."""
        if self.assignment is not Assignment.DUE:
            return False
        # The old set goes before the new one is made (see BucketLayout.build): no reference is left here.
        self.buckets, self._slot, self._plans, self._route = [], [], [], []
        order = self.layout.agreed_order(self.group, self.owner, self.step)
        self.layout.rebuild(order, last_bucket_cap=os.environ.get("DDP_SET_LAST_BUCKET_CAP") == "1")
        self._adopt_buckets()
        self._assign(Assignment.REBUILT)
        return True

    def bucket_indices(self) -> list[list[int]]:
        """Each bucket's parameters (indices into ``named_params``), as the gradients are reduced now."""
        return [list(b.indices) for b in self.buckets]

    @property
    def buckets_final(self) -> bool:
        """No rebuild will come: the buckets were rebuilt, or the first assignment is final (unused parameters
        searched for without a static graph). Before, :meth:`bucket_indices` are not the ones the run goes on in."""
        return self.layout.final

    def restore_buckets(self, indices: Sequence[Sequence[int]]) -> None:
        """Take the final assignment that :attr:`BucketSet.indices` of a run of this model recorded, before the
        first backward: a resumed run reduces in the saved run's buckets from its first step (a comm hook that
        keeps state per bucket, PowerSGD's, needs them), and no rebuild comes.

        Raises:
            RuntimeError: after a synchronised backward, or once the buckets were rebuilt.
            ValueError: ``indices`` is not each of this reducer's parameters once.
        """
        if self.step or self.assignment is not Assignment.FIRST:
            raise RuntimeError(f"{self.owner}: restore the buckets before the first backward (this reducer has "
                               f"synchronised {self.step} and its buckets are {self.assignment.value})")
        wanted = [[int(i) for i in bucket] for bucket in indices]
        flat = [i for bucket in wanted for i in bucket]
        if sorted(flat) != list(range(len(self.params))) or not all(wanted):
            raise ValueError(f"{self.owner}: the saved buckets {wanted} do not hold each of the {len(self.params)} "
                             "parameters once: a checkpoint of another model?")
        for bucket in wanted:
            kinds = {(self.params[i].dtype, self.params[i].device) for i in bucket}
            if len(kinds) > 1 or (len(bucket) > 1 and any(self.layout.sparse[i] for i in bucket)):
                raise ValueError(f"{self.owner}: the saved bucket {bucket} mixes dtypes or devices, or holds a "
                                 "sparse gradient beside others: a checkpoint of another model (or of this one "
                                 "before a cast)?")
        if self.layout.final:  # the first assignment is final: nothing to take, only to check
            if wanted != self.bucket_indices():
                raise ValueError(f"{self.owner}: this reducer's buckets {self.bucket_indices()} are final from the "
                                 f"start (unused parameters are searched for), not the saved {wanted}")
            return
        self.buckets, self._slot, self._plans, self._route = [], [], [], []  # the old set goes first (see rebuild)
        self.layout.final, self.layout.arrival = True, []
        self.layout.build(wanted)
        self._adopt_buckets()
        self._assign(Assignment.REBUILT)

    @property
    def rebuilt(self) -> bool:
        """The buckets were assigned again (DDP's logging data: ``has_rebuilt_buckets``)."""
        return self.assignment is Assignment.REBUILT

    def _assign(self, assignment: Assignment) -> None:
        """Move the bucket assignment's state (the only place it changes)."""
        check_move(ASSIGNMENT_MOVES, self.assignment, assignment, f"{self.owner}: the bucket assignment")
        self.assignment = assignment

    def _become(self, phase: Phase) -> None:
        """Move the backward's :class:`Phase` (the only place it changes; :data:`MOVES` says which moves exist)."""
        check_move(MOVES, self.phase, phase, f"{self.owner}: the gradient reducer")
        self.phase = phase
        if phase is Phase.ARMED:
            self._path = type(self)._first_gradient
        else:
            self._path = self._armed_path if phase.armed else type(self)._unarmed_gradient

    def add_observer(self, observer: Observer) -> ObserverHandle:
        """Call ``observer``'s methods at this reducer's events (see :mod:`ddpkit.parallel.common.observer`)."""
        return self.observers.add(observer)

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] = ()) -> None:
        """Arm the hooks for the next backward; called by every forward that syncs. ``outputs``: torch's signature
        (Accelerate's ``trigger_sync_in_backward`` passes ``[]``); unused parameters are found at the end of
        backward, without it."""
        del outputs
        self.rebuild_if_due()
        if self.step < 2:  # where a move after wrapping shows
            self.layout.set.check_unchanged(self.names)  # type: ignore[union-attr]
        else:  # a cast, at any step (a dtype's look per parameter): its bucket would convert its gradient
            self.layout.set.check_dtypes(self.names)  # type: ignore[union-attr]
        self._reset()
        # Nothing but the buckets to count: the gradient hooks take the short path.
        plain = not self.find_unused and not self.static_graph and self.layout.final and self.ready_order is None
        self._armed_path = type(self)._plain_gradient if plain else type(self)._counted_gradient
        self._become(Phase.ARMED)

    def _rebuild_buckets(self) -> bool:  # torch's name, called by Lightning and Accelerate
        return self.rebuild_if_due()

    def _delay_all_reduce(self) -> None:
        """torch's flush of a static graph's first backward (Lightning calls it): that backward reduced at its end."""

    def disarm(self) -> None:
        """Let the next backward accumulate locally (``no_sync``)."""
        self._reset()

    def _reset(self) -> None:
        self._become(Phase.IDLE)
        self._next_launch = 0
        self._ready = [False] * len(self.params)
        self._hits = [0] * len(self.params)
        self._saved: dict[int, torch.Tensor] = {}
        self._undefined: set[int] = set()  # parameters whose hook ran without a gradient
        self.static.reset()
        self.layout.set.reset()  # type: ignore[union-attr]

    def on_gradient(self, index: int, param: torch.Tensor) -> None:
        """Parameter ``index``'s gradient has been accumulated (its post-accumulate-grad hook)."""
        self._path(self, index, param)  # chosen by the phase (and, armed, by the arming): no test per gradient

    def _first_gradient(self, index: int, param: torch.Tensor) -> None:
        """Armed, the backward's first gradient: queue the end-of-backward callback (queued from now on), then as
        the arming chose."""
        self._queue_finish()
        self._armed_path(self, index, param)

    def _plain_gradient(self, index: int, param: torch.Tensor) -> None:
        """Armed, nothing but the buckets to count: check and count, stage nothing until a bucket is complete."""
        # Paid for every parameter in every backward of the common case.
        if self._ready[index]:
            self._twice(index)
        if self._mark_ready(index):
            self._launch_ready()

    def _counted_gradient(self, index: int, param: torch.Tensor) -> None:
        """Armed, with unused parameters searched for, a static graph, buckets not final or a logged iteration."""
        # Autograd also calls the hook with no gradient (an output the loss left out passes None through DDP's sink):
        # the parameter is ready but, as torch counts it, used only if it holds a gradient. Counted only where torch
        # keeps a used-map: unused parameters searched for, or a static graph's first backward. Plain DDP reduces
        # zeros for it and writes them back.
        if (self.find_unused or self.static_graph) and not self.static.counted and param.grad is None:
            self._undefined.add(index)
        self._on_ready(index)

    def _unarmed_gradient(self, index: int, param: torch.Tensor) -> None:
        """A gradient outside a synchronised backward (``no_sync``, or the reducer not armed)."""
        if self.find_unused and param.grad is not None:
            # Used in a no_sync() backward: its accumulated gradient must be reduced by the next synchronised backward
            # even if that one does not use it (torch records local use the same way).
            self._used_since_sync[index] = True

    def expect_backward(self) -> None:
        """Queue the end-of-backward callback on the backward now running (see :mod:`ddpkit.parallel.ddp.sink`)."""
        self._queue_finish()

    def _queue_finish(self) -> None:
        """Armed: queue the end-of-backward callback (once; queued or seeded, it is)."""
        if self.phase is Phase.ARMED:
            Variable._execution_engine.queue_callback(self._finish_backward)
            self._become(Phase.QUEUED)

    def _on_ready(self, index: int) -> None:
        self._queue_finish()
        if self.static_graph:
            self._hits[index] += 1
            if not self.static.counted:
                return  # the first backward counts only; everything is reduced at its end
            if self.phase is not Phase.SEEDED:
                self._become(Phase.SEEDED)
                self._mark_static_unused()
            # Too many is raised at the end of this backward, once every bucket is out: the other ranks, whose graph
            # may not have changed, are waiting in those all-reduces.
            if self.static.count(index, self._hits[index]) != sg.READY:
                return
        elif self._ready[index]:
            self._twice(index)
        if not self.layout.final:
            self.layout.arrival.append(index)
        if self.ready_order is not None:
            self.ready_order.append(index)
        if self._mark_ready(index):
            self._launch_ready()

    def _twice(self, index: int) -> None:
        raise twice_error(self.names[index])

    def _divide(self) -> int | None:
        """What staging averages over: ``div_factor`` without a comm hook (None: nothing to divide)."""
        return self.div_factor if self.comm_hook is None and self.div_factor != 1 else None

    def _mark_ready(self, index: int) -> bool:
        """Count ``index`` in; stage its bucket if that completes it (returns whether it did)."""
        self._ready[index] = True
        bucket, eager = self._route[index]
        if eager is not None:
            self.staging.stage_one(bucket, eager, self._divide())
            bucket.staged.add(eager)
        bucket.pending -= 1
        if bucket.pending:
            return False
        self._stage(bucket)
        return True

    def _stage(self, bucket: GradBucket) -> None:
        self.staging.stage(bucket, self._plans[bucket.index()], self._divide())
        if self.observers.ready:
            self.observers.bucket_ready(bucket.index(), payload(bucket), self.step)

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
        # Reached in bucket index order on every rank (_launch_ready): the collectives match whatever the arrival order.
        if self.skip_unused and self._skipped(bucket):
            return
        if bucket.sparse:  # alone on the group (see Staging.drain_before_sparse)
            self.staging.drain_before_sparse(self.buckets[: bucket.index()], self.outside)
        observed = self.observers.launch or self.observers.done
        # Measured before the launch: gloo's sparse all-reduce replaces its input's indices and values on its thread.
        nbytes = payload(bucket) if observed or self.world_size > 1 else 0
        if self.world_size > 1:
            events.collective("{} bucket {} all-reduce", self.owner, bucket.index(), step=self.step,
                              nbytes=0 if self.comm_hook is not None else nbytes)
        if self.comm_hook is not None:
            if bucket.index() == 0:
                check_hook_fits(self.comm_hook, self.group, len(self.buckets), bucket.buffer().device)
            bucket.future = check_hook_future(self.comm_hook, self.comm_hook(self.comm_state, bucket), bucket)
        elif self.world_size > 1:
            bucket.work = dist.all_reduce(bucket.target, group=self.group, async_op=True)
        if bucket.sparse:
            self.staging.collect(bucket)
        if observed:
            self.observers.launched(bucket, nbytes, self.step)

    def _skipped(self, bucket: GradBucket) -> bool:
        """Whether ``skip_unused`` leaves the bucket unreduced (the rule: :mod:`~ddpkit.parallel.common.unused`)."""
        if self.static_graph:
            used = self.static.used if self.static.counted else None
            return used is not None and not any(used[i] for i in bucket.indices)
        return self.find_unused and not any(
            (self._ready[i] and i not in self._undefined) or self._used_since_sync[i] for i in bucket.indices)

    def _finish_backward(self) -> None:
        """End of backward: launch the rest; unless deferred, wait and write ``.grad``."""
        if not self._undefined and not any(self._ready) and not any(self._hits):
            if self.phase is Phase.QUEUED:
                self._become(Phase.ARMED)  # no hook ran: not the synchronised backward (see the module notes)
            return
        self._end_of_backward()

    def _end_of_backward(self) -> None:
        """The synchronised backward's end: launch the rest, wait, write ``.grad``."""
        try:
            self._launch_rest()
            self._complete()
        finally:
            self._end_step()

    def _end_step(self) -> None:
        self.step += 1
        self.outside.clear()
        if self.assignment is Assignment.FIRST and self.layout.rebuild_due(self.step, self.static_graph):
            self._assign(Assignment.DUE)
        self._reset()

    def set_static_graph(self) -> None:
        """Turn on ``static_graph`` before the first synchronised backward (torch's ``_set_static_graph``)."""
        if self.step or self.phase is not Phase.IDLE:
            raise RuntimeError("_set_static_graph() must be called before the first backward: pass "
                               "DistributedDataParallel(..., static_graph=True) instead")
        self.static_graph = True
        if self.assignment is not Assignment.REBUILT:  # (buckets a checkpoint gave are final)
            self.layout.final = False  # a static graph is rebuilt, even with find_unused_parameters

    def searches_unused(self) -> bool:
        """Whether this backward all-reduces a used-parameter map (see :mod:`ddpkit.parallel.common.unused`)."""
        return (self.find_unused and not self.static_graph) or (self.static_graph and not self.static.counted)

    def _launch_rest(self) -> None:
        """Launch every bucket not launched yet and note which parameters were used (for _complete)."""
        first_static = self.static_graph and not self.static.counted
        searched = self.searches_unused()
        if first_static:
            self._ready = self.static.first_done(self._hits)  # the first backward of a static graph reduces here
        elif self.static_graph and self.phase is not Phase.SEEDED:
            self._become(Phase.SEEDED)
            self._mark_static_unused()
        missing = [i for i, r in enumerate(self._ready) if not r] if False in self._ready else []
        local_used = [(r and i not in self._undefined) or u for i, (r, u) in
                      enumerate(zip(self._ready, self._used_since_sync))] if searched or missing else []
        if searched and not first_static:
            self.unused_here = [i for i, u in enumerate(local_used) if not u]
            self.unreached = missing
            self.unused_searches += 1
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
        self._used_since_sync = [False] * len(self.params)
        used = None
        if self.reduce_missing:
            used = [True] * len(self.params)
        elif searched:
            if not first_static and all(local_used):
                warn_nothing_unused()
            if self.world_size > 1:  # every rank, after all of its buckets: the collectives line up
                used, self.last_used_flags = all_ranks_used(local_used, self.group, self.step, self.params[0])
            else:
                used = local_used
            if first_static:
                self.static.used = used
        elif self.static_graph:
            used = self.static.used
        elif missing:
            used = local_used
        self._launched = (first_static, missing, used)

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
            refuse_unused(self.names, missing)

    def wait_all(self) -> None:
        """Block until every bucket's reduction is done (the exposed part of communication)."""
        observed = self.observers.wait or self.observers.done
        start = time.perf_counter() if observed else 0.0
        for bucket in self.buckets:
            self.staging.collect(bucket)
        if observed:
            self.observers.waited(start, time.perf_counter(), self.step)

    def begin_shadow(self) -> None:
        """A joined rank's side of a backward begins (see :func:`ddpkit.parallel.ddp.join.shadow_backward`)."""
        self.rebuild_if_due()
        self._reset()
        if not self.layout.final and not self.layout.arrival:
            self.layout.arrival = list(range(len(self.params)))  # torch's joined rank offers every one in order

    def end_shadow(self) -> None:
        """A joined rank's side of a backward is over: count it as this rank's step."""
        self.wait_all()
        self._end_step()

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Let ``hook(state, bucket)`` reduce each bucket; see :mod:`ddpkit.hooks`."""
        check_new_hook(self.comm_hook, hook)
        self.comm_hook = hook
        self.comm_state = state


def twice_error(name: str) -> RuntimeError:
    """Parameter ``name`` got a second gradient in one synchronised backward without ``static_graph``."""
    return RuntimeError(
        f"parameter {name!r} received a gradient twice in one synchronised backward (reentrant "
        "checkpointing, or two backward passes through one forward): run a forward before each backward, "
        "use no_sync() for all but the last, or construct DistributedDataParallel(..., static_graph=True) "
        "if the model is the same every iteration"
    )
