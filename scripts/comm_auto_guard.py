"""The guard of ``comm="auto"`` in real training: does it fire, and what does it do to the validation loss?

Two gloo ranks on this machine train the character-level GPT (0.8 M parameters) on tiny Shakespeare (AdamW, lr
3e-3, 32 samples of 64 characters per rank and step) three ways: the exact all-reduce (DDP without a hook), and
``AutoComm`` with PowerSGD rank 2 as its one candidate, with its guard (``guard=0.5``) and without
(``guard=None``). For PowerSGD to be chosen as on a slow link, each AutoComm run times its steps on a clock this
script sets (100 ms an exact step, 50 ms a compressed one: the trials' outcome at 100 Mbit/s) and is given that
link; the training, the reductions and the guard's gradient norms are real. Prints, per run, the seconds it took,
the validation loss (the first 512 validation samples) and what the guard did.

    .venv/bin/python scripts/comm_auto_guard.py --steps 400
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.comm import auto
from ddpkit.comm.link_model import Link
from ddpkit.comm.schemes import parse_scheme
from ddpkit.data.datasets import load_shakespeare
from ddpkit.models.language import GPT

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare"
BATCH = 32


class _Clock:
    """``auto.time`` for the AutoComm runs: advanced by the loop, as a slow link's steps would take."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _slow_link(group, device) -> Link:  # noqa: ANN001
    return Link(latency_s=0.0, seconds_per_byte=1 / 12.5e6, flops_per_s=1e10, world=2)  # 100 Mbit/s


def _run(rank: int, mode: str, steps: int, out: str) -> None:
    ddpkit.init()
    torch.manual_seed(0)
    splits = load_shakespeare(DATA)
    net = GPT()
    model = ddpkit.DDP(net)
    state, clock = None, _Clock()
    if mode != "exact":
        auto.time = clock
        state = auto.AutoComm(candidates=[parse_scheme("powersgd:2")], probe=_slow_link,
                              guard=None if mode == "no guard" else 0.5, say=lambda line: print(line, flush=True))
        model.register_comm_hook(state, auto.auto_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        idx = torch.randint(0, len(splits.train), (BATCH,), generator=g)
        logits = model(splits.train.images[idx])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), splits.train.labels[idx].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        clock.now += 0.1 if state is None or state.scheme.name == "none" else 0.05
    net.eval()
    with torch.no_grad():
        logits = net(splits.test.images[:512])
        val = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), splits.test.labels[:512].reshape(-1)).item()
    if rank == 0:
        Path(out).write_text(json.dumps({"val_loss": val, "guards": state.guards if state else [],
                                         "chosen": [d["chosen"] for d in state.decisions] if state else []}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("exact", "guard", "no guard"):
            out, start = str(Path(tmp) / "out.json"), time.perf_counter()
            ddpkit.spawn(_run, 2, args=(mode, args.steps, out))
            result = json.loads(Path(out).read_text())
            guards = ", ".join(f"step {g['step']}: {g['action']} ({g['before']:.3g} -> {g['norm']:.3g})"
                               for g in result["guards"]) or "none"
            print(f"{mode:9s} {time.perf_counter() - start:5.0f} s  val loss {result['val_loss']:.3f}  "
                  f"chosen {result['chosen'] or '-'}  guard: {guards}", flush=True)


if __name__ == "__main__":
    main()
