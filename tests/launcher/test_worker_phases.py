"""The phases of a worker under ``--on-failure continue``, as its launcher sees them (``launcher/fault_tolerant_group.py``),
and a node's standing across nodes (``launcher/council_group.py``): the moves the tables allow and no other, and the
phases a small job of interpreters without torch goes through."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest
from procs import base_env

from ddpkit.launcher import LaunchConfig, plan_workers, resolve
from ddpkit.launcher.output import LogLayout
from ddpkit.launcher.council_group import STANDING_MOVES, CouncilGroup, Standing
from ddpkit.launcher.fault_tolerant_group import LIVENESS_MOVES, WORKER_MOVES, FaultTolerantGroup, Liveness, WorkerPhase
from ddpkit.runtime.process import SignalCatcher, free_port


@pytest.mark.parametrize("start, to", [(s, t) for s in WorkerPhase for t in WorkerPhase if t not in WORKER_MOVES[s]],
                         ids=lambda p: p.name)
def test_a_move_the_worker_phases_do_not_allow_raises(start: WorkerPhase, to: WorkerPhase) -> None:
    group = FaultTolerantGroup.__new__(FaultTolerantGroup)  # its bookkeeping alone: no launcher, no processes
    group.phases, group.member_of, group._moving = {4: start}, {4: 7}, threading.RLock()
    with pytest.raises(RuntimeError, match=f"member 7's worker has no move from {start.value} to {to.value}"):
        group._move(4, to)
    assert group.phases[4] is start


@pytest.mark.parametrize("start, to", [(s, t) for s in Liveness for t in Liveness if t not in LIVENESS_MOVES[s]],
                         ids=lambda p: p.name)
def test_a_move_a_members_liveness_does_not_allow_raises(start: Liveness, to: Liveness) -> None:
    group = FaultTolerantGroup.__new__(FaultTolerantGroup)  # its bookkeeping alone: no launcher, no processes
    group.liveness, group._moving = {7: start}, threading.RLock()
    with pytest.raises(RuntimeError, match=f"process 7's liveness has no move from {start.value} to {to.value}"):
        group._hear(7, to)
    assert group.liveness[7] is start


@pytest.mark.parametrize("start, to", [(s, t) for s in Standing for t in Standing if t not in STANDING_MOVES[s]],
                         ids=lambda p: p.name)
def test_a_move_a_nodes_standing_does_not_allow_raises(start: Standing, to: Standing) -> None:
    group = CouncilGroup.__new__(CouncilGroup)  # its bookkeeping alone: no council, no processes
    group.standing, group.council = start, type("Council", (), {"node": 2})()
    with pytest.raises(RuntimeError, match=f"node 2's launcher has no move from {start.value} to {to.value}"):
        group._stand(to)
    assert group.standing is start


# Member 0 and 2 hold the state, then finish once the replacement runs; member 1 holds it and dies at once; its
# replacement (member 3) never gets the state, and is dismissed when training is over.
WORKER = """
import os, sys, time
member = int(os.environ["DDPKIT_FT_MEMBER"])
started = os.path.join(sys.argv[1], "replacement started")
if member == 3:
    open(started, "w").close()
    time.sleep(120)
os.write(int(os.environ["DDPKIT_FT_REPLY_FD"]), b"holding\\n")
if member == 1:
    sys.exit(1)
deadline = time.monotonic() + 60
while not os.path.exists(started) and time.monotonic() < deadline:
    time.sleep(0.02)
time.sleep(0.3 * member)  # member 0 finishes first
"""


def test_the_phases_of_a_job_that_loses_a_worker_and_dismisses_its_replacement(tmp_path: Path) -> None:
    program = tmp_path / "worker.py"
    program.write_text(WORKER)
    cfg = resolve(LaunchConfig(program=str(program), args=[str(tmp_path)], nproc_per_node=3, standalone=True,
                               max_restarts=1))
    specs = plan_workers(cfg, master_port=free_port(), restart_count=0, base_env=base_env())
    layout = LogLayout(cfg, "test")
    layout.start_attempt(0, 3)
    group = FaultTolerantGroup(cfg, layout, replacements=1)
    signals = SignalCatcher()
    previous = signal.signal(signal.SIGTERM, signals)
    try:
        group.start(specs, signals)
        assert group.wait() is None  # members 0 and 2 finished: the job succeeded
    finally:
        signal.signal(signal.SIGTERM, previous)
        group.stop()
    assert {group.member_of[i]: phase for i, phase in group.phases.items()} == {
        0: WorkerPhase.FINISHED, 1: WorkerPhase.DIED, 2: WorkerPhase.FINISHED, 3: WorkerPhase.GONE}
    assert [d.member for d in group.deaths] == [1]
    assert group.replacements == 0
