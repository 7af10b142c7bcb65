"""``SyncBatchNorm``: batch normalisation over the global batch of every rank, on gloo and NCCL.

In training each layer normalises with the mean and variance of the whole
batch across the group, not of this rank's shard, which matters when each
rank's batch is small. It costs two small collectives per layer and step:

* forward: one all-gather of each rank's (count, mean, sum of squared
  deviations) per channel, combined in float64 with the parallel variance
  formula, so ranks may hold different batch sizes, none included;
* backward: one all-reduce of the two per-channel sums the input gradient
  needs (sum of the output gradient, and of it times the normalised input).

A half-precision input (bf16, fp16) is handled as ``BatchNorm`` handles it:
its statistics and its normalisation in float32, the output and the input's
gradient rounded once to the input's dtype, the parameters' gradients in
theirs.

The weight and bias gradients stay local (DDP averages them like any other),
so inside DDP the step equals one ``BatchNorm`` over the global batch.
Running statistics follow ``BatchNorm``'s rules over the global batch
(unbiased variance, ``momentum=None`` for a cumulative average). In eval mode,
in a world of one, or without a process group, the layer is exactly
``BatchNorm``.

Unlike torch's own SyncBatchNorm, which supports CUDA only, this one also
runs on CPU with gloo.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from ddpkit.runtime import events
from ddpkit.runtime.devices import comm_device

__all__ = ["SyncBatchNorm"]


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _shape(x: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (x.dim() - 2)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Half-precision inputs are normalised in float32 and the result rounded once, as torch's batch norm kernels
    do (their accumulation type); float32 and float64 in their own precision."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


class _SyncNorm(torch.autograd.Function):
    """Normalise with global statistics; the backward reduces its two sums over the group.

    The output and the input's gradient are in the input's dtype, the parameters' gradients in theirs, as
    BatchNorm's; the arithmetic is in :func:`_compute_dtype`. The input is saved, not the normalised input (what
    torch's SyncBatchNorm saves: the same memory as BatchNorm's backward needs)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                mean: torch.Tensor, invstd: torch.Tensor, total: int, group: Any) -> torch.Tensor:
        shape, dtype = _shape(x), _compute_dtype(x)
        mean, invstd = mean.to(dtype), invstd.to(dtype)
        out = (x.to(dtype) - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            out = out * weight.to(dtype).view(shape) + bias.to(dtype).view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total, ctx.group = total, group
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out.to(x.dtype)

    @staticmethod
    @once_differentiable  # its collective has no derivative: a double backward raises rather than come out wrong
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        x, weight, mean, invstd = ctx.saved_tensors
        dims, shape, dtype = _reduce_dims(x), _shape(x), mean.dtype
        xhat = (x.to(dtype) - mean.view(shape)) * invstd.view(shape)
        grad = grad_out.to(dtype).contiguous()
        local = torch.stack([grad.sum(dims), (grad * xhat).sum(dims)])
        sums = local.clone()
        # Every rank of the group reaches this, including one with no samples
        # (its sums are zeros): the layers' backward collectives line up.
        events.collective("SyncBatchNorm backward: all-reduce gradient sums", nbytes=sums.numel() * sums.element_size())
        dist.all_reduce(sums, group=ctx.group)
        mean_g, mean_gx = (sums / ctx.total).unbind(0)
        scale = invstd if weight is None else invstd * weight.to(dtype)
        grad_x = (scale.view(shape) * (grad - mean_g.view(shape) - xhat * mean_gx.view(shape))).to(x.dtype)
        grad_w = local[1].to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = local[0].to(ctx.bias_dtype) if weight is not None and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None


class ChannelMismatchError(ValueError, RuntimeError):
    """An input whose channel count is not the layer's: a ``RuntimeError`` as torch's batch norm raises, and a
    ``ValueError`` as earlier ddpkit versions did."""


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``BatchNorm1d/2d/3d`` that normalises over the global batch of the group.

    Args:
        num_features: channels (dimension 1 of the input).
        eps: added to the variance. Default 1e-5.
        momentum: running-statistics factor; ``None`` for a cumulative average. Default 0.1.
        affine: learnable weight and bias. Default True.
        track_running_stats: keep running mean and variance. Default True.
        process_group: the ranks to normalise over; default the world.

    Raises:
        ValueError: in training, a channel has one value or fewer over the
            whole group (as ``BatchNorm`` raises for a batch of one), or the
            input has fewer than 2 dimensions.

    Warning:
        Every rank of the group must run each training forward and backward of
        the layer (an empty batch is fine): each issues a collective.

    Example::

        model = ddpkit.SyncBatchNorm.convert_sync_batchnorm(model)
        model = ddpkit.DDP(model.to(ctx.device))
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: dist.ProcessGroup | None = None,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input (N, C, ...), got {input.dim()}-D")
        if input.shape[1] == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero (dimension 1 is empty)")

    def _group_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ChannelMismatchError(
                f"SyncBatchNorm({self.num_features}) got an input with {input.shape[1]} channels (dimension 1): "
                f"give it {self.num_features} channels, or build the layer for {input.shape[1]}"
            )
        if not self.training or self._group_size() == 1:
            # Exactly BatchNorm: evaluation (torch's rule: never synchronised, batch statistics without
            # running ones are this rank's own), or nobody to synchronise with.
            return self._plain(input)
        mean, var, total = self._global_stats(input)
        if total <= 1:
            raise ValueError(
                f"SyncBatchNorm: expected more than 1 value per channel when training, got {total} over "
                "the whole group: use larger batches"
            )
        if self.training and self.track_running_stats:
            self._update_running_stats(mean, var, total)
        invstd = torch.rsqrt(var + self.eps)  # (float64: the forward rounds it to its compute dtype)
        return _SyncNorm.apply(input, self.weight, self.bias, mean, invstd, total, self.process_group)

    def _plain(self, input: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        return F.batch_norm(
            input, self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight, self.bias, self.training or not self.track_running_stats, factor, self.eps,
        )

    def _global_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Global mean and biased variance per channel (float64), and the global count."""
        dims = _reduce_dims(x)
        n = x.numel() // x.shape[1] if x.shape[1] else 0
        with torch.no_grad():
            if n:
                # In the precision BatchNorm computes its own statistics in (float32 for a half-precision
                # input); only the combination across ranks is in float64.
                var, mean = (t.double() for t in torch.var_mean(x.to(_compute_dtype(x)), dims, unbiased=False))
            else:
                mean = var = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
            mine = torch.cat([torch.tensor([float(n)], dtype=torch.float64, device=x.device), mean, var * n])
            device = comm_device(self.process_group, like=x)
            parts = [torch.empty_like(mine, device=device) for _ in range(self._group_size())]
            events.collective("SyncBatchNorm forward: all-gather batch statistics",
                              nbytes=mine.numel() * mine.element_size())
            dist.all_gather(parts, mine.to(device), group=self.process_group)
            table = torch.stack(parts).to(x.device)
        counts, means, m2s = table[:, :1], table[:, 1 : 1 + x.shape[1]], table[:, 1 + x.shape[1] :]
        total = counts.sum()
        if total <= 0:
            return means[0], means[0], 0
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
        return mean, m2 / total, int(total.item())

    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, total: int) -> None:
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            unbiased = var * total / (total - 1)
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
        """Replace every ``BatchNorm*`` in ``module`` by a ``SyncBatchNorm`` (returned; in place below the root).

        Weights and biases are the same parameter objects (``requires_grad``
        kept), buffers are carried over, and so is training mode.
        """
        out = module
        if isinstance(module, _BatchNorm):  # a SyncBatchNorm too, rebuilt on process_group (torch's rule)
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_group)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return out
