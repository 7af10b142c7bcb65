"""Gradient compression for :class:`ddpkit.DistributedOptimizer`, Horovod's ``Compression`` contract.

A compressor has two static methods: ``compress(tensor) -> (compressed, ctx)``
before the all-reduce and ``decompress(tensor, ctx) -> tensor`` after it, so a
compressor class written for Horovod (``hvd.Compression``) works unchanged.

Example::

    opt = ddpkit.DistributedOptimizer(opt, compression=ddpkit.Compression.fp16)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Compression", "Compressor", "FP16Compressor", "BF16Compressor", "NoneCompressor"]


class Compressor:
    """Interface: what happens to a gradient before and after it is all-reduced."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to send and what :meth:`decompress` needs to undo it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the reduced tensor in the gradient's own form."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send gradients as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Send floating gradients in ``dtype``; others as they are."""

    dtype: torch.dtype

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.is_floating_point():
            return tensor.to(cls.dtype), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """float16 on the wire: half the bytes of float32; values beyond ~6.5e4 become inf."""

    dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """bfloat16 on the wire: half the bytes, float32's range, ~2 decimal digits."""

    dtype = torch.bfloat16


class Compression:
    """The compressors by name, as ``hvd.Compression`` offers them."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
