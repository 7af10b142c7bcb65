"""The self-test: ranks of this machine run what ddpkit does, on each backend and device, and check it.

One group of ranks per (backend, device) :func:`plan` finds here: gloo on
the CPU always, gloo with CUDA tensors and NCCL (one GPU per rank: NCCL
refuses two ranks on one GPU) where there is CUDA, MPI where torch has it.
Each group checks, in order:

collectives
    every collective ddpkit uses, each algorithm of ``ddpkit.collectives``
    (all-reduce sum and average; broadcast, reduce, reduce-scatter,
    all-gather), and the object collectives (``all_gather_object``,
    ``broadcast_object``), against the values they must give;
DDP
    three SGD steps of a small model with BatchNorm under ddpkit's DDP and
    under torch's, from the same weights: the parameters and buffers must
    agree (bitwise, or within 1e-5 where the backend adds in another order;
    the report says which);
SyncBatchNorm
    ``ddpkit.SyncBatchNorm`` forward and backward against BatchNorm over the
    whole gathered batch in one process (and against torch's
    ``nn.SyncBatchNorm`` on NCCL);
bandwidth
    all-reduce bus bandwidth at 1, 16 and 64 MiB (median of three; bus
    bandwidth counts the 2(n-1)/n of the data a ring moves per rank). A
    world of one has no bus: it says so, with the time of the call alone;
comm auto
    the link as ``comm="auto"`` measures it (:func:`ddpkit.comm.link_model.probe_link`:
    latency and bandwidth of the all-reduce), what its cost model predicts a
    step's reduction of a 25 M-parameter model (:data:`REFERENCE_SHAPES`, in
    25 MB buckets) takes exactly and with each of ``auto``'s candidates, and so
    which of them ``auto`` would try, up to which step time each (a candidate
    is tried when predicted 5 % faster than the exact step, the best three at
    most, one half precision; the trials decide).

A group whose ranks cannot start or meet fails with the error and the likely
fix; a timeout bounds every wait, so nothing hangs.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["REFERENCE_SHAPES", "SIZES_MIB", "describe_auto", "plan", "run_group"]

SIZES_MIB = (1, 16, 64)
REFERENCE_SHAPES = ((2896, 2896), (2896,)) * 3
"""The comm-auto check's model: three 2896 x 2896 layers with their biases (25.2 M parameters, about 100 MB of
float32 gradients)."""


def plan(backends: dict[str, dict[str, Any]], gpus: int, nproc: int, asked: tuple[str, ...] | None) -> list[dict]:
    """The groups to run: ``{"backend", "device", "world"}``, or ``{"skip": reason}`` / ``{"fail": reason}``."""
    groups: list[dict[str, Any]] = []
    wanted = asked or tuple(b for b, info in backends.items() if info["available"])
    for backend in wanted:
        info = backends[backend]
        name = f"{backend}"
        if not info["available"]:
            groups.append({"backend": backend, "device": "-", "world": nproc,
                           "fail": f"{name} is not available here: {info['why']}"})
            continue
        if backend in ("gloo", "mpi"):
            groups.append({"backend": backend, "device": "cpu", "world": nproc})
            if gpus and backend == "gloo":
                groups.append({"backend": backend, "device": "cuda", "world": nproc})
        elif nproc > gpus:
            groups.append({"backend": backend, "device": "cuda", "world": nproc,
                           "skip": f"NCCL needs one GPU per rank, and {nproc} ranks share {gpus} GPU(s): run with "
                                   f"--nproc-per-node {gpus} (gloo with CUDA tensors covers ranks sharing a GPU)"})
        else:
            groups.append({"backend": backend, "device": "cuda", "world": nproc})
    return groups


def _check(results: list[dict], name: str, fn: Any) -> None:
    start = time.perf_counter()
    try:
        detail = fn()
        results.append({"check": name, "ok": True, "detail": detail or "", "seconds": time.perf_counter() - start})
    except Exception as e:  # noqa: BLE001 - every failure is reported, the others still run
        results.append({"check": name, "ok": False, "detail": f"{type(e).__name__}: {e}",
                        "seconds": time.perf_counter() - start})


def _collectives(torch: Any, dist: Any, device: Any) -> str:
    from ddpkit.comm import allreduce as collectives
    from ddpkit.runtime.objects import all_gather_object, broadcast_object

    rank, world = dist.get_rank(), dist.get_world_size()
    expected = world * (world + 1) / 2
    done = []
    for algorithm in collectives.ALGORITHMS:
        t = torch.full((1000,), float(rank + 1), device=device)
        collectives.all_reduce(t, "sum", algorithm)
        if not torch.all(t == expected):
            raise AssertionError(f"all_reduce sum ({algorithm}) gave {t[0].item()}, expected {expected}")
        done.append(algorithm)
    t = torch.full((8,), float(rank + 1), device=device)
    collectives.all_reduce(t, "avg")
    assert torch.allclose(t, torch.full_like(t, expected / world)), f"all_reduce avg gave {t[0].item()}"
    t = torch.full((8,), float(rank), device=device)
    collectives.broadcast(t, src=world - 1)
    assert torch.all(t == world - 1), f"broadcast gave {t[0].item()}"
    t = torch.full((8,), float(rank + 1), device=device)
    collectives.reduce(t, dst=0)
    assert rank != 0 or torch.all(t == expected), f"reduce gave {t[0].item()}"
    src = torch.arange(4 * world, dtype=torch.float32, device=device) * (rank + 1)
    out = torch.empty(4, device=device)
    collectives.reduce_scatter(out, src.clone())
    assert torch.equal(out, torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32, device=device) * expected), \
        "reduce_scatter gave another chunk"
    gathered = torch.empty(4 * world, device=device)
    collectives.all_gather(gathered, torch.full((4,), float(rank), device=device))
    assert torch.equal(gathered, torch.arange(world, device=device).float().repeat_interleave(4)), "all_gather"
    assert all_gather_object({"rank": rank}) == [{"rank": r} for r in range(world)], "all_gather_object"
    assert broadcast_object("from 0" if rank == 0 else None) == "from 0", "broadcast_object"
    dist.barrier()
    return f"all_reduce ({', '.join(done)}), avg, broadcast, reduce, reduce_scatter, all_gather, objects, barrier"


def _model(torch: Any) -> Any:
    nn = torch.nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def _ddp(torch: Any, dist: Any, device: Any) -> str:
    import copy

    from ddpkit._reference import torch_ddp
    from ddpkit.parallel.ddp.wrapper import DistributedDataParallel

    base = _model(torch).to(device)
    ids = [device.index] if device.type == "cuda" else None
    models = {"ddpkit": DistributedDataParallel(copy.deepcopy(base), device_ids=ids),
              "torch": torch_ddp(copy.deepcopy(base), device_ids=ids)}
    rank = dist.get_rank()
    for model in models.values():
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(6, 1, 8, 8, generator=g).to(device)
            y = torch.randint(0, 3, (6,), generator=g).to(device)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    ours, theirs = (m.module.state_dict() for m in models.values())
    worst = max((ours[k].float() - theirs[k].float()).abs().max().item() for k in ours)
    if worst > 1e-5:
        raise AssertionError(f"ddpkit's DDP and torch's differ by {worst:.3g} after 3 steps")
    return "equal to torch's DDP, bit for bit" if worst == 0 else f"equal to torch's DDP within {worst:.1g}"


def _syncbn(torch: Any, dist: Any, device: Any, backend: str) -> str:
    from ddpkit.parallel.syncbn import SyncBatchNorm
    from ddpkit.runtime.objects import all_gather_object

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(4, 3, 5, 5, generator=g).to(device).requires_grad_()
    bn = SyncBatchNorm(3).to(device)
    out = bn(x)
    (out * out).sum().backward()
    # The reference: one BatchNorm over every rank's batch, in this process.
    batches = [t.to(device) for t in all_gather_object(x.detach().cpu())]
    full = torch.cat(batches).requires_grad_()
    ref = torch.nn.BatchNorm2d(3).to(device)
    ref_out = ref(full)
    (ref_out * ref_out).sum().backward()
    mine = slice(4 * rank, 4 * rank + 4)
    worst = max((out - ref_out[mine]).abs().max().item(), (x.grad - full.grad[mine]).abs().max().item(),
                (bn.running_mean - ref.running_mean).abs().max().item())
    if worst > 1e-4:
        raise AssertionError(f"SyncBatchNorm differs from BatchNorm over the {world}-rank batch by {worst:.3g}")
    detail = f"forward and backward equal to BatchNorm over the whole batch within {worst:.1g}"
    if backend == "nccl":
        from ddpkit._reference import torch_sync_batchnorm

        theirs = torch_sync_batchnorm(3).to(device)
        y = theirs(x.detach())
        diff = (y - out.detach()).abs().max().item()
        if diff > 1e-4:
            raise AssertionError(f"ddpkit.SyncBatchNorm differs from torch's nn.SyncBatchNorm by {diff:.3g}")
        detail += f"; torch's nn.SyncBatchNorm within {diff:.1g}"
    return detail


def _bandwidth(torch: Any, dist: Any, device: Any) -> tuple[dict[str, float], dict[str, float]]:
    """``(bus GB/s, median seconds)`` of an all-reduce per size; no bus figure in a world of one, which moves
    no data (its all-reduce is a local no-op or copy): the time alone is what is meaningful there."""
    world = dist.get_world_size()
    bus, took = {}, {}
    for mib in SIZES_MIB:
        t = torch.ones(mib * 2**20 // 4, device=device)
        times = []
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        took[f"{mib} MiB"] = seconds
        if world > 1:
            bus[f"{mib} MiB"] = round(mib * 2**20 * 2 * (world - 1) / world / seconds / 1e9, 3)
    return bus, took


def describe_bandwidth(bus: dict[str, float], took: dict[str, float]) -> str:
    """The bandwidth check's line: bus bandwidth per size, or at world 1 why there is none and the call's time."""
    if bus:
        return ", ".join(f"{size} {gbps:g} GB/s" for size, gbps in bus.items()) + " (bus bandwidth)"
    times = ", ".join(f"{size} {seconds * 1e6:.0f} us" for size, seconds in took.items())
    return (f"no bus at world 1 (one rank's all-reduce moves nothing; start 2 or more ranks, "
            f"--nproc-per-node, to measure one); the call alone takes {times}")


def _auto(torch: Any, device: Any) -> str:
    from ddpkit.comm.link_model import predict, probe_link
    from ddpkit.comm.schemes import CANDIDATE_SPECS, parse_scheme

    link = probe_link(None, device)
    shapes = [torch.Size(s) for s in REFERENCE_SHAPES]
    cap = 25 * 2**20 // 4  # elements in a 25 MB bucket
    buckets: list[list[Any]] = [[]]
    for shape in shapes:
        if buckets[-1] and sum(s.numel() for s in buckets[-1]) + shape.numel() > cap:
            buckets.append([])
        buckets[-1].append(shape)
    seconds = {spec: predict(parse_scheme(spec), link, buckets) for spec in ("none", *CANDIDATE_SPECS)}
    return describe_auto(link.describe(), seconds)


def describe_auto(link: str, seconds: dict[str, float]) -> str:
    """The comm-auto check's line: the link, the predicted reductions of the reference model, and which candidates
    ``comm="auto"`` would try (as its decision picks them), each up to the step time at which it saves 5 % of the
    exact step."""
    from ddpkit.comm.auto import TRIES, worth_trying
    from ddpkit.comm.schemes import parse_scheme

    exact = seconds["none"]
    each = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in seconds.items())
    faster = {parse_scheme(k): v for k, v in seconds.items() if k != "none" and v < exact}
    tried = worth_trying(faster, exact, TRIES)
    if not tried:
        then = "no compression is predicted to pay for it at any step time: auto would keep the exact all-reduce"
    else:
        up_to = ", ".join(f"{s.spec} for steps up to {20 * (exact - faster[s]):.2f} s" for s in tried)
        then = f"auto would try {up_to} (each saving 5 % or more) and keep the exact all-reduce above"
    return f"{link}; a 25 M-parameter model's reduction a step: {each}; {then}"


def _rank(rank: int, group: dict[str, Any], out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from ddpkit.runtime.group import init, shutdown

    torch.set_num_threads(1)
    ctx = init(backend=group["backend"], timeout=group["timeout"])
    device = torch.device("cpu")
    if group["device"] == "cuda":
        device = torch.device("cuda", ctx.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    results: list[dict] = []
    _check(results, "collectives", lambda: _collectives(torch, dist, device))
    _check(results, "DDP step", lambda: _ddp(torch, dist, device))
    _check(results, "SyncBatchNorm", lambda: _syncbn(torch, dist, device, group["backend"]))
    bandwidth: dict[str, float] = {}

    def measure() -> str:
        bus, took = _bandwidth(torch, dist, device)
        bandwidth.update(bus)
        return describe_bandwidth(bus, took)

    _check(results, "all-reduce bandwidth", measure)
    _check(results, "comm auto", lambda: _auto(torch, device))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"checks": results, "bus_gbps": bandwidth}))
    shutdown()


def _hint(text: str, group: dict[str, Any]) -> str:
    """The likely fix for a group whose ranks failed with ``text``."""
    low = text.lower()
    if "unable to find address" in low or "gloo_socket_ifname" in low:
        return ("gloo cannot use the interface GLOO_SOCKET_IFNAME names: unset it to let ddpkit choose, or name an "
                "interface this machine has")
    if "timed out" in low or "timeout" in low or "could not reach" in low:
        return ("the ranks could not meet or a collective never completed: check that MASTER_ADDR resolves to this "
                "machine, that no firewall blocks the port, and GLOO_SOCKET_IFNAME (the interface gloo uses)")
    if group["backend"] == "nccl":
        return ("NCCL failed: rerun with NCCL_DEBUG=INFO for its reason; NCCL needs one GPU per rank and a driver "
                "that matches this torch's CUDA")
    if "cuda" in low:
        return "a CUDA error: check the driver (nvidia-smi), CUDA_VISIBLE_DEVICES and that the GPU is free"
    return "see the error above"


def run_group(group: dict[str, Any]) -> dict[str, Any]:
    """Run one group's ranks; its checks (per rank) and a verdict."""
    from ddpkit.runtime.process import environment
    from ddpkit.runtime.spawn import WorkerError, spawn

    start = time.perf_counter()
    name = f"{group['backend']} / {group['device']}"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with environment({"DDPKIT_STALL_WARN": "0"}):  # the doctor reports failures itself
                spawn(_rank, group["world"], args=(group, tmp), backend=group["backend"])
        except WorkerError as e:
            line = (str(e).strip().splitlines() or ["failed"])[-1]
            return {**group, "name": name, "ok": False, "error": line, "fix": _hint(str(e), group),
                    "seconds": time.perf_counter() - start}
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(group["world"])]
    checks = []
    for k, first in enumerate(ranks[0]["checks"]):
        failed = [(r, rank["checks"][k]) for r, rank in enumerate(ranks) if not rank["checks"][k]["ok"]]
        checks.append({"check": first["check"], "ok": not failed,
                       "detail": (f"rank {failed[0][0]}: {failed[0][1]['detail']}" if failed else first["detail"])})
    ok = all(c["ok"] for c in checks)
    out = {**group, "name": name, "ok": ok, "checks": checks, "bus_gbps": ranks[0]["bus_gbps"],
           "seconds": time.perf_counter() - start}
    if not ok:
        out["fix"] = _hint(" ".join(c["detail"] for c in checks if not c["ok"]), group)
    return out
