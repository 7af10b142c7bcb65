"""``GradBucket``: one bucket of gradients as a comm hook sees it.

The reducer (:mod:`ddpkit.parallel.common.reducer`) fills buckets during backward and
hands each to the registered hook; hooks (:mod:`ddpkit.comm.bucket_hooks`, or torch's
own) only read and write through the methods below. It lives in ``comm`` so
that hooks, which sit below the engine, never import the engine.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CommHook", "CommHookSignatureError", "GradBucket", "check_hook_fits", "check_hook_future",
           "check_hook_signature", "check_new_hook"]

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]
"""``hook(state, bucket) -> Future[Tensor]``: reduces one bucket."""


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory without gaps or overlaps, in some order of its dims."""
    expected = 1
    for size, stride in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


class GradBucket:
    """One bucket as a comm hook sees it.

    Offers the methods of ``torch.distributed.GradBucket`` that hooks use, so
    torch's built-in hooks (``allreduce_hook``, ``fp16_compress_hook``,
    ``bf16_compress_hook``, the compress wrappers) run on ddpkit unchanged.
    """

    def __init__(self, index: int, params: list[torch.Tensor], indices: list[int], sparse: bool = False,
                 materialize: bool = True) -> None:
        self._index = index
        self.params = params
        """The bucket's parameters, in bucket order (the engine's list; hooks use :meth:`parameters`)."""
        self.indices = indices
        """Indices of the bucket's parameters in the reducer's parameter list."""
        self.sparse = sparse
        """A bucket of one parameter whose gradient is sparse (``nn.Embedding(sparse=True)``): it has no memory
        of its own, the gradient itself is reduced (torch's rule)."""
        self.numel = 0 if sparse else sum(p.numel() for p in params)
        """Elements of the bucket's gradients."""
        numel = self.numel if materialize else 0
        self.flat = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        """The bucket's own memory; reduced results always end up here (empty for a sparse bucket, and for a
        bucket made with ``materialize=False``, whose engine gives it memory only while it is reduced)."""
        self.views: list[torch.Tensor] = []
        """Each parameter's place in the bucket, with the parameter's strides where its memory is dense (as
        torch's reducer lays them out: a channels_last weight's gradient is copied in memory order, and under
        ``gradient_as_bucket_view`` ``.grad`` keeps the parameter's layout)."""
        offset = 0
        for p in [] if sparse or not materialize else params:
            self.views.append(self.flat.as_strided(p.shape, p.stride(), offset) if _dense(p)
                              else self.flat[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        self._buffer = self.flat
        self.target = self.flat
        """Where the reduced result must end up: ``flat``, a sparse bucket's gradient itself, or a joined rank's
        zeros (a shadow step)."""
        self.last = False
        """Whether the bucket is launched last in an iteration (:meth:`is_last`)."""
        self.pending = len(params)
        self.staged: set[int] = set()
        """Positions already copied into the bucket in this backward (the reducer's bookkeeping)."""
        self.work: Any = None
        self.future: torch.futures.Future | None = None

    def index(self) -> int:
        """The bucket's index; bucket 0 is launched first."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D tensor to reduce (the gradients, concatenated)."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the tensor :meth:`buffer` returns (compression wrappers do this)."""
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient, as a view into the bucket's memory.

        As torch's ``GradBucket.gradients()``: each parameter's stretch of the
        current :meth:`buffer` viewed in the parameter's shape with contiguous
        strides (for a channels_last parameter that is its memory order read as
        if contiguous).
        """
        if self.sparse:
            return [self.target]
        # The buffer as it is now (torch's rule): the flat bucket, a joined rank's zeros in its place (a shadow
        # step), or what a compression wrapper's set_buffer() put there (half-precision views for the hook it wraps).
        source = self._buffer.reshape(-1)
        pieces, offset = [], 0
        for view in self.views:  # made on each call, as torch's are
            pieces.append(source[offset : offset + view.numel()].view(view.shape))
            offset += view.numel()
        return pieces

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in bucket order."""
        return list(self.params)

    def is_last(self) -> bool:
        """Whether this is the last bucket launched in an iteration."""
        return self.last


class CommHookSignatureError(KeyError, ValueError):
    """A comm hook without a parameter named ``bucket``: a ``KeyError`` as torch raises, and a ``ValueError``."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def check_new_hook(current: CommHook | None, hook: Any) -> None:
    """torch's rules for registering ``hook`` where ``current`` is already registered (or ``None``)."""
    if current is not None:
        raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once. (torch's "
                           "rule: one comm hook per model; to combine two, call one from the other)")
    if not callable(hook):
        raise TypeError(f"comm hook {hook!r} is not callable: pass hook(state, bucket) -> Future")


def check_hook_signature(hook: Callable[..., Any]) -> None:
    """torch's checks of a comm hook's signature, with messages that say what to change."""
    try:
        sig = inspect.signature(hook, eval_str=True)  # string annotations (``from __future__ import annotations``)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to read
    except Exception:  # noqa: BLE001 - an annotation that does not evaluate: read the names only
        sig = inspect.signature(hook)
    if "bucket" not in sig.parameters:
        raise CommHookSignatureError(
            f"comm hook {getattr(hook, '__name__', hook)!r} has no parameter named 'bucket' (torch looks it up by "
            "name): define it as hook(state, bucket)"
        )
    annotation = sig.parameters["bucket"].annotation
    if annotation is not inspect.Parameter.empty and annotation not in (dist.GradBucket, GradBucket) \
            and not isinstance(annotation, str):
        raise ValueError(f"Communication hook: bucket annotation should be dist.GradBucket, not {annotation!r}")
    returned = sig.return_annotation
    if returned is not inspect.Signature.empty and returned != torch.futures.Future[torch.Tensor] \
            and not isinstance(returned, str):
        raise ValueError(f"Communication hook: return annotation should be torch.futures.Future[torch.Tensor], "
                         f"not {returned!r}")


_TORCH_POWERSGD_MODULE = "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook"


def _torch_powersgd(hook: Any, depth: int = 2) -> Any:
    """torch's PowerSGD hook, when ``hook`` is it or wraps it (``fp16_compress_wrapper(powerSGD_hook)``), else None."""
    if getattr(hook, "__module__", None) == _TORCH_POWERSGD_MODULE:
        return hook
    for cell in (getattr(hook, "__closure__", None) or ()) if depth else ():
        try:
            if (found := _torch_powersgd(cell.cell_contents, depth - 1)) is not None:
                return found
        except ValueError:  # an empty cell
            continue
    return None


def check_hook_fits(hook: CommHook, group: Any, buckets: int, device: torch.device) -> None:
    """Before a backward's first bucket goes to ``hook``: refuse torch's PowerSGD hooks where they deadlock.

    torch's ``powerSGD_hook`` waits for each of its all-reduces inside the callback of the one before, which gloo
    runs on its own thread: with several buckets in flight that thread waits for work queued behind itself, and
    the job hangs with no timeout (torch's DDP aborts on a collective mismatch instead). NCCL, with the buckets
    on the GPU, runs it.
    """
    powersgd = _torch_powersgd(hook) if buckets > 1 and group is not None else None
    if powersgd is None:
        return
    backend = str(dist.get_backend(group))
    if device.type == "cuda" and "nccl" in backend:
        return
    raise RuntimeError(
        f"torch's {getattr(powersgd, '__name__', 'PowerSGD hook')} deadlocks on {backend} (tensors on "
        f"{device.type}) with more than one bucket "
        f"(this model has {buckets}): it waits for its next all-reduce inside the callback of the one before, on "
        "the backend's own thread. Register ddpkit.hooks.powersgd_hook with the same state (it takes torch's "
        "PowerSGDState and computes torch's bits), or give bucket_cap_mb large enough for one bucket"
    )


def check_hook_future(hook: CommHook, future: Any, bucket: GradBucket) -> torch.futures.Future:
    """``future``, what ``hook`` returned for ``bucket``, if it is a future (torch's, or a collective's own).

    Raises:
        RuntimeError: anything else, naming the hook and the bucket (torch crashes, or fails deep in its reducer).
    """
    if not isinstance(future, torch._C.Future):
        name = getattr(hook, "__qualname__", None) or repr(hook)
        raise RuntimeError(
            f"comm hook {name} returned {type(future).__name__} for bucket {bucket.index()}; a comm hook "
            "must return a torch.futures.Future object holding the reduced bucket, e.g. "
            "dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])"
        )
    return future

