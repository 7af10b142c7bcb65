"""``ZeroRedundancyOptimizer``: ZeRO stage 1, the optimizer state sharded over the data-parallel ranks.

A drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer`` (same
constructor, methods and partition), working with ddpkit's DDP or torch's.
Every rank still holds the whole model and, after DDP's all-reduce, the whole
averaged gradient; each rank owns some of the parameters and keeps the
optimizer state of those only, in a local optimizer of ``optimizer_class``.
``step()`` steps the owned parameters, then every rank broadcasts what it
owns, so all replicas end the step identical. With AdamW the state is twice
the parameters: sharded, a rank keeps about ``2/N`` of it instead of ``2``.

The partition (torch's rule)
    For each parameter group in order, its parameters sorted by size (largest
    first; equal sizes keep their order) each go to the rank with the fewest
    elements assigned so far, counting every earlier group (the lowest rank on
    a tie). Each rank's local optimizer has one group per group of the
    optimizer, with that group's settings and its owned parameters (maybe
    none). ``add_param_group`` appends a group; the earlier ones keep their
    owners.

The optimizer's ``param_groups`` are the whole model's, as a user reads and
changes them (a learning-rate scheduler): their settings are copied to the
local optimizer before each step and back after.

``state_dict()`` is the state of the whole model in the format of an
unsharded optimizer (indices over all parameters, in group order), so a
checkpoint loads at any world size or into a plain optimizer; it needs a
``consolidate_state_dict(to)`` on every rank first, and is then available on
rank ``to``. ``load_state_dict`` takes that format, from any world size.

Stage 2
    Over the parameters of ``DistributedDataParallel(model, zero_stage=2)``
    the optimizer finds the model's sharded reducer
    (:mod:`ddpkit.parallel.zero.stage2`) and shards by elements instead: its
    local optimizer steps this rank's segments of the buckets (views of the
    reducer's parameter shards, with the averaged gradient shards), and the
    step ends with the reducer's all-gather of the parameters. It must hold
    every trainable parameter of that model (one optimizer per model, groups
    given at construction), its optimizer's state must be elementwise (SGD,
    Adam, AdamW, ...: one value per element, or a scalar such as Adam's
    step), and ``state_dict`` puts each parameter's state together from its
    segments: the same unsharded format, which loads at any world size and
    under any stage.

Differences from torch's, on purpose: ``load_state_dict`` leaves the given
dict as it is (torch's sets the entries of parameters this rank does not own
to ``None``) and keeps no second copy of the loaded state in ``self.state``;
``overlap_with_ddp=True`` (torch's DDP communication hook that steps inside
the backward) is refused with the alternative: ddpkit's own overlap is ZeRO
stage 2 in its DDP (``DistributedDataParallel(..., zero_stage=2)``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ddpkit.parallel.common.join_context import DISABLED, Join
from ddpkit.parallel.zero.partition import (
    checked_params,
    copy_settings,
    load_segment_state,
    merge_segment_state,
    partition,
    to_device,
)
from ddpkit.parallel.zero.stage2 import Segment, ShardedReducer, sharded_reducer
from ddpkit.runtime import events

__all__ = ["ZeroRedundancyOptimizer", "partition"]

log = logging.getLogger(__name__)


class ZeroRedundancyOptimizer(Optimizer):
    """ZeRO stage 1: each rank keeps the optimizer state of its share of the parameters (see the module notes).

    Args:
        params: the parameters, or parameter groups (dicts with ``params``), as for any optimizer.
        optimizer_class: the optimizer each rank runs on its share (``torch.optim.AdamW``, ...).
        process_group: the data-parallel group (default: the whole world).
        parameters_as_bucket_view: keep each rank's parameters in one flat
            tensor per device (the parameters become views of it), so each
            rank's broadcast is one message instead of one per parameter.
        overlap_with_ddp: torch's overlap through a DDP communication hook; not
            supported (``ValueError``): use ``DistributedDataParallel(...,
            zero_stage=2)``.
        **defaults: the optimizer's settings (``lr=...``), as for ``optimizer_class``.

    Raises:
        TypeError: ``params`` is not an iterable of tensors or of groups.
        ValueError: no parameters; parameters of several dtypes/devices or
            sparse; ``overlap_with_ddp=True``.

    Example::

        model = ddpkit.DDP(net)
        optimizer = ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        ...
        optimizer.consolidate_state_dict(to=0)      # on every rank
        if ddpkit.rank() == 0:
            torch.save(optimizer.state_dict(), "optimizer.pt")
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[Optimizer], process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False, **defaults: Any) -> None:
        if overlap_with_ddp:
            raise ValueError("overlap_with_ddp=True is torch's overlap through its DDP communication hook, which "
                             "ddpkit does not have: use overlap_with_ddp=False (ZeRO stage 1), or ddpkit's own "
                             "overlapped sharding, DistributedDataParallel(model, zero_stage=2) with its "
                             "optimizer (see docs/zero.md)")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"optimizer_class={optimizer_class!r} is not an optimizer class: pass the class, "
                            "e.g. torch.optim.AdamW, and its settings as keywords (lr=...)")
        items = checked_params(params)
        self._initialized = False
        super().__init__(items, defaults)
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self._global_ranks = [dist.get_global_rank(self.process_group, r) for r in range(self.world_size)]
        self._defaults = defaults
        self._join_config: Any = DISABLED
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._partition = partition(self.param_groups, self.world_size)
        self.sharded: ShardedReducer | None = sharded_reducer(self._all_params())
        """Stage 2: the reducer that shards the gradients (``DistributedDataParallel(zero_stage=2)``)."""
        self._segments: list[tuple[Segment, torch.Tensor]] = []
        if self.sharded is not None:
            self._check_stage2(optimizer_class)
            self.optim = optimizer_class(self._segment_groups(), **defaults)
        else:
            self.optim = optimizer_class(self._partition[self.rank], **defaults)
        copy_settings(self.optim.param_groups, self.param_groups)
        self._trainable = self._trainability()
        self._buckets: list[list[torch.Tensor]] = []
        self._build_buckets()
        self._consolidated: list[dict[str, Any]] = []
        self._initialized = True

    # -- the partition ---------------------------------------------------------------------------

    def _all_params(self) -> list[torch.Tensor]:
        return list(chain.from_iterable(g["params"] for g in self.param_groups))

    def owner(self, param: torch.Tensor) -> int:
        """The rank (of the process group) that steps ``param``."""
        for rank, groups in enumerate(self._partition):
            if any(param is p for g in groups for p in g["params"]):
                return rank
        raise KeyError("this parameter is not in the optimizer")

    def _trainability(self) -> list[bool]:
        return [p.requires_grad for p in self._all_params()]

    # -- stage 2: the segments of the sharded reducer --------------------------------------------

    def _check_stage2(self, optimizer_class: type[Optimizer]) -> None:
        reducer = self.sharded
        assert reducer is not None
        if self.parameters_as_bucket_view:
            raise ValueError("parameters_as_bucket_view=True with a zero_stage=2 model: its parameters are "
                             "gathered bucket by bucket already; drop parameters_as_bucket_view")
        if reducer.group is not None and self.process_group is not reducer.group \
                and dist.get_process_group_ranks(self.process_group) != dist.get_process_group_ranks(reducer.group):
            raise ValueError("the optimizer's process_group is not the zero_stage=2 model's: pass the model's "
                             "process_group, or leave both at their default")
        mine = {id(p) for p in self._all_params()}
        left_out = [n for n, p in zip(reducer.names, reducer.params) if id(p) not in mine]
        if left_out:
            raise ValueError(f"a zero_stage=2 model needs one ZeroRedundancyOptimizer over all of its trainable "
                             f"parameters; {', '.join(left_out[:3])}{' ...' if len(left_out) > 3 else ''} "
                             "are not in this one")
        # Each rank steps flat segments of the parameters: an optimizer whose update depends on a parameter's shape
        # or on all of it computes another one there, silently (Adafactor factors no matrix, its state still one
        # value per element; LBFGS's directions span the model). Elementwise ones (SGD, Adam, ...) are exact.
        shaped = tuple(c for c in (getattr(torch.optim, n, None) for n in ("Adafactor", "LBFGS", "SparseAdam"))
                       if c is not None)
        if issubclass(optimizer_class, shaped):
            raise ValueError(f"{optimizer_class.__name__} over a zero_stage=2 model: its update depends on whole "
                             "parameters (their shapes, or all of them), and stage 2 steps flat segments of them: "
                             "use zero_stage=1 (each parameter whole on one rank) or zero_stage=0")

    def _segment_groups(self) -> list[dict[str, Any]]:
        """The local optimizer's groups under stage 2: each group's segments, as views of the parameter shards."""
        reducer = self.sharded
        assert reducer is not None
        position = {id(p): i for i, p in enumerate(reducer.params)}
        by_param: dict[int, list[Segment]] = {}
        for seg in reducer.segments:
            by_param.setdefault(seg.param, []).append(seg)
        groups = []
        for group in self.param_groups:
            part = copy.copy(group)
            tensors = []
            for p in group["params"]:
                for seg in by_param.get(position.get(id(p), -1), []):
                    view = reducer.segment_view(reducer.param_shards, seg)
                    self._segments.append((seg, view))
                    tensors.append(view)
            part["params"] = tensors
            groups.append(part)
        return groups

    def _step_sharded(self, closure: Callable[[], float] | None, **kwargs: Any) -> float | None:
        reducer = self.sharded
        assert reducer is not None
        used = reducer.take_gradients()
        if used is None:
            log.warning("ZeroRedundancyOptimizer.step() with no synchronised backward since the last step: with "
                        "zero_stage=2 the gradients are sharded by that backward, so nothing is stepped")
        reducer.load_param_shards()
        for seg, view in self._segments:
            view.grad = (reducer.segment_view(reducer.grad_shards, seg)
                         if used is not None and used[seg.param] else None)
        copy_settings(self.param_groups, self.optim.param_groups)
        try:
            loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        finally:
            for _, view in self._segments:
                view.grad = None
        copy_settings(self.optim.param_groups, self.param_groups)
        reducer.gather_params()
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as any optimizer); the new parameters are shared out, the others keep their owners.

        Call it on every rank: the ranks' partitions must agree.
        """
        if self._initialized and self.sharded is not None:
            raise RuntimeError("add_param_group with a zero_stage=2 model: its optimizer holds all of the model's "
                               "parameters from the start; give groups when constructing it")
        super().add_param_group(param_group)
        if not self._initialized:
            return
        self._consolidated = []  # of the groups before: state_dict() asks for a consolidation again
        self._partition = partition(self.param_groups, self.world_size)
        self.optim.add_param_group(self._partition[self.rank][-1])
        # The groups before: the user's settings since the last step (a scheduler's rate) stand, as under torch's;
        # the new one: the inner class's defaults (Adam's betas) filled in, as at construction.
        copy_settings(self.param_groups[:-1], self.optim.param_groups[:-1])
        copy_settings(self.optim.param_groups[-1:], self.param_groups[-1:])
        self._build_buckets()
        self._trainable = self._trainability()  # new parameters, not a change of trainability: no warning

    # -- parameters as bucket views --------------------------------------------------------------

    def _build_buckets(self) -> None:
        """With ``parameters_as_bucket_view``: one flat tensor per device and rank; trainable parameters become
        views."""
        if not self.parameters_as_bucket_view:
            return
        devices: dict[torch.device, list[list[torch.Tensor]]] = {}
        for rank, groups in enumerate(self._partition):
            for param in (p for g in groups for p in g["params"]):
                devices.setdefault(param.device, [[] for _ in range(self.world_size)])[rank].append(param)
        self._buckets = []
        for device, per_rank in devices.items():
            row = []
            for params in per_rank:
                trainable = [p for p in params if p.requires_grad]
                for p in params:
                    if not p.requires_grad:
                        p.data = p.data.detach().clone()  # out of any earlier bucket
                if not trainable:
                    row.append(torch.zeros(1, device=device))  # torch's placeholder: one broadcast per rank
                    continue
                flat = torch.empty(sum(p.numel() for p in trainable), dtype=trainable[0].dtype, device=device)
                offset = 0
                for p in trainable:
                    view = flat[offset : offset + p.numel()]
                    view.copy_(p.data.reshape(-1))
                    p.data = view.view_as(p.data)
                    offset += p.numel()
                row.append(flat)
            self._buckets.append(row)

    # -- the step --------------------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step this rank's share of the parameters, then give every rank everyone's (a collective).

        A ``closure`` runs on every rank (it must, as it runs the model). Extra
        keywords go to the local optimizer's ``step``.
        """
        if self.sharded is not None:
            return self._step_sharded(closure, **kwargs)
        Join.notify_join_context(self)
        trainable = self._trainability()
        if trainable != self._trainable:
            log.warning("ZeroRedundancyOptimizer: the trainable parameters changed; rebuilding the parameter "
                        "buckets" if self.parameters_as_bucket_view else
                        "ZeroRedundancyOptimizer: the trainable parameters changed")
            self._build_buckets()
            self._trainable = trainable
        copy_settings(self.param_groups, self.optim.param_groups)
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        copy_settings(self.optim.param_groups, self.param_groups)
        self.sync_params()
        return loss

    def sync_params(self) -> None:
        """Every rank broadcasts the parameters it owns (a collective; :meth:`step` ends with it)."""
        works = []
        for rank in range(self.world_size):
            src = self._global_ranks[rank]
            tensors = ([row[rank] for row in self._buckets] if self.parameters_as_bucket_view
                       else [p.data for g in self._partition[rank] for p in g["params"]])
            for t in tensors:
                events.collective("ZeroRedundancyOptimizer: broadcast rank {}'s parameters", rank,
                                  nbytes=t.numel() * t.element_size())
                works.append(dist.broadcast(t, src=src, group=self.process_group, async_op=True))
        for work in works:
            work.wait()

    # -- state -----------------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's optimizer state on rank ``to`` (of the group) for :meth:`state_dict`; on every rank."""
        if not 0 <= to < self.world_size:
            raise ValueError(f"consolidate_state_dict(to={to}): not a rank of the group; use 0..{self.world_size - 1}")
        copy_settings(self.param_groups, self.optim.param_groups)
        mine = (to_device(self.optim.state_dict(), torch.device("cpu")), self._segment_map())
        parts: list[Any] = [None] * self.world_size if self.rank == to else []
        events.collective("ZeroRedundancyOptimizer: gather the optimizer state on rank {}", to, nbytes=0)
        dist.gather_object(mine, parts if self.rank == to else None, dst=self._global_ranks[to],
                           group=self.process_group)
        self._consolidated = parts if self.rank == to else []

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, as an unsharded optimizer's (see the module notes).

        Raises:
            RuntimeError: no :meth:`consolidate_state_dict` to this rank before.
        """
        if not self._consolidated:
            raise RuntimeError("Optimizer state has not been consolidated on this rank. Please call "
                               f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you meant to "
                               "save the global state.")
        packed = super().state_dict()  # the groups' settings, parameters as indices over all of them
        packed["state"] = dict(sorted(self._merged_state().items()))
        return packed

    def _segment_map(self) -> list[tuple[int, int, int]]:
        """Stage 2: for each parameter of the local optimizer, (index over all parameters, start, stop)."""
        if self.sharded is None:
            return []
        index = {id(p): i for i, p in enumerate(self._all_params())}
        return [(index[id(self.sharded.params[seg.param])], seg.start, seg.stop) for seg, _ in self._segments]

    def _merged_state(self) -> dict[int, Any]:
        """Every rank's local state, gathered by :meth:`consolidate_state_dict`, keyed by global index."""
        if self.sharded is not None:
            return merge_segment_state(self._consolidated, self._all_params())
        index = {id(p): i for i, p in enumerate(self._all_params())}
        state: dict[int, Any] = {}
        for rank, (local, _) in enumerate(self._consolidated):
            owned = self._partition[rank]
            if len(local["param_groups"]) != len(owned):
                raise RuntimeError(f"rank {rank}'s optimizer has {len(local['param_groups'])} parameter groups, "
                                   f"this one expects {len(owned)}: add_param_group ran on some ranks only")
            for local_group, group in zip(local["param_groups"], owned, strict=True):
                for local_index, param in zip(local_group["params"], group["params"], strict=True):
                    if local_index in local["state"]:
                        state[index[id(param)]] = local["state"][local_index]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (of any world size, or a plain optimizer's with the same groups).

        Raises:
            ValueError: the groups or their sizes differ from this optimizer's.
        """
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if groups is None or "state" not in state_dict:
            raise ValueError("load_state_dict: not an optimizer state dict (it needs 'state' and 'param_groups')")
        if len(groups) != len(self.param_groups) or any(
                len(saved["params"]) != len(mine["params"]) for saved, mine in zip(groups, self.param_groups)):
            raise ValueError(
                "load_state_dict: the saved optimizer has groups of "
                f"{[len(g['params']) for g in groups]} parameters, this one "
                f"{[len(g['params']) for g in self.param_groups]}: load the state of the same model and groups")
        by_saved_id = dict(zip(chain.from_iterable(g["params"] for g in groups), self._all_params(), strict=True))
        if self.sharded is not None:
            saved_id = {id(p): k for k, p in by_saved_id.items()}
            for seg, view in self._segments:
                param = self.sharded.params[seg.param]
                value = state_dict["state"].get(saved_id[id(param)])
                if value is None:
                    self.optim.state.pop(view, None)
                else:
                    self.optim.state[view] = load_segment_state(value, param, seg.start, seg.stop, view.device)
            copy_settings(groups, self.param_groups)
            copy_settings(self.param_groups, self.optim.param_groups)
            return
        mine = {id(p) for g in self._partition[self.rank] for p in g["params"]}
        for saved_id, value in state_dict["state"].items():
            param = by_saved_id.get(saved_id)
            if param is None:
                raise ValueError(f"load_state_dict: state for parameter index {saved_id}, which no group has")
            if id(param) in mine:
                loaded = to_device(value, param.device)
                for key, item in loaded.items():
                    if isinstance(item, torch.Tensor) and item.dim() == 0:
                        loaded[key] = item.cpu()  # as torch's: scalar state (Adam's step) on the CPU
                self.optim.state[param] = loaded
            else:
                self.optim.state.pop(param, None)
        copy_settings(groups, self.param_groups)
        copy_settings(self.param_groups, self.optim.param_groups)

    # -- join ------------------------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> _ZeroJoinHook:
        """Under ``Join``: a rank that has run out of inputs steps with the others (as torch's: its own share,
        with the gradients it has) and takes part in their parameter broadcasts."""
        del kwargs
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._all_params()[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group


class _ZeroJoinHook:
    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        # torch's: a whole step. The joined rank steps its share with the gradients it has (DDP's joined side
        # leaves them as they are), then the broadcasts match the training ranks'.
        self.zero.step()

    def post_hook(self, is_last_joiner: bool) -> None:
        del is_last_joiner
