"""Local SGD with periodic model averaging (post-local SGD, Lin et al., 2018).

Synchronous data parallelism averages gradients every step. Local SGD lets
each rank take optimizer steps on its own gradients and averages the
*parameters* every ``period`` steps instead, sending about ``1 / period`` of
the bytes. Post-local SGD starts with ``warmup_steps`` ordinary synchronous
steps (the start of training is the most sensitive to the noise local steps
add), then switches.

Schedule (step = the 0-based index of the optimizer step just taken, as in
torch's ``PeriodicModelAverager``): steps ``< warmup_steps`` reduce gradients
through DDP; from step ``warmup_steps`` on, DDP communicates nothing in
backward, and parameters are averaged after steps ``warmup_steps``,
``warmup_steps + period``, ... Hierarchical periods (torch's
``HierarchicalModelAverager``): ``period={2: 4, 8: world}`` averages within
groups of 4 consecutive ranks after every step divisible by 2, and over the
whole world after every step divisible by 8 (the largest period that divides
the step wins).

Buffers (BatchNorm statistics) follow DDP's rule as under torch's post-local
SGD hook: with ``broadcast_buffers`` they are broadcast from rank 0 before
every forward with grad enabled (and the first after one without), local
steps and their micro-batches included; they are not averaged. Only the
trainable parameters are averaged (torch's averagers skip those without a
gradient).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.comm.allreduce import ALGORITHMS, all_reduce
from ddpkit.parallel.ddp.wrapper import DistributedDataParallel
from ddpkit.runtime import events, membership

__all__ = ["LocalSGD", "average_parameters", "driven"]


def driven(model: nn.Module, process_group: dist.ProcessGroup | None, who: str, *, follows_membership: bool = False,
           ) -> tuple[DistributedDataParallel | None, dist.ProcessGroup | None]:
    """What an averaging scheme (``who``: LocalSGD, DiLoCo) drives: ``model``'s ddpkit DDP (None: a plain module)
    and the group to average over (the one given, else the DDP's, else the world's; None without one).

    Under ``ddpkit launch --on-failure continue`` no group spans the job (its world changes as workers die): a
    scheme that ``follows_membership`` (DiLoCo) takes the plain module and the membership's groups; any other, and
    a DDP wrapper built there (it spans no group), is refused rather than left to train each process alone.

    Raises:
        TypeError: not a module, or torch's DDP.
        ValueError: under ``--on-failure continue``, a wrapper built there, or a scheme that cannot follow the
            membership, with no group given.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who} takes a module (ddpkit.DDP or plain), not {type(model).__name__}")
    if type(model).__name__ == "DistributedDataParallel" and not isinstance(model, DistributedDataParallel):
        raise TypeError(f"{who} drives ddpkit's DDP: wrap the model with ddpkit.DDP, not torch's")
    ddp = model if isinstance(model, DistributedDataParallel) else None
    if process_group is None and ddp is not None:
        if ddp.under_membership:
            fix = "pass the plain module (model.module): DiLoCo then follows the membership" if follows_membership \
                else f"{who} does not run under --on-failure continue; use DiLoCo, or --on-failure restart"
            raise ValueError(f"{who} over a DistributedDataParallel built under ddpkit launch --on-failure continue: "
                             f"that wrapper spans no group (the world changes as workers die), so each process would "
                             f"average with itself alone; {fix}")
        process_group = ddp.process_group
    if process_group is None and dist.is_available() and dist.is_initialized():
        process_group = dist.group.WORLD
    if process_group is None and not follows_membership and membership.current() is not None:
        raise ValueError(f"{who} under ddpkit launch --on-failure continue: no process group spans the job (its "
                         f"world changes as workers die), so each process would average with itself alone; {who} "
                         "does not follow the membership: use ddpkit.DiLoCo, or --on-failure restart")
    return ddp, process_group


def average_parameters(params: list[torch.Tensor], group: dist.ProcessGroup, algorithm: str = "native") -> None:
    """Replace ``params`` by their mean over ``group``: one flat all-reduce per dtype and device.

    Divides before summing (torch's averager does the same, so the numbers agree).
    """
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    size = dist.get_world_size(group)
    with torch.no_grad():
        for members in by_kind.values():
            flat = torch.cat([p.detach().reshape(-1) for p in members])
            flat /= size
            events.collective("LocalSGD: average {} parameters", len(members))
            all_reduce(flat, "sum", algorithm, group, check=False)
            at = 0
            for p in members:
                p.copy_(flat[at : at + p.numel()].view_as(p))
                at += p.numel()


