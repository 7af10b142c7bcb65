"""Block-wise quantisation of a flat float tensor into bytes, and back: 8 or 4 bits a number, one scale a block.

Each block of ``block_size`` numbers keeps its largest magnitude as a float32
scale; a number is rounded to the nearest of the ``2 ** (bits - 1) - 1``
steps each side of zero (symmetric: 127 at 8 bits, 7 at 4 bits), so zero
stays exact and the error of a number is at most half a step of its block.
At 4 bits two numbers share a byte; a block holding inf or NaN decodes as
NaN. The payload is one ``uint8`` tensor, the codes then the scales, so that
one collective carries both; its size depends only on the number of
elements, so every rank knows every rank's layout.

Pure torch (no Triton, no CUDA kernel): the same bytes on gloo, MPI and NCCL,
on the CPU and the GPU, for every shape (the input is flattened) and every
floating dtype (computed in float32).
"""

from __future__ import annotations

import torch

__all__ = ["BITS", "dequantize", "payload_bytes", "quantize"]

BITS = (8, 4)
"""The widths a number may be sent in."""


def _check(bits: int, block_size: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits={bits!r}: choose one of {', '.join(map(str, BITS))}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size % 2:
        raise ValueError(f"block_size={block_size!r} must be an even integer >= 2 (numbers sharing one scale)")


def _blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def payload_bytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of the payload of ``numel`` numbers: the codes (padded to whole blocks) and a float32 scale a block."""
    _check(bits, block_size)
    blocks = _blocks(numel, block_size)
    return blocks * block_size * bits // 8 + 4 * blocks


def quantize(values: torch.Tensor, bits: int, block_size: int = 128) -> torch.Tensor:
    """``values`` (any shape, a floating dtype) as a ``uint8`` payload of :func:`payload_bytes` bytes."""
    _check(bits, block_size)
    if not values.is_floating_point():
        raise TypeError(f"quantize takes floating-point numbers, not {values.dtype}")
    flat = values.detach().reshape(-1).float()
    blocks = _blocks(flat.numel(), block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float32, device=flat.device)
    padded[: flat.numel()] = flat
    padded = padded.view(blocks, block_size)
    steps = 2 ** (bits - 1) - 1
    finite = torch.isfinite(padded).all(dim=1)
    padded = torch.where(finite[:, None], padded, torch.zeros_like(padded))
    scales = padded.abs().amax(dim=1) / steps
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # a block of zeros: codes of zero
    codes = torch.round(padded / divisor[:, None]).clamp_(-steps, steps).to(torch.int16) + steps  # 0..2*steps
    # A block holding inf or NaN (or a float64 beyond float32's range) decodes as NaN on every rank: diverged
    # training spreads as it does through an all-reduce, instead of one rank stopping before the collective.
    scales = torch.where(finite, scales, torch.full_like(scales, float("nan")))
    codes = codes.to(torch.uint8).reshape(-1)
    if bits == 4:
        codes = codes[0::2] | (codes[1::2] << 4)
    return torch.cat([codes, scales.view(torch.uint8)])


def dequantize(payload: torch.Tensor, numel: int, bits: int, block_size: int = 128) -> torch.Tensor:
    """The ``numel`` float32 numbers :func:`quantize` encoded in ``payload`` (flat)."""
    _check(bits, block_size)
    if payload.dtype != torch.uint8 or payload.numel() != payload_bytes(numel, bits, block_size):
        raise ValueError(f"a payload of {payload.numel()} {payload.dtype} does not hold {numel} numbers at {bits} "
                         f"bits in blocks of {block_size} ({payload_bytes(numel, bits, block_size)} uint8)")
    blocks = _blocks(numel, block_size)
    code_bytes = blocks * block_size * bits // 8
    codes = payload[:code_bytes]
    if bits == 4:
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=1).reshape(-1)
    steps = 2 ** (bits - 1) - 1
    scales = payload[code_bytes:].clone().view(torch.float32)
    values = (codes.to(torch.float32) - steps).view(blocks, block_size) * scales[:, None]
    return values.reshape(-1)[:numel]
