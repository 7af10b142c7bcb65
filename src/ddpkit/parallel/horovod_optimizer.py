"""Horovod-style data parallelism: wrap the optimizer instead of the model.

``DistributedOptimizer(optimizer)`` returns an optimizer of the same class
(``isinstance`` holds, ``state_dict`` is the same) whose parameters' gradients
are all-reduced by ddpkit's reducer (:mod:`ddpkit.parallel.common.reducer`): in
buckets, launched as gradients become ready during backward, so that
communication overlaps the rest of backward as in DDP. The reductions run on
after ``backward()`` returns; ``step()`` (or ``synchronize()``) waits for them,
writes the averages into ``.grad`` and steps.

Definitions
-----------
pass
    One ``backward()`` that produced gradients for the optimizer's parameters.
    With ``backward_passes_per_step=k`` the first k-1 passes accumulate in
    ``.grad`` locally and the k-th launches the reduction.
pending
    From the first pass after a step until the next ``synchronize()``: the
    gradients are not final, and ``zero_grad()`` raises (Horovod's rule).

A difference from Horovod, on purpose: the wrapped optimizer shares the
original's state (Horovod builds a fresh one, silently dropping state loaded
before wrapping). Horovod's ``broadcast_parameters`` and
``broadcast_optimizer_state`` are in :mod:`ddpkit.parallel.common.broadcast`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.comm.bucket import GradBucket
from ddpkit.comm.compression import Compression
from ddpkit.parallel.common.broadcast import world_group
from ddpkit.parallel.common.bucket_caps import check_bucket_cap
from ddpkit.parallel.common.deferred import DeferredReducer
from ddpkit.parallel.common.observer import Observer, ObserverHandle
from ddpkit.parallel.common.replicas import verify_same_parameters

__all__ = ["DistributedOptimizer"]

OPS = ("avg", "sum")
HOROVOD_AVERAGE, HOROVOD_SUM, HOROVOD_ADASUM = 0, 1, 2
"""The values of Horovod's ``hvd.Average``, ``hvd.Sum`` and ``hvd.Adasum`` (its C++ ``ReduceOp``)."""


