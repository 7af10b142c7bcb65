"""Broadcasts of model state from one rank to all: coalesced tensors, and Horovod's two helpers.

Used by :class:`ddpkit.parallel.ddp.wrapper.DistributedDataParallel` at construction
(parameters and buffers), before forwards (buffers) and at the end of
``join()`` (the last joiner's model). ``broadcast_parameters`` and
``broadcast_optimizer_state`` are Horovod's, for :func:`ddpkit.DistributedOptimizer`
users; unlike Horovod's, ``broadcast_optimizer_state`` copies the root's state
as it is instead of first stepping a fresh optimizer with zero gradients
(which moves parameters under weight decay and changes Adam's step count).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.runtime import events
from ddpkit.runtime.devices import comm_tensor
from ddpkit.runtime.objects import broadcast_object

__all__ = ["BROADCAST_CHUNK_BYTES", "PackedBroadcast", "broadcast_once", "broadcast_optimizer_state",
           "broadcast_parameters", "world_group"]

BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024
"""Largest message of a coalesced broadcast."""


class PackedBroadcast:
    """Broadcast rank 0's values of a fixed list of tensors, one message per device.

    Tensors of every dtype travel together as raw bytes at aligned offsets of
    a persistent buffer, so BatchNorm's float statistics and integer counters
    cost one collective, and a repeated broadcast (buffers, every forward)
    allocates nothing: rank 0 only packs, the others only unpack.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, what: str) -> None:
        self.group = group
        self.what = what
        """What is broadcast, as the stall inspector names it."""
        self.rank = dist.get_rank(group)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
        self.packs: list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        for device, members in by_device.items():
            offsets, size = [], 0
            for t in members:
                offsets.append(size)
                size += -(-_nbytes(t) // _ALIGN) * _ALIGN
            packed = torch.empty(size, dtype=torch.uint8, device=device)
            pairs = [(t, packed[o : o + _nbytes(t)].view(t.dtype).view(t.shape)) for t, o in zip(members, offsets)]
            self.packs.append((packed, pairs))

    def __call__(self, src: int = 0, keep_versions: bool = False) -> None:
        """Broadcast from group rank ``src``.

        As torch's broadcasts count: each tensor's version counter (what
        autograd checks before using a saved tensor) goes up by one on every
        rank, the root's too; with ``keep_versions`` it stays as it was (the
        buffer broadcast before a forward, so a graph that saved a buffer, as
        BatchNorm does, still runs backward after a second forward).
        """
        # Same devices, tensors and sizes in the same order on every rank (the
        # parameters were verified identical), so the broadcasts match up.
        is_src = self.rank == src
        with torch.no_grad():
            for packed, pairs in self.packs:
                if is_src:
                    for t, view in pairs:
                        view.copy_(t)
                events.collective("DDP broadcast {} from group rank {}", self.what, src)
                dist.broadcast(packed, src=dist.get_global_rank(self.group, src), group=self.group)
                if not is_src:
                    tensors = [t for t, _ in pairs]
                    with torch.autograd._unsafe_preserve_version_counter(tuple(tensors)) if keep_versions \
                            else contextlib.nullcontext():
                        torch._foreach_copy_(tensors, [view for _, view in pairs])
                elif not keep_versions:
                    torch.autograd.graph.increment_version([t for t, _ in pairs])


_ALIGN = 16
"""Byte alignment of each tensor in a packed broadcast (any dtype can be viewed there)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def broadcast_once(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, what: str, src: int = 0,
                   chunk_bytes: int = BROADCAST_CHUNK_BYTES) -> None:
    """Overwrite ``tensors`` with group rank ``src``'s values in messages of at most ``chunk_bytes`` (or one
    tensor, if larger): the memory the broadcast takes for a while."""
    chunk: list[torch.Tensor] = []
    size = 0
    for t in list(tensors) + [None]:  # type: ignore[list-item]
        if t is not None and (not chunk or size + _nbytes(t) <= chunk_bytes):
            chunk.append(t)
            size += _nbytes(t)
            continue
        if chunk:
            PackedBroadcast(chunk, group, what)(src)
        if t is not None:
            chunk, size = [t], _nbytes(t)


def world_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, or the world when none is given and a process group exists (else None: a world of one)."""
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


# -- Horovod's helpers --------------------------------------------------------


def _check_root(root_rank: int, group: dist.ProcessGroup | None) -> int:
    world = 1 if group is None else dist.get_world_size(group)
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < world:
        raise ValueError(f"root_rank={root_rank!r} is not a rank of this job: it must be in 0..{world - 1}")
    return root_rank


def _same_layout(layout: list[tuple[str, tuple[int, ...], str]], group: dist.ProcessGroup, root: int,
                 what: str) -> None:
    """Raise on every rank when this rank's tensors differ from the root's (names, shapes, dtypes)."""
    theirs = broadcast_object(layout, src=dist.get_global_rank(group, root), group=group)
    mismatch = next((i for i, (a, b) in enumerate(zip(layout, theirs)) if a != b), None)
    bad = comm_tensor([0 if mismatch is None and len(layout) == len(theirs) else 1], group=group)
    events.collective("{}: compare the ranks' tensors", what)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if not bad.item():
        return
    if mismatch is None and len(layout) != len(theirs):
        detail = f"this rank has {len(layout)} tensors, root rank {root} has {len(theirs)}"
    elif mismatch is None:
        detail = "another rank's tensors differ from the root's"
    else:
        detail = f"this rank has {layout[mismatch]}, root rank {root} has {theirs[mismatch]}"
    raise ValueError(f"{what}: the ranks' tensors differ ({detail}): build the same model on every rank first")


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int = 0, process_group: dist.ProcessGroup | None = None) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place (Horovod's ``broadcast_parameters``).

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or a
            list of tensors (``list(model.parameters())``): the same names,
            shapes and dtypes on every rank (checked).
        root_rank: the rank whose values everyone takes.
        process_group: default the world.

    Example::

        ddpkit.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        # Horovod's rule: (name, tensor) pairs, or bare tensors (list(model.parameters())).
        items = [x if isinstance(x, tuple) else (f"params[{i}]", x) for i, x in enumerate(params)]
        if not all(len(x) == 2 for x in items):
            raise ValueError("params must be a state_dict, a sequence of (name, tensor) pairs as "
                             "model.named_parameters() gives, or a list of tensors")
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}: pass model.state_dict() or "
                         "model.named_parameters()")
    bad = [str(n) for n, t in items if not isinstance(t, torch.Tensor)]
    if bad:
        raise ValueError(f"broadcast_parameters: {', '.join(bad[:5])} are not tensors")
    group = world_group(process_group)
    root = _check_root(root_rank, group)
    if group is None or dist.get_world_size(group) == 1:
        return
    _same_layout([(str(n), tuple(t.shape), str(t.dtype)) for n, t in items], group, root, "broadcast_parameters")
    with torch.no_grad():
        broadcast_once([t.detach() for _, t in items], group, "broadcast_parameters", src=root)


@dataclass(frozen=True)
class _Slot:
    """Where a tensor of the root's optimizer state goes, in the object that carries the rest."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool


def _walk(value: Any, leaf: Any) -> Any:
    """``value`` with every tensor or :class:`_Slot` replaced by ``leaf(it)``, in a fixed order."""
    if isinstance(value, (torch.Tensor, _Slot)):
        return leaf(value)
    if isinstance(value, dict):
        return {k: _walk(v, leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_walk(v, leaf) for v in value)
    return value


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_group: dist.ProcessGroup | None = None) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyper-parameters (Horovod's ``broadcast_optimizer_state``).

    The root's ``state_dict()`` (state tensors, step counts, learning rates
    and other group options) is loaded on every rank; each rank keeps its own
    parameters. A root that has not stepped yet has no state: every rank then
    ends with none. Typical use: rank 0 resumed from a checkpoint.

    Raises:
        ValueError: ``torch.optim.LBFGS`` (its state is not per parameter, as
            in Horovod); a bad ``root_rank``; the ranks' optimizers hold
            different parameters.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state: its state is not per parameter")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state takes a torch.optim.Optimizer, not {type(optimizer).__name__}")
    group = world_group(process_group)
    root = _check_root(root_rank, group)
    if group is None or dist.get_world_size(group) == 1:
        return
    params = [(f"param_groups[{g}]['params'][{k}]", p) for g, pg in enumerate(optimizer.param_groups)
              for k, p in enumerate(pg["params"])]
    _same_layout([(n, tuple(p.shape), str(p.dtype)) for n, p in params], group, root, "broadcast_optimizer_state")
    device = params[0][1].device if params else torch.device("cpu")
    tensors: list[torch.Tensor] = []

    def slot(t: torch.Tensor) -> _Slot:
        tensors.append(t)
        return _Slot(tuple(t.shape), t.dtype, t.device.type == "cpu")

    def allocate(s: _Slot) -> torch.Tensor:
        tensors.append(torch.empty(s.shape, dtype=s.dtype, device="cpu" if s.on_cpu else device))
        return tensors[-1]

    is_root = dist.get_rank(group) == root
    # The structure and the numbers travel as one object, the tensors in one coalesced broadcast.
    skeleton = broadcast_object(_walk(optimizer.state_dict(), slot) if is_root else None,
                                src=dist.get_global_rank(group, root), group=group)
    state = None if is_root else _walk(skeleton, allocate)
    if tensors:
        # NCCL moves device tensors only: CPU ones (Adam's step) go through the device and back.
        nccl = dist.get_backend(group) == "nccl"
        moved = [t.to(device) if nccl and t.device.type == "cpu" else t for t in tensors]
        broadcast_once(moved, group, "broadcast_optimizer_state", src=root)
        for t, m in zip(tensors, moved):
            if m is not t:
                t.copy_(m)
    if state is not None:
        optimizer.load_state_dict(state)
