"""Gradients into buckets before a reduction, and the averages back into ``.grad`` after it.

Staging
    Without a comm hook the average is taken by pre-scaling: each gradient
    is multiplied by ``1 / div_factor`` on its way into the bucket (fused
    into the copy for large parameters, one fused copy and one fused scale
    for all the small ones), and the collective sums. A parameter without
    ``.grad`` contributes zeros; one whose gradient did not arrive in this
    backward contributes the gradient it holds (accumulated under
    ``no_sync``), as torch's reducer does. A bucket of one parameter is
    copied too, as torch's: reduced where its gradient lies (as it was until
    2026-12-01), ``.grad`` was divided and written by the collective while
    the backward went on, under the eyes of the user's own gradient hooks. A
    sparse bucket reduces the sparse gradient itself, divided first (torch's
    rule).
Collecting
    A comm hook's future must hold the reduced bucket: a tensor of the
    bucket's size (or, for a sparse bucket, a sparse tensor). It is copied
    into the bucket's memory unless it already is that memory.
Write-back
    The averages go into ``.grad``: copied (one fused copy per bucket where
    every parameter has a gradient), or, under ``gradient_as_bucket_view``,
    ``.grad`` is the bucket's view itself. A parameter that no rank used keeps
    what it had.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ddpkit.comm.bucket import GradBucket
from ddpkit.parallel.common.buckets import StagingPlan, sparse_zeros

__all__ = ["Staging"]


class Staging:
    """Moves gradients between ``.grad`` and the buckets for one reducer.

    Args:
        names: every parameter's name (for errors), in the reducer's order.
        owner: who drives the reducer (``"DDP"``, ``"DistributedOptimizer"``), for errors.
        as_view: ``gradient_as_bucket_view``.
        sparse_as_dense: a sparse gradient where a dense one is expected is
            made dense in ``.grad`` (Horovod's option) instead of refused.
    """

    def __init__(self, names: Sequence[str], owner: str, as_view: bool, sparse_as_dense: bool) -> None:
        self.names = names
        self.owner = owner
        self.as_view = as_view
        self.sparse_as_dense = sparse_as_dense

    def stage(self, bucket: GradBucket, plan: StagingPlan, divide: int | None) -> None:
        """Put the bucket's gradients into the bucket, averaged over ``divide`` ranks (see the module notes).

        ``divide``: ``None`` when nothing is to be divided (a comm hook averages, or a world of one).
        """
        if bucket.sparse:
            self._stage_sparse(bucket, divide)
            return
        factor = None if divide is None else 1.0 / divide
        params = bucket.params
        each: Sequence[int] = range(len(params))
        if not self.as_view and plan.fused_params:
            grads = [p.grad for p in plan.fused_params]
            if not any(g is None or g.is_sparse for g in grads):
                each = plan.each
                torch._foreach_copy_(plan.fused_views, grads)
                if factor is not None:
                    if len(plan.fused_views) == len(params):
                        bucket.flat.mul_(factor)  # the same products, one kernel
                    else:
                        torch._foreach_mul_(plan.fused_views, factor)
        elif not self.as_view:
            each = plan.each
        for s in each:
            if s not in bucket.staged:
                self.stage_one(bucket, s, divide)

    def _stage_sparse(self, bucket: GradBucket, divide: int | None) -> None:
        """A sparse gradient is reduced itself, divided first when no comm hook averages it (torch's rule).

        A parameter without a gradient contributes an empty sparse tensor (zeros), where torch's reducer
        would stop with "Expected sparse gradient to be defined".
        """
        param, index = bucket.params[0], bucket.indices[0]
        grad = param.grad
        if grad is None:
            grad = sparse_zeros(param)
        elif not grad.is_sparse:
            raise RuntimeError(
                f"parameter {self.names[index]!r} belongs to an embedding with sparse=True but got a dense "
                "gradient: keep its gradients sparse, or construct the embedding with sparse=False"
            )
        elif divide is not None:
            grad.div_(divide)
        bucket.target = grad
        bucket.set_buffer(grad)

    def stage_one(self, bucket: GradBucket, s: int, divide: int | None) -> None:
        """Copy the gradient of the bucket's parameter at position ``s`` in, averaged over ``divide`` ranks."""
        view = bucket.views[s]
        param = bucket.params[s]
        grad = param.grad
        if grad is None:
            view.zero_()
            return
        if grad.is_sparse and self.sparse_as_dense:
            grad = param.grad = grad.to_dense()
        elif grad.is_sparse:
            name = self.names[bucket.indices[s]]
            if self.owner != "DDP":
                raise RuntimeError(f"parameter {name!r} has a sparse gradient, which {self.owner} reduces only "
                                   "made dense: pass sparse_as_dense=True (Horovod's option)")
            raise RuntimeError(
                f"parameter {name!r} has a sparse gradient, but DDP expects sparse gradients only from "
                "nn.Embedding / nn.EmbeddingBag(sparse=True) (torch's rule): make the gradient dense, or "
                "produce it with one of those"
            )
        if grad.data_ptr() == view.data_ptr():
            if divide is not None:
                view.div_(divide)
            return
        if divide is not None:
            # The no-hook path averages by pre-scaling, fused into the copy.
            torch.mul(grad.detach(), 1.0 / divide, out=view)
        else:
            view.copy_(grad.detach())
        if self.as_view:
            param.grad = view

    @staticmethod
    def collect(bucket: GradBucket) -> None:
        """Wait for the bucket's reduction and leave its result in ``bucket.target``."""
        if bucket.future is not None:
            result = bucket.future.wait()
            if isinstance(result, (list, tuple)) and len(result) == 1:
                result = result[0]  # all_reduce's own future, returned as it is
            size = bucket.target.numel()
            if not isinstance(result, torch.Tensor) or (not bucket.sparse and result.numel() != size):
                what = f"a tensor of {result.numel()} elements" if isinstance(result, torch.Tensor) else \
                    type(result).__name__
                raise RuntimeError(
                    f"the comm hook's future for bucket {bucket.index()} holds {what}; it must hold the reduced "
                    f"bucket, a tensor of {size} elements (bucket.buffer() after the reduction)"
                )
            if bucket.sparse:
                if result is not bucket.target:
                    bucket.target.copy_(result)
            elif result.data_ptr() != bucket.target.data_ptr():
                bucket.target.copy_(result.view(-1))
        elif bucket.work is not None:
            bucket.work.wait()

    def drain_before_sparse(self, launched: Sequence[GradBucket], outside: list[Any]) -> None:
        """Before a sparse bucket is reduced: wait for every reduction ``launched`` before it and for the works in
        ``outside`` (then emptied); the sparse one is then waited for at once.

        gloo's sparse all-reduce corrupts the heap when any other collective of its group runs at the same time
        (torch 2.13: a sparse and a dense, or two sparse, asynchronous all-reduces on two ranks crash within
        seconds), so it must run alone.
        """
        for bucket in launched:
            self.collect(bucket)
        for work in outside:
            work.wait()
        outside.clear()

    def write_back(self, buckets: Sequence[GradBucket], params: Sequence[torch.Tensor], unused_here: set[int],
                   used: list[bool] | None, saved: dict[int, torch.Tensor]) -> None:
        """Leave the averages in ``.grad``; a parameter no rank used keeps what it had (``saved``)."""
        for bucket in buckets:
            skip = ([s for s, i in enumerate(bucket.indices) if i in unused_here and not used[i]]  # type: ignore[index]
                    if unused_here else [])
            for s in skip:
                i = bucket.indices[s]
                if i in saved:
                    params[i].grad.copy_(saved[i])  # type: ignore[union-attr]
            if bucket.sparse:
                param = bucket.params[0]
                if not skip and param.grad is None:
                    param.grad = bucket.target  # it had none: the zeros it sent came back as the average
                continue
            if bucket.target is not bucket.flat:
                continue  # a joined rank's zeros (a shadow step): its gradients stay as they are
            if not self.as_view and not skip:
                grads = [p.grad for p in bucket.params]
                if not any(g is None for g in grads):
                    torch._foreach_copy_(grads, bucket.views)
                    continue
            for s, p in enumerate(bucket.params):
                if s in skip:
                    continue
                view = bucket.views[s]
                if self.as_view:
                    if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view
                elif p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
