"""Run Accelerate's own ``test_sync.py`` with ddpkit's DDP in place of torch's (under ``ddpkit launch``)."""

import os

os.environ.setdefault("ACCELERATE_USE_CPU", "true")  # Accelerate's MULTI_CPU mode: gloo, no GPU

import torch  # noqa: E402
from accelerate.test_utils.scripts import test_sync

import ddpkit  # noqa: E402

wrapped = []


class _Recorded(ddpkit.DDP):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        wrapped.append(type(self))


torch.nn.parallel.DistributedDataParallel = _Recorded  # what Accelerator.prepare_model constructs
test_sync.main()
assert wrapped, "Accelerate did not wrap a model: the test ran without ddpkit's DDP"
print(f"rank {os.environ['RANK']}: accelerate test_sync passed with ddpkit's DDP ({len(wrapped)} models wrapped)")
