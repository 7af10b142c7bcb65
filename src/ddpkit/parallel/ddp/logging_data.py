"""What ``DistributedDataParallel._get_ddp_logging_data()`` returns: torch's DDP logging data, from ddpkit's engine.

torch's DDP keeps a C++ logger whose data is one dictionary of strings and
integers; Lightning reads it at teardown (``can_set_static_graph``) and users
print it to see how DDP was set up and how an iteration went. ddpkit fills
the same keys with the same meaning:

construction
    ``module_name``, ``device_ids``, ``output_device``, ``world_size``,
    ``rank``, ``backend_name``, ``bucket_cap_bytes``, ``bucket_sizes`` (bytes
    of each bucket), ``find_unused_parameters``, ``gradient_as_bucket_view``,
    ``broadcast_buffers`` (buffers synchronised at each forward),
    ``has_sync_bn``, ``is_multi_device_module``, ``num_parameter_tensors``,
    ``total_parameter_size_bytes``, ``dtypes``, ``static_graph`` (when set),
    ``comm_hook`` (when registered), ``join_uneven_inputs`` (under join), and
    the environment (``master_addr``, ``master_port``, ``gloo_*`` or
    ``nccl_*``, ``cuda_visible_devices``, ``torch_distributed_debug``;
    ``N/A`` when unset).
runtime
    Sampled as torch samples them: the synchronised iterations 1 to 10, then
    every 100th (:meth:`DDPLogging.set_sample_rate`). A synchronised forward
    records the figures of the previous sampled iteration: ``iteration``,
    ``has_rebuilt_buckets`` (then ``rebuilt_bucket_sizes`` and
    ``rebuilt_per_bucket_param_indices``), ``prev_iteration_grad_ready_order_indices``,
    ``num_buckets_reduced``, ``unused_parameter_size`` (bytes of the
    parameters this rank did not use, with ``find_unused_parameters``), and the
    times in nanoseconds since the epoch: ``forward_compute_time_start``,
    ``backward_compute_time_start`` / ``_end`` (the last gradient),
    ``backward_comm_time_start`` (the first bucket launched) / ``_end`` (the
    last reduction waited for), their durations ``forward_compute_time``,
    ``backward_compute_time``, ``backward_comm_time``,
    ``backward_compute_comm_overlap_time``, and ``avg_`` of each duration over
    the sampled iterations.

``can_set_static_graph`` is written as torch writes it: once per process, by
the first model that logs it, into its own data. A model that searches for
unused parameters (without a static graph) logs ``0`` (and ``iteration``)
when the set of parameters its synchronised pass did not reach (those outside
the graph of its outputs) changes from one iteration to the next, after its
first; any model logs whether its graph stayed static when it is destroyed,
where no one reads it. So a live model reports it only if it is the process's
first to see its graph change (Lightning's ``.get`` otherwise gives ``None``).
Where torch finds the set at the forward, ddpkit finds it at the end of the
backward, and judges it at the next forward or read of the data: two models
whose graphs change in the same iteration may take the process's one logging
in another order than under torch.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.parallel.common.observer import (
    BucketEvent,
    Observer,
    ObserverHandle,
    WaitEvent,
)

__all__ = ["DEFAULT_SAMPLE_RATE", "DDPLogging"]

DEFAULT_SAMPLE_RATE = 100
"""torch's ``kDDPRuntimeLoggingSampleRate``: after the first 10 iterations, one in this many is sampled."""

# How torch's logger names element types (caffe2's type names).
_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
                torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int", torch.bool: "bool",
                torch.uint8: "unsigned char", torch.int8: "signed char", torch.int16: "short int",
                torch.complex64: "c10::complex<float>", torch.complex128: "c10::complex<double>"}
_ENV = {"master_port": "MASTER_PORT", "master_addr": "MASTER_ADDR",
        "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG", "cuda_visible_devices": "CUDA_VISIBLE_DEVICES"}
_BACKEND_ENV = {
    "gloo": {"gloo_socket_ifname": "GLOO_SOCKET_IFNAME", "gloo_device_transport": "GLOO_DEVICE_TRANSPORT"},
    "nccl": {"nccl_socket_ifname": "NCCL_SOCKET_IFNAME", "nccl_blocking_wait": "TORCH_NCCL_BLOCKING_WAIT",
             "nccl_async_error_handling": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "nccl_debug": "NCCL_DEBUG",
             "nccl_nthreads": "NCCL_NTHREADS", "nccl_ib_timeout": "NCCL_IB_TIMEOUT"},
}
_DURATIONS = {"forward_compute_time": ("forward_compute_time_start", "backward_compute_time_start"),
              "backward_compute_time": ("backward_compute_time_start", "backward_compute_time_end"),
              "backward_comm_time": ("backward_comm_time_start", "backward_comm_time_end"),
              "backward_compute_comm_overlap_time": ("backward_comm_time_start", "backward_compute_time_end")}


