"""Training that goes on through a worker's death, in the same processes, losing no sample.

Under ``ddpkit launch --on-failure continue`` (see
:mod:`ddpkit.launcher.fault_tolerant_group` and :mod:`ddpkit.runtime.membership`) the
launcher announces every death to the survivors within milliseconds.
:class:`FaultTolerance` turns that into training that does not notice, apart
from the time it costs:

* **Steps, not ranks, own the data.** Each step's global batch is cut into
  ``virtual_shards`` fixed shards (:class:`~ddpkit.data.shards.VirtualShards`);
  rank ``r`` of ``n`` trains shards ``r, r+n, ...`` (in the deterministic
  mode a contiguous run of them, see below) as micro-batches and
  accumulates (in the default mode up to ``ceil(V / n)`` shards together, ``n``
  the starting world: until a death, the batch a ``DistributedSampler`` gives
  it). A smaller world trains more micro-batches per step: the global
  batch, the step count, the epoch boundaries and so any schedule keyed on
  the step stay those of the run without a failure, and every sample of every
  epoch is trained exactly once.
* **The step in flight is done again.** The gradient reduction waits
  interruptibly; when the view loses a member every survivor abandons the
  group, builds the next view's group (a new store prefix), discards the
  step's gradients and trains the step again at the new size. No checkpoint
  is read.
* **The survivors agree before going on.** A reduction can complete on some
  ranks and not on others when a peer dies in the middle of it, so after every
  rebuild the ranks compare how many steps they have applied; whoever is
  behind receives the state (model, optimizer, the ``state`` objects, the
  step) from the lowest rank that is furthest, in 25 MiB chunks. A
  replacement joins the same way.
* **Randomness follows the shard.** Each micro-batch runs with torch's RNG
  seeded by (seed, step, its first shard), so in the deterministic mode (a
  micro-batch per shard) dropout draws the same masks for a shard whichever
  rank trains it.
* **Buffers move once per step.** Every micro-batch starts from the step's
  buffers (batch-norm statistics) and the step keeps the update of rank 0's
  first micro-batch (shard 0's alone for a model with batch norm, which
  trains a shard per micro-batch), which rank 0 makes at any world size and
  hands to all with the step's reduction (DDP's ``broadcast_buffers``): a
  rank that trains two shards does not move the statistics twice, and every
  rank ends each step with the same buffers (evaluations and state transfers
  agree).
* **Deterministic mode** (``deterministic=True``): each shard is a
  micro-batch of its own, and the shards' gradients are added along a fixed
  binary tree over the shards ``0..V-1``
  (:mod:`ddpkit.parallel.fault_tolerance.shard_tree`): each rank trains a
  contiguous run of shards and adds the tree's nodes inside it as the shards
  come (a stack of sums, at most one per level of the tree plus one: about
  ``log2(V/n) + 1`` gradients, not one per shard); an ordered
  reduce-scatter hands each rank those partial sums' slices of its own
  block of the gradient, which it finishes along the tree and sends to all.
  Each micro-batch runs with the RNG seeded by (seed, step, shard). The sum
  no longer depends on which rank computed which shard, so a run with any
  number of deaths ends **bitwise equal** to the run without one. Beside
  the stack it keeps the exchange's room (the partial sums sent and
  received: one gradient's worth each where ``n`` and ``V`` are powers of
  two, the block sums then going out in the send buffer; at most two nodes
  per level of the tree otherwise, and the block sums, one; two results in
  turn), and it sends two all-to-alls where an all-reduce is handed one
  gradient.
  Without the deterministic mode, a death changes the order of float additions:
  the result is within reduction-order noise of the run without a failure.
  At ``V`` = the world size and before any death, the default mode trains
  exactly the batches of a ``DistributedSampler`` job and its gradients
  (bitwise equal to ``ddpkit train``'s DDP at world 2).

Use::

    ft = ddpkit.FaultTolerance(model, optimizer, dataset, batch_size=256)
    for step in ft.steps(epochs=3):
        for x, y in step:                 # this rank's shards of the step, in micro-batches
            F.cross_entropy(model(x), y).backward()   # the micro-batch's mean loss
        if step.sync():                   # False: the world changed, the step comes again
            optimizer.step()
        optimizer.zero_grad()

Each micro-batch's loss must be its mean (what ``reduction="mean"`` gives):
the engine weighs it by its share of the step's samples. The model is the
plain module, or a ``ddpkit.DistributedDataParallel`` of it (a DDP script keeps its wrapper: each
micro-batch then runs under its ``no_sync()``, and the step is reduced here, as for the plain module, through
the wrapper's comm hook if it has one, with the members' group as its state; in the deterministic mode a hook that
only changes the dtype sets the dtype of the tree's additions instead).

* **Buckets overlap the last backward** (the summed mode, :mod:`.overlap`): during a rank's last micro-batch of
  the step each gradient goes into the step's sum as autograd accumulates it, and each bucket (the wrapper's
  ``bucket_cap_mb``, torch's default for a plain module) is all-reduced, or handed to the comm hook, as soon as it
  is complete, as DDP's buckets go out during backward; ``step.sync()`` waits for them as for any collective of the
  step. The step's gradient stays the one a reduction after the loop body makes: a gradient changed after its
  backward took it (a second backward, ``zero_grad()`` between backward passes) makes the step be trained again,
  once, and from then on the buckets go out after the loop body.
Outside ``--on-failure continue`` (no launcher, torchrun, ``ddpkit launch``
restarting) the same code trains the same steps on the default group, and a
death fails the job as under DDP.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import default_collate

from ddpkit.data.shards import VirtualShards
from ddpkit.parallel.fault_tolerance import agreement
from ddpkit.parallel.fault_tolerance.all_reduced_sum import AllReducedSum, check_dense
from ddpkit.parallel.fault_tolerance.hook_reduction import wire_dtype
from ddpkit.parallel.fault_tolerance.model_buffers import ModelBuffers
from ddpkit.parallel.fault_tolerance.ordered_sum import OrderedSum
from ddpkit.parallel.fault_tolerance.overlap import Overlap, spans
from ddpkit.parallel.fault_tolerance.shard_tree import ShardTree
from ddpkit.parallel.fault_tolerance.wrapped import compiled, hook_name, wrapper_of
from ddpkit.runtime import events, membership
from ddpkit.runtime.group import init
from ddpkit.runtime.membership import MembershipChanged, View

__all__ = ["Change", "FaultTolerance", "Step"]

VALUES = 16
"""How many values ``step.sync(values=...)`` carries with the gradients."""
LATE, DIRTY, JOINING = VALUES, VALUES + 1, VALUES + 2
"""The words after the values in a step's bookkeeping: whether a rank has late gradients, or a dirty step
(:mod:`.overlap`), and whether it knows of members joining (:meth:`FaultTolerance.reduce`)."""


@dataclass
class Change:
    """One membership change as a member lived it (``time.time()`` stamps): the view it rebuilt its group for,
    which may stand for several views announced meanwhile."""

    generation: int
    size: int
    noticed: float
    """When the launcher's word reached this rank."""
    rebuilt: float
    """When the new group was built and the ranks had agreed on the state."""
    resumed: float | None = None
    """When the first step after it was applied."""
    transferred: int = 0
    """Bytes of state this rank received (0 when it was not behind)."""


