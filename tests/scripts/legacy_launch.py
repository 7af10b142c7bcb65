"""A script written for torch.distributed.launch: it takes --local-rank (torch 2) or --local_rank as an argument."""

import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--local-rank", "--local_rank", type=int, required=True)  # as torch's docs advise
parser.add_argument("--tag", default="")
args = parser.parse_args()
assert args.local_rank == int(os.environ["LOCAL_RANK"])
print(f"LEGACY local_rank={args.local_rank} tag={args.tag}", flush=True)
