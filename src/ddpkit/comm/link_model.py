"""The link as ``comm="auto"`` measures it, and the cost model that predicts each reduction's time over it.

:func:`probe_link` times all-reduces of growing sizes over the group (every rank takes part; the slowest rank's
times count): the bandwidth from the large ones, the latency from the small ones, and this machine's rate of
PowerSGD's products. :func:`predict` adds up each bucket's collectives (their latency and bytes) and products under
a :class:`~ddpkit.comm.schemes.Scheme`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.comm.schemes import Scheme

__all__ = ["PROBE_LIMIT_S", "Link", "fit_link", "predict", "probe_link", "slowest"]

PROBE_LIMIT_S = 0.25
"""The probe's sizes grow (4 KiB to 64 MiB, by 4) until one all-reduce takes this long."""


@dataclass(frozen=True)
class Link:
    """The link as the group's all-reduce sees it: ``seconds = latency_s + bytes * seconds_per_byte`` (the slowest
    rank's times), and this machine's matrix-product rate (PowerSGD's cost)."""

    latency_s: float
    seconds_per_byte: float
    flops_per_s: float
    world: int

    @property
    def bandwidth(self) -> float:
        """Bytes a second that an all-reduce moves (the payload's, not the wire's)."""
        return 1 / self.seconds_per_byte if self.seconds_per_byte > 0 else float("inf")

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte

    def describe(self) -> str:
        if self.world == 1:
            return "no link (a world of one)"
        bw = self.bandwidth
        rate = "unbounded" if bw == float("inf") else (f"{bw / 1e9:.2f} GB/s" if bw >= 1e9 else f"{bw / 1e6:.1f} MB/s")
        return f"all-reduce {rate}, latency {self.latency_s * 1e6:.0f} us over {self.world} ranks"


