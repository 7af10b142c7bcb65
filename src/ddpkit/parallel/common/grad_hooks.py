"""How the engine learns that a gradient is ready: one post-accumulate-grad hook per parameter.

``Tensor.register_post_accumulate_grad_hook`` runs once autograd has
accumulated a parameter's gradient into ``.grad`` for this backward (also
with no gradient, for an output the loss left out).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["hook_gradients"]


def hook_gradients(reducer: Any, params: Sequence[torch.Tensor]) -> None:
    """Call ``reducer.on_gradient(index, param)`` each time the gradient of ``params[index]`` has been accumulated.

    Each parameter's hook knows its index and holds the reducer weakly, so
    a model wrapped again (or a wrapper dropped) does not keep the old reducer
    and its buckets alive through its parameters; once the reducer is gone its
    hooks are removed, as torch's reducer removes its own when destroyed.
    """
    ref = weakref.ref(reducer)

    def hook_for(index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:  # run for every parameter in every backward: kept to two look-ups
            owner = ref()
            if owner is not None:
                owner.on_gradient(index, param)
        return hook

    # Only each hook's key is kept (torch's RemovableHandle, a weak reference and a dict per parameter,
    # would be most of what the reducer holds per parameter on a model of many small ones).
    keys = [p.register_post_accumulate_grad_hook(hook_for(i)).id for i, p in enumerate(params)]
    weakref.finalize(reducer, _remove_hooks, list(params), keys).atexit = False


def _remove_hooks(params: list[torch.Tensor], keys: list[int]) -> None:
    for param, key in zip(params, keys):
        if param._post_accumulate_grad_hooks:
            param._post_accumulate_grad_hooks.pop(key, None)  # what RemovableHandle.remove() does
