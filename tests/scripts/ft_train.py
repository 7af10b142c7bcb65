"""A library user's script under ``ddpkit launch --on-failure continue``: ddpkit.FaultTolerance on a small model.

Environment: ``KILL=MEMBER:STEP[,MEMBER:STEP...]`` makes that member SIGKILL itself in that step
(after its first micro-batch's backward); ``DET=1`` the deterministic mode; ``EPOCHS`` (default 2); ``SLEEP`` seconds
after each step; ``GROW=N``: after a step applied by fewer than N workers, wait (at most 120 s; at most
``GROW_WAITS`` times, and only while fewer replacements have joined the job) for the next membership (a
replacement's admission) before the next step, so that a replacement joins however long its interpreter takes to
start (``GROW_MID=1``: wait in the middle of the step's micro-batches instead, so the join comes during a step);
a ``KILL`` entry ``MEMBER:STEP:stop`` makes that member SIGSTOP itself there instead (a stalled worker, which
its launcher kills once its beats stop), and ``MEMBER:STEP:launcher`` stops its launcher for ``HOLD_LAUNCHER``
seconds and SIGKILLs itself (a launcher held up while a worker dies); ``STOP_ON_ADMISSION=1``: a replacement
SIGSTOPs itself the moment its launcher admits it, before the state transfer; ``RAISE=MEMBER:STEP``: that member
raises there instead, and ``TEARDOWN_S`` makes its interpreter teardown take that long; ``METRIC=1``: an ``ft.all_reduce``
of a metric between the micro-batches and
``step.sync()``, and a ``KILL`` entry ``MEMBER:STEP:metric`` kills that member just before it (so the others are
inside it); ``REPLACEMENT_SHARDS=N``: a replacement asks for N virtual shards (a joiner started otherwise than the
job); ``QUIT=MEMBER:STEP``: that member leaves the loop at that step and exits 0 (the others are waiting for it in
the step's reduction); ``NOISE=1``: inputs get noise from NumPy's and Python's global generators (data
augmentation as users write it); ``DDP=1``: the script wraps the model in ``ddpkit.DistributedDataParallel`` (as a DDP script would) and
trains through the wrapper (``HOOK=NAME``: with ``ddpkit.hooks.NAME`` registered, its calls counted outside the
deterministic mode); ``COUNTERS=1``: the model carries a float64 and an int64 buffer beyond float32's
precision, moved every forward; ``PIDS`` a file each worker adds its PID to; ``STOP_AT_START=MEMBER``: that
member SIGSTOPs itself before ``ddpkit.init()`` (before its first beat); ``OUT`` where the
first member saves the final state dict and a JSON account (its membership changes, steps, the samples each step
reduced, the steps whose ``sync()`` said to do them again).
"""

import json
import os
import random
import signal
import subprocess
import time

import numpy as np

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

if os.environ.get("STOP_AT_START") == os.environ["DDPKIT_FT_MEMBER"]:
    os.kill(os.getpid(), signal.SIGSTOP)
ddpkit.init()
if os.environ.get("STOP_ON_ADMISSION") == "1" and int(os.environ["DDPKIT_FT_MEMBER"]) >= int(os.environ["WORLD_SIZE"]):
    import threading

    from ddpkit.runtime import membership

    def stop_once_admitted() -> None:
        watch = membership.current()
        while int(os.environ["DDPKIT_FT_MEMBER"]) not in watch.latest().members:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGSTOP)

    threading.Thread(target=stop_once_admitted, daemon=True).start()
