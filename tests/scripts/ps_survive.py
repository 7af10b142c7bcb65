"""Parameter servers through deaths, under ``ddpkit launch --on-failure continue --num-servers K``.

``--model mlp``: a small MLP, SGD with momentum and weight decay, each worker's batches fixed by (rank, step);
the final parameters (bitwise comparable with a run without a death) go to ``OUT/rank{R}.pt``.

``--model ones``: four tensors whose gradient is all ones every step (SGD, lr 1, no momentum): every update a
server applies takes ``1 / workers`` off every element of its tensors, so the final values count the updates
applied, tensor by tensor, and a partly applied one shows as unequal elements. Each worker writes how many of
its steps were answered to ``OUT/acked{R}`` after each one.

``--kill-server K@STEP``: worker 0 SIGKILLs the job's server K before its step STEP (``--stop-server``: SIGSTOPs
it, for good; STEP -1: before the channel to the servers is built).
``--kill-self R@SECONDS``: worker R SIGKILLs itself that long after its first step, wherever it is.
Every worker writes the wall time (``time.time()``) at which each of its steps was answered to
``OUT/times{R}.json``, and worker 0 the moment of its kill to ``OUT/killed_at``.
"""

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
from torch import nn

import ddpkit

parser = argparse.ArgumentParser()
parser.add_argument("--mode", default="sync")
parser.add_argument("--model", default="mlp")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--kill-server", default="")
parser.add_argument("--stop-server", default="")
parser.add_argument("--kill-self", default="")
parser.add_argument("--out", required=True)
parser.add_argument("--exit-early", type=int, default=-1, help="this worker exits 3 before joining the servers")
args = parser.parse_args()
rank = int(os.environ["RANK"])
out = Path(args.out)


def server_pid(k: int, wait_s: float = 0.0) -> int:
    """The job's server ``k``: the process that names itself ``ddpkit-server{k}``, a child of our launcher
    (waiting up to ``wait_s`` for it to name itself)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _server_pid(k)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _server_pid(k: int) -> int:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                name = Path(f"/proc/{entry}/comm").read_text().strip()
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if name == f"ddpkit-server{k}" and parent == os.getppid():
                return int(entry)
    raise AssertionError(f"no ddpkit-server{k} beside this worker")


ddpkit.init()
if rank == args.exit_early:
    raise SystemExit(3)
fault = signal.SIGSTOP if args.stop_server else signal.SIGKILL
server_fault = args.stop_server or args.kill_server
kill_server = tuple(map(int, server_fault.split("@"))) if server_fault else None
if kill_server and rank == 0 and kill_server[1] < 0:
    os.kill(server_pid(kill_server[0], wait_s=30), fault)
torch.manual_seed(0)
if args.model == "mlp":
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = ddpkit.ParameterServerOptimizer(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9,
                                          weight_decay=0.01, mode=args.mode)
else:
    model = nn.ParameterList([nn.Parameter(torch.zeros(1 << 20)) for _ in range(4)])
    opt = ddpkit.ParameterServerOptimizer(model.parameters(), torch.optim.SGD, lr=1.0, mode=args.mode)
kill_self = args.kill_self.split("@") if args.kill_self else None
g = torch.Generator().manual_seed(100 + rank)
answered = []
for step in range(args.steps):
    if kill_server and rank == 0 and step == kill_server[1]:
        os.kill(server_pid(kill_server[0]), fault)
        (out / "killed_at").write_text(repr(time.time()))
    opt.zero_grad()
    if args.model == "mlp":
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
    else:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
    if step == 1 and kill_self and int(kill_self[0]) == rank:
        threading.Timer(float(kill_self[1]), os.kill, (os.getpid(), signal.SIGKILL)).start()
    opt.step()
    answered.append(time.time())
    if args.model == "ones":
        (out / f"acked{rank}.tmp").write_text(str(step + 1))
        os.replace(out / f"acked{rank}.tmp", out / f"acked{rank}")  # whole, even when this process is killed
if args.model == "ones":
    # Once every worker that lives is done, the servers' values count every update they applied.
    (out / f"done{rank}").write_text("")
    others = [r for r in range(int(os.environ["WORLD_SIZE"])) if not (kill_self and int(kill_self[0]) == r)]
    while not all((out / f"done{r}").exists() for r in others):
        time.sleep(0.01)
    opt.pull()
torch.save([p.detach().clone() for p in model.parameters()], out / f"rank{rank}.pt")
(out / f"times{rank}.json").write_text(json.dumps(answered))
opt.close()