class LocalSGD:
    """Post-local SGD around a ddpkit DDP model: synchronous warm-up, then local steps and periodic averaging.

    Args:
        model: a :class:`ddpkit.DistributedDataParallel`, or a plain module
            (then ``warmup_steps`` must be 0: nothing would synchronise it).
        period: average every this many steps (an int >= 1), or hierarchical
            periods ``{period: group_size}`` with increasing periods and group
            sizes, the last group size the world size.
        warmup_steps: synchronous steps before local SGD starts.
        process_group: the group to average over; default the model's (or the world).
        algorithm: all-reduce algorithm of the averaging (``ddpkit.collectives``).

    Raises:
        ValueError: ``period < 1``, negative ``warmup_steps``, a bad hierarchy,
            ``warmup_steps > 0`` with a plain module.
        TypeError: a model that is neither.

    Example::

        model = ddpkit.DDP(net)
        local = ddpkit.LocalSGD(model, period=4, warmup_steps=100)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()   # after step 100: no communication here
            opt.step()
            local.step()                      # averages parameters every 4th step
    """

    def __init__(self, model: nn.Module, period: int | Mapping[int, int], warmup_steps: int = 0,
                 process_group: dist.ProcessGroup | None = None, algorithm: str = "native") -> None:
        self.ddp, process_group = driven(model, process_group, "LocalSGD")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an integer >= 0")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r} is not known: choose one of {', '.join(ALGORITHMS)}")
        if self.ddp is None and warmup_steps > 0:
            raise ValueError(
                f"warmup_steps={warmup_steps} needs a ddpkit.DDP model to synchronise the warm-up steps; "
                "wrap the model with ddpkit.DDP, or pass warmup_steps=0"
            )
        self.group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        self.module = self.ddp.module if self.ddp is not None else model
        self.warmup_steps = warmup_steps
        self.algorithm = algorithm
        self.periods = self._hierarchy(period)
        """``[(period, group), ...]`` with increasing periods; the last group is the whole one."""
        self.hierarchical = isinstance(period, Mapping)
        """``period`` was a dict: torch's ``HierarchicalModelAverager``'s rule (the step itself divisible by a
        period), one entry too; an int: ``PeriodicModelAverager``'s (counted from the warm-up's end)."""
        self.period = self.periods[-1][0]
        self.step_count = 0
        """Optimizer steps taken so far (``step()`` calls)."""
        self.averages = 0
        """Parameter averagings done so far (each a collective over its group)."""
        self._apply_mode()

    def _hierarchy(self, period: int | Mapping[int, int]) -> list[tuple[int, dist.ProcessGroup | None]]:
        if isinstance(period, Mapping):
            items = list(period.items())
            if not items:
                raise ValueError("period={}: give at least one {period: group_size}")
            periods = [p for p, _ in items]
            sizes = [s for _, s in items]
            if any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in periods):
                raise ValueError(f"period={dict(period)}: every period must be an integer >= 1")
            if periods != sorted(set(periods)) or sizes != sorted(sizes):
                raise ValueError(f"period={dict(period)}: periods and group sizes must both increase")
            if sizes[-1] != self.world_size:
                raise ValueError(
                    f"period={dict(period)}: the last group size {sizes[-1]} must be the world size "
                    f"{self.world_size} (the largest period averages over everyone)"
                )
            bad = [s for s in sizes if s < 1 or self.world_size % s]
            if bad:
                raise ValueError(f"period={dict(period)}: group size(s) {bad} do not divide the world size "
                                 f"{self.world_size}")
            out = []
            for p, s in items:
                if s == self.world_size:
                    out.append((p, self.group))
                else:
                    out.append((p, dist.new_subgroups(group_size=s, group=self.group)[0]))
            if periods[-1] == 1:
                warnings.warn("LocalSGD with period 1 sends as much as DDP does, later: use plain DDP", stacklevel=3)
            return out
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"period={period!r} must be an integer >= 1 (average every period steps), or a "
                             "{period: group_size} dict")
        if period == 1:
            warnings.warn("LocalSGD(period=1) sends as much as DDP does, later: use plain DDP", stacklevel=3)
        return [(period, self.group)]

    @property
    def local(self) -> bool:
        """Whether steps are local now (the warm-up is over)."""
        return self.step_count >= self.warmup_steps

    def _apply_mode(self) -> None:
        if self.ddp is None:
            return
        self.ddp.require_backward_grad_sync = not self.local
        self.ddp.local_steps = self.local  # as under torch's post-local SGD hook, every forward broadcasts buffers
        if self.local:
            self.ddp.require_forward_param_sync = True

    def _due(self, step: int) -> dist.ProcessGroup | None | bool:
        """The group to average over after ``step``, or False."""
        if step < self.warmup_steps:
            return False
        if not self.hierarchical:
            return self.periods[0][1] if (step - self.warmup_steps) % self.period == 0 else False
        for p, group in reversed(self.periods):  # torch's hierarchical rule: the step itself, largest period
            if step % p == 0:
                return group
        return False

    def average(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Average the parameters over the whole group now, outside the schedule (before evaluating or saving).

        With ``optimizer``, its floating-point state (momentum, Adam's moments)
        too, so that every rank holds one model and one optimizer state: what
        a checkpoint needs to be the whole job's state.
        """
        if self.world_size <= 1:
            return
        tensors = self._trainable()
        if optimizer is not None:
            tensors += [v for p in tensors for k, v in optimizer.state.get(p, {}).items()
                        if torch.is_tensor(v) and v.is_floating_point() and k != "step"]
        average_parameters(tensors, self.group, self.algorithm)  # type: ignore[arg-type]
        self.averages += 1

    def _trainable(self) -> list[torch.Tensor]:
        """What is averaged: the parameters trainable now (torch's averagers skip those without a gradient; a
        frozen one would only pick up the rounding of the average; one unfrozen later is averaged from then on)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def step(self) -> bool:
        """Call after every ``optimizer.step()``; averages when due. Returns whether it averaged."""
        group = self._due(self.step_count)
        averaged = group is not False and self.world_size > 1
        if averaged:
            average_parameters(self._trainable(), group, self.algorithm)  # type: ignore[arg-type]
            self.averages += 1
        self.step_count += 1
        self._apply_mode()
        return averaged

    def state_dict(self) -> dict[str, Any]:
        """The step count, for checkpoints."""
        return {"step_count": self.step_count, "averages": self.averages}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step_count = int(state["step_count"])
        self.averages = int(state.get("averages", 0))
        self._apply_mode()
