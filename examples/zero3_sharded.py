"""ZeRO-3 for a model that does not fit one rank: built on the meta device, sharded, saved and loaded in shards.

    .venv/bin/ddpkit launch --standalone --nproc-per-node 2 examples/zero3_sharded.py --output-dir runs/zero3

The model is built on the meta device (no memory for its weights), and ``DDP(zero_stage=3)`` materialises it
unit by unit, each rank keeping only its rows of every parameter. It trains, writes a sharded checkpoint (one
file per rank and an ``index.json``, each tensor digested), loads it into a second model built the same way, and
checks the two give the same loss. ``ddpkit.consolidate_sharded`` turns the folder into one ordinary file.
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--output-dir", type=Path, default=Path("runs/zero3"), help="where the sharded checkpoint goes")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--width", type=int, default=256)
args = parser.parse_args()

ctx = ddpkit.init()


def build() -> nn.Module:
    """The model, on the meta device: its parameters have shapes and no storage until the wrapper shards them."""
    torch.manual_seed(0)  # the same initial weights on every rank, whatever the world size
    with torch.device("meta"):
        blocks = [nn.Sequential(nn.Linear(args.width, args.width), nn.GELU()) for _ in range(4)]
        net = nn.Sequential(nn.Linear(32, args.width), *blocks, nn.Linear(args.width, 4))
    return ddpkit.DDP(net, zero_stage=3)


model = build()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(ctx.rank)  # each rank its own data
x, y = torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)
for step in range(args.steps):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # torch's own: the whole model's norm
    optimizer.step()
local = sum(p.to_local().numel() for p in model.parameters())
whole = sum(p.numel() for p in model.parameters())
ddpkit.print0(f"trained {args.steps} steps at world {ctx.world_size}: loss {loss.item():.4f}; rank 0 holds "
              f"{local:,} of the model's {whole:,} parameters")

folder = args.output_dir / "sharded"
ddpkit.save_sharded(model, folder, optimizer)  # a collective: every rank writes its own file
ddpkit.print0(f"saved: {sorted(p.name for p in folder.iterdir())} in {folder} (load_sharded reads it at any world "
              "size)")

again = build()
again_opt = torch.optim.AdamW(again.parameters(), lr=1e-3)
ddpkit.load_sharded(again, folder, again_opt)  # verified: a damaged file is refused by name, on every rank
with torch.no_grad():
    same = F.cross_entropy(again(x), y).item() == F.cross_entropy(model(x), y).item()
same = all(ddpkit.all_gather_object(same))
ddpkit.print0(f"loaded into a fresh model: {'the same' if same else 'a DIFFERENT'} loss on every rank")
ddpkit.shutdown()
if not same:
    raise SystemExit(1)
