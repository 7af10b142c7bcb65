"""Which ``ddpkit train`` runs start the forkserver their workers are forked from (``ddpkit.train.preload``)."""

from __future__ import annotations

import pytest

from ddpkit.train.preload import starts_workers
from ddpkit.train.train_config import TrainConfig

UNDER_TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.mark.parametrize(("settings", "environ", "forks"), [
    ({"nproc_per_node": 2}, {}, True),
    ({"nproc_per_node": 1, "max_restarts": 1}, {}, True),  # a restart forks the worker again
    ({"nproc_per_node": 1}, {}, False),  # the one worker is this process
    ({"nproc_per_node": 2}, UNDER_TORCHRUN, False),  # the launcher started the workers
    ({"nproc_per_node": 2, "engine": "dp"}, {}, False),
    # --on-failure continue: its launcher, in this process, forks every worker (ddpkit.runtime.preloaded)
    ({"nproc_per_node": 2, "on_failure": "continue"}, {}, True),
    ({"nproc_per_node": 2, "on_failure": "continue", "max_restarts": 1}, {}, True),
], ids=["two workers", "restarts", "one worker", "under torchrun", "dataparallel", "continue",
        "continue, replacements"])
def test_a_forkserver_starts_only_where_workers_are_forked_from_it(settings, environ, forks):
    assert starts_workers(TrainConfig(**settings), environ) is forks
