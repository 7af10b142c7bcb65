"""Launcher-parity worker: torch's own env:// rendezvous, one all-reduce, the whole environment to DIR/rankN.json.

Run under ``ddpkit launch`` and under ``torchrun`` with the same flags; the
test compares what each rank was given.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
out = Path(sys.argv[1]) / f"rank{os.environ['RANK']}.json"
out.write_text(json.dumps({"sum": value.item(), "env": dict(os.environ)}))
dist.destroy_process_group()
