"""DiLoCo and streaming DiLoCo: inner steps alone, an outer step on the averaged pseudo-gradient every H steps.

DiLoCo (Douillard et al., 2023): every rank takes ``sync_every`` (H) steps of
its own optimizer (the *inner* one, AdamW in the paper) on its own data, with
no communication. Then the ranks average the *pseudo-gradient*, the change
since the last synchronisation, ``global - local`` (the sign of a gradient:
a step against it moves the global model towards the local ones), and an
*outer* optimizer (SGD with Nesterov momentum, lr 0.7, momentum 0.9 by
default) applies it to the global model, which every rank then continues
from. With ``H = 1``, an inner SGD and an outer SGD at lr 1 without momentum,
it is DDP: the global model moves by the mean of the ranks' steps.

Streaming DiLoCo (Douillard et al., 2025): the model in ``fragments`` (P)
synchronised on a staggered schedule (fragment ``f`` after steps
``(f + 1) * H // P``, then every H), so that a synchronisation sends 1/P of
the model; each one's exchange runs while the rank takes ``delay`` (tau)
more inner steps, and the fragment then becomes ``mixing`` (alpha) of the
local parameters plus ``1 - alpha`` of the new global ones (alpha 0: the
global ones, as DiLoCo). Any number of fragments may be in flight at once.

The pseudo-gradient (computed in float32, float64 where a parameter is)
travels as ``codec``: ``fp32``, ``bf16`` (an all-reduce of the mean in that
type, whatever the parameters' dtype), or ``int8`` / ``int4`` (block-wise,
one float32 scale per ``block_size`` numbers, :mod:`ddpkit.comm.quantize`: every rank's
codes are gathered and each rank decodes and sums them in rank order, so
every rank applies the same outer step bit for bit). Nothing is ever sent
in another form than the one asked for.

The outer optimizer is an ordinary torch optimizer over the model's own
parameters (as torchft's): at a synchronisation the parameters are set back
to the global copy, their ``.grad`` to the averaged pseudo-gradient (the
inner gradients are put back afterwards) and ``outer.step()`` moves them;
fragments not due have no gradient, so the optimizer leaves them alone.

Memory: one copy of the trainable parameters (the global model) and, while
a fragment is in flight, its pseudo-gradient.

Under ``ddpkit launch --on-failure continue`` (a plain module, no group
given) the workers are the launcher's membership (:mod:`ddpkit.runtime.membership`)
and a worker's death lets the others go on: every exchange waits
interruptibly; at a change (seen inside an exchange, or at the next
:meth:`DiLoCo.step`) the survivors build the new view's group and compare how
many outer steps each has applied. An exchange can end on some ranks and not
on others when a peer dies inside it: those behind take the global model,
the outer optimizer's state and the counts from the lowest rank that is
furthest (their own inner steps were in that outer step already); when none
is ahead, the survivors exchange their pseudo-gradients again among
themselves, averaged over the new size. The dead worker's inner steps since
its last outer step are lost; :attr:`DiLoCo.samples` counts the samples the
global model holds (each exchange carries the members' counts, given to
:meth:`DiLoCo.step`), so the loss shows. Streaming (``fragments > 1`` or
``delay > 0``), an algorithm other than ``native`` and a replacement worker
are refused there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
import io
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.comm.allreduce import ALGORITHMS, all_reduce
from ddpkit.comm.quantize import dequantize, payload_bytes, quantize
from ddpkit.parallel.common.broadcast import broadcast_parameters
from ddpkit.parallel.local_sgd import average_parameters, driven
from ddpkit.runtime import events, membership
from ddpkit.runtime.devices import comm_device

__all__ = ["CODECS", "DiLoCo"]

CODECS = ("fp32", "bf16", "int8", "int4")
"""How the pseudo-gradient travels."""
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


@dataclass(eq=False)
class _Fragment:
    """Parameters synchronised together, when, and the exchange in flight."""

    index: int
    params: list[nn.Parameter]
    backup: list[torch.Tensor]
    """The global model's values of ``params``."""
    offset: int
    """The first step after which it synchronises (then every ``sync_every``)."""
    work: Any = None
    """The exchange in flight (a collective's handle), or None."""
    buffer: Any = None
    """What the exchange fills: the sum (fp32, bf16), or every rank's payload (int8, int4)."""
    mean: torch.Tensor | None = None
    """The averaged pseudo-gradient once the exchange is done (flat, ``dtype``)."""
    due: int = 0
    """The step after which the exchange in flight is applied."""
    applied_at: int = 0
    """The inner step at which its global values were last taken (0: the start, where every rank holds them)."""
    count: torch.Tensor | None = None
    """Under a membership: the members' samples that the exchange in flight folds in (their sum, once done)."""
    count_work: Any = None
    dtype: torch.dtype = torch.float32
    numel: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.numel = sum(p.numel() for p in self.params)

    @property
    def in_flight(self) -> bool:
        return self.work is not None or self.mean is not None


