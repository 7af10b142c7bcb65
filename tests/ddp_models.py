"""Small models and a step loop shared by the DDP engine's tests (ddpkit vs torch oracles)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddpkit


class ConvBN(nn.Module):
    """Convolutions and BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv1(x)))
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class EmbedTied(nn.Module):
    """Embedding, LayerNorm, a frozen layer, and an output layer tied to the embedding."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.norm(self.emb(x))))
        return self.out(h).mean(1)


class Branchy(nn.Module):
    """``used`` always takes part; ``sometimes`` and ``never`` only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(5, 3)
        self.sometimes = nn.Linear(5, 3)
        self.never = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, branch: bool = False, never: bool = False) -> torch.Tensor:
        out = self.used(x) + self.never(x) if never else self.used(x)
        return out + self.sometimes(x) if branch else out


class Plain(nn.Module):
    """No BatchNorm: the per-rank mean of losses equals the global-batch loss."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.norm = nn.LayerNorm([3, 8, 8])
        self.fc = nn.Linear(3 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.norm(self.conv(x))).flatten(1))


class Wide(nn.Module):
    """A layer over 64 KB (its gradient is copied into the bucket the moment it is ready) and a small one."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(8 * 8, 300)
        self.out = nn.Linear(300, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.wide(x.flatten(1))))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "convbn": ConvBN, "embed": EmbedTied, "branchy": Branchy, "plain": Plain, "wide": Wide,
}


class SparseEmbeddings(nn.Module):
    """Two embeddings with sparse gradients (one an EmbeddingBag) and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.bag = nn.EmbeddingBag(30, 8, sparse=True, mode="sum")
        self.lin = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.emb(x).mean(1)
        return self.lin(h if y is None else h + self.bag(y))


_SERIAL_GROUPS: dict[int, Any] = {}


def torch_sparse_group() -> Any:
    """A gloo group of every rank that runs one collective at a time, for torch's DDP on :class:`SparseEmbeddings`.

    torch's reducer launches a sparse bucket's all-reduce while the others run, and gloo's sparse all-reduce
    corrupts the heap when another collective of its group runs beside it (torch 2.13, two threads per gloo group:
    ``malloc(): unaligned tcache chunk detected`` in about one run in a thousand of these tests, and within seconds
    under a loop of overlapping ones; with one thread, none in 6,000). The reference runs unchanged, its
    collectives in the order it starts them; the corrupted heap no longer takes the worker (and the next test) down.
    Created once per worker process: every rank calls it in the same job.
    """
    world = dist.get_world_size()
    if world not in _SERIAL_GROUPS:
        options = dist.ProcessGroupGloo._Options()
        options._threads = 1
        _SERIAL_GROUPS[world] = dist.new_group(backend="gloo", pg_options=options)
    return _SERIAL_GROUPS[world]

def batch(name: str, seed: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic inputs and class targets for model ``name``."""
    g = torch.Generator().manual_seed(seed)
    if name == "embed":
        return torch.randint(0, 11, (n, 4), generator=g), torch.randint(0, 11, (n,), generator=g)
    if name == "branchy":
        return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)
    if name == "plain":
        return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def make(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def train(model: nn.Module, name: str, steps: int, momentum: float, forward_kw: Callable[[int], dict] | None = None,
          micro: int = 1, seed0: int = 1000) -> nn.Module:
    """``steps`` SGD steps on this rank's data; ``micro`` > 1 accumulates under no_sync."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(name, seed0 + 100 * step + 10 * rank + m)
            kw = forward_kw(step) if forward_kw else {}
            ctx = model.no_sync() if m < micro - 1 else _null()
            with ctx:
                loss = nn.functional.cross_entropy(model(x, **kw), y)
                loss.backward()
        opt.step()
    return model


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def pair(name: str, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """The same model (seed 0 on every rank) in ddpkit's DDP and torch's DDP."""
    base = make(name)
    return ddpkit.DDP(copy.deepcopy(base), **kwargs), TorchDDP(copy.deepcopy(base), **kwargs)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, gradients and buffers of the plain module, detached copies."""
    m = ddpkit.unwrap(model)
    out = {k: v.detach().clone() for k, v in m.state_dict().items()}
    out.update({f"{k}.grad": p.grad.clone() for k, p in m.named_parameters() if p.grad is not None})
    return out
