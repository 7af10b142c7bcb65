"""Which way of driving MPI hides an all-reduce behind computation best: the measurement behind the mpi backend's
progress thread (docs/mpi.md, "Overlap").

Run under mpirun with two ranks: ``mpirun -np 2 python scripts/mpi_overlap.py [cpu|idle]``. Each rank computes
(``cpu``: multiplies matrices, the stand-in for a CPU backward; ``idle``: sleeps as long, the stand-in for a GPU
backward, which leaves the CPU free) while a 25 MiB float32 all-reduce runs (DDP's bucket size), driven four ways:

* ``blocking``: no overlap at all, compute then ``Allreduce`` (the floor to beat);
* ``thread``: ``Allreduce`` on a second thread, as the backend's progress thread does;
* ``nonblocking``: ``Iallreduce`` posted first, ``Wait`` after the computation (MPI progresses it only when
  called);
* ``nonblocking+test``: ``Iallreduce``, and a second thread calling ``Test`` every 100 microseconds.

Reported per way: the median over rounds of the time to finish both, and the share of the all-reduce's own time
that stayed hidden: ``(compute + comm - both) / comm``.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import mpi4py

mpi4py.rc.thread_level = "multiple"
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

ROUNDS = 15
comm = MPI.COMM_WORLD
buf = np.ones(25 * 2**20 // 4, dtype=np.float32)
a = np.random.default_rng(comm.rank).standard_normal((384, 384)).astype(np.float32)


IDLE = len(sys.argv) > 1 and sys.argv[1] == "idle"


def compute() -> None:
    if IDLE:
        time.sleep(0.037)
        return
    x = a
    for _ in range(40):
        x = np.tanh(x @ a)


def timed(fn) -> float:
    comm.Barrier()
    start = time.perf_counter()
    fn()
    took = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    return took


def ways() -> dict:
    def blocking():
        compute()
        comm.Allreduce(MPI.IN_PLACE, buf)

    def thread():
        t = threading.Thread(target=lambda: comm.Allreduce(MPI.IN_PLACE, buf))
        t.start()
        compute()
        t.join()

    def nonblocking():
        req = comm.Iallreduce(MPI.IN_PLACE, buf)
        compute()
        req.Wait()

    def nonblocking_test():
        req = comm.Iallreduce(MPI.IN_PLACE, buf)
        done = threading.Event()

        def poll():
            while not req.Test():
                time.sleep(1e-4)
            done.set()

        t = threading.Thread(target=poll)
        t.start()
        compute()
        t.join()

    return {"blocking": blocking, "thread": thread, "nonblocking": nonblocking, "nonblocking+test": nonblocking_test}


def main() -> None:
    alone = {"compute": compute, "comm": lambda: comm.Allreduce(MPI.IN_PLACE, buf)}
    times: dict[str, list[float]] = {name: [] for name in [*alone, *ways()]}
    for r in range(ROUNDS + 1):
        for name, fn in [*alone.items(), *ways().items()]:
            took = timed(fn)
            if r:
                times[name].append(took)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    if comm.rank == 0:
        print(f"{MPI.Get_library_version().replace(chr(0), '').splitlines()[0].strip()}, {comm.size} ranks, 25 MiB all-reduce, "
              f"median of {ROUNDS} rounds, compute {'idle' if IDLE else 'cpu'}")
        print(f"compute alone {1e3 * med['compute']:.1f} ms, all-reduce alone {1e3 * med['comm']:.1f} ms")
        for name in ways():
            hidden = (med["compute"] + med["comm"] - med[name]) / med["comm"]
            print(f"{name:>17}: both {1e3 * med[name]:6.1f} ms, hidden {100 * max(0.0, min(1.0, hidden)):5.1f} %")


if __name__ == "__main__":
    main()