class DiLoCo:
    """DiLoCo, and streaming DiLoCo with ``fragments > 1`` (see the module notes).

    Args:
        model: a :class:`ddpkit.DistributedDataParallel` (its backward then
            communicates nothing: inner steps are local) or a plain module
            (its parameters and buffers are broadcast from rank 0 here, as
            DDP's constructor does).
        sync_every: H, inner steps between two synchronisations of a fragment.
        outer_optimizer: a torch optimizer over the model's parameters (every
            trainable one); default ``SGD(lr=0.7, momentum=0.9, nesterov=True)``.
        fragments: P, the number of fragments (the trainable parameters in
            order, cut where the elements are closest to equal parts), or the
            fragments themselves (modules or lists of parameters, disjoint,
            together every trainable parameter).
        delay: tau, inner steps a fragment's exchange overlaps (``< sync_every``).
        mixing: alpha in [0, 1], the share of the local parameters kept when a
            fragment takes the new global ones.
        codec: how the pseudo-gradient travels: ``fp32``, ``bf16``, ``int8``, ``int4``.
        block_size: numbers per scale of ``int8`` and ``int4``.
        process_group: default the model's (or the world); under ``ddpkit launch
            --on-failure continue``, with none given, the membership's groups (see the module notes).
        algorithm: the all-reduce algorithm of ``fp32`` and ``bf16`` (``ddpkit.collectives``).

    Raises:
        ValueError: a bad H, P, tau, alpha, codec, or fragments that do not
            cover the trainable parameters once; an outer optimizer over other
            parameters.
        TypeError: torch's DDP, or something that is not a module.

    Example::

        model = ddpkit.DDP(net)
        inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
        diloco = ddpkit.DiLoCo(model, sync_every=100)
        for x, y in loader:
            inner.zero_grad()
            loss_fn(model(x), y).backward()   # no communication
            inner.step()
            diloco.step()                     # an outer step every 100 steps
    """

    def __init__(self, model: nn.Module, sync_every: int, outer_optimizer: torch.optim.Optimizer | None = None, *,
                 fragments: int | Sequence[nn.Module | Iterable[nn.Parameter]] = 1, delay: int = 0,
                 mixing: float = 0.0, codec: str = "fp32", block_size: int = 128,
                 process_group: dist.ProcessGroup | None = None, algorithm: str = "native") -> None:
        given = process_group
        self.ddp, process_group = driven(model, process_group, "DiLoCo", follows_membership=True)
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r} must be an integer >= 1 (inner steps between outer steps)")
        if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < sync_every:
            raise ValueError(f"delay={delay!r} must be an integer from 0 to sync_every - 1 ({sync_every - 1}): a "
                             "fragment's exchange must end before its next one begins")
        if not isinstance(mixing, (int, float)) or isinstance(mixing, bool) or not 0.0 <= mixing <= 1.0:
            raise ValueError(f"mixing={mixing!r} must be a number in [0, 1] (the share of the local parameters kept)")
        if codec not in CODECS:
            raise ValueError(f"codec={codec!r} is not known: choose one of {', '.join(CODECS)}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r} is not known: choose one of {', '.join(ALGORITHMS)}")
        if codec in ("int8", "int4"):
            payload_bytes(1, int(codec[3:]), block_size)  # checks block_size
        if self.ddp is not None and self.ddp.zero_stage:
            raise ValueError(f"DiLoCo needs every rank to hold the whole model and its gradients, not a ZeRO stage "
                             f"{self.ddp.zero_stage} shard: wrap the model with ddpkit.DDP(model) (zero_stage=0)")
        self.module = self.ddp.module if self.ddp is not None else model
        self.group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        self.membership = membership.current() if given is None and self.ddp is None else None
        """Under ``ddpkit launch --on-failure continue``: the job's membership, whose groups change at deaths."""
        self.view: membership.View | None = None
        self.samples: int | None = None
        """Under the membership: the samples the global model holds (every member's, as given to :meth:`step`,
        folded in by the outer steps so far); None elsewhere."""
        self._pending_samples = 0
        self._ended = 0
        """Under the membership: final agreements this member ended (see :meth:`agree`)."""
        self.changes: list[dict[str, Any]] = []
        """Under the membership: each change met (the generation, the members lost, whether this rank took the
        state, the outer steps applied)."""
        if self.membership is not None:
            self._check_survivable(fragments, delay, algorithm)
            self.samples = 0
            self._join_view()
        self.sync_every, self.delay, self.mixing = sync_every, delay, float(mixing)
        self.codec, self.block_size, self.algorithm = codec, block_size, algorithm
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("DiLoCo: the model has no trainable parameter")
        bad = [str(p.dtype) for p in trainable if not p.is_floating_point()]
        if bad:
            raise ValueError(f"DiLoCo: parameters of dtype {bad[0]} have no pseudo-gradient to average; freeze them")
        if self.ddp is None and self.world_size > 1 and self.membership is None:
            broadcast_parameters(self.module.state_dict(), root_rank=0, process_group=self.group)
        if self.ddp is not None:
            # Inner steps are local: nothing in backward; buffers follow DDP's rule (broadcast before each forward).
            self.ddp.require_backward_grad_sync = False
            self.ddp.local_steps = True
            self.ddp.require_forward_param_sync = True
        self.params = trainable
        self.outer = outer_optimizer if outer_optimizer is not None else torch.optim.SGD(
            trainable, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
        self._check_outer(trainable)
        self.fragments = [
            _Fragment(i, group, [p.detach().clone() for p in group], offset=(i + 1) * sync_every // len(groups),
                      dtype=self._delta_dtype(group))
            for groups in [self._fragments(fragments, trainable)] for i, group in enumerate(groups)
        ]
        self.step_count = 0
        """Inner steps so far (:meth:`step` calls)."""
        self.syncs = 0
        """Fragment synchronisations applied so far (a whole model's counts P)."""
        self.bytes_sent = 0
        """Bytes this rank handed to collectives so far (the payloads, before the transport's own overhead)."""
        if self.membership is not None:  # every member starts from the first one's model (DDP's rule)
            self.syncs = -1  # not started: an agreement then sends the model (its buffers too) from a member
            self._recover()
            self.syncs = max(self.syncs, 0)

    # -- set-up --------------------------------------------------------------

    def _check_outer(self, trainable: list[nn.Parameter]) -> None:
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer must be a torch.optim.Optimizer, not {type(self.outer).__name__}")
        theirs = {id(p) for g in self.outer.param_groups for p in g["params"]}
        names = {id(p): n for n, p in self.module.named_parameters()}
        missing = [names[id(p)] for p in trainable if id(p) not in theirs]
        if missing or not theirs <= set(names):
            why = f"it leaves out {', '.join(missing[:5])}" if missing else "it holds parameters of another model"
            raise ValueError(f"outer_optimizer must hold the model's trainable parameters ({why}): build it as "
                             "torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)")

    @staticmethod
    def _delta_dtype(params: list[nn.Parameter]) -> torch.dtype:
        """float32, or float64 where a parameter is: a pseudo-gradient keeps every bit the parameters have."""
        return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32

    def _fragments(self, fragments: int | Sequence[Any], trainable: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        if isinstance(fragments, bool) or not isinstance(fragments, (int, Sequence)) or isinstance(fragments, str):
            raise ValueError(f"fragments={fragments!r} must be a count or a list of modules or parameter lists")
        if isinstance(fragments, int):
            if not 1 <= fragments <= min(len(trainable), self.sync_every):
                raise ValueError(f"fragments={fragments} must be from 1 to {min(len(trainable), self.sync_every)} "
                                 f"(the model has {len(trainable)} trainable parameters, and every fragment "
                                 f"synchronises once in sync_every={self.sync_every} steps)")
            return _cut(trainable, fragments)
        groups = [[p for p in (f.parameters() if isinstance(f, nn.Module) else f) if p.requires_grad]
                  for f in fragments]
        if not groups or not 1 <= len(groups) <= self.sync_every or any(not g for g in groups):
            raise ValueError(f"fragments: give 1 to sync_every={self.sync_every} fragments, each with a trainable "
                             "parameter")
        seen: dict[int, int] = {}
        for i, g in enumerate(groups):
            for p in g:
                if id(p) in seen:
                    raise ValueError(f"fragments {seen[id(p)]} and {i} share a parameter: each belongs to one")
                seen[id(p)] = i
        names = {id(p): n for n, p in self.module.named_parameters()}
        missing = [names.get(id(p), "?") for p in trainable if id(p) not in seen]
        if missing:
            raise ValueError(f"fragments leave out {', '.join(missing[:5])}: every trainable parameter belongs to "
                             "one fragment")
        if len(seen) != len(trainable):
            raise ValueError("fragments hold parameters that are not the model's")
        return groups

    def global_parameters(self) -> list[torch.Tensor]:
        """The global model's values of :attr:`params` (what the last outer steps made), in their order."""
        where = {id(p): b for f in self.fragments for p, b in zip(f.params, f.backup)}
        return [where[id(p)] for p in self.params]

    # -- the schedule --------------------------------------------------------

    def _due(self, fragment: _Fragment, step: int) -> bool:
        return step >= fragment.offset and (step - fragment.offset) % self.sync_every == 0

    def step(self, samples: int = 0) -> bool:
        """Call after every inner ``optimizer.step()``: begins the exchanges due, applies the ones that end.

        ``samples``: how many the inner step trained (counted under a membership, see :attr:`samples`).
        Returns whether a fragment took new global parameters.
        """
        self.step_count += 1
        self._pending_samples += samples
        if self.membership is not None and self._changed():
            self._recover()  # at once, so that a member behind (inside an exchange) is not kept waiting
        if self.ddp is not None:
            self.ddp.require_forward_param_sync = True  # as LocalSGD: every forward still broadcasts buffers
        applied = False
        for f in self.fragments:
            if f.in_flight and f.due <= self.step_count:
                self._apply(f, self.mixing)
                applied = True
        for f in self.fragments:
            if self._due(f, self.step_count):
                self._begin(f)
                if self.delay == 0:
                    self._apply(f, self.mixing)
                    applied = True
        return applied

    def sync(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """An outer step of every fragment now, outside the schedule (before evaluating or saving): every rank
        then holds the global model. The exchanges in flight are applied first, each rank keeping its local
        parameters, whose progress since then the outer step of this call then takes in; a fragment whose
        parameters are its global values already (just synchronised, mixing 0) takes no outer step (a zero
        pseudo-gradient would still move it by the outer optimizer's momentum).

        With ``optimizer`` (the inner one), its floating-point state (AdamW's moments, momentum) is averaged too,
        so that every rank holds one model and one state: what a checkpoint of one rank needs to be the job's.
        Under a membership the inner state stays each worker's own (``optimizer`` is refused), and the call ends
        with the members agreed (:meth:`agree`).
        """
        if self.membership is not None and optimizer is not None:
            raise ValueError("DiLoCo.sync(optimizer) under --on-failure continue: the inner state stays each "
                             "worker's own (an average of it could not survive a death half-way); call sync()")
        for f in self.fragments:
            if f.in_flight:
                self._apply(f, 1.0)  # its outer step; the local parameters kept, to go into the next
        moved = self._moved_anywhere() if self.membership is None else []
        for f in self.fragments:
            if self.membership is not None:  # decided by the schedule, the same on every member
                unchanged = f.applied_at == self.step_count and self.mixing == 0.0
            else:
                unchanged = not moved[f.index]
            if not unchanged:  # else no outer step: a zero pseudo-gradient would still move it by momentum
                self._begin(f)
                self._apply(f, 0.0)
        if self.membership is not None:
            self._agree_final()
        if optimizer is not None and self.world_size > 1:
            state = [v for p in self.params for k, v in optimizer.state.get(p, {}).items()
                     if torch.is_tensor(v) and v.is_floating_point() and k != "step"]
            if state:
                average_parameters(state, self.group, self.algorithm)  # type: ignore[arg-type]

    def _moved_anywhere(self) -> list[bool]:
        """Per fragment, whether its parameters left their global values on any rank (one small collective): every
        rank then takes the same outer steps in :meth:`sync`. A rank's own look could differ from another's (a
        fragment no gradient reached there, or an inner step that moved nothing), and a rank that skipped an outer
        step another took would pair its next collective with the wrong one."""
        with torch.no_grad():
            flags = torch.tensor([float(not all(torch.equal(p, b) for p, b in zip(f.params, f.backup)))
                                  for f in self.fragments])
        if self.world_size > 1:
            flags = flags.to(comm_device(self.group, like=self.params[0]))
            all_reduce(flags, "max", self.algorithm, self.group, check=False)
        return [bool(x) for x in flags.tolist()]

    # -- one fragment --------------------------------------------------------

    def _begin(self, f: _Fragment) -> None:
        """Start averaging ``f``'s pseudo-gradient (global - local) over the group."""
        with torch.no_grad():
            delta = torch.cat([(b.to(f.dtype) - p.detach().to(f.dtype)).reshape(-1)
                               for p, b in zip(f.params, f.backup)])
        f.due = self.step_count + self.delay
        f.work = f.buffer = None
        if self.membership is not None:
            f.count = torch.tensor([float(self._pending_samples)], dtype=torch.float64)
            f.count_work = self.group.allreduce([f.count])  # a membership's group: not in torch's registry
        if self.world_size == 1:
            f.mean = delta
            return
        device = comm_device(self.group, like=delta)
        if self.codec in ("fp32", "bf16"):
            send = (delta / self.world_size).to(device=device, dtype=torch.bfloat16 if self.codec == "bf16"
                                                else torch.float32)
            events.collective("DiLoCo: fragment {} pseudo-gradient ({})", f.index, self.codec)  # all_reduce counts
            f.buffer = send
            f.work = self.group.allreduce([send]) if self.membership is not None else \
                all_reduce(send, "sum", self.algorithm, self.group, async_op=True, check=False)
            self.bytes_sent += send.numel() * send.element_size()
            return
        payload = quantize(delta, int(self.codec[3:]), self.block_size).to(device)
        gathered = [torch.empty_like(payload) for _ in range(self.world_size)]
        events.collective("DiLoCo: fragment {} pseudo-gradient ({})", f.index, self.codec, nbytes=payload.numel())
        f.buffer = gathered
        f.work = self.group.allgather([gathered], [payload]) if self.membership is not None else \
            dist.all_gather(gathered, payload, group=self.group, async_op=True)
        self.bytes_sent += payload.numel()

    def _finish(self, f: _Fragment, mixing: float = 0.0) -> torch.Tensor | None:
        """The averaged pseudo-gradient of ``f`` (waits for its exchange); None when, under a membership, this
        rank took the outer step's result from a member ahead instead (``mixing`` of its own kept, as
        :meth:`_apply` would)."""
        if f.count_work is not None and not self._settled(f, mixing):  # (under a membership)
            return None
        if f.mean is None:
            f.work.wait()
            if self.codec in ("fp32", "bf16"):
                f.mean = f.buffer.to(device=f.backup[0].device, dtype=f.dtype)
            else:
                bits, total = int(self.codec[3:]), None
                for payload in f.buffer:  # in rank order: every rank adds the same numbers in the same order
                    part = dequantize(payload, f.numel, bits, self.block_size).to(f.dtype)
                    total = part if total is None else total.add_(part)
                f.mean = (total / self.world_size).to(f.backup[0].device)  # type: ignore[operator]
            f.work = f.buffer = None
        return f.mean

    def _apply(self, f: _Fragment, mixing: float) -> None:
        """The outer step of ``f`` on its global values; the fragment takes them (``mixing`` of its own kept)."""
        mean = self._finish(f, mixing)
        f.mean = None
        if mean is None:
            return  # the state of a member ahead taken (_adopt)
        if f.count is not None:
            self.samples += int(f.count.item())  # type: ignore[operator]
            self._pending_samples, f.count = 0, None
        local = [p.detach().clone() for p in f.params] if mixing else None
        grads = [p.grad for p in self.params]
        try:
            for p in self.params:
                p.grad = None
            at = 0
            with torch.no_grad():
                for p, b in zip(f.params, f.backup):
                    p.copy_(b)
                    p.grad = mean[at : at + p.numel()].view_as(p).to(p.dtype).clone()
                    at += p.numel()
            self.outer.step()
        finally:
            for p, g in zip(self.params, grads):
                p.grad = g
        with torch.no_grad():
            for i, (p, b) in enumerate(zip(f.params, f.backup)):
                b.copy_(p)
                if local is not None:
                    p.lerp_(local[i], mixing)
        self.syncs += 1
        f.applied_at = self.step_count

    # -- checkpoints ---------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The schedule, the global model, the outer optimizer's state, and the exchanges in flight (waited for:
        their averages, applied at their step after a load as they would have been)."""
        pending = {}
        for f in self.fragments:
            if f.in_flight:  # (never under a membership: no delay, nothing in flight between two calls)
                mean = self._finish(f)
                assert mean is not None
                pending[str(f.index)] = {"due": f.due, "mean": mean.clone()}
        return {"step_count": self.step_count, "syncs": self.syncs, "bytes_sent": self.bytes_sent,
                "backup": [[b.clone() for b in f.backup] for f in self.fragments], "outer": self.outer.state_dict(),
                "pending": pending, "layout": self._layout()}

    def _layout(self) -> dict[str, Any]:
        return {"sync_every": self.sync_every, "fragments": [[list(p.shape) for p in f.params]
                                                             for f in self.fragments]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (of a run with the same model, H and fragments).

        Between two synchronisations every rank's parameters are its own: restore them after making the DiLoCo
        (whose constructor, on a plain module, broadcasts rank 0's, as DDP's does), or save after :meth:`sync`.
        """
        if state.get("layout") != self._layout():
            raise ValueError(f"DiLoCo state of another set-up ({state.get('layout')}, this one {self._layout()}): "
                             "resume with the same model, sync_every and fragments")
        with torch.no_grad():
            for f, saved in zip(self.fragments, state["backup"]):
                for b, s in zip(f.backup, saved):
                    b.copy_(s)
        self.outer.load_state_dict(state["outer"])
        self.step_count, self.syncs = int(state["step_count"]), int(state["syncs"])
        self.bytes_sent = int(state.get("bytes_sent", 0))
        for f in self.fragments:
            f.work = f.buffer = f.mean = None
            if (p := state["pending"].get(str(f.index))) is not None:
                f.due, f.mean = int(p["due"]), p["mean"].to(device=f.backup[0].device, dtype=f.dtype)

    # -- a membership that changes (ddpkit launch --on-failure continue) ------

    def _check_survivable(self, fragments: Any, delay: int, algorithm: str) -> None:
        why = None
        if (fragments != 1 if isinstance(fragments, int) else len(fragments) != 1) or delay:
            why = (f"streaming (fragments={fragments!r}, delay={delay}) is not built for it: exchanges in flight "
                   "across a death would need each fragment's own agreement; use fragments=1, delay=0")
        elif algorithm != "native":
            why = f"algorithm={algorithm!r} cannot be interrupted by a death: use the native all-reduce"
        if why is not None:
            raise ValueError(f"DiLoCo under --on-failure continue: {why}")

    def _join_view(self) -> None:
        """The newest view's group (built again after each change); this rank must be a member of it."""
        assert self.membership is not None
        while True:
            view = self.membership.latest()
            if self.membership.member not in view.members:
                raise RuntimeError(f"member {self.membership.member} joins a running DiLoCo job (a replacement, or "
                                   "a spare node's worker): it takes none (its data and inner state would be "
                                   "another's); run it without --max-restarts and without spare nodes")
            try:
                # Earlier groups kept: an exchange's count may be in flight there, unwaited (freeing blocks).
                self.group = self.membership.group(view)
            except membership.MembershipChanged:
                continue
            self.view, self.world_size = view, view.size
            return

    def _rank(self) -> int:
        assert self.membership is not None and self.view is not None
        return self.view.rank_of(self.membership.member)

    def _changed(self) -> bool:
        assert self.membership is not None and self.view is not None
        return self.membership.latest().generation != self.view.generation

    def _wait(self, work: Any) -> None:
        assert self.membership is not None and self.view is not None
        self.membership.wait(work, self.view)

    def _settled(self, f: _Fragment, mixing: float) -> bool:
        """Wait for ``f``'s exchange; after a change, agree, and exchange again in the new view when no member is
        ahead. False when this rank took a member's state instead (see :meth:`_recover`)."""
        while True:
            try:
                if f.work is not None:
                    self._wait(f.work)
                self._wait(f.count_work)
                f.count_work = None
                return True
            except membership.MembershipChanged:
                if self._recover(mixing=mixing)[0]:
                    return False
                self._begin(f)  # the same pseudo-gradient, its samples, averaged over the members left

    def agree(self) -> None:
        """Under a membership: agree with the other members once more, without an outer step (at the end of a
        run, before choosing who writes: every member then holds the same global model and view). Elsewhere
        nothing.

        The final agreements (this one, and the one that ends each :meth:`sync`) are numbered alike on every
        member, and each agreement says which one its member is in (0: none) and how many it has ended. Member
        in final agreement ``c`` goes on until one in which every member was in ``c`` or later, or had ended
        ``c`` already (it ended there an agreement this member gave up when a death interrupted it: the state
        it needs came with this one). So a member whose exchange or agreement a death interrupted while it ended
        elsewhere takes the outer step before the others leave, and no member waits for one that went on.
        """
        if self.membership is not None:
            self._agree_final()

    def _agree_final(self) -> None:
        call = self._ended + 1
        while True:
            rows = self._recover(call=call)[1]
            if all(in_call >= call or ended >= call for in_call, ended in rows):
                break
        self._ended = call

    def _recover(self, *, call: int = 0, mixing: float = 0.0) -> tuple[bool, list[tuple[int, int]]]:
        """Join the newest view and agree on the outer steps applied: whoever is behind takes the global model,
        the outer state and the counts from the lowest rank that is furthest (a member not started yet, at -1,
        its whole module too). ``call``: the final agreement this member is in (:meth:`agree`; 0: none).
        Whether this rank took the state, and each member's final agreement and the number it has ended."""
        before = self.view
        while True:
            self._join_view()
            try:
                rows = [torch.zeros(3, dtype=torch.int64) for _ in range(self.world_size)]
                mine = torch.tensor([self.syncs, call, self._ended])
                self._wait(self.group.allgather([rows], [mine]))
                applied = [int(r[0]) for r in rows]
                took = False
                if min(applied) != max(applied) or min(applied) < 0:
                    source = applied.index(max(applied))
                    state = self._broadcast_state(source, whole=min(applied) < 0)
                    if self.syncs < state["syncs"] or (self.syncs < 0 and self._rank() != source):
                        self._adopt(state, mixing)
                        took = True
                break
            except membership.MembershipChanged:
                continue
        assert self.view is not None
        lost = [m for m in (before.members if before is not None else ()) if m not in self.view.members]
        if lost or (took and self.syncs > 0):  # (not the start's)
            self.changes.append({"generation": self.view.generation, "lost": lost, "took_state": took,
                                 "outer_steps": max(self.syncs, 0), "step": self.step_count,
                                 "workers": self.view.size})
        return took, [(int(r[1]), int(r[2])) for r in rows]

    def _broadcast_state(self, source: int, whole: bool) -> dict[str, Any]:
        """The global model, the outer state and the counts of group rank ``source``, to every member; ``whole``:
        its module's state too (buffers, frozen parameters), for a member not started."""
        return self._broadcast(source, lambda: {
            "syncs": self.syncs, "samples": self.samples, "outer": self.outer.state_dict(),
            "backup": [[b.cpu() for b in f.backup] for f in self.fragments],
            "module": {k: v.cpu() for k, v in self.module.state_dict().items()} if whole else None})

    def _broadcast(self, source: int, make: Callable[[], Any]) -> Any:
        """``make()`` of group rank ``source``, to every member (its length, then its bytes; each wait
        interruptible)."""
        mine = self._rank() == source
        data = torch.empty(0, dtype=torch.uint8)
        if mine:
            buffer = io.BytesIO()
            torch.save(make(), buffer)
            data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        self._wait(self.group.broadcast([size], _root(source)))
        if not mine:
            data = torch.empty(int(size), dtype=torch.uint8)
        self._wait(self.group.broadcast([data], _root(source)))
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)

    def _adopt(self, state: Mapping[str, Any], mixing: float) -> None:
        """A member's outer step in place of this rank's exchange (its inner steps were in it already), ``mixing``
        of its own parameters kept as :meth:`_apply` keeps them; a member not started takes the whole module
        (its buffers as the source holds them now) and the global parameters."""
        starting = self.syncs < 0
        with torch.no_grad():
            if starting and state["module"] is not None:
                self.module.load_state_dict(state["module"])
            for f, saved in zip(self.fragments, state["backup"]):
                for p, b, value in zip(f.params, f.backup, saved):
                    local = p.detach().clone() if mixing and not starting else None
                    b.copy_(value)
                    p.copy_(b)
                    if local is not None:
                        p.lerp_(local, mixing)
                f.work = f.buffer = f.mean = f.count = f.count_work = None
                f.applied_at = self.step_count
        self.outer.load_state_dict(state["outer"])
        self.syncs, self.samples, self._pending_samples = int(state["syncs"]), state["samples"], 0


def _root(rank: int) -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = rank
    return options


def _cut(params: list[nn.Parameter], parts: int) -> list[list[nn.Parameter]]:
    """``params`` in order in ``parts`` runs, cut where the running count of elements is nearest each equal
    share (every run holding at least one parameter)."""
    total = sum(p.numel() for p in params)
    ends, running, cumulative = [], 0, []
    for p in params:
        running += p.numel()
        cumulative.append(running)
    start = 0
    for k in range(1, parts):
        target = total * k / parts
        lo, hi = start + 1, len(params) - (parts - k)  # leave one parameter for every later run
        best = min(range(lo, hi + 1), key=lambda i: (abs(cumulative[i - 1] - target), i))
        ends.append(best)
        start = best
    bounds = [0, *ends, len(params)]
    return [params[a:b] for a, b in zip(bounds, bounds[1:])]
