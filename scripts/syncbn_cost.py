"""Step time of the ConvNet under ddpkit's DDP with BatchNorm vs SyncBatchNorm: 2 gloo ranks, interleaved.

Run: OMP_NUM_THREADS=1 .venv/bin/python scripts/syncbn_cost.py
"""

import copy
import statistics
import time

import torch

import ddpkit
from ddpkit.models import build_model

STEPS, WARMUP = 60, 5


def run(rank: int) -> None:
    torch.set_num_threads(1)
    ddpkit.init(backend="gloo")
    torch.manual_seed(0)
    base = build_model("convnet")
    models = {
        "bn": ddpkit.DDP(copy.deepcopy(base)),
        "syncbn": ddpkit.DDP(ddpkit.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base))),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    times: dict[str, list[float]] = {k: [] for k in models}
    for i in range(WARMUP + STEPS):
        for k in ("bn", "syncbn") if i % 2 else ("syncbn", "bn"):  # alternate who goes first
            ddpkit.barrier()
            start = time.perf_counter()
            opts[k].zero_grad()
            torch.nn.functional.cross_entropy(models[k](x), y).backward()
            opts[k].step()
            if i >= WARMUP:
                times[k].append(time.perf_counter() - start)
    if rank == 0:
        ratios = [a / b for a, b in zip(times["syncbn"], times["bn"])]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"ConvNet, batch 32 per rank, world 2 gloo: BN {1000 * statistics.median(times['bn']):.2f} ms, "
              f"SyncBN {1000 * statistics.median(times['syncbn']):.2f} ms, SyncBN/BN {statistics.median(ratios):.3f} "
              f"(IQR {q1:.3f}-{q3:.3f}, {len(ratios)} steps)")
    ddpkit.shutdown()


if __name__ == "__main__":
    ddpkit.spawn(run, 2)
