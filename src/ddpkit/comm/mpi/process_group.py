"""A ``torch.distributed.ProcessGroup`` whose collectives are MPI's, through mpi4py.

Each group owns a communicator of its own (the world's duplicated, or a
subgroup's made with ``MPI_Comm_create_group`` by its members only, as
torch's ``new_group`` calls it) and a :class:`~ddpkit.comm.mpi.progress.Progress`
thread. Every collective torch's Python API reaches a backend through is
here, so ``dist.all_reduce(t, group=g)`` and ddpkit's engines run unchanged.

Memory: a contiguous CPU tensor is handed to MPI where it lies (no copy).
A non-contiguous tensor goes through a contiguous copy; list forms
(``all_gather`` into a list, ``reduce_scatter`` from one) through one
staging buffer, since MPI takes one buffer per call. CUDA tensors go to a
CUDA-aware MPI as they are and through host memory otherwise (one warning
per process says so).
"""

from __future__ import annotations

import threading
import warnings
import zlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.comm.mpi.datatypes import datatype, reduction
from ddpkit.comm.mpi.library import cuda_aware, load
from ddpkit.comm.mpi.progress import MPIWork, Progress

__all__ = ["MPIProcessGroup"]

_staged_warning = threading.Event()


class _Stand:
    """Stand-ins MPI can use for one operation's tensors, and the copies back into the caller's outputs."""

    def __init__(self, direct_cuda: bool) -> None:
        self.direct_cuda = direct_cuda
        self.back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cuda = False

    def _direct(self, t: torch.Tensor) -> bool:
        if t.device.type == "cuda":
            self.cuda = True
            if not self.direct_cuda:
                if not _staged_warning.is_set():
                    _staged_warning.set()
                    warnings.warn("the MPI library is not CUDA-aware (or does not say it is): CUDA tensors go "
                                  "through host memory, a copy each way; set DDPKIT_MPI_CUDA_AWARE=1 if it is",
                                  stacklevel=5)
                return False
        elif t.device.type != "cpu":
            raise ValueError(f"the MPI backend takes CPU and CUDA tensors, not {t.device.type} ones")
        return t.is_contiguous() and not t.is_conj() and not t.is_neg()

    def src(self, t: torch.Tensor) -> torch.Tensor:
        """An input: the tensor itself, or a contiguous host copy made now."""
        if self._direct(t):
            return t
        return t.resolve_conj().resolve_neg().to("cpu" if not self.direct_cuda else t.device,
                                                 memory_format=torch.contiguous_format, copy=True)

    def dst(self, t: torch.Tensor) -> torch.Tensor:
        """An output: the tensor itself, or a contiguous host copy (of its current values) copied back after."""
        if self._direct(t):
            return t
        stand = self.src(t)
        self.back.append((t, stand))
        return stand

    def finish(self) -> None:
        for t, stand in self.back:
            t.copy_(stand)
        if self.cuda and self.back:
            torch.cuda.synchronize()

    def ready(self) -> None:
        """The caller's CUDA work that produced the inputs is done before MPI reads device memory."""
        if self.cuda and self.direct_cuda:
            torch.cuda.current_stream().synchronize()


def _buf(t: torch.Tensor) -> list[Any]:
    """``[memory, count, datatype]`` of a contiguous tensor: MPI reads and writes its storage in place."""
    MPI = load()
    memory = MPI.buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else None
    return [memory, t.numel(), datatype(t.dtype)]


def _block(t: torch.Tensor, count: int) -> list[Any]:
    """A buffer of one block per rank, as MPI's regular collectives count it: ``count`` elements a block."""
    memory, _, kind = _buf(t)
    return [memory, count, kind]


def _one(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"MPI backend: {what} takes one tensor per process, got {len(tensors)} (torch's "
                         "multi-tensor form is gone from NCCL and gloo alike): pass one tensor")
    return tensors[0]


def _same(tensors: Sequence[torch.Tensor], like: torch.Tensor, what: str) -> None:
    for i, t in enumerate(tensors):
        if t.dtype != like.dtype:
            raise ValueError(f"MPI backend: {what}: tensor {i} has dtype {t.dtype} and the input {like.dtype}: "
                             "every tensor of a collective has one dtype")


