"""Where backward enters the model: torch's ``_DDPSink`` on the forward's outputs, or anchors on their nodes.

The reducer's end-of-backward callback must belong to the outer backward,
even when the first gradients arrive inside a reentrant (checkpointing)
backward nested in it. So the forward's outputs tell the reducer when
backward reaches them: through :class:`_DDPSink` (torch's rule: every forward
with ``find_unused_parameters``, and a static graph's forwards until its
first backward), or, for every other synchronised forward (stages 0 to 2),
through prehooks on the nodes that made them, the outputs left untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["anchor_end_of_backward", "through_sink"]

_ANCHORED = "ddpkit: anchored for"
"""The key of a node's ``metadata`` that names the reducer its prehook tells."""


class _DDPSink(torch.autograd.Function):
    """torch's ``_DDPSink``: the forward's outputs pass through it (copies when
    ``clone``, so in-place changes to them stay legal); its backward, the first
    step of any backward through them, queues the reducer's end-of-backward
    callback on that (outer) backward. Gradients left ``None`` stay ``None``,
    so a branch whose output the loss does not use gets none."""

    @staticmethod
    def forward(ctx: Any, reducer: Any, clone: bool, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.reducer = reducer
        return tuple(t.clone() for t in tensors) if clone else tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.reducer.expect_backward()
        return (None, None, *grads)


def _graph_outputs(output: Any) -> tuple[list[Any], Any, list[int]]:
    """``output`` flattened as torch's DDP does (its pytree: tuples, lists, dicts, namedtuples, ...), and
    where the tensors that have a ``grad_fn`` are among the leaves."""
    leaves, spec = tree_flatten(output)
    return leaves, spec, [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def through_sink(output: Any, reducer: Any, clone: bool) -> Any:
    """``output`` with each tensor that has a ``grad_fn`` passed through :class:`_DDPSink`, the structure kept.

    ``reducer``: what backward reaching the outputs tells (its ``expect_backward()``).
    """
    leaves, spec, at = _graph_outputs(output)
    if not at:
        return output
    passed = _DDPSink.apply(reducer, clone, *(leaves[i] for i in at))
    for i, t in zip(at, passed):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


def anchor_end_of_backward(output: Any, reducer: Any) -> None:
    """Call ``reducer.expect_backward()`` when backward reaches the nodes that made ``output``:
    what the sink's backward does, with the outputs left as they are (no copies)."""
    leaves, _, at = _graph_outputs(output)
    nodes = {id(leaves[i].grad_fn): leaves[i].grad_fn for i in at}

    def arrived(grads: Any) -> None:
        reducer.expect_backward()

    for node in nodes.values():
        if node.metadata.get(_ANCHORED) is reducer:
            continue  # an output kept from an earlier forward (cached on the module): one prehook is enough
        node.metadata[_ANCHORED] = reducer
        node.register_prehook(arrived)
