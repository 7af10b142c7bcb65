"""The summed mode's gradients reduced through a ``DistributedDataParallel``'s comm hook, bucket by bucket, as the
wrapper's engine calls it; and which hooks and hook states the mode can run.

Under ``--on-failure continue`` the members' group changes with each death, so a hook gets the step's group as its
state (:func:`hook_state`), and a hook with a state made for one group is refused. The deterministic mode runs only
the hooks that change the dtype (:data:`DTYPE_HOOKS`), as the dtype of its tree's additions
(:mod:`.ordered_sum`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddpkit.comm import bucket_hooks
from ddpkit.comm.bucket import CommHook, GradBucket, check_hook_future
from ddpkit.comm.bucket_hooks import AllReduceState
from ddpkit.runtime import events

__all__ = ["DTYPE_HOOKS", "HookReduction", "hook_state", "wire_dtype"]

DTYPE_HOOKS = {"allreduce_hook": torch.float32, "fp16_compress_hook": torch.float16,
               "bf16_compress_hook": torch.bfloat16}
"""The comm hooks that only change the dtype of the reduction, by name, with that dtype: ddpkit's
(:mod:`ddpkit.comm.bucket_hooks`) and torch's of the same names, which the deterministic mode runs as its tree's
additions in that dtype."""
_TORCH_HOOKS_MODULE = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks"


def wire_dtype(hook: CommHook | None) -> torch.dtype | None:
    """The dtype of the deterministic mode's tree under ``hook`` when it is a dtype hook (:data:`DTYPE_HOOKS`),
    else None."""
    name = getattr(hook, "__name__", None)
    if not isinstance(name, str) or name not in DTYPE_HOOKS:
        return None
    ours = hook is getattr(bucket_hooks, name)
    return DTYPE_HOOKS[name] if ours or getattr(hook, "__module__", None) == _TORCH_HOOKS_MODULE else None


def hook_state(state: Any, group: dist.ProcessGroup | None) -> Any:
    """What the mode calls a comm hook with, given the ``state`` it was registered with: the step's ``group``
    in place of None (the world, which the members are) or of an ``AllReduceState``'s missing group. Outside
    the mode the world's group stands too (it is the mode's group there).

    Raises:
        ValueError: any other state (a group of its own, PowerSGD's, the link's choice): under ``--on-failure
            continue`` the members' group changes with each death, and a state made for one group (PowerSGD's
            error feedback and matrices sized to it too) cannot follow.
    """
    if state is None or (dist.is_initialized() and state is dist.group.WORLD):
        return group
    if isinstance(state, AllReduceState) and state.group in (None, dist.group.WORLD):
        if state.algorithm != "native":
            raise ValueError(f"FaultTolerance over a DistributedDataParallel whose comm hook has "
                             f"AllReduceState(algorithm={state.algorithm!r}): ddpkit's own all-reduce algorithms run "
                             "in the hook's call, where a death could not end the wait; use algorithm='native'")
        return dataclasses.replace(state, group=group)
    raise ValueError(f"FaultTolerance over a DistributedDataParallel whose comm hook has the state "
                     f"{type(state).__module__}.{type(state).__qualname__}: the mode reduces over its members' group "
                     "(under --on-failure continue it changes with each death) and gives a hook that group as its "
                     "state; register the hook with the state None (or an AllReduceState without a group): "
                     "fp16_compress_hook, bf16_compress_hook, allreduce_hook, torch's default hooks; PowerSGD and "
                     "comm='auto' keep a state per group and do not run under the mode")


class HookReduction:
    """A flat gradient reduced through a comm hook in the wrapper's buckets (``groups``: the parameters' indices
    of each bucket, in the wrapper's order), with the buckets' room kept from step to step; made anew after a
    membership change (an abandoned hook may still write the old)."""

    def __init__(self, params: Sequence[torch.Tensor], groups: Sequence[Sequence[int]]) -> None:
        self.offsets = np.cumsum([0] + [p.numel() for p in params]).tolist()
        self.buckets = [GradBucket(k, [params[i] for i in idx], list(idx)) for k, idx in enumerate(groups)]

    def __call__(self, hook: CommHook, state: Any, flat: torch.Tensor, wait: Callable[[Any], None],
                 step: int | None = None) -> None:
        """``flat`` (every parameter's gradient in order) reduced by ``hook`` called with ``state``, back in
        place: every bucket's hook in bucket order, then ``wait`` for all of them together (all, or all abandoned
        together)."""
        offsets = self.offsets
        futures = []
        for k, bucket in enumerate(self.buckets):
            torch.cat([flat[offsets[i] : offsets[i + 1]] for i in bucket.indices], out=bucket.flat)
            bucket.set_buffer(bucket.flat)
            bucket.last = k == len(self.buckets) - 1
            events.collective("FaultTolerance: the comm hook's reduction of bucket {}", k, step=step,
                              nbytes=0)  # (the hook counts its own bytes)
            futures.append(check_hook_future(hook, hook(state, bucket), bucket))
        wait(torch.futures.collect_all(futures))
        for bucket, future in zip(self.buckets, futures):
            value = future.value()
            reduced = (value[0] if isinstance(value, list) else value).reshape(-1)
            at = 0
            for i in bucket.indices:
                n = offsets[i + 1] - offsets[i]
                flat[offsets[i] : offsets[i + 1]].copy_(reduced[at : at + n])
                at += n