class MPIProcessGroup(dist.ProcessGroup):
    """The process group of the ``mpi`` backend (see the module docstring).

    Args:
        comm: the group's own MPI communicator (this object frees it when destroyed).
        timeout: the group's collective timeout (the job is aborted past it: MPI cannot cancel a call).
        on_shutdown: called once the group is destroyed.
    """

    def __init__(self, comm: Any, timeout: timedelta, on_shutdown: Callable[[], None] | None = None) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        self.comm = comm
        self._on_shutdown = on_shutdown
        self._direct_cuda = bool(cuda_aware())
        self._progress = Progress(f"{comm.Get_size()}ranks-{id(self):x}", timeout.total_seconds(),
                                  lambda: load().COMM_WORLD.Abort(1))
        self._group_name: str | None = None
        self._group_desc = ""

    # -- torch's bookkeeping ------------------------------------------------------------------------------------

    def getBackendName(self) -> str:
        return "mpi"

    def name(self) -> str:
        return "mpi"

    def _get_backend_name(self) -> str:
        return "mpi"

    def _set_group_name(self, name: str) -> None:
        self._group_name = name
        super()._set_group_name(name)

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc
        super()._set_group_desc(desc)

    @property
    def group_name(self) -> str:
        if self._group_name is None:
            raise RuntimeError("MPI backend: the group has no name yet (torch names it when it registers it)")
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def shutdown(self) -> None:
        """Finish what is queued, stop the threads and free the communicator (torch calls it on destroy)."""
        if self.comm is None:
            return
        self._progress.stop()
        comm, self.comm = self.comm, None
        MPI = load()
        if comm != MPI.COMM_WORLD and not MPI.Is_finalized():
            comm.Free()
        if self._on_shutdown is not None:
            self._on_shutdown()

    def abort(self) -> None:
        load().COMM_WORLD.Abort(1)

    # -- the operations -------------------------------------------------------------------------------------------

    def _submit(self, what: str, outputs: Sequence[torch.Tensor], stand: _Stand,
                call: Callable[[Any], None]) -> MPIWork:
        if self.comm is None:
            raise RuntimeError(f"MPI backend: {what} on a destroyed process group: create a new group")
        stand.ready()
        comm = self.comm

        def run() -> None:
            call(comm)
            stand.finish()

        return self._progress.submit(what, run, outputs)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> MPIWork:
        t = _one(tensors, "all_reduce")
        op = _reduce_op(opts)
        if t.is_sparse:
            return self._sparse_allreduce(t, op)
        red = reduction(op, t.dtype)
        stand = _Stand(self._direct_cuda)
        buf = stand.dst(t)
        size = self.size()

        def call(comm: Any) -> None:
            MPI = load()
            red.scale_(buf)
            comm.Allreduce(MPI.IN_PLACE, _buf(buf), red.op)
            red.finish(buf, size)

        return self._submit("all_reduce", tensors, stand, call)

    def _sparse_allreduce(self, t: torch.Tensor, op: Any) -> MPIWork:
        """A sparse COO tensor summed as gloo sums it: every rank's entries gathered in rank order, coalesced
        (duplicates added in that order), and the input tensor replaced by the sum."""
        if (op.op if hasattr(op, "op") else op) != dist.ReduceOp.SUM:
            raise ValueError("MPI backend: all_reduce of a sparse tensor sums (gloo's rule too): use ReduceOp.SUM, "
                             "or make the tensor dense (to_dense())")
        if t.device.type != "cpu":
            raise ValueError("MPI backend: all_reduce of a sparse tensor runs on CPU tensors: move it (t.cpu())")
        local = t.coalesce()
        # Entries one after the other: (nnz, sparse_dim) indices, so that ranks' blocks concatenate.
        indices = local.indices().t().contiguous()
        values = local.values().contiguous()
        sparse_dim, row = indices.shape[1], values[0].numel() if values.dim() > 1 else 1
        size = self.size()

        def call(comm: Any) -> None:
            mine, counts = torch.tensor([indices.shape[0]], dtype=torch.int64), torch.zeros(size, dtype=torch.int64)
            comm.Allgather(_buf(mine), _block(counts, 1))  # (a named tensor: MPI reads its memory, keep it alive)
            nnz = counts.tolist()
            all_indices = torch.empty(sum(nnz), sparse_dim, dtype=indices.dtype)
            all_values = torch.empty(sum(nnz), *values.shape[1:], dtype=values.dtype)
            index_counts = [n * sparse_dim for n in nnz]
            value_counts = [n * row for n in nnz]
            comm.Allgatherv(_buf(indices), [_buf(all_indices)[0], index_counts, _displacements(index_counts),
                                            datatype(indices.dtype)])
            comm.Allgatherv(_buf(values), [_buf(all_values)[0], value_counts, _displacements(value_counts),
                                           datatype(values.dtype)])
            total = torch.sparse_coo_tensor(all_indices.t(), all_values, t.shape).coalesce()
            t.copy_(total)

        return self._submit("all_reduce (sparse)", [t], _Stand(self._direct_cuda), call)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> MPIWork:
        op = _reduce_op(opts)
        if not tensors:
            return self._submit("all_reduce_coalesced", tensors, _Stand(self._direct_cuda), lambda comm: None)
        _same(tensors, tensors[0], "all_reduce_coalesced")
        red = reduction(op, tensors[0].dtype)
        size = self.size()
        device = tensors[0].device if self._direct_cuda else torch.device("cpu")
        flat = torch.cat([t.detach().reshape(-1).to(device) for t in tensors])
        stand = _Stand(self._direct_cuda)
        stand.src(flat)

        def call(comm: Any) -> None:
            MPI = load()
            red.scale_(flat)
            comm.Allreduce(MPI.IN_PLACE, _buf(flat), red.op)
            red.finish(flat, size)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            if stand.cuda:
                torch.cuda.synchronize()

        return self._submit("all_reduce_coalesced", tensors, stand, call)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> MPIWork:
        t = _one(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        self._check_rank(root, "broadcast")
        stand = _Stand(self._direct_cuda)
        buf = stand.src(t) if self.rank() == root else stand.dst(t)
        return self._submit("broadcast", tensors, stand, lambda comm: comm.Bcast(_buf(buf), root=root))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> MPIWork:
        t = _one(tensors, "reduce")
        root = opts.rootRank if opts is not None else 0
        self._check_rank(root, "reduce")
        red = reduction(_reduce_op(opts), t.dtype)
        stand = _Stand(self._direct_cuda)
        size, mine = self.size(), self.rank() == root
        buf = stand.dst(t) if mine else red.scale(stand.src(t)).contiguous()

        def call(comm: Any) -> None:
            MPI = load()
            if mine:
                red.scale_(buf)
                comm.Reduce(MPI.IN_PLACE, _buf(buf), red.op, root=root)
                red.finish(buf, size)
            else:
                comm.Reduce(_buf(buf), None, red.op, root=root)

        return self._submit("reduce", tensors, stand, call)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> MPIWork:
        t = _one(input_tensors, "all_gather")
        outputs = _one(output_tensors, "all_gather")
        self._check_count(outputs, "all_gather", "output list")
        _same(outputs, t, "all_gather")
        stand = _Stand(self._direct_cuda)
        src = stand.src(t)
        counts = [o.numel() for o in outputs]
        if counts[self.rank()] != t.numel():
            raise ValueError(f"MPI backend: all_gather: output {self.rank()} holds {counts[self.rank()]} elements "
                             f"and this rank's input {t.numel()}: make them the same size")
        flat = torch.empty(sum(counts), dtype=t.dtype, device=src.device)

        def call(comm: Any) -> None:
            comm.Allgatherv(_buf(src), [_buf(flat)[0], counts, _displacements(counts), datatype(t.dtype)])
            _spread(flat, outputs)
            if stand.cuda:
                torch.cuda.synchronize()

        return self._submit("all_gather", output_tensors[0], stand, call)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> MPIWork:
        works = [self.allgather([outputs], [t], opts) for outputs, t in zip(output_lists, input_list, strict=True)]
        return self._after(works, "all_gather_coalesced", [o for outs in output_lists for o in outs])

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> MPIWork:
        if output.dtype != input.dtype:
            raise ValueError(f"MPI backend: all_gather_into_tensor: output dtype {output.dtype} and input dtype "
                             f"{input.dtype} differ: give both one dtype")
        if output.numel() != input.numel() * self.size():
            raise ValueError(f"MPI backend: all_gather_into_tensor: the output holds {output.numel()} elements and "
                             f"must hold world size x input = {self.size()} x {input.numel()}: resize it")
        stand = _Stand(self._direct_cuda)
        src, dst = stand.src(input), stand.dst(output)
        return self._submit("all_gather_into_tensor", [output], stand,
                            lambda comm: comm.Allgather(_buf(src), _block(dst, src.numel())))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> MPIWork:
        return self._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> MPIWork:
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._after(works, "all_gather_into_tensor_coalesced", outputs)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> MPIWork:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> MPIWork:
        t = _one(input_tensors, "gather")
        root = opts.rootRank if opts is not None else 0
        self._check_rank(root, "gather")
        stand = _Stand(self._direct_cuda)
        src = stand.src(t)
        if self.rank() != root:
            if output_tensors and output_tensors[0]:
                raise ValueError(f"MPI backend: gather: rank {self.rank()} is not the destination ({root}) and "
                                 "passes a gather list: pass none (gather_list=None) off the destination")
            return self._submit("gather", [], stand, lambda comm: comm.Gatherv(_buf(src), None, root=root))
        outputs = _one(output_tensors, "gather")
        self._check_count(outputs, "gather", "gather list")
        _same(outputs, t, "gather")
        counts = [o.numel() for o in outputs]
        flat = torch.empty(sum(counts), dtype=t.dtype, device=src.device)

        def call(comm: Any) -> None:
            comm.Gatherv(_buf(src), [_buf(flat)[0], counts, _displacements(counts), datatype(t.dtype)], root=root)
            _spread(flat, outputs)
            if stand.cuda:
                torch.cuda.synchronize()

        return self._submit("gather", outputs, stand, call)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> MPIWork:
        t = _one(output_tensors, "scatter")
        root = opts.rootRank if opts is not None else 0
        self._check_rank(root, "scatter")
        stand = _Stand(self._direct_cuda)
        dst = stand.dst(t)
        if self.rank() != root:
            if input_tensors and input_tensors[0]:
                raise ValueError(f"MPI backend: scatter: rank {self.rank()} is not the source ({root}) and passes a "
                                 "scatter list: pass none (scatter_list=None) off the source")
            return self._submit("scatter", output_tensors, stand,
                                lambda comm: comm.Scatterv(None, _buf(dst), root=root))
        inputs = _one(input_tensors, "scatter")
        self._check_count(inputs, "scatter", "scatter list")
        _same(inputs, t, "scatter")
        counts = [i.numel() for i in inputs]
        flat = torch.cat([i.detach().reshape(-1).to(dst.device) for i in inputs])

        def call(comm: Any) -> None:
            comm.Scatterv([_buf(flat)[0], counts, _displacements(counts), datatype(t.dtype)], _buf(dst), root=root)

        return self._submit("scatter", output_tensors, stand, call)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> MPIWork:
        t = _one(output_tensors, "reduce_scatter")
        inputs = _one(input_tensors, "reduce_scatter")
        self._check_count(inputs, "reduce_scatter", "input list")
        _same(inputs, t, "reduce_scatter")
        red = reduction(_reduce_op(opts), t.dtype)
        counts = [i.numel() for i in inputs]
        if counts[self.rank()] != t.numel():
            raise ValueError(f"MPI backend: reduce_scatter: input {self.rank()} holds {counts[self.rank()]} elements "
                             f"and this rank's output {t.numel()}: make them the same size")
        stand = _Stand(self._direct_cuda)
        dst = stand.dst(t)
        flat = red.scale(torch.cat([i.detach().reshape(-1).to(dst.device) for i in inputs]))
        size = self.size()

        def call(comm: Any) -> None:
            comm.Reduce_scatter(_buf(flat), _buf(dst), counts, red.op)
            red.finish(dst, size)

        return self._submit("reduce_scatter", output_tensors, stand, call)

    def _reduce_scatter_base(self, outputTensor: torch.Tensor, inputTensor: torch.Tensor,
                             opts: Any = None) -> MPIWork:
        output, input = outputTensor, inputTensor
        if output.dtype != input.dtype:
            raise ValueError(f"MPI backend: reduce_scatter_tensor: output dtype {output.dtype} and input dtype "
                             f"{input.dtype} differ: give both one dtype")
        if input.numel() != output.numel() * self.size():
            raise ValueError(f"MPI backend: reduce_scatter_tensor: the input holds {input.numel()} elements and must "
                             f"hold world size x output = {self.size()} x {output.numel()}: resize it")
        red = reduction(_reduce_op(opts), output.dtype)
        stand = _Stand(self._direct_cuda)
        src = red.scale(stand.src(input)).contiguous()
        dst = stand.dst(output)
        size = self.size()

        def call(comm: Any) -> None:
            comm.Reduce_scatter_block(_block(src, dst.numel()), _buf(dst), red.op)
            red.finish(dst, size)

        return self._submit("reduce_scatter_tensor", [output], stand, call)

    def reduce_scatter_single(self, outputTensor: torch.Tensor, inputTensor: torch.Tensor,
                              opts: Any = None) -> MPIWork:
        return self._reduce_scatter_base(outputTensor, inputTensor, opts)

    def reduce_scatter_tensor_coalesced(self, outputTensors: list[torch.Tensor], inputTensors: list[torch.Tensor],
                                        opts: Any = None) -> MPIWork:
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputTensors, inputTensors, strict=True)]
        return self._after(works, "reduce_scatter_tensor_coalesced", outputTensors)

    def reduce_scatter_single_coalesced(self, outputTensors: list[torch.Tensor], inputTensors: list[torch.Tensor],
                                        opts: Any = None) -> MPIWork:
        return self.reduce_scatter_tensor_coalesced(outputTensors, inputTensors, opts)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> MPIWork:
        size = self.size()
        if output.dtype != input.dtype:
            raise ValueError(f"MPI backend: all_to_all_single: output dtype {output.dtype} and input dtype "
                             f"{input.dtype} differ: give both one dtype")
        recv_counts = _split_counts(output, output_split_sizes, size, "output")
        send_counts = _split_counts(input, input_split_sizes, size, "input")
        stand = _Stand(self._direct_cuda)
        src, dst = stand.src(input), stand.dst(output)
        kind = datatype(output.dtype)

        def call(comm: Any) -> None:
            comm.Alltoallv([_buf(src)[0], send_counts, _displacements(send_counts), kind],
                           [_buf(dst)[0], recv_counts, _displacements(recv_counts), kind])

        return self._submit("all_to_all_single", [output], stand, call)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> MPIWork:
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> MPIWork:
        self._check_count(output_tensors, "all_to_all", "output list")
        self._check_count(input_tensors, "all_to_all", "input list")
        like = input_tensors[0]
        _same(output_tensors, like, "all_to_all")
        _same(input_tensors, like, "all_to_all")
        stand = _Stand(self._direct_cuda)
        device = like.device if self._direct_cuda else torch.device("cpu")
        send_counts = [t.numel() for t in input_tensors]
        recv_counts = [t.numel() for t in output_tensors]
        send = torch.cat([t.detach().reshape(-1).to(device) for t in input_tensors])
        recv = torch.empty(sum(recv_counts), dtype=like.dtype, device=device)
        stand.src(like)
        kind = datatype(like.dtype)

        def call(comm: Any) -> None:
            comm.Alltoallv([_buf(send)[0], send_counts, _displacements(send_counts), kind],
                           [_buf(recv)[0], recv_counts, _displacements(recv_counts), kind])
            _spread(recv, output_tensors)
            if stand.cuda:
                torch.cuda.synchronize()

        return self._submit("all_to_all", output_tensors, stand, call)

    def barrier(self, opts: Any = None) -> MPIWork:
        return self._submit("barrier", [], _Stand(self._direct_cuda), lambda comm: comm.Barrier())

    # -- point to point: posted now, completed by the group's completer ----------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> MPIWork:
        t = _one(tensors, "send")
        self._check_rank(dstRank, "send")
        stand = _Stand(self._direct_cuda)
        src = stand.src(t)
        stand.ready()
        request = self._comm("send").Isend(_buf(src), dest=dstRank, tag=tag)
        # The request reads src until it completes: keep it alive with the work.
        return self._progress.post("send", request, tensors, lambda status, keep=src: None)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> MPIWork:
        self._check_rank(srcRank, "recv")
        return self._receive(tensors, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> MPIWork:
        return self._receive(tensors, None, tag)

    def _receive(self, tensors: list[torch.Tensor], source: int | None, tag: int) -> MPIWork:
        t = _one(tensors, "recv")
        MPI = load()
        stand = _Stand(self._direct_cuda)
        dst = stand.dst(t)
        stand.ready()
        request = self._comm("recv").Irecv(_buf(dst), source=MPI.ANY_SOURCE if source is None else source,
                                           tag=MPI.ANY_TAG if tag < 0 else tag)
        work: MPIWork

        def then(status: Any) -> None:
            work._source = status.Get_source()
            stand.finish()

        work = self._progress.post("recv", request, tensors, then)
        return work

    # -- helpers ----------------------------------------------------------------------------------------------------

    def _comm(self, what: str) -> Any:
        if self.comm is None:
            raise RuntimeError(f"MPI backend: {what} on a destroyed process group: create a new group")
        return self.comm

    def _after(self, works: list[MPIWork], what: str, outputs: Sequence[torch.Tensor]) -> MPIWork:
        """A work that completes when ``works`` (already queued, in order) have: queued behind them."""

        def call(comm: Any) -> None:
            for work in works:
                work.wait()

        return self._submit(what, outputs, _Stand(self._direct_cuda), call)

    def _check_rank(self, rank: int, what: str) -> None:
        if not 0 <= rank < self.size():
            raise ValueError(f"MPI backend: {what}: rank {rank} is not in this group of {self.size()}: "
                             f"use 0..{self.size() - 1} (a group rank)")

    def _check_count(self, tensors: Sequence[torch.Tensor], what: str, name: str) -> None:
        if len(tensors) != self.size():
            raise ValueError(f"MPI backend: {what}: the {name} has {len(tensors)} tensors and the group "
                             f"{self.size()} ranks: pass one per rank")


def _reduce_op(opts: Any) -> Any:
    return opts.reduceOp if opts is not None else dist.ReduceOp.SUM


def _displacements(counts: Sequence[int]) -> list[int]:
    out, total = [], 0
    for count in counts:
        out.append(total)
        total += count
    return out


def _spread(flat: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
    offset = 0
    for o in outputs:
        o.copy_(flat[offset:offset + o.numel()].view(o.shape))
        offset += o.numel()


def _split_counts(t: torch.Tensor, splits: Sequence[int], size: int, name: str) -> list[int]:
    """Element counts per rank of an all-to-all's tensor split along dim 0 (equal splits when none are given)."""
    rows = t.shape[0] if t.dim() else 1
    row = t.numel() // rows if rows else 0
    if not splits:
        if rows % size:
            raise ValueError(f"MPI backend: all_to_all_single: the {name} has {rows} rows, not divisible by the "
                             f"group's {size} ranks: pass {name}_split_sizes")
        return [rows // size * row] * size
    if len(splits) != size or sum(splits) != rows:
        raise ValueError(f"MPI backend: all_to_all_single: {name}_split_sizes {list(splits)} must have {size} "
                         f"entries summing to the {name}'s {rows} rows")
    return [s * row for s in splits]


def group_tag(name: str) -> int:
    """A tag for ``MPI_Comm_create_group`` from the group's name (the same on every member)."""
    return zlib.crc32(name.encode()) % 32768
