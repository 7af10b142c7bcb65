"""Which models the fault-tolerant mode can drive: the plain module, or a ``ddpkit.DistributedDataParallel`` of
it whose micro-batches run under ``no_sync()`` while the mode reduces the step (through the wrapper's comm hook if
it has one); ``torch.compile``'d or not. Every other wrapper, and every setting of the wrapper the mode could not
keep, is refused by name with the fix.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.parallel.ddp.wrapper import DistributedDataParallel
from ddpkit.parallel.fault_tolerance.hook_reduction import hook_state, wire_dtype

__all__ = ["compiled", "hook_name", "wrapper_of"]


def wrapper_of(model: torch.nn.Module, deterministic: bool) -> DistributedDataParallel | None:
    """``model`` if it is a ``ddpkit.DistributedDataParallel`` the mode can drive (its micro-batches under
    ``no_sync()``, the step reduced by the mode, through the wrapper's comm hook if it has one), None for a
    plain module.

    Raises:
        ValueError: another wrapper (torch's DDP, DataParallel), a ZeRO stage, a comm hook in the deterministic
            mode other than the dtype hooks (``hook_reduction.DTYPE_HOOKS``) or with a state of its own
            (``hook_reduction.hook_state``), or buffers kept per rank: each named, with the fix.
    """
    model = compiled(model)  # torch.compile(DDP(module)): the wrapper it compiled
    if not isinstance(model, DistributedDataParallel):
        if hasattr(model, "module"):
            raise ValueError(f"FaultTolerance takes the plain module or ddpkit.DistributedDataParallel, not "
                             f"{type(model).__module__}.{type(model).__qualname__}: pass model.module (the mode "
                             "reduces the gradients itself)")
        return None
    if model.zero_stage:
        raise ValueError(f"FaultTolerance over DistributedDataParallel(zero_stage={model.zero_stage}): a ZeRO shard "
                         "exists once, on the rank that dies with it; wrap without zero_stage (the mode keeps whole "
                         "replicas)")
    if model.parameters_to_ignore:
        ignored = sorted(model.parameters_to_ignore)
        raise ValueError(f"FaultTolerance over a DistributedDataParallel that ignores {ignored} "
                         "(_set_params_and_buffers_to_ignore_for_model): the mode averages every trainable parameter "
                         "and hands every buffer to the members, so nothing could stay per rank; wrap without it")
    if model.process_group is not None and model.process_group != dist.group.WORLD:
        raise ValueError("FaultTolerance over a DistributedDataParallel of a subgroup: the mode trains over the whole "
                         "job (the world, or under --on-failure continue its members); wrap without process_group")
    if model.reducer.comm_hook is not None:
        hook = model.reducer.comm_hook
        if deterministic and wire_dtype(hook) is None:
            name = f"{getattr(hook, '__module__', '')}.{getattr(hook, '__qualname__', repr(hook))}"
            raise ValueError(f"FaultTolerance(deterministic=True) over a DistributedDataParallel with the comm hook "
                             f"{name}: the mode adds the shards along its fixed tree, so it runs the hooks that only "
                             "change the dtype (ddpkit's or torch's fp16_compress_hook, bf16_compress_hook, "
                             "allreduce_hook), in that dtype; any other would reduce each rank's sum of its shards, "
                             "whose rounding depends on who holds which; use one of those, or deterministic=False")
        hook_state(model.comm_state, None)
    if not model.forward_sync_buffers and any(True for _ in model.module.buffers()):
        raise ValueError("FaultTolerance over DistributedDataParallel(broadcast_buffers=False) (or "
                         "forward_sync_buffers=False) with a model that has buffers: every member must hold the same "
                         "buffers, since any of them may hand the state on; leave the default (rank 0's go to all "
                         "with each step)")
    return model


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    """What ``torch.compile`` compiled, for a compiled module (whose state is that module's); else ``model``."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def hook_name(wrapper: DistributedDataParallel | None) -> str:
    """The wrapper's comm hook's name ("" without a wrapper or a hook): part of the configuration the members
    compare (a member without it would issue other collectives)."""
    hook = wrapper.reducer.comm_hook if wrapper is not None else None
    return "" if hook is None else f"{getattr(hook, '__module__', '')}.{getattr(hook, '__qualname__', hook)}"
