"""How the engine learns that a gradient is ready: one post-accumulate-grad hook per parameter.

``Tensor.register_post_accumulate_grad_hook`` runs once autograd has
accumulated a parameter's gradient into ``.grad`` for this backward (also
with no gradient, for an output the loss left out).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["hook_gradients"]


def hook_gradients(reducer: Any, params: Sequence[torch.Tensor]) -> None:
    """Call ``reducer.on_gradient(index, param)`` each time the gradient of ``params[index]`` has been accumulated.

    One hook function serves every parameter and holds the reducer weakly, so
    a model wrapped again (or a wrapper dropped) does not keep the old reducer
    and its buckets alive through its parameters; once the reducer is gone its
    hooks are removed, as torch's reducer removes its own when destroyed.
    """
    ref = weakref.ref(reducer)
    index = {id(p): i for i, p in enumerate(params)}

    def hook(param: torch.Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner.on_gradient(index[id(param)], param)

    # Only each hook's key is kept (torch's RemovableHandle, a weak reference and a dict per parameter,
    # would be most of what the reducer holds per parameter on a model of many small ones).
    keys = [p.register_post_accumulate_grad_hook(hook).id for p in params]
    weakref.finalize(reducer, _remove_hooks, list(params), keys).atexit = False


def _remove_hooks(params: list[torch.Tensor], keys: list[int]) -> None:
    for param, key in zip(params, keys):
        if param._post_accumulate_grad_hooks:
            param._post_accumulate_grad_hooks.pop(key, None)  # what RemovableHandle.remove() does
