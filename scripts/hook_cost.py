"""The reducer's cost per gradient: the backward of a model of many small parameters, with the engine's hooks.

Each parameter's gradient runs one hook of ddpkit's reducer (``parallel/common/reducer.py``): with 300 parameters of
a 4x4 ``nn.Linear`` the model's own backward is short and the hooks are a large part of it. No process group (a
world of one): nothing is sent, the hooks count, stage and write back. Prints the median of the backwards after a
warm-up. Compare two checkouts, interleaved, by running it under each one's ``src``:

    for i in 1 2 3; do for src in ../old/src src; do
        PYTHONPATH=$src OMP_NUM_THREADS=1 .venv/bin/python scripts/hook_cost.py; done; done
"""

import argparse
import statistics
import time

import torch
from torch import nn

from ddpkit.parallel.common.reducer import Reducer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=150, help="4x4 linear layers (two parameters each)")
    parser.add_argument("--steps", type=int, default=400, help="backwards timed (the first 50 are a warm-up)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(args.layers)])
    reducer = Reducer(list(model.named_parameters()), process_group=None)
    x = torch.randn(2, 4)
    times = []
    for _ in range(args.steps):
        reducer.prepare_for_backward()
        loss = model(x).sum()
        start = time.perf_counter()
        loss.backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    n = 2 * args.layers
    print(f"{statistics.median(times[50:]) * 1e6:.0f} us per backward ({n} parameters)")


if __name__ == "__main__":
    main()
