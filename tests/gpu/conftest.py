"""Every test under tests/gpu carries the ``gpu`` marker (``pytest -m gpu`` selects them), and runs with
deterministic algorithms in the test process too (DataParallel runs there), restored afterwards."""

import pytest
import torch
from gpu_ranks import GPUS, ON_CPU, deterministic


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if ON_CPU:  # the rehearsal is the full suite's: the fast tier runs the same code in tests/parallel
                item.add_marker(pytest.mark.slow("the GPU suite rehearsed on the CPU: fresh ranks per case"))


@pytest.fixture(autouse=True)
def _deterministic_here(monkeypatch):
    if not GPUS:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, \
        torch.backends.cudnn.benchmark
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    deterministic()
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]
