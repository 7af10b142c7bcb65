"""The three probes behind docs/plans/fault-tolerance.md: what gloo does when a rank of a running job dies or hangs.

Run with three ranks (rank 2 is the one that fails, 2 s in)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 3 scripts/ft_probes.py kill
    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 3 scripts/ft_probes.py abort
    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 3 scripts/ft_probes.py rebuild

* ``kill``: rank 2 kills itself (SIGKILL) during a loop of 16 MiB all-reduces; each survivor says how long after
  the kill its all-reduce raised.
* ``abort``: rank 2 stops taking part (a hung process, or a machine gone without resetting its connections); 1 s
  later rank 0 calls ``ProcessGroup.abort()`` on a second thread; each survivor says when its all-reduce returned.
* ``rebuild``: rank 2 hangs as in ``abort``; 1 s later the survivors stop waiting (they poll the work instead of
  blocking in ``wait()``), leave the operation in flight, build a new gloo group of the two on a new store prefix
  and all-reduce on it; each says how long that took.

The group timeout is 20 s, so an operation nobody releases ends by it.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=20)
FAIL_AT_S = 2.0


def _group(store: dist.Store, prefix: str, rank: int, size: int) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, TIMEOUT)


def main(mode: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world, rank == 0,
                          timeout=TIMEOUT)
    group = _group(store, "epoch0/", rank, world)
    t = torch.ones(4 << 20)
    group.allreduce([t]).wait()
    start = time.monotonic()
    failed_at = start + FAIL_AT_S
    if mode == "abort" and rank == 0:
        threading.Thread(target=lambda: (time.sleep(FAIL_AT_S + 1.0), group.abort()), daemon=True).start()
    while True:
        if rank == world - 1 and time.monotonic() >= failed_at:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)  # alive, never joining again
        work = group.allreduce([t])
        if mode != "rebuild":
            try:
                work.wait()
                continue
            except Exception as e:  # noqa: BLE001 - the probe reports whatever gloo raises
                print(f"{mode}: rank {rank}: all_reduce raised {time.monotonic() - failed_at:.2f} s after rank "
                      f"{world - 1} failed: {str(e).splitlines()[0][:120]}", flush=True)
                os._exit(0)
        while not work.is_completed() and time.monotonic() < failed_at + 1.0:
            time.sleep(0.001)
        if work.is_completed():
            continue
        begun = time.monotonic()
        survivors = _group(store, "epoch1/", rank, world - 1)
        fresh = torch.full((1 << 20,), float(rank + 1))
        survivors.allreduce([fresh]).wait()
        print(f"rebuild: rank {rank}: a new group of {world - 1} built and all-reduced in "
              f"{(time.monotonic() - begun) * 1000:.1f} ms (sum {fresh[0].item():g}), the old operation still in "
              "flight", flush=True)
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "kill")
