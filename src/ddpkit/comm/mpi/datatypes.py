"""torch's dtypes and reduce ops in MPI's terms: the datatype of a tensor's memory, the op that reduces it.

MPI has predefined datatypes for torch's integer, floating, complex and bool
dtypes, and predefined ops for sum, product, min, max and the bitwise ops on
them. It has neither a half nor a bfloat16 type: their tensors travel as
16-bit words, and reductions over them (or over any pair MPI does not
define, e.g. SUM on bool) run a user-defined op that reduces in torch, in
the tensor's own dtype, as gloo does (each addition rounded to the dtype).
AVG and PREMUL_SUM are not MPI ops: the group sums and then divides, or
scales a copy of the input first (NCCL's meaning: integers divide with
truncation; PREMUL_SUM only on floating tensors). A pair that torch itself
does not reduce (bitwise ops on floats; MIN, MAX or PRODUCT on complex,
torch's own rule) fails with one line naming the dtype and the op.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.comm.mpi.library import load

__all__ = ["Reduction", "datatype", "reduction"]

ReduceOp = dist.ReduceOp

_NATIVE = {
    torch.float32: "FLOAT", torch.float64: "DOUBLE",
    torch.int8: "INT8_T", torch.int16: "INT16_T", torch.int32: "INT32_T", torch.int64: "INT64_T",
    torch.uint8: "UINT8_T", torch.uint16: "UINT16_T", torch.uint32: "UINT32_T", torch.uint64: "UINT64_T",
    torch.bool: "C_BOOL", torch.complex64: "C_FLOAT_COMPLEX", torch.complex128: "C_DOUBLE_COMPLEX",
}
"""Dtypes MPI has a predefined datatype for."""

_WORDS = {1: "BYTE", 2: "UINT16_T", 4: "UINT32_T", 8: "UINT64_T"}
"""The carrier of a dtype MPI lacks, by element size (reductions over it run in torch)."""

_FLOATS = (torch.float32, torch.float64)
_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
             torch.uint64)
_MPI_OPS = {ReduceOp.SUM: "SUM", ReduceOp.PRODUCT: "PROD", ReduceOp.MIN: "MIN", ReduceOp.MAX: "MAX",
            ReduceOp.BAND: "BAND", ReduceOp.BOR: "BOR", ReduceOp.BXOR: "BXOR"}
_NAMES = {ReduceOp.SUM: "SUM", ReduceOp.PRODUCT: "PRODUCT", ReduceOp.MIN: "MIN", ReduceOp.MAX: "MAX",
          ReduceOp.BAND: "BAND", ReduceOp.BOR: "BOR", ReduceOp.BXOR: "BXOR", ReduceOp.AVG: "AVG",
          ReduceOp.PREMUL_SUM: "PREMUL_SUM"}


def datatype(dtype: torch.dtype) -> Any:
    """The MPI datatype whose elements are ``dtype``'s, or a word of the same size for a dtype MPI lacks.

    Raises:
        TypeError: a dtype no MPI word carries (wider than 8 bytes and not complex).
    """
    MPI = load()
    if dtype in _NATIVE:
        return getattr(MPI, _NATIVE[dtype])
    size = torch.empty((), dtype=dtype).element_size()
    if size not in _WORDS:
        raise TypeError(f"the MPI backend cannot carry tensors of dtype {dtype} ({size}-byte elements)")
    return getattr(MPI, _WORDS[size])


class Reduction:
    """How one (dtype, op) pair is reduced: the MPI op, and what to do before and after it."""

    def __init__(self, op: Any, *, divide: bool, factor: float | torch.Tensor | None) -> None:
        self.op = op
        """The MPI op (predefined, or one of ours that reduces in torch)."""
        self.divide = divide
        """AVG: divide the sum by the group's size afterwards."""
        self.factor = factor
        """PREMUL_SUM: scale each rank's input by this before summing."""

    def scale(self, tensor: torch.Tensor) -> torch.Tensor:
        """PREMUL_SUM's input: a scaled copy (the caller's input stays as it was); others pass through."""
        if self.factor is None:
            return tensor
        return tensor * self.factor

    def scale_(self, tensor: torch.Tensor) -> None:
        """PREMUL_SUM's input scaled in place (a buffer that is also the output); others are left as they are."""
        if self.factor is not None:
            tensor.mul_(self.factor)

    def finish(self, tensor: torch.Tensor, size: int) -> None:
        """AVG's division, in place, with NCCL's rounding for integers (towards zero)."""
        if not self.divide:
            return
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            tensor.div_(size)
        else:
            tensor.copy_(torch.div(tensor, size, rounding_mode="trunc"))


