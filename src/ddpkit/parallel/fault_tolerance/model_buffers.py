"""The module's buffers (batch-norm statistics) as the fault-tolerant mode carries them: rank 0's bytes, each
buffer at an 8-byte aligned span of one blob, copied bit for bit whatever the dtype (a sum, or a float32 copy,
would change a float64's low bits or an int64 counter above 2**24).

Every micro-batch of a step starts from the buffers the step found (:meth:`ModelBuffers.snapshot`,
:meth:`ModelBuffers.put_back`), and the step ends with rank 0's on every member (:meth:`ModelBuffers.blob`,
:meth:`ModelBuffers.load_blob`), as DDP's ``broadcast_buffers``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ModelBuffers"]


class ModelBuffers:
    """A module's buffers and the blob that carries them."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.tensors = list(module.buffers())
        self.device = device
        self.spans = _byte_spans(self.tensors)
        """Where each buffer's bytes start in the blob, and the blob's length last (a multiple of 8)."""

    def __bool__(self) -> bool:
        return bool(self.tensors)

    @property
    def nbytes(self) -> int:
        """The blob's length."""
        return self.spans[-1]

    def blob(self) -> torch.Tensor:
        """This rank's buffers' bytes, each at its span, as one uint8 tensor."""
        blob = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
        for b, start in zip(self.tensors, self.spans):
            n = b.numel() * b.element_size()
            blob[start : start + n] = b.detach().contiguous().reshape(-1).view(torch.uint8).to(self.device)
        return blob

    def load_blob(self, blob: torch.Tensor) -> None:
        """The buffers from ``blob`` (:meth:`blob`'s, a peer's), bit for bit."""
        with torch.no_grad():
            for b, start in zip(self.tensors, self.spans):
                n = b.numel() * b.element_size()
                b.copy_(blob[start : start + n].view(b.dtype).view(b.shape))

    def snapshot(self) -> list[torch.Tensor]:
        return [b.detach().clone() for b in self.tensors]

    def put_back(self, saved: Sequence[torch.Tensor]) -> None:
        """The buffers as :meth:`snapshot` saw them."""
        with torch.no_grad():
            for b, v in zip(self.tensors, saved):
                b.copy_(v)


def _byte_spans(buffers: Sequence[torch.Tensor]) -> list[int]:
    """Where each buffer's bytes start in one blob (8-byte aligned, so each can be viewed as its dtype), and the
    blob's length last (a multiple of 8)."""
    spans, at = [], 0
    for b in buffers:
        spans.append(at)
        at += -(-(b.numel() * b.element_size()) // 8) * 8
    return [*spans, at]
