"""One rank of :class:`mpi_harness.MPIRankPool`: started by mpirun, it runs what the test process sends."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
from multiprocessing.connection import Client


def main() -> None:
    from harness import serve_jobs

    faulthandler.enable()
    host, port = os.environ["DDPKIT_TEST_POOL"].rsplit(":", 1)
    import torch

    import ddpkit

    torch.set_num_threads(1)
    ctx = ddpkit.init(backend="mpi", timeout=90)
    key = bytes.fromhex(os.environ["DDPKIT_TEST_KEY"])
    multiprocessing.current_process().authkey = key  # the test process's: it takes our tensors' shared memory
    conn = Client((host, int(port)), authkey=key)
    conn.send(ctx.rank)
    serve_jobs(conn)
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