def reduction(op: Any, dtype: torch.dtype) -> Reduction:
    """The :class:`Reduction` of torch's ``op`` (a ``ReduceOp``) over tensors of ``dtype``.

    Raises:
        ValueError: an op torch itself does not define for the dtype (bitwise ops on floating or complex
            tensors, MIN/MAX on complex), or an op the backend does not know.
    """
    kind = op.op if hasattr(op, "op") else op
    factor = None
    if kind == ReduceOp.PREMUL_SUM:
        if not (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"reduce op PREMUL_SUM scales by a floating factor, and tensors of dtype {dtype} cannot "
                             "hold the products: use a floating tensor, or SUM and scale yourself")
        factor = op.factor
        if isinstance(factor, torch.Tensor):
            factor = factor.to("cpu", dtype)
    base = ReduceOp.SUM if kind in (ReduceOp.AVG, ReduceOp.PREMUL_SUM) else kind
    if base not in _MPI_OPS:
        raise ValueError(f"the MPI backend does not know reduce op {kind}: use SUM, PRODUCT, MIN, MAX, BAND, BOR, "
                         "BXOR, AVG or PREMUL_SUM")
    bitwise = base in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
    if bitwise and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"reduce op {_NAMES[kind]} is bitwise and tensors of dtype {dtype} have no bits to "
                         "combine: use an integer or bool tensor, or another op")
    if dtype.is_complex and base in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
        # torch's own rule (supports_complex): all_reduce refuses these before any backend sees them.
        raise ValueError(f"reduce op {_NAMES[kind]} is not defined on complex tensors ({dtype}), as torch's "
                         "all_reduce says too: reduce the real and imaginary parts (torch.view_as_real) instead")
    if kind == ReduceOp.AVG and dtype == torch.bool:
        raise ValueError("reduce op AVG over bool tensors has no meaning: use an integer or floating dtype")
    MPI = load()
    if dtype in _FLOATS or dtype in _INTEGERS or (dtype.is_complex and base == ReduceOp.SUM):
        mpi_op = getattr(MPI, _MPI_OPS[base])
    elif dtype == torch.bool and base in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        mpi_op = {ReduceOp.BAND: MPI.LAND, ReduceOp.BOR: MPI.LOR, ReduceOp.BXOR: MPI.LXOR}[base]
    else:
        mpi_op = _torch_op(base, dtype)
    return Reduction(mpi_op, divide=kind == ReduceOp.AVG, factor=factor)


_COMBINE = {
    ReduceOp.SUM: lambda acc, x: acc.add_(x) if acc.dtype != torch.bool else torch.logical_or(acc, x, out=acc),
    ReduceOp.PRODUCT: lambda acc, x: acc.mul_(x) if acc.dtype != torch.bool else torch.logical_and(acc, x, out=acc),
    ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
    ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
}
"""torch's meaning of each op over one pair of buffers, in the dtype itself (bool: SUM is OR, PRODUCT is AND)."""


@functools.cache
def _torch_op(base: Any, dtype: torch.dtype) -> Any:
    """A user-defined MPI op that reduces two buffers of ``dtype`` with torch (created once per pair)."""
    MPI = load()
    combine = _COMBINE[base]

    def reduce(invec: Any, inoutvec: Any, _datatype: Any) -> None:
        x = torch.frombuffer(invec, dtype=dtype)
        acc = torch.frombuffer(inoutvec, dtype=dtype)
        combine(acc, x)

    return MPI.Op.Create(reduce, commute=True)


def op_name(op: Any) -> str:
    """The op's name as torch users write it (``SUM``, ``AVG``, ...)."""
    kind = op.op if hasattr(op, "op") else op
    return _NAMES.get(kind, str(kind))
