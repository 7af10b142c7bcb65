"""``ddpkit.unwrap``: the plain module inside any data-parallel or compiled wrapper, ddpkit's or torch's."""

from __future__ import annotations

from torch import nn

__all__ = ["unwrap"]


def unwrap(model: nn.Module) -> nn.Module:
    """Return the plain module inside DDP / DataParallel / ``torch.compile`` wrappers.

    Works for ddpkit's and torch's wrappers, nested in any order; a plain
    module is returned as is.

    Example::

        torch.save(ddpkit.unwrap(model).state_dict(), "model.pt")
    """
    while True:
        if isinstance(model, nn.Module) and hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif type(model).__name__ in ("DistributedDataParallel", "DataParallel") and isinstance(
            getattr(model, "module", None), nn.Module
        ):
            model = model.module
        else:
            return model