@dataclass
class Step:
    """One training step: this rank's micro-batches of it, and the reduction that ends it."""

    engine: FaultTolerance
    index: int
    """The global step number (from the first step of epoch 0)."""
    epoch: int
    shards: Sequence[int]
    """The virtual shards this rank trains in this step."""
    samples: int
    """The step's global batch: samples in all its shards."""
    view_generation: int = 0
    """The membership generation the step began in: it is applied only if every shard was trained in that view."""
    synced: bool | None = None
    aborted: bool = False
    """A collective of the step (:meth:`FaultTolerance.all_reduce`) met a membership change: the step is done
    again, and its later collectives do not communicate."""
    trained: list[int] = field(default_factory=list)
    """After a successful :meth:`sync`: samples each shard of the step contributed, as reduced over the job
    (from whichever rank trained it): the step's own account that no shard was lost or counted twice."""
    values: torch.Tensor | None = None
    """After :meth:`sync`: the ``values`` given to it (float32, float16 or bfloat16; summed in float32), summed
    over the ranks."""
    _buffer: torch.Tensor | None = None
    """What this rank sends: the weighted gradients of its shards, their sample counts, which parameters had a
    gradient, and room for the caller's values (see :meth:`FaultTolerance.new_buffer`)."""
    _iterating: bool = False
    """Inside the loop over this rank's micro-batches (ranks train different numbers of them)."""
    _iterated: bool = False
    """The loop over this rank's micro-batches ran to its end."""

    def __iter__(self) -> Iterator[Any]:
        self._iterating = True
        try:
            yield from self._micro_batches()
        finally:
            self._iterating = False
        self._iterated = True

    def _micro_batches(self) -> Iterator[Any]:
        engine = self.engine
        # Every micro-batch starts from the step's buffers, and the step keeps shard 0's update of them (rank 0
        # trains shard 0 at any world size, and its buffers start the next step): batch-norm statistics move
        # once per step, as in a DDP job, however many shards a rank trains. A step done again starts from the
        # same buffers: a discarded step's updates are undone.
        engine.step_buffers = start = engine.buffers.snapshot()
        keep_buffers = bool(engine.buffers)
        after_first = None
        self._buffer = engine.new_buffer()
        overlapped = engine.begin_overlap(self._buffer)
        batches = engine.micro_batches(self.shards)
        sizes_of = [[len(engine.shards.shard(self.index, shard)) for shard in shards] for shards in batches]
        last = max((k for k, sizes in enumerate(sizes_of) if sum(sizes)), default=-1)
        for k, (shards, sizes) in enumerate(zip(batches, sizes_of)):
            if not sum(sizes):
                continue
            engine.seed_generators(engine.micro_batch_seed(self.index, shards[0]))  # randomness follows the shard
            samples = dict(zip(shards, sizes))
            # A DDP wrapper communicates nothing: the step's reduction is the mode's; the last micro-batch's
            # backward sends the buckets as their gradients come in (overlap.py).
            with engine.local(), engine.overlapping(self._buffer, samples, self.samples, k == last and overlapped):
                yield engine.load(engine.shards.samples(self.index, shards))
            engine.harvest(self._buffer, k, samples, self.samples)
            if keep_buffers:
                if shards[0] == 0:
                    after_first = engine.buffers.snapshot()
                engine.buffers.put_back(start)
        if after_first is not None:
            engine.buffers.put_back(after_first)
        if overlapped:
            engine.send_rest(self._buffer)  # the buckets no backward completed: before any collective of the caller's

    def sync(self, values: torch.Tensor | None = None) -> bool:
        """Average the step's gradients over the job into each parameter's ``.grad``.

        ``values`` (a float tensor, e.g. this rank's loss sum) are summed over the ranks with the gradients, no
        extra collective: :attr:`values` holds the sums afterwards.

        Returns:
            True: the gradients are the step's global average; apply them. False: the membership changed
            during the step (or, once, a gradient changed after its backward took it, :mod:`.overlap`); its
            gradients are discarded and :meth:`FaultTolerance.steps` gives this step again.
        """
        if self.synced is not None:
            raise RuntimeError(f"step {self.index}: sync() was already called for this step")
        if not self._iterated:
            raise RuntimeError(f"step {self.index}: sync() before this rank's micro-batches of the step were all "
                               f"given: iterate the step to its end first (for x, y in step: ... .backward()), "
                               "without a break; each rank trains its own shards of the step there")
        if values is not None and values.numel() > VALUES:
            raise ValueError(f"step.sync(values=...) takes at most {VALUES} values, not {values.numel()}: sum "
                             "more with ft.all_reduce()")
        if values is not None and values.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"step.sync(values=...) of {values.dtype}: the values ride in the step's float32 "
                             "buffer, where a float64 loses its last digits and a count above 2**24 its units; pass "
                             "float32 values, or sum these exactly in their dtype with ft.all_reduce()")
        buffer = self._buffer if self._buffer is not None else self.engine.new_buffer()
        self._buffer = None
        reduced = self.engine.reduce(buffer, None if values is None else values.detach(), self)
        self.synced = reduced is not None
        if reduced is not None:
            counts, sums = reduced
            self.trained = [int(c) for c in counts.tolist()]
            self.values = sums[: values.numel()].to(values).view_as(values) if values is not None else None
        return self.synced


_told_outside: list[bool] = []


def _say_outside_the_mode(rank: int) -> None:
    """Once per process, on rank 0: this FaultTolerance is not fault-tolerant (no mode's launcher around it)."""
    if rank == 0 and not _told_outside:
        _told_outside.append(True)
        print("ddpkit: FaultTolerance runs outside the fault-tolerant mode (no `ddpkit launch --on-failure "
              "continue` around this process): the same steps, but a worker's death ends the job as under DDP",
              file=sys.stderr, flush=True)