torch.manual_seed(0)
x = torch.randn(600, 20)
y = (x[:, :10].sum(1) > 0).long()
class Counters(nn.Module):
    """Buffers float32 cannot carry: a float64 that moves by 1e-12, an int64 above 2**53."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("fine", torch.tensor([0.1], dtype=torch.float64))
        self.register_buffer("big", torch.tensor([2**60 + 1], dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.fine += 1e-12 * x.shape[0]
            self.big += 3
        return x


layers = [nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 2)]
net = nn.Sequential(*layers, *([Counters()] if os.environ.get("COUNTERS") == "1" else []))
model = ddpkit.DistributedDataParallel(net) if os.environ.get("DDP") == "1" else net  # a DDP script keeps its wrapper
hook_calls = []
if os.environ.get("HOOK"):  # the DDP script's comm hook, counted
    hook = getattr(ddpkit.hooks, os.environ["HOOK"])

    def counted(state, bucket):
        hook_calls.append(type(state).__name__)
        return hook(state, bucket)

    # The deterministic mode runs the dtype hooks it knows as its tree's dtype (never calling them): not counted.
    model.register_comm_hook(None, hook if os.environ.get("DET") == "1" else counted)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
member = int(os.environ.get("DDPKIT_FT_MEMBER", "0"))
replacement = member >= int(os.environ.get("WORLD_SIZE", "1"))
shards = int(os.environ["REPLACEMENT_SHARDS"]) if replacement and os.environ.get("REPLACEMENT_SHARDS") else 6
ft = ddpkit.FaultTolerance(model, opt, TensorDataset(x, y), batch_size=48, virtual_shards=shards,
                           deterministic=os.environ.get("DET") == "1", state={"scheduler": sched})
if os.environ.get("PIDS"):
    with open(os.environ["PIDS"], "a") as f:
        f.write(f"{os.getpid()}\n")
kills = {tuple(map(int, k.split(":")[:2])) for k in os.environ.get("KILL", "").split(",") if k and k.count(":") == 1}
raise_at = tuple(map(int, os.environ["RAISE"].split(":"))) if os.environ.get("RAISE") else None


class SlowToGo:
    def __del__(self) -> None:
        time.sleep(float(os.environ.get("TEARDOWN_S", "0")))


kept = SlowToGo() if raise_at and raise_at[0] == member else None  # destroyed in the teardown, after the threads
holds = {tuple(map(int, k.split(":")[:2])) for k in os.environ.get("KILL", "").split(",") if k.endswith(":launcher")}
stops = {tuple(map(int, k.split(":")[:2])) for k in os.environ.get("KILL", "").split(",") if k.endswith(":stop")}
metric_kills = {tuple(map(int, k.split(":")[:2])) for k in os.environ.get("KILL", "").split(",") if k.endswith(":metric")}
quit_at = tuple(map(int, os.environ["QUIT"].split(":"))) if os.environ.get("QUIT") else None
trained = {}
discarded = []
joiners: set[int] = set()
waits = 0
epochs = int(os.environ.get("EPOCHS", "2"))
grow, most, grow_mid = int(os.environ.get("GROW", "0")), int(os.environ.get("GROW_WAITS", "99")), os.environ.get("GROW_MID") == "1"


def wait_for_a_join() -> None:
    """Wait (at most 120 s) for the next membership: a replacement's admission."""
    global waits
    waits += 1
    deadline = time.monotonic() + 120
    while ft.membership.latest().generation == ft.view.generation and time.monotonic() < deadline:
        time.sleep(0.01)


def growing() -> bool:
    return ft.world_size < grow and ft.committed < ft.steps_per_epoch * epochs and max(waits, len(joiners)) < most


for step in ft.steps(epochs=epochs):
    if (member, step.index) == quit_at:
        break  # leaves without a word: exit 0 below
    for i, (xb, yb) in enumerate(step):
        if i == 0 and grow_mid and growing():
            wait_for_a_join()
        if os.environ.get("NOISE") == "1":  # augmentation from the global generators, seeded per shard by ddpkit
            xb = xb + torch.from_numpy(np.random.standard_normal(xb.shape)).float() * 0.05 + random.random() * 0.05
        F.cross_entropy(model(xb), yb).backward()
        if i == 0 and (member, step.index) in kills:  # after its first micro-batch: in the middle of the step
            os.kill(os.getpid(), signal.SIGKILL)
        if i == 0 and (member, step.index) == raise_at:
            raise RuntimeError(f"member {member} fails in step {step.index}")
        if i == 0 and (member, step.index) in stops:
            os.kill(os.getpid(), signal.SIGSTOP)
        if i == 0 and (member, step.index) in holds:  # the launcher continued by a process of its own
            launcher = os.getppid()
            os.kill(launcher, signal.SIGSTOP)
            subprocess.Popen(["sh", "-c", f"sleep {os.environ['HOLD_LAUNCHER']}; kill -CONT {launcher}"],
                             start_new_session=True)
            time.sleep(0.2)  # the others are in the step's reduction with it when it dies
            os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("METRIC") == "1":
        if (member, step.index) in metric_kills:
            os.kill(os.getpid(), signal.SIGKILL)
        ft.all_reduce(torch.tensor([float(step.index)]))
    if step.sync():
        opt.step()
        sched.step()
        trained[step.index] = step.trained
    else:
        discarded.append(step.index)
    opt.zero_grad()
    time.sleep(float(os.environ.get("SLEEP", "0")))
    joiners |= {m for m in ft.view.members if m >= ft.started_with}  # replacements admitted (this one too)
    if step.synced and not grow_mid and growing():
        wait_for_a_join()
if ft.rank == 0 and os.environ.get("OUT"):
    torch.save(net.state_dict(), os.environ["OUT"] + ".pt")
    with open(os.environ["OUT"] + ".json", "w") as f:
        json.dump({"world_size": ft.world_size, "committed": ft.committed, "lr": opt.param_groups[0]["lr"],
                   "changes": [c.__dict__ for c in ft.changes], "trained": trained,
                   "discarded": discarded, "hook_calls": hook_calls}, f)