class _ScaledReduce:
    """Comm hook state: Horovod's reduction of one bucket (compress, pre-scale, sum, post-scale, decompress)."""

    def __init__(self, group: dist.ProcessGroup, compression: Any, prescale: float, postscale: float) -> None:
        self.group, self.compression, self.prescale, self.postscale = group, compression, prescale, postscale

    @staticmethod
    def hook(state: _ScaledReduce, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        sent, ctx = state.compression.compress(buffer)
        if state.prescale != 1.0:
            sent = sent.mul_(state.prescale)
        fut = dist.all_reduce(sent, group=state.group, async_op=True).get_future()

        def finish(f: torch.futures.Future) -> torch.Tensor:
            out = f.value()[0]
            if state.postscale != 1.0:
                out = out.mul_(state.postscale)
            return state.compression.decompress(out, ctx)

        return fut.then(finish)


def _check_compression(compression: Any) -> Any:
    if compression is None:
        return Compression.none
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError(
            f"compression={compression!r} is not a compressor: pass ddpkit.Compression.none, .fp16 or .bf16, "
            "or a class with compress(tensor) -> (tensor, ctx) and decompress(tensor, ctx) -> tensor"
        )
    return compression


def _check_groups(optimizer: torch.optim.Optimizer, num_groups: Any, groups: Any) -> None:
    """Horovod's ``num_groups`` / ``groups``, validated as Horovod does (they only shape message fusion)."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups={num_groups!r} must be an integer >= 0")
    if groups is None or (isinstance(groups, int) and not isinstance(groups, bool) and groups >= 0):
        return
    if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
        raise ValueError(f"groups={groups!r} must be an integer >= 0 or a list of lists of parameters")
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if any(not isinstance(p, torch.Tensor) or id(p) not in mine for g in groups for p in g):
        raise ValueError("groups: every entry must be a parameter of the optimizer")


def _named(optimizer: torch.optim.Optimizer, named_parameters: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) for every parameter of the optimizer that requires grad, in param-group order."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        names = {id(p): f"allreduce.noname.{i}" for i, p in enumerate(params)}
    else:
        named = list(named_parameters)
        if not all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in named):
            raise ValueError(
                "named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                "model.named_parameters()"
            )
        counts: dict[str, int] = {}
        for n, _ in named:
            counts[n] = counts.get(n, 0) + 1
        dups = sorted(n for n, c in counts.items() if c > 1)
        if dups:
            raise ValueError(f"parameter names in named_parameters must be unique; found duplicates: {', '.join(dups)}")
        names = {id(p): n for n, p in named}
        missing = [
            f"param_groups[{g}]['params'][{k}] (shape {list(p.shape)})"
            for g, group in enumerate(optimizer.param_groups) for k, p in enumerate(group["params"])
            if id(p) not in names
        ]
        if missing:
            raise ValueError(
                f"named_parameters was given, but {len(missing)} parameter(s) of the optimizer are not in it: "
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}. Pass the named_parameters() of "
                "the model the optimizer was built on (all of them), or leave named_parameters=None"
            )
    seen: set[int] = set()
    out = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((names[id(p)], p))
    return out


class _DistributedOptimizer(torch.optim.Optimizer):
    """The methods a :func:`DistributedOptimizer` adds to the wrapped optimizer's class."""

    reducer: DeferredReducer
    """The engine doing the all-reduces (the same as ``DistributedDataParallel.reducer``)."""

    def _setup(self, named: list[tuple[str, torch.Tensor]], passes: int, compression: Any, op: str,
               predivide: float, group: dist.ProcessGroup | None, bucket_cap_mb: float | None,
               sparse_as_dense: bool) -> None:
        self.backward_passes_per_step = passes
        self.op = op
        self.gradient_predivide_factor = predivide
        self.process_group = group
        self._passes = 0
        """Backward passes since the last synchronize()."""
        self._synchronized = False
        self._should_synchronize = True
        world = 1 if group is None else dist.get_world_size(group)
        self._alone = world == 1
        """A world of one: as Horovod at size 1 (no hooks), nothing is reduced or checked, gradients accumulate
        as under the plain optimizer."""
        if world > 1:
            verify_same_parameters(named, group, "DistributedOptimizer")
        reducer = DeferredReducer(named, process_group=group, bucket_cap_mb=bucket_cap_mb, reduce_missing=True,
                                  sparse_as_dense=sparse_as_dense, owner="DistributedOptimizer")
        compression = _check_compression(compression)
        if op == "sum":
            reducer.div_factor = 1
        if group is not None and (compression is not Compression.none or predivide != 1.0):
            # Horovod's split of the average: sum(g / f) * f / world.
            post = predivide / world if op == "avg" else 1.0
            reducer.register_comm_hook(_ScaledReduce(group, compression, 1.0 / predivide, post), _ScaledReduce.hook)
        reducer.on_local_backward = self._end_of_local_pass
        reducer.on_overrun = self._overrun
        self.reducer = reducer
        self._arm_if_last_pass()

    # -- passes ----------------------------------------------------------------

    def _arm_if_last_pass(self) -> None:
        if not self._alone and self._passes == self.backward_passes_per_step - 1:
            self.reducer.prepare_for_backward()

    def _end_of_local_pass(self) -> None:
        self._passes += 1
        self._arm_if_last_pass()

    def _overrun(self, name: str) -> None:
        raise AssertionError(
            f"DistributedOptimizer: gradients were computed more than backward_passes_per_step="
            f"{self.backward_passes_per_step} times before step() (parameter {name!r} got another one while "
            "the last pass's all-reduce is in flight). Call step() or synchronize() after every "
            f"{self.backward_passes_per_step} backward pass(es), or raise backward_passes_per_step to "
            "accumulate more gradients locally"
        )

    def register_observer(self, observer: Observer) -> ObserverHandle:
        """Call ``observer`` at the engine's events, as :meth:`ddpkit.DistributedDataParallel.register_observer`."""
        return self.reducer.add_observer(observer)

    def _pending(self) -> bool:
        return not self._alone and (self._passes > 0 or self.reducer.in_flight)

    # -- Horovod's API ---------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for the gradient all-reduces and leave the averages in ``.grad``.

        Reduces whatever ``.grad`` holds when fewer than
        ``backward_passes_per_step`` passes ran (parameters without a gradient
        count as zeros and get the average, as in Horovod). Every rank must
        call it (or ``step()``) the same number of times.
        """
        if not self._alone:
            self.reducer.launch_now()
            self.reducer.complete()
        self._passes = 0
        self._arm_if_last_pass()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside does not synchronise: for steps after an explicit ``synchronize()``.

        Example::

            loss.backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                opt.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Synchronise (unless inside :meth:`skip_synchronize`), then step.

        A ``closure`` (LBFGS's, or ``step(closure)`` of any optimizer) synchronises after each of its calls: its
        backward's gradients are the ones the step uses (Horovod synchronises before calling it, and each rank
        steps on its own gradients).
        """
        if closure is not None and self._should_synchronize:
            closure = self._synchronizing(closure)
            if not self._pending():  # nothing reduced before it: the closure's backward is the step's
                return self._step_now(closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(): the gradients are all-reduced a second time, which costs "
                    "time. Use `with optimizer.skip_synchronize(): optimizer.step()` after synchronize()",
                    stacklevel=2,
                )
            self.synchronize()
        return self._step_now(closure)

    def _step_now(self, closure: Any) -> Any:
        try:
            return super().step(closure)
        finally:
            self._synchronized = False

    def _synchronizing(self, closure: Any) -> Any:
        def closure_then_synchronize() -> Any:
            loss = closure()
            self.synchronize()
            return loss

        return closure_then_synchronize

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As the wrapped optimizer's; a ``synchronize()`` before it no longer counts (Horovod's rule)."""
        super().load_state_dict(state_dict)
        self._synchronized = False
        self._should_synchronize = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending():
            raise AssertionError(
                "DistributedOptimizer: optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). The gradients' all-reduce is still pending "
                "(it may be writing into .grad right now), so clearing them would race with it and leave "
                "the ranks with different gradients. Call zero_grad() before backward (or after step())"
            )
        super().zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "DistributedOptimizer: add_param_group() after wrapping is not supported (the new "
            "parameters' gradients would never be all-reduced): add the group to the optimizer first, "
            "then wrap it with ddpkit.DistributedOptimizer"
        )


def DistributedOptimizer(  # noqa: N802 - Horovod's name for a factory that returns an optimizer
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Any = None,
    backward_passes_per_step: int = 1,
    op: str | int = "avg",
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    *,
    process_group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Args:
        optimizer: any ``torch.optim.Optimizer``; the result is an instance of
            its class and shares its parameter groups and state.
        named_parameters: ``model.named_parameters()``: names every parameter
            (in errors and the stall inspector); each of the optimizer's
            parameters must be in it. Default: numbered names.
        compression: ``ddpkit.Compression.none`` (default), ``.fp16``, ``.bf16``
            or a Horovod-style compressor class.
        backward_passes_per_step: backward passes accumulated locally in
            ``.grad`` per step; the last one is reduced. Default 1.
        op: ``"avg"`` (default) or ``"sum"`` over ranks; Horovod's values
            ``hvd.Average`` (0) and ``hvd.Sum`` (1) are accepted too.
        gradient_predivide_factor: with ``"avg"``, divide by this before the
            sum and by ``world_size / factor`` after (Horovod's split, for
            low-precision range). Default 1: divide by the world size first.
        num_groups: Horovod's count of fused groups of all-reduces. It only
            changes how messages are fused, never a result; ddpkit fuses by
            bucket size (``bucket_cap_mb``), so it is checked and has no other
            effect.
        groups: Horovod's explicit grouping (lists of parameters); checked,
            as ``num_groups``, and otherwise without effect.
        sparse_as_dense: turn sparse gradients (``nn.Embedding(sparse=True)``)
            dense before reducing them, as Horovod's option does; ``.grad``
            then holds the dense average. Without it a sparse gradient is an
            error naming the parameter.
        process_group: the group to reduce over; default the world.
        bucket_cap_mb: bucket size cap in MiB, as in ``DistributedDataParallel``:
            default 25 with a first bucket of 1 MiB; a value given caps the
            first bucket too.

    Returns:
        The distributed optimizer.

    Raises:
        TypeError: not an optimizer; a compression without compress/decompress.
        ValueError: a bad argument, a parameter missing from
            ``named_parameters``, the ranks' parameters differ.
        AssertionError: from ``zero_grad()`` between backward and step, and
            from a backward beyond ``backward_passes_per_step`` (Horovod's types).

    Example::

        opt = ddpkit.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters())
        ddpkit.broadcast_parameters(model.state_dict(), root_rank=0)
        ddpkit.broadcast_optimizer_state(opt, root_rank=0)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()   # all-reduces start during backward
            opt.step()                         # waits for them, then steps
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer: wrap it once")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be an integer >= 1")
    if not isinstance(op, bool) and isinstance(op, int):
        if op == HOROVOD_ADASUM:
            raise ValueError(f"op={op} (Horovod's Adasum) is not implemented: use 'avg' or 'sum'")
        op = {HOROVOD_AVERAGE: "avg", HOROVOD_SUM: "sum"}.get(op, op)
    if op not in OPS:
        raise ValueError(f"op={op!r} is not supported: choose one of {', '.join(OPS)} (Adasum is not implemented)")
    _check_groups(optimizer, num_groups, groups)
    if not (isinstance(gradient_predivide_factor, (int, float)) and gradient_predivide_factor > 0):
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} must be a positive number")
    if gradient_predivide_factor != 1.0 and op != "avg":
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} is only supported with op='avg'")
    check_bucket_cap(bucket_cap_mb)
    named = _named(optimizer, named_parameters)
    if not named:
        raise ValueError("DistributedOptimizer: the optimizer has no parameter that requires grad")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # the same param groups, state and hooks
    for name in ("step", "zero_grad"):
        # Not a method of the instance's own: an LR scheduler made before wrapping puts a `step` there that steps
        # the original optimizer, without the all-reduce. As under Horovod (a new optimizer over the same groups),
        # the scheduler still sets the rates, and at its first step warns that it saw no optimizer.step().
        wrapped.__dict__.pop(name, None)
    # Not patched for step hooks: the wrapped class's own step (which ours calls) runs them, once per step.
    wrapped._setup(named, backward_passes_per_step, compression, op, float(gradient_predivide_factor),
                   world_group(process_group), bucket_cap_mb, bool(sparse_as_dense))
    return wrapped