class FaultTolerance:
    """Data-parallel training that survives the loss of workers (see the module notes).

    Args:
        model: the plain module (same architecture on every rank; rank 0's initial state is everyone's), or a
            ``ddpkit.DistributedDataParallel`` of it without ZeRO (under ``--on-failure continue`` one built with
            no group, which then trains inside this), ``torch.compile``'d or not; its comm hook, registered with
            the state None, reduces the steps (in the deterministic mode only a hook that changes the dtype: the
            tree adds in it).
        optimizer: its optimizer (its state moves with a state transfer).
        dataset: indexable by sample, with ``len()``.
        batch_size: the global batch of every step (all ranks together).
        virtual_shards: shards per step; default the world size at the start (resuming: the state's). At least
            the largest world size of the job, and a divisor of ``batch_size``.
        deterministic: bitwise reproducible at any membership (module notes).
        shuffle: shuffle each epoch's order, as :class:`ddpkit.DistributedSampler` (seeded with ``seed + epoch``).
        seed: the shuffle's seed, and the micro-batches' RNG seeds with the step and the shard.
        drop_last: leave out each epoch's last, short step.
        collate_fn: makes a micro-batch of samples (default torch's ``default_collate``).
        fetch: makes a micro-batch from sample indices at once (replaces ``dataset[i]`` + ``collate_fn``; for
            data already in tensors: ``lambda idx: (x[idx], y[idx])``).
        device: where micro-batches go (default the model's device).
        state: more objects with ``state_dict``/``load_state_dict`` to move with the model (an LR scheduler, a
            grad scaler).
        broadcast_buffers: as DDP's: rank 0's buffers (batch-norm statistics) to every rank, here at the end of
            every applied step, bit for bit whatever their dtype (default True). False is refused for a model
            with buffers: every member must hold the same ones, since any of them may hand the state to a
            replacement.
        resume: a :meth:`state_dict` saved earlier (a checkpoint's) to start from. It is loaded before the
            members first agree, so the furthest state among them wins: a replacement that joins a running job
            takes the live state, not the older checkpoint.
        overlap: the summed mode's buckets go out during each step's last backward (default True,
            :mod:`.overlap`); False: after the loop body, for a body that changes gradients in place through
            ``.data``, which the check for changed gradients cannot see. Every member must pass the same.
        accumulation: micro-batches each rank trains a step at the starting world, as DDP's gradient
            accumulation: ``virtual_shards`` defaults to the starting world size ``n`` times it (at least that;
            in the summed mode a multiple of it), and the summed mode trains ``V / (n * accumulation)`` shards
            together, so that each micro-batch holds at most ``batch_size / (n * accumulation)`` samples, at any
            world (the deterministic mode's micro-batches, and those of a model with batch normalisation, are
            its shards either way: with a larger ``V``, more of them). Every member must pass the same.

    Raises:
        ValueError: a setting the mode cannot run (with the fix).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: Any, batch_size: int, *,
                 virtual_shards: int | None = None, deterministic: bool = False, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, collate_fn: Callable[[list[Any]], Any] | None = None,
                 fetch: Callable[[list[int]], Any] | None = None, device: torch.device | str | None = None,
                 state: Mapping[str, Any] | None = None, broadcast_buffers: bool = True,
                 resume: Mapping[str, Any] | None = None, overlap: bool = True, accumulation: int = 1) -> None:
        ctx = init()
        self.wrapper = wrapper_of(model, deterministic)
        """The ``ddpkit.DistributedDataParallel`` the script trains through, or None (a plain module)."""
        if self.wrapper is not None:
            model = self.wrapper.module
            self.wrapper.require_forward_param_sync = False  # (see local(): an evaluation on one rank before a step)
        model = compiled(model)  # a compiled module's state is the plain module's, whichever way it was compiled
        self.model, self.optimizer = model, optimizer
        self.state = dict(state or {})
        self.deterministic = deterministic
        self.broadcast_buffers = broadcast_buffers
        self.seed = seed
        self.collate = collate_fn or default_collate
        self.fetch = fetch
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.membership = membership.current()
        # Without the mode's launcher (torchrun, ddpkit launch with restarts, a world of one): the default group,
        # the same steps, and a death fails the job as under DDP.
        self._member = self.membership.member if self.membership else ctx.rank
        self.view = self.membership.latest() if self.membership else View(0, tuple(range(ctx.world_size)))
        self.started_with = ctx.world_size
        """The world size the job started with (member ids from it on are replacements)."""
        self.first_world = int((resume or {}).get("first_world", ctx.world_size))
        """The world the job first started with (a resumed run's: its checkpoint's), which sizes the default
        mode's micro-batches (:meth:`micro_batches`)."""
        if virtual_shards is not None and (isinstance(virtual_shards, bool) or not isinstance(virtual_shards, int)
                                           or virtual_shards < 1):
            raise ValueError(f"virtual_shards={virtual_shards!r} is not a whole number of shards of at least 1: give "
                             "at least the largest world size the job may have, or None for the starting world size")
        if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
            raise ValueError(f"accumulation={accumulation!r} is not a whole number of micro-batches of at least 1 "
                             "(each rank's micro-batches a step, as DDP's gradient accumulation)")
        self.accumulation = accumulation
        saved = (resume or {}).get("configuration") or {}
        # The world that sizes the micro-batches: a resumed state's first one, else this start's (a replacement's
        # WORLD_SIZE is the job's starting world too). Not the current view: a run resumed at more workers, or a
        # replacement after a spare node joined, trains with the micro-batches the job began with.
        first = self.first_world
        defaulted = virtual_shards is None
        if virtual_shards is None:  # a resumed state's shards, else the starting world's micro-batches
            virtual_shards = int(saved.get("virtual_shards", first * accumulation))
        # Checked where the job starts: a resumed run's state, a replacement's or a spare's were the starting
        # members' (and the agreement compares V and the accumulation with theirs).
        starting = resume is None and self._member < self.started_with
        # (In the deterministic mode, and for a model that normalises over the batch, a micro-batch is one shard:
        # V at least the workers x N gives each at least N of them.)
        self.batch_statistics = any(isinstance(m, _BatchNorm) for m in model.modules())
        """The model normalises over the batch: its micro-batches are one shard each (:meth:`micro_batches`)."""
        one_shard_each = deterministic or self.batch_statistics
        if starting and accumulation > 1 and (virtual_shards < first * accumulation
                                              or (not one_shard_each and virtual_shards % (first * accumulation))):
            raise ValueError(f"virtual_shards {virtual_shards} with accumulation={accumulation} at {first} "
                             f"worker(s): a worker's share of a step would not be {accumulation} micro-batches of "
                             f"batch_size / {first * accumulation} samples; give virtual_shards "
                             f"{first * accumulation} or a multiple of it (or leave it out: that is its default)")
        if virtual_shards < self.view.size:
            raise ValueError(f"virtual_shards {virtual_shards} is below the world size {self.view.size}: every rank "
                             "needs at least one shard of each step; give at least the largest world size")
        if defaulted and starting and accumulation > 1 and batch_size % virtual_shards:
            fit = -(-batch_size // virtual_shards) * virtual_shards
            raise ValueError(f"batch_size {batch_size} does not split into {first} worker(s) x accumulation="
                             f"{accumulation} micro-batches of one size: give a batch_size that {virtual_shards} "
                             f"divides (e.g. {fit}), or another accumulation")
        self.shards = VirtualShards(len(dataset), batch_size, virtual_shards, shuffle=shuffle, seed=seed,
                                    drop_last=drop_last)
        self.dataset = dataset
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._every_param = list(model.named_parameters())
        self._trainable = [p.requires_grad for _, p in self._every_param]
        """Which parameters required grad when the engine was built (its layout): :meth:`_check_trainable`."""
        self.buffers = ModelBuffers(model, self.device)
        if self.buffers and not broadcast_buffers:
            raise ValueError("FaultTolerance(broadcast_buffers=False) with a model that has buffers (batch-norm "
                             "statistics): every member must hold the same buffers, since any of them may hand the "
                             "state to a replacement or be the one left; leave broadcast_buffers=True (rank 0's, "
                             "which train shard 0, go to all with each step)")
        self.numel = sum(p.numel() for p in self.params)
        self._offsets = np.cumsum([0] + [p.numel() for p in self.params]).tolist()
        """Where each parameter's gradient starts in the flat gradient (the last: its end)."""
        cap = None if self.wrapper is None or self.wrapper.bucket_bytes_cap_default else self.wrapper.bucket_cap_mb
        self._summed = AllReducedSum(
            self.params, self.device, self.wrapper,
            None if deterministic or not overlap else Overlap(self.params, spans(self.params, cap)),
            self._announce, lambda work: self._wait(work, step=True), lambda: self._step)
        """The summed mode's reduction (its buckets sent during the last micro-batch's backward, :mod:`.overlap`;
        the deterministic mode uses its comm hook's accessors only)."""
        self.configuration = agreement.configuration(
            model, virtual_shards=virtual_shards, batch_size=batch_size, seed=seed, shuffle=shuffle,
            drop_last=drop_last, samples=len(dataset), deterministic=deterministic, hook_name=hook_name(self.wrapper),
            overlap=overlap, accumulation=accumulation)
        """What every member must share to train the same samples into the same model (compared at each
        agreement: a member started otherwise is refused by name)."""
        self._step: Step | None = None
        """The step in flight (from its start to the next one's), whose collectives abort it on a change."""
        self._pool: list[torch.Tensor] = []
        """The two send buffers steps take in turn (:meth:`new_buffer`)."""
        self._tree: ShardTree | None = None
        """The deterministic mode's tree at the current world size (:meth:`tree`)."""
        self._ordered = OrderedSum(self.device)
        """The deterministic mode's reduction along the tree, with its room kept from step to step."""
        self.step_buffers: list[torch.Tensor] = []
        """The buffers as the current step found them."""
        self.committed = 0
        """Steps applied on this rank."""
        self.loops_done = 0
        """Calls of :meth:`steps` this run of the script ended (ran to their end together, or left with a
        ``break``), the members' count: a state transfer carries it (a checkpoint's is not taken back: a resumed
        script starts its loops again, as every member of it does)."""
        self._skip_loops = 0
        """Calls of :meth:`steps` the members had ended before this process took their state (a replacement, which
        runs the script from its start): its next ones give no step and communicate nothing."""
        self._join_agreed = False
        """The last step's reduction said that every member knew of members joining: switch before the next."""
        self.changes: list[Change] = []
        """One entry per group this rank rebuilt: views announced while it was between two rebuilds (a death
        and a join close together, a join while a step waited) are taken together, as the newest one, so two
        ranks' lists may differ in the epochs they name (each names the last one)."""
        self.group: dist.ProcessGroup | None = None
        if resume is not None:
            self.load_state_dict(resume)
        if self.membership is not None:
            self.membership.ready()
            self._rebuild(first=True)
            self.membership.holds_state()
        else:
            _say_outside_the_mode(ctx.rank)
            if ctx.world_size > 1:
                self.group = dist.group.WORLD
                self._agree(force=True)  # rank 0's state to all, as DDP's construction

    # -- where this rank stands

    @property
    def rank(self) -> int:
        return self.view.rank_of(self._member)

    @property
    def world_size(self) -> int:
        return self.view.size

    def micro_batch_seed(self, step: int, shard: int) -> int:
        digest = hashlib.sha256(f"ddpkit shard {self.seed} {step} {shard}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

    @staticmethod
    def seed_generators(seed: int) -> None:
        """Seed torch's, Python's and NumPy's global generators for one micro-batch: dropout and data
        augmentation draw the same numbers for a shard whichever member trains it. (Generators of your own, a
        ``torch.Generator`` or ``numpy.random.default_rng``, are yours to seed from the step and shard.)"""
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % (1 << 32))

    # -- the steps

    def steps(self, epochs: int | None = None, *, max_steps: int | None = None) -> Iterator[Step]:
        """The steps of ``epochs`` epochs (or up to step ``max_steps``), each given again until it is applied.

        Resumes at :attr:`committed` (so after a state transfer, or a checkpoint loaded into the engine).
        """
        if epochs is None and max_steps is None:
            raise ValueError("steps() needs epochs or max_steps")
        end = min(x for x in (epochs and epochs * self.shards.steps_per_epoch, max_steps) if x is not None)
        if self._skip_loops:  # the members ended this loop before this process took the state: they are past it
            self._skip_loops -= 1
            return
        try:
            while True:
                while self.committed < end:
                    if self._view_changes():
                        self._rebuild()
                        continue
                    self._check_trainable()
                    index = self.committed
                    step = self._step = Step(self, index, self.shards.epoch_of(index),
                                             self.shards_of(self.rank),
                                             len(self.shards.step(index)), view_generation=self.view.generation)
                    try:
                        yield step
                    except GeneratorExit:  # a `break`: every member leaves this loop at the same step
                        self.loops_done += 1
                        raise
                    finally:  # (a `break` after sync() returned True too: the step is the state's, once)
                        if step.synced:
                            self.committed = index + 1
                            if self.changes and self.changes[-1].resumed is None:
                                self.changes[-1].resumed = time.time()
                    if step.synced is None:
                        raise RuntimeError(f"step {index}: the loop body did not call step.sync(); call it once per "
                                           "step (after the micro-batches' backward, before optimizer.step())")
                self._step = None
                if self._finished(end):
                    self.loops_done += 1
                    return
        finally:
            self._step = None

    def _check_trainable(self) -> None:
        """Refuse a model whose parameters' ``requires_grad`` changed since the engine was built: the step's layout
        holds the gradients of those that required grad then, so one unfrozen later would be trained on each
        member's own shards alone and the replicas would part (one frozen later would be moved on a zero)."""
        # (the list kept: walking the modules each step cost 145 us at 200 parameters, the list 11 us)
        if [p.requires_grad for _, p in self._every_param] != self._trainable:
            names = [n for (n, p), was in zip(self._every_param, self._trainable) if p.requires_grad != was]
            shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
            raise RuntimeError(f"FaultTolerance: requires_grad of {shown} changed after FaultTolerance was built: "
                               "its reduction holds the gradients of the parameters that required grad then, and "
                               "the replicas would part; build a new FaultTolerance (from ft.state_dict()) after "
                               "freezing or unfreezing, as torch's DDP needs a new wrapper")

    def tree(self) -> ShardTree:
        """The deterministic mode's order of additions at the current world size."""
        if self._tree is None or self._tree.world_size != self.world_size:
            self._tree = ShardTree(self.shards.virtual_shards, self.world_size)
        return self._tree

    def shards_of(self, rank: int) -> Sequence[int]:
        """The shards ``rank`` trains in every step at the current world size: ``rank, rank + n, ...`` (torch's
        sampler's dealing, see :mod:`ddpkit.data.shards`), or, in the deterministic mode, its run of the tree."""
        if self.deterministic:
            return self.tree().runs[rank]
        return self.shards.shards_of(rank, self.world_size)

    def _view_changes(self) -> bool:
        """Whether the next step starts in a newer view: at once when a member was lost (or this one removed);
        members that only join, at the boundary the last step's reduction agreed on (:meth:`reduce`)."""
        if self.membership is None or self.membership.latest().generation == self.view.generation:
            return False
        return self._join_agreed or not self.membership.knows_a_join(self.view)

    def _finished(self, end: int) -> bool:
        """Whether every member applied the last step (one collective): only then may a member return and exit,
        since one whose last reduction a death interrupted needs a peer that still holds the final state. False
        after a membership change (the state is agreed again, and the steps go on from the lowest member's)."""
        if self.membership is None or self.group is None or self.world_size == 1:
            return True
        applied = torch.tensor([self.committed], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        try:
            self._wait(self.group.allreduce([applied], options), step=True)  # a join waits: the job ends here
        except MembershipChanged:
            self._rebuild()
            return False
        if int(applied) < end:  # a member that joined since: it trains on (cannot happen once one has finished)
            return False
        return True

    @property
    def steps_per_epoch(self) -> int:
        return self.shards.steps_per_epoch

    # -- micro-batches and their gradients

    def local(self) -> contextlib.AbstractContextManager[None]:
        """Where a micro-batch's forward and backward run: under the DDP wrapper's ``no_sync()`` (its gradients
        accumulate locally and :meth:`harvest` takes them), or as they are for a plain module.

        Raises:
            ValueError: a comm hook the mode cannot run was registered on the wrapper since
                (:func:`~ddpkit.parallel.fault_tolerance.wrapped.wrapper_of`).
            RuntimeError: the wrapper has been in a ``join()`` (its forwards then join the join's collective).
        """
        if self.wrapper is None:
            return contextlib.nullcontext()
        wrapper_of(self.wrapper, self.deterministic)  # a comm hook registered since: one the mode can run
        if self.wrapper.joining and self.wrapper.world_size > 1:
            raise RuntimeError("a step of FaultTolerance over a wrapper that has been in a join(): from then on each "
                               "forward joins a collective of the join's (torch's rule, after the block too), and a "
                               "rank trains as many micro-batches as it holds shards (none, some steps), so they "
                               "would not pair; leave join() out: the mode deals every step's samples to the ranks "
                               "itself, so inputs are never uneven")
        # Its buffers are the mode's to move (Step.__iter__, reduce): the wrapper's broadcast at a forward after a
        # synchronised one (its first forward too) is a collective a rank without samples would not join.
        self.wrapper.require_forward_param_sync = False
        # A synchronised forward outside the steps (possible outside the launcher's mode) armed the wrapper's
        # reducer, and under torch's rule a no_sync() forward leaves it armed: the micro-batch would reduce.
        self.wrapper.reducer.disarm()
        return self.wrapper.no_sync()

    def load(self, indices: list[int]) -> Any:
        if self.fetch is not None:
            return self.fetch(indices)
        batch = self.collate([self.dataset[i] for i in indices])
        return _to(batch, self.device)

    def new_buffer(self) -> torch.Tensor:
        """A step's send buffer, its bookkeeping zeroed (the gradients' part is written before it is read).

        Summed mode, one vector: the weighted gradients (all of this rank's shards added), the sample count of
        each shard, for each parameter how many micro-batches gave it a gradient, the module's buffers (rank 0's;
        zeros elsewhere, so the sum is rank 0's exactly), the caller's values. Two buffers take turns (``.grad``
        is a view into the last step's while this step's fills), allocated anew after a membership change: an
        abandoned operation may still hold the old ones.

        Deterministic mode, the bookkeeping alone, one row per shard this rank trains (row ``k``: the ``k``-th of
        its run of the tree): its sample count and parameter marks, the buffers and values on row 0. The
        gradients go to the tree's sums as each shard is trained (:meth:`harvest`), so that a rank never holds
        its shards' gradients all at once.
        """
        end = self._layout()[-1]
        if self.deterministic:
            tree = self.tree()
            shape: tuple[int, ...] = (max(len(run) for run in tree.runs), end)
            wire = wire_dtype(self._summed.comm_hook_function()) or torch.float32
            self._ordered.start(tree, self.rank, self.numel, self.group is not None and self.world_size > 1, wire)
        else:
            shape = (end,)
        if not self._pool or self._pool[0].shape != shape:
            self._pool = [torch.empty(shape, dtype=torch.float32, device=self.device) for _ in range(2)]
        self._pool.reverse()
        buffer = self._pool[0]
        buffer[..., 0 if self.deterministic else self.numel :] = 0
        self._summed.start(self.group)
        return buffer

    def _layout(self) -> tuple[int, int, int, int, int]:
        """Offsets in a row: the counts, the parameter marks, the buffers, the values, and the row's end (after
        the values, :data:`LATE`, :data:`DIRTY` and :data:`JOINING`). The summed mode's row begins with the
        gradients; the deterministic mode's holds the bookkeeping alone."""
        counts = 0 if self.deterministic else self.numel
        marks = counts + (1 if self.deterministic else self.shards.virtual_shards)
        buffers = marks + len(self.params)
        words = self.buffers.nbytes // 4 if self.deterministic else 0
        values = buffers + words
        return counts, marks, buffers, values, values + JOINING + 1

    def micro_batches(self, shards: Sequence[int]) -> list[list[int]]:
        """This rank's ``shards`` of a step, as the micro-batches it trains: one shard each in the deterministic
        mode (each shard's gradient has its own slot) and for a model with batch normalisation (a shard's batch
        statistics then stay the same whoever trains it, so a death changes only the order of additions); else
        up to ``ceil(V / (n * a))`` together, ``n`` the world the job first started with (:attr:`first_world`)
        and ``a`` the :attr:`accumulation`, so that until a death each rank trains ``a`` micro-batches (where
        ``n * a`` divides ``V``: the batches a ``DistributedSampler`` job with DDP's gradient accumulation gives it)
        at DDP's cost, and after one, or resumed at fewer workers, the micro-batches keep that size (their memory
        too)."""
        if self.deterministic or self.batch_statistics:
            return [[shard] for shard in shards]
        size = -(-self.shards.virtual_shards // (self.first_world * self.accumulation))
        return [list(shards[i : i + size]) for i in range(0, len(shards), size)]

    def harvest(self, buffer: torch.Tensor, k: int, samples: Mapping[int, int], total: int) -> None:
        """This rank's ``k``-th micro-batch (its shards and their ``samples``, of the step's ``total``) into
        ``buffer`` (the deterministic mode: its gradient into the tree's sums), its gradients weighted by its
        share of the step; ``.grad`` cleared for the next one. (A gradient the last micro-batch's backward took as
        it came, :meth:`overlapping`, is checked to be unchanged instead.)"""
        weight = self._weight(samples, total)
        counts, marks = self._layout()[:2]
        if self.deterministic:
            row = buffer[k]
            [(shard, trained)] = samples.items()  # a micro-batch per shard
            row[counts] = trained
            grads = self._ordered.leaf(shard)
        else:
            row = grads = buffer
            for shard, n in samples.items():
                row[counts + shard] = n
        overlap = None if self.deterministic else self._summed.taken_during_backward(grads)
        for i, p in enumerate(self.params):
            if overlap is not None and overlap.taken[i] is not None:
                overlap.check(i, p.grad)  # taken during backward: it must be as it was then
            elif p.grad is not None:
                if self.deterministic:
                    check_dense(p.grad)
                    torch.mul(p.grad.reshape(-1), weight, out=grads[self._offsets[i] : self._offsets[i + 1]])
                else:
                    self._summed.take(grads, i, p.grad, weight)
                row[marks + i] += 1
            elif self.deterministic:  # every element of a shard's slot is written
                grads[self._offsets[i] : self._offsets[i + 1]].zero_()
            p.grad = None
        if self.deterministic:
            self._ordered.push()

    def _weight(self, samples: Mapping[int, int], total: int) -> float:
        """A micro-batch's weight in the step: its share of the step's samples (times the world size for a comm
        hook, which divides by it: 1.0 exactly at an even split, DDP's bits)."""
        if not self.deterministic and self._summed.comm_hook_function() is not None:
            return sum(samples.values()) * self.world_size / total
        return sum(samples.values()) / total

    def begin_overlap(self, buffer: torch.Tensor) -> bool:
        """Whether the step's buckets go out as its last micro-batch's gradients come in (the summed mode, with
        members to reduce with): then they go from ``buffer``."""
        return not self.deterministic and self._summed.begin_overlap(buffer, self.world_size)

    def overlapping(self, buffer: torch.Tensor, samples: Mapping[int, int], total: int,
                    last: bool) -> contextlib.AbstractContextManager[None]:
        """Around a micro-batch's forward and backward: where it is this rank's ``last`` of the step (and the
        step overlaps, :meth:`begin_overlap`), each gradient is weighted into ``buffer`` as autograd
        accumulates it and each complete bucket goes out (:mod:`.overlap`)."""
        if not last or self.deterministic:
            return contextlib.nullcontext()
        return self._summed.overlapping(buffer, self._weight(samples, total), self._layout()[1])

    def send_rest(self, buffer: torch.Tensor) -> None:
        """Send the buckets of ``buffer`` that no backward completed (once the rank's micro-batches are done)."""
        self._summed.send_rest(buffer)

    def reduce(self, buffer: torch.Tensor, values: torch.Tensor | None,
               step: Step | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's ``buffer`` (:meth:`new_buffer`) summed over the job, the gradients into ``.grad``.

        Returns the samples each shard contributed and the summed values, or None when the membership changed
        (the gradients are then discarded and the group rebuilt) or a gradient changed after its backward took
        it (:meth:`_train_again`). A parameter no micro-batch of any rank gave a
        gradient keeps ``.grad`` None, as under DDP.

        Raises:
            RuntimeError: a shard's samples were lost or counted twice without a membership change (a bug: the
                step is not applied).
        """
        if step is not None and (step.aborted or step.view_generation != self.view.generation):
            return self._discard()  # a shard of it was trained in another view (or a collective of it failed)
        if self.membership is not None and self.membership.lost_since(self.view):
            return self._discard()
        v, p = self.shards.virtual_shards, len(self.params)
        c0, m0, b0, v0, end = self._layout()
        first = buffer[0] if self.deterministic else buffer
        if values is not None:
            first[v0 : v0 + values.numel()] = values.reshape(-1)
        # Members that join are taken in at a step boundary every member agrees on: the first after a step whose
        # reduction says that each of them knew of the join (the step's collectives let a join pass, see _wait).
        first[end - 1] = float(self.membership is not None and self.membership.knows_a_join(self.view))
        if self.buffers and self.deterministic:  # rank 0's bytes as float32 words: a gather copies them exactly
            first[b0:v0] = self.buffers.blob().view(torch.float32) if self.rank == 0 else 0
        try:
            if self.deterministic:
                total = self._ordered_sum()
                received = self._gather(buffer[:, c0:])  # the bookkeeping: counts, marks, buffers, values
                counts = torch.zeros(v, dtype=torch.float32, device=self.device)
                had = torch.zeros(p, dtype=torch.float32, device=self.device)
                for shard in range(v):  # in shard order, whoever trained which
                    owner, slot = self.tree().owner(shard)
                    row = received[owner][slot]
                    counts[shard] = row[0]
                    had.add_(row[m0 - c0 : m0 - c0 + p])
                blob = received[0][0][b0 - c0 : v0 - c0].view(torch.uint8).clone()  # aligned: views its dtype
                sums = sum(rows[0][v0 - c0 : end - c0] for rows in received)
            elif self._summed.taken_during_backward(buffer) is not None:
                if not self._summed.reduce_overlapped(buffer, v0 + LATE, v0 + DIRTY, self.world_size):
                    return self._train_again()
            else:
                self._summed.reduce_after(buffer, self.world_size)
            if not self.deterministic:
                total, counts, had = buffer[: self.numel], buffer[c0 : c0 + v], buffer[m0 : m0 + p]
                sums = buffer[v0:end]
                blob = self._broadcast_blob() if self.buffers else None  # rank 0's bytes: a sum would change them
        except MembershipChanged:
            return self._discard()
        self._join_agreed = round(float(sums[JOINING])) == self.world_size
        if step is not None:
            expected = [len(self.shards.shard(step.index, s)) for s in range(v)]
            if [round(float(c)) for c in counts] != expected:
                raise RuntimeError(f"step {step.index}: the shards' sample counts after the reduction are "
                                   f"{[round(float(c)) for c in counts]}, not {expected}, without a membership "
                                   "change: a shard was lost or counted twice; the step is not applied (please "
                                   "report this with the job's lines)")
        offset = 0
        for i, param in enumerate(self.params):
            n = param.numel()
            param.grad = total[offset : offset + n].view_as(param).to(param.dtype) if had[i] > 0 else None
            offset += n
        if blob is not None:  # rank 0's buffers, which hold shard 0's update: every rank's now, bit for bit
            self.buffers.load_blob(blob)
        return counts, sums

    def _train_again(self) -> None:
        """A dirty step (:mod:`.overlap`), on every member alike: its gradients discarded and its buffer updates
        undone, as for a step a death interrupted, but the group stands; from now on the buckets go out after the
        loop body."""
        for p in self.params:
            p.grad = None
        self._summed.train_again()
        self.buffers.put_back(self.step_buffers)
        if self.rank == 0:
            print("ddpkit: FaultTolerance: a gradient changed after its backward handed it to the step's reduction "
                  "(a second backward, zero_grad() between backward passes, .grad changed inside the loop body): "
                  "this step is trained again, and from now on each step's gradients are reduced after its loop "
                  "body instead of during its last backward", file=sys.stderr, flush=True)
        return None

    def _broadcast_blob(self) -> torch.Tensor | None:
        """Rank 0's buffers' bytes, on every rank (one collective; a world of one: its own)."""
        blob = self.buffers.blob()
        if self.group is not None and self.world_size > 1:
            self._announce("broadcast of rank 0's buffers", blob)
            self._wait(self.group.broadcast([blob], agreement.root(0)), step=True)
        return blob

    def _ordered_sum(self) -> torch.Tensor:
        """The deterministic mode's gradient: every rank's shards added along the tree of :meth:`tree`,
        whichever rank trained which, as a tensor the next step's reduction leaves intact
        (:class:`~ddpkit.parallel.fault_tolerance.ordered_sum.OrderedSum`, which took this rank's shards in as
        they were trained); in a dtype hook's dtype where the wrapper has one."""
        return self._ordered.finish(self.group, self._collective)

    def _collective(self, what: str, payload: torch.Tensor, start: Callable[[], Any]) -> None:
        """One of the step's collectives: announced, started, waited for in the current view."""
        self._announce(what, payload)
        self._wait(start(), step=True)

    def _gather(self, send: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's rows, to every rank."""
        if self.group is None or self.world_size == 1:
            return [send]
        received = [torch.empty_like(send) for _ in range(self.world_size)]
        self._announce("all-gather of the step's counts and values", send)
        self._wait(self.group.allgather([received], [send.contiguous()]), step=True)
        return received

    def _discard(self) -> None:
        for p in self.params:
            p.grad = None
        self._pool = []  # the abandoned operation may still read or write them
        self._summed.drop()  # its buckets are abandoned with the buffers
        self._ordered.drop()
        self.buffers.put_back(self.step_buffers)  # before a state transfer may bring newer ones
        self._rebuild()
        return None

    def _announce(self, what: str, payload: torch.Tensor) -> None:
        """Tell the collectives' observers (byte counts, the stall inspector) that a step's collective starts."""
        events.collective("FaultTolerance: {}", what, step=self._step.index if self._step is not None else None,
                          nbytes=payload.numel() * payload.element_size())

    def _wait(self, work: Any, *, step: bool = False) -> None:
        """Wait for ``work`` in the current view; ``step``: a collective of a training step, which a join does
        not interrupt (the members switch at a step boundary they agree on, :meth:`reduce`)."""
        if self.membership is None:
            work.wait()
        else:
            self.membership.wait(work, self.view, joins=not step)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over the step's members (a metric) and return it.

        Under ``--on-failure continue`` it is a collective of the step in flight, to be called after its
        micro-batch loop and before ``step.sync()`` (the step's buckets not yet sent go out first): when the
        membership loses a member during it, ``tensor`` keeps its own value, the step is aborted (``step.sync()``
        returns False without communicating, and the step comes again), and the step's later collectives return
        at once. It is refused elsewhere in the mode (after
        ``step.sync()``, outside the steps): a member that finished such a collective may have gone on, so it
        could be neither done again nor trusted. Without the mode (no launcher, torchrun) it may be called
        anywhere, and a death fails the job as under DDP.

        Raises:
            RuntimeError: in the mode, outside a step's window (the message says where to call it instead).
        """
        step = self._step
        if step is not None and step._iterating:
            raise RuntimeError("ft.all_reduce() / ft.barrier() inside the step's micro-batch loop: ranks train "
                               "different numbers of micro-batches, so the ranks' collectives would not pair; call it "
                               "after the loop, before step.sync()")
        if step is not None and self.membership is not None and not step._iterated:
            raise RuntimeError("ft.all_reduce() / ft.barrier() before the step's micro-batch loop: under "
                               "--on-failure continue they are collectives of the step, after its micro-batches (a "
                               "death then aborts the step on every member alike); call it after the loop, before "
                               "step.sync()")
        if self.membership is not None and (step is None or step.synced is not None):
            where = "after step.sync()" if step is not None else "outside ft.steps()"
            raise RuntimeError(f"ft.all_reduce() / ft.barrier() {where}: under --on-failure continue they are "
                               "collectives of a step, called after its micro-batch loop, before step.sync() (a death "
                               "then aborts the step on every member alike); move the call before step.sync(), "
                               "or pass up to 16 values to step.sync(values=...)")
        if self.group is None or self.world_size == 1 or (step is not None and step.aborted):
            return tensor
        if step is not None and self.membership is not None and self.membership.lost_since(self.view):
            step.aborted = True
            return tensor
        if step is not None and step._buffer is not None:
            # The step's buckets first, on every member (each sends the rest of them here): a gradient after this
            # is late, and the collectives pair whoever had sent which.
            self.send_rest(step._buffer)
        summed = tensor.detach().clone()  # an abandoned operation may still write its tensor: never the caller's
        self._announce("ft.all_reduce", summed)
        try:
            self._wait(self.group.allreduce([summed]), step=True)
        except MembershipChanged:
            assert step is not None
            step.aborted = True
            return tensor
        with torch.no_grad():
            tensor.copy_(summed)
        return tensor

    def barrier(self) -> None:
        """Wait until every member of the step gets here (see :meth:`all_reduce` for where it may be called)."""
        self.all_reduce(torch.zeros(1, device=self.device))

    # -- membership changes

    def _difference(self, name: str, there: int, here: int) -> str:
        return agreement.difference(name, there, here, hook_name(self.wrapper))

    def _rebuild(self, first: bool = False) -> None:
        """Build the newest view's group, then agree on the state (a transfer to whoever is behind)."""
        assert self.membership is not None
        while True:
            view = self.membership.latest()
            if self.membership.member not in view.members:
                self.membership.wait_for_member(view)
                continue
            noticed = self.membership.noticed_at.get(view.generation, time.time())
            try:
                group = self.membership.group(view, free_old=True)  # it waits on every operation it issues
                self.view, self.group = view, group
                self._join_agreed = False
                self._summed.new_view()
                received = self._agree(force=first)
            except MembershipChanged:
                continue
            if not first or self.membership.member >= self.started_with:  # a replacement's join is a change too
                self.changes.append(Change(view.generation, view.size, noticed, time.time(), transferred=received))
            return

    def _agree(self, force: bool) -> int:
        """Compare applied steps and configurations; the lowest rank of the furthest sends its state to all
        (:mod:`.agreement`). Bytes received.

        Raises:
            RuntimeError: this member runs another configuration than the member whose state the others take, or
                has no shard to train (more members than virtual shards); the message names both.
        """
        said = agreement.compare(self.group, self._wait, self.world_size, self.committed, force, self.configuration)
        if said.differ:
            what = ", ".join(self._difference(name, there, here) for name, here, there in said.differ)
            raise RuntimeError(f"member {self._member} runs another configuration than member "
                               f"{self.view.members[said.source]}, whose state the job takes: {what}; start every "
                               "worker (replacements and spare nodes too) with the job's settings, dataset and model")
        if self.rank >= self.shards.virtual_shards:
            raise RuntimeError(f"member {self._member} joined a job of {self.shards.virtual_shards} virtual shards "
                               f"that has {self.shards.virtual_shards} members already: no shard is left for it, it "
                               "would only idle; start the job with more virtual shards (--deterministic-shards, "
                               "FaultTolerance(virtual_shards=...)) or fewer workers")
        if not said.transfer:
            return 0
        state, received = agreement.transfer(self.group, self._wait, self.rank, said.source, self.state_dict,
                                             self.device)
        if state is not None:
            self.load_state_dict(state)
            # A replacement runs the script from its start: the loops the members ended, it passes by.
            self._skip_loops = max(0, int(state.get("loops", 0)) - self.loops_done)
            self.loops_done = max(self.loops_done, int(state.get("loops", 0)))
        return received

    def state_dict(self) -> dict[str, Any]:
        """What a state transfer (or a checkpoint of the mode) holds: model, optimizer, ``state``, step.

        Inside a step's loop body after ``step.sync()`` returned True (and ``optimizer.step()`` ran), the step
        counts as applied: a checkpoint written there resumes at the next step.
        """
        step = self._step
        committed = step.index + 1 if step is not None and step.synced else self.committed
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "state": {name: obj.state_dict() for name, obj in self.state.items()},
                "committed": committed, "first_world": self.first_world, "configuration": dict(self.configuration),
                "loops": self.loops_done}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take ``state`` (:meth:`state_dict`'s, a peer's or a checkpoint's).

        Raises:
            ValueError: it was written under another configuration (virtual shards, batch, seed, shuffling, the
                dataset's length, the model's layout, the comm hook): the steps after it would train other samples,
                split and seeded otherwise, or reduce otherwise than the run that wrote it; the message names each
                difference.
        """
        theirs = state.get("configuration") or {}  # (files of before it was kept have none)
        # How the steps' buckets go out changes no result: a resumed run may choose it (the members compare it).
        differ = [name for name, value in self.configuration.items()
                  if name in theirs and theirs[name] != value and name != "overlap"]
        if differ:
            what = ", ".join(self._difference(name, theirs[name], self.configuration[name]) for name in differ)
            raise ValueError(f"FaultTolerance: the state to resume from was written under another configuration "
                             f"than this run's: {what}; resume with the settings it was written with, or start "
                             "afresh")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for name, obj in self.state.items():
            obj.load_state_dict(state["state"][name])
        self.committed = int(state["committed"])
        self.first_world = int(state.get("first_world", self.first_world))  # (files of before it was kept)


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch
