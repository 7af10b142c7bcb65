"""Parameters without a gradient in a synchronised backward: found, agreed on, and refused when unexpected.

With ``find_unused_parameters=True`` (and in a static graph's first backward)
every rank all-reduces a map of the parameters it used, after all of its
buckets, so the collectives line up everywhere; a parameter no rank used keeps
the ``.grad`` it had, one used somewhere gets the average (this rank's zeros
included). Without it, a parameter that gets no gradient is still reduced as
zeros (so no rank hangs) and the backward raises :class:`UnusedParametersError`
naming it.

``skip_all_reduce_unused_params=True`` (torch's) leaves a bucket unreduced
when none of its parameters was used. With the search for unused parameters,
as torch decides it: not used *on this rank* (no gradient in this backward nor
in a ``no_sync()`` one since the last step), so every rank must leave the same
parameters unused, or their collectives stop matching (torch's documented
condition: training hangs or fails). With a static graph: used by no rank in
the first backward, a decision every rank shares. Its parameters keep their
``.grad``, as a parameter no rank used does anyway.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ddpkit.runtime import events
from ddpkit.runtime.devices import comm_device

__all__ = ["UnusedParametersError", "all_ranks_used", "all_reduce_used_map", "refuse_unused", "warn_nothing_unused"]


class UnusedParametersError(RuntimeError):
    """Parameters got no gradient in a synchronised backward without ``find_unused_parameters``."""


_warned_nothing_unused = False


def warn_nothing_unused() -> None:
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


def all_reduce_used_map(flags: torch.Tensor, group: dist.ProcessGroup, step: int) -> None:
    """Sum the ranks' used-parameter maps in place (a collective: every rank, after all of its buckets)."""
    events.collective("DDP all-reduce of the used-parameter map", step=step,
                      nbytes=flags.numel() * flags.element_size())
    dist.all_reduce(flags, group=group)


def all_ranks_used(local_used: list[bool], group: dist.ProcessGroup, step: int,
                   like: torch.Tensor) -> tuple[list[bool], torch.Tensor]:
    """Which parameters some rank used, from every rank's ``local_used`` (a collective), and the summed map;
    on the device of the group's collectives for tensors ``like`` the parameters."""
    flags = torch.tensor(local_used, dtype=torch.int32, device=comm_device(group, like=like))
    all_reduce_used_map(flags, group, step)
    return flags.bool().tolist(), flags


def refuse_unused(names: Sequence[str], missing: Sequence[int]) -> None:
    """Raise :class:`UnusedParametersError` naming the parameters that got no gradient."""
    listed = ", ".join(repr(names[i]) for i in missing)
    raise UnusedParametersError(
        f"DistributedDataParallel: {len(missing)} parameter(s) got no gradient in this "
        f"backward: {listed}. Every parameter that requires grad must take part in the "
        "loss of every synchronised step; if some legitimately do not (branches, frozen "
        "heads), construct DistributedDataParallel(..., find_unused_parameters=True), "
        "or set requires_grad=False on them before wrapping"
    )
