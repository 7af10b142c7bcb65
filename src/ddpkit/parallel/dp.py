"""``DataParallel``: one process, the batch split across devices, one thread per replica.

Each forward:

1. scatters the inputs along ``dim``: every tensor in ``args`` and ``kwargs``
   (inside tuples, lists and dicts too) is cut into one chunk per device
   (``torch.chunk``'s sizes; a batch smaller than the devices uses fewer
   replicas); anything else is passed to every replica as it is;
2. replicates the module onto each device: the parameters are differentiable
   copies of the originals (the originals themselves on ``device_ids[0]``),
   so gradients flow back into the original module and a plain optimizer on
   ``model.parameters()`` trains it;
3. runs the replicas in parallel threads, each with the caller's grad mode
   and autocast state;
4. gathers the outputs (same nesting) onto ``output_device`` along ``dim``: tensors (scalars stacked, with
   torch's warning), None, and tuples, lists, dicts, namedtuples and dataclasses of them; any other value (an
   int, a string) is refused by name, as torch's gather fails on it.

Buffers: the first replica shares the module's own buffers, so its updates
(BatchNorm's running statistics) are kept; the other replicas work on copies
and their updates are lost, as torch documents for its DataParallel.

Why DistributedDataParallel is faster: this re-replicates the model at every
step, its threads share one Python interpreter (the GIL), and the outputs
and gradients all pass through the first device; DDP keeps one process per
device and only exchanges gradients.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ddpkit.parallel.common.scatter import gather, scatter

__all__ = ["DataParallel"]


def _as_device(d: int | str | torch.device) -> torch.device:
    if isinstance(d, int):
        return torch.device("cuda", d)
    return torch.device(d)


def _find_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(_find_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_find_tensor(v) for v in obj)
    return False


def _replicate(module: nn.Module, device: torch.device, first: bool) -> nn.Module:
    """A shallow copy of the module tree whose tensors live on ``device``, differentiably."""
    memo: dict[int, nn.Module] = {}

    def copy(m: nn.Module) -> nn.Module:
        if id(m) in memo:  # a module used twice stays one module
            return memo[id(m)]
        r = m.__new__(type(m))
        r.__dict__ = m.__dict__.copy()
        # .to() keeps autograd's link to the original parameter (it is the
        # parameter itself on its own device), so gradients reach it.
        r._parameters = {k: None if p is None else p.to(device) for k, p in m._parameters.items()}
        r._buffers = {
            k: None if b is None else (b.to(device) if first else b.to(device, copy=True))
            for k, b in m._buffers.items()
        }
        memo[id(m)] = r
        r._modules = {k: None if c is None else copy(c) for k, c in m._modules.items()}
        return r

    return copy(module)


def _run(replicas: list[nn.Module], pieces: list[tuple[tuple, dict]], devices: list[torch.device]) -> list[Any]:
    """Each replica's forward in its own thread, with the caller's grad mode and autocast."""
    grad_enabled = torch.is_grad_enabled()
    autocast = {t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in {d.type for d in devices}}
    results: list[Any] = [None] * len(replicas)
    errors: list[tuple[int, BaseException] | None] = [None] * len(replicas)

    def work(i: int) -> None:
        device = devices[i]
        enabled, dtype = autocast[device.type]
        try:
            with torch.set_grad_enabled(grad_enabled), torch.autocast(device.type, dtype=dtype, enabled=enabled):
                if device.type == "cuda":
                    with torch.cuda.device(device):
                        results[i] = replicas[i](*pieces[i][0], **pieces[i][1])
                else:
                    results[i] = replicas[i](*pieces[i][0], **pieces[i][1])
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors[i] = (i, e)

    threads = [threading.Thread(target=work, args=(i,), name=f"ddpkit-dp-replica{i}") for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for failure in errors:
        if failure is not None:
            i, e = failure
            message = f"in DataParallel replica {i} on {devices[i]}: {type(e).__name__}: {e}"
            try:
                wrapped = type(e)(message)
            except Exception:  # noqa: BLE001 - an exception type with another signature
                wrapped = RuntimeError(message)
            raise wrapped from e
    return results


class DataParallel(nn.Module):
    """Split each batch across devices in one process (see the module docstring).

    Args:
        module: the model, on ``device_ids[0]``.
        device_ids: the devices (CUDA indices, ``torch.device`` or strings such
            as ``"cpu"``). Default: every visible GPU; with none, the module
            runs unwrapped (GPU ids given on a machine without GPUs are
            ignored, as torch ignores them). A list of CPU devices
            (``["cpu", "cpu"]``) runs that many replicas in threads on the CPU.
        output_device: where outputs are gathered; default ``device_ids[0]``.
        dim: the batch dimension to split and gather along. Default 0.

    Raises:
        ValueError: the module's parameters or buffers are not on
            ``device_ids[0]``; an input has nothing to split (empty batch, a
            0-d tensor); no input holds a tensor.

    Warning:
        Buffer updates made by replicas other than the first are lost.

    Example::

        model = ddpkit.DataParallel(net, device_ids=["cpu", "cpu"])
        loss_fn(model(x), y).backward()      # gradients land in net's parameters
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[int | str | torch.device] | None = None,
                 output_device: int | str | torch.device | None = None, dim: int = 0) -> None:
        super().__init__()
        self.module = module
        self.dim = dim
        if device_ids is None:
            device_ids = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        self.device_ids = [_as_device(d) for d in device_ids]
        if not torch.cuda.is_available() and any(d.type == "cuda" for d in self.device_ids):
            # torch's rule: on a machine without GPUs DataParallel ignores GPU device ids and runs the module.
            self.device_ids, output_device = [], None
        self.output_device = (_as_device(output_device) if output_device is not None
                              else self.device_ids[0] if self.device_ids else None)
        if self.device_ids:
            self._check_on_source()

    def _check_on_source(self) -> None:
        src = self.device_ids[0]
        for name, t in [*self.module.named_parameters(), *self.module.named_buffers()]:
            if t.device != src and not (src.type == "cuda" and src.index is None and t.device.type == "cuda"):
                raise ValueError(
                    f"DataParallel: module's {name!r} is on {t.device}, but device_ids[0] is {src}: "
                    f"move the module there first (module.to({str(src)!r}))"
                )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.device_ids:
            return self.module(*args, **kwargs)
        self._check_on_source()
        if not _find_tensor((args, kwargs)):
            raise ValueError(
                "DataParallel: no input holds a tensor, so there is no batch to split: pass the batch "
                "as a tensor (or call the module itself)"
            )
        arg_pieces = scatter(tuple(args), self.device_ids, self.dim)
        kwarg_pieces = scatter(dict(kwargs), self.device_ids, self.dim) if kwargs else [{}] * len(arg_pieces)
        n = min(len(arg_pieces), len(kwarg_pieces))
        pieces = list(zip(arg_pieces[:n], kwarg_pieces[:n]))
        devices = self.device_ids[:n]
        if len(self.device_ids) == 1:
            return self.module(*pieces[0][0], **pieces[0][1])
        replicas = [_replicate(self.module, d, first=i == 0) for i, d in enumerate(devices)]
        return gather(_run(replicas, pieces, devices), self.output_device, self.dim)