_GRAPH_STATIC_LOGGED: list[bool] = []
"""Whether a model of this process has logged ``can_set_static_graph`` (torch's process-wide once flag)."""


def _log_graph_static() -> bool:
    """Take the process's one logging of ``can_set_static_graph``: whether this call is the one."""
    if _GRAPH_STATIC_LOGGED:
        return False
    _GRAPH_STATIC_LOGGED.append(True)
    return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class DDPLogging(Observer):
    """The logging data of one ``DistributedDataParallel``; it observes the reducer in sampled iterations only."""

    judges_graph = True
    """Whether it takes part in torch's one logging of ``can_set_static_graph`` per process (see the notes)."""

    def __init__(self, ddp: Any) -> None:
        self._ddp = weakref.ref(ddp)  # not the wrapper itself: a cycle would keep it until a garbage collection
        self.strs: dict[str, str] = {}
        self.ints: dict[str, int] = {}
        self.sample_rate = DEFAULT_SAMPLE_RATE
        self.iterations = 0
        """Synchronised forwards so far (torch's ``num_iterations_``)."""
        self.recorded = 0
        self.times: dict[str, int] = {}
        self.buckets_reduced = 0
        self.handle: ObserverHandle | None = None
        self.graph_static = True
        """torch's ``ddp_graph_static_``: the set of unused parameters has not changed between iterations."""
        self._previous_unused: set[int] | None = None
        self._searches_seen = 0
        self._construction()
        if self.judges_graph:  # torch's logger logs it when destroyed (where no one reads it): the flag is taken
            weakref.finalize(self, _log_graph_static)

    @property
    def ddp(self) -> Any:
        """The ``DistributedDataParallel`` whose data this is."""
        return self._ddp()

    def _construction(self) -> None:
        ddp, reducer = self.ddp, self.ddp.reducer
        group = ddp.process_group
        backend = dist.get_backend(group) if group is not None else "undefined"
        params = reducer.params
        self.strs.update({
            "module_name": type(ddp.module).__name__, "backend_name": backend,
            "device_ids": ", ".join(str(d) for d in (ddp.device_ids or [])),
            "dtypes": ", ".join(sorted({_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params})),
            "bucket_sizes": ", ".join(str(n) for n in self._bucket_sizes()),
        })
        for key, name in {**_ENV, **_BACKEND_ENV.get(backend, {})}.items():
            self.strs[key] = os.environ.get(name, "N/A")  # torch's: set but empty is ""
        sync_bn = any(type(m).__name__ == "SyncBatchNorm" for m in ddp.module.modules())
        output = ddp.output_device
        self.ints.update({
            "world_size": ddp.world_size, "rank": dist.get_rank(group) if group is not None else 0,
            "output_device": -1 if output is None else int(getattr(output, "index", output) or 0),
            "broadcast_buffers": int(ddp.forward_sync_buffers), "has_sync_bn": int(sync_bn),
            "bucket_cap_bytes": ddp.bucket_bytes_cap, "find_unused_parameters": int(ddp.find_unused_parameters),
            "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
            "is_multi_device_module": int(ddp.is_multi_device_module),
            "num_parameter_tensors": len(params), "total_parameter_size_bytes": sum(_nbytes(p) for p in params),
            "iteration": 0,
        })
        if backend == "gloo":
            self.ints["gloo_num_threads"] = 2  # torch's default; ddpkit's groups keep it
        if ddp.static_graph:
            self.static_graph()

    def _bucket_sizes(self) -> list[int]:
        params = self.ddp.reducer.params
        return [sum(_nbytes(params[i]) for i in bucket) for bucket in self.ddp.reducer.layout.set.indices()]

    # -- what the wrapper tells it ---------------------------------------------

    def static_graph(self) -> None:
        self.ints["static_graph"] = 1

    def comm_hook(self, name: str) -> None:
        self.strs["comm_hook"] = name

    def uneven_input_join(self) -> None:
        self.ints["join_uneven_inputs"] = 1

    def set_sample_rate(self, rate: int) -> None:
        """torch's ``_set_ddp_runtime_logging_sample_rate``: after the first 10, one iteration in ``rate``."""
        if rate < 1:
            raise ValueError(f"DDP runtime logging sample rate should be equal or greater than 1 (got {rate})")
        self.sample_rate = rate

    def _sampled(self, iteration: int) -> bool:
        return iteration > 0 and (iteration <= 10 or iteration % self.sample_rate == 0)

    def _judge_graph(self) -> None:
        """torch's check, each iteration that searched for unused parameters (without a static graph): whether
        the set this rank did not use changed since the last, after the first iteration; the first change logs
        ``can_set_static_graph`` 0 with the iteration, if no model of this process logged it before."""
        ddp = self.ddp
        if ddp is None or not self.judges_graph or ddp.reducer.unused_searches == self._searches_seen:
            return
        reducer = ddp.reducer
        self._searches_seen = reducer.unused_searches
        if reducer.static_graph or not self.graph_static:
            return
        unused = set(reducer.unreached)
        if self.iterations > 1 and self._previous_unused is not None:  # (a forward without backward: not judged)
            self.graph_static = unused == self._previous_unused
            if not self.graph_static and _log_graph_static():
                self.ints["can_set_static_graph"] = 0
                self.ints["iteration"] = self.iterations
        self._previous_unused = unused

    def forward_start(self) -> None:
        """A synchronised forward begins: record the last sampled iteration, then time this one if sampled."""
        self._judge_graph()  # the last backward's (torch judges it at that backward's forward)
        if self._sampled(self.iterations):
            self._record()
        self.iterations += 1
        reducer = self.ddp.reducer
        if self._sampled(self.iterations):
            self.times = {"forward_compute_time_start": time.time_ns()}
            self.buckets_reduced = 0
            reducer.ready_order = []
            if self.handle is None:
                self.handle = reducer.add_observer(self)
        elif self.handle is not None:
            self.handle.remove()
            self.handle = None
            reducer.ready_order = None

    def forward_end(self) -> None:
        if self.handle is not None:
            self.times["backward_compute_time_start"] = time.time_ns()

    # -- what the reducer tells it, in sampled iterations ------------------------

    def on_bucket_ready(self, event: BucketEvent) -> None:
        self.times["backward_compute_time_end"] = time.time_ns()
        self.buckets_reduced += 1

    def on_launch(self, event: BucketEvent) -> None:
        self.times.setdefault("backward_comm_time_start", time.time_ns())

    def on_wait(self, event: WaitEvent) -> None:
        self.times["backward_comm_time_end"] = time.time_ns()
        ddp = self.ddp
        if ddp is None:  # the wrapper was dropped while a graph of its output still runs its reducer
            return
        if ddp.reducer.static_graph and event.step == 0:
            self.buckets_reduced = 0  # torch reduces a static graph's first backward all at once, uncounted

    def _record(self) -> None:
        """torch's ``set_runtime_stats_and_log``: the figures of the iteration sampled last."""
        reducer = self.ddp.reducer
        self.recorded += 1
        self.ints["iteration"] = self.iterations
        self.ints["unused_parameter_size"] = sum(_nbytes(reducer.params[i]) for i in reducer.unused_here)
        changed = self.ints.get("has_rebuilt_buckets", 0) != int(reducer.rebuilt)
        self.ints["has_rebuilt_buckets"] = int(reducer.rebuilt)
        if changed:
            self.strs["rebuilt_bucket_sizes"] = ", ".join(str(n) for n in self._bucket_sizes())
            self.strs["rebuilt_per_bucket_param_indices"] = ", ".join(
                " ".join(str(i) for i in bucket) for bucket in reducer.layout.set.indices())
        if reducer.ready_order:
            self.strs["prev_iteration_grad_ready_order_indices"] = ", ".join(str(i) for i in reducer.ready_order)
            reducer.ready_order = []
        self.ints["num_buckets_reduced"] = self.buckets_reduced
        times = self.times
        if "backward_comm_time_end" not in times:
            return  # no synchronised backward followed the sampled forward
        times.setdefault("backward_comm_time_start", times["backward_comm_time_end"])
        times.setdefault("backward_compute_time_end", times.get("backward_compute_time_start", 0))
        self.ints.update(times)
        for name, (start, end) in _DURATIONS.items():
            value = max(0, times.get(end, 0) - times.get(start, 0))
            self.ints[name] = value
            avg = self.ints.get(f"avg_{name}", 0)
            self.ints[f"avg_{name}"] = (avg * (self.recorded - 1) + value) // self.recorded

    def data(self) -> dict[str, Any]:
        """The dictionary torch's ``_get_ddp_logging_data()`` returns: strings, then integers."""
        self._judge_graph()
        return {**self.strs, **self.ints}


class ShardedLogging(DDPLogging):
    """The logging data of ``DistributedDataParallel(zero_stage=3)``: the construction figures (the units stand
    for the buckets) and the iteration count; no runtime figures, as stage 3 has no buckets to observe."""

    judges_graph = False

    def _bucket_sizes(self) -> list[int]:
        return [u.nbytes for u in self.ddp.reducer.units]

    def forward_start(self) -> None:
        self.iterations += 1
        self.ints["iteration"] = self.iterations

    def forward_end(self) -> None:
        pass