def _timed_all_reduces(group: Any, device: torch.device, nbytes: int, reps: int) -> list[float]:
    t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    dist.all_reduce(t, group=group)  # warm: the connection and the buffers
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(t, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def slowest(values: Sequence[float], group: Any, device: torch.device) -> list[float]:
    """Each value's maximum over the group: every rank then decides from the same numbers."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _matmul_rate(device: torch.device) -> float:
    """Floating-point operations a second of a float32 product the size of a PowerSGD factor's."""
    a = torch.randn(512, 512, device=device)
    b = torch.randn(512, 8, device=device)
    torch.mm(a, b)
    reps, start = 20, time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * 512 * 512 * 8 * reps / max(time.perf_counter() - start, 1e-9)


def probe_link(group: Any = None, device: torch.device | None = None, reps: int = 5,
               most_bytes: int | None = None) -> Link:
    """Time all-reduces of 4 KiB, 16 KiB, ... (until one takes :data:`PROBE_LIMIT_S`, at most 64 MiB) over the
    group, ``reps`` of each, and fit the slowest rank's times with :func:`fit_link`. ``most_bytes``: the largest
    message that matters (a model's largest bucket): the sizes stop at the first that reaches it (4 MiB at
    least, so that two sizes of 1 MiB and more give the bandwidth). Every rank of the group must call it at once
    (a series of collectives, with the same ``most_bytes``); all get the same :class:`Link`."""
    group = group if group is not None else dist.group.WORLD
    device = device if device is not None else torch.device("cpu")
    world = dist.get_world_size(group)
    if world == 1:  # one rank's all-reduce moves nothing: there is no link
        return Link(latency_s=0.0, seconds_per_byte=0.0, flops_per_s=_matmul_rate(device), world=1)
    sizes, medians, fastest = [], [], []
    size = 4096
    while size <= 64 << 20:
        times = _timed_all_reduces(group, device, size, reps)
        median, low = slowest([statistics.median(times), min(times)], group, device)
        sizes.append(size)
        medians.append(median)
        fastest.append(low)
        if median >= PROBE_LIMIT_S or (most_bytes is not None and size >= max(4 << 20, most_bytes)):
            break
        size *= 4
    rate = -slowest([-_matmul_rate(device)], group, device)[0]  # the slowest rank's rate
    latency, per_byte = fit_link(sizes, medians, fastest)
    return Link(latency_s=latency, seconds_per_byte=per_byte, flops_per_s=rate, world=world)


def fit_link(sizes: Sequence[int], medians: Sequence[float], fastest: Sequence[float]) -> tuple[float, float]:
    """The latency and the seconds a byte of a link from a probe's sizes (bytes, growing, the first 64 KiB or
    less) and each size's median and fastest time.

    The latency is the smallest time of a message of 64 KiB or less (noise on a small message only adds, so its
    fastest repetition is the truest; a shaped link's burst lets a small message through at the line's rate, so
    its bytes' share at the sustained rate is not taken off). The seconds a byte are the larger of the
    least-squares slope of the medians over the sizes of 1 MiB and more (all of them when none reached 1 MiB) and
    the largest message's own time less the latency, a byte: with two or three large sizes, one median that a
    retransmission or a busy machine lengthened tilts the slope (at 100 Mbit/s the probe stops at 4 MiB, and a
    1 MiB median lengthened to just under :data:`PROBE_LIMIT_S` cuts the two-point slope to a third of the
    rate, the reductions' cost with it), while the largest message, with the most bytes, is the least moved by
    any one delay.

    Raises:
        ValueError: not one median and one fastest time per size, sizes not positive and growing, or a first
            size above 64 KiB (no latency to read).
    """
    if not sizes or len(sizes) != len(medians) or len(sizes) != len(fastest) or sizes[0] > 64 << 10 or \
            sizes[0] <= 0 or any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"fit_link: sizes {list(sizes)} with {len(medians)} medians and {len(fastest)} fastest "
                         "times: one of each per size, the sizes positive and growing, the first 64 KiB or less")
    latency = min(t for x, t in zip(sizes, fastest) if x <= 64 << 10)
    big = [(x, y) for x, y in zip(sizes, medians) if x >= 1 << 20] or list(zip(sizes, medians))
    mean_x, mean_y = statistics.fmean(x for x, _ in big), statistics.fmean(y for _, y in big)
    var = sum((x - mean_x) ** 2 for x, _ in big)
    slope = max(sum((x - mean_x) * (y - mean_y) for x, y in big) / var, 0.0) if var else mean_y / mean_x
    largest, its_time = big[-1]
    return latency, max(slope, max(its_time - latency, 0.0) / largest)


def predict(scheme: Scheme, link: Link, buckets: Sequence[Sequence[torch.Size]], element_size: int = 4,
            min_compression_rate: float = 2) -> float:
    """Seconds a step spends reducing ``buckets`` (each a list of its gradients' shapes) with ``scheme`` over
    ``link``, one bucket after the other: each collective's latency and bytes, and PowerSGD's products."""
    total = 0.0
    for shapes in buckets:
        numel = sum(s.numel() for s in shapes)
        if scheme.name == "none":
            total += link.seconds(numel * element_size)
        elif scheme.name in ("fp16", "bf16"):
            total += link.seconds(numel * min(2, element_size))
        else:
            plain, ps, qs, flops = 0, 0, 0, 0.0
            r = scheme.rank
            for s in shapes:
                rows = s[0] if len(s) else 1
                cols = s.numel() // rows if rows else 0
                if len(s) >= 2 and (rows + cols) * r * min_compression_rate < rows * cols:
                    ps, qs = ps + rows * r, qs + cols * r
                    flops += 2 * rows * cols * r * 3 + 2 * rows * r * r  # P = MQ, Q = M^T P, M = P Q^T, P's QR
                else:
                    plain += s.numel()
            total += link.seconds(plain * element_size) + link.seconds(ps * element_size)
            total += link.seconds(qs * element_size) + flops / link.flops_per_s
    return total
