"""What one worker of ``ddpkit train`` trains with (:class:`Run`): its state, its live objects and its data.

:mod:`ddpkit.train.loop` builds a :class:`Run` per attempt and drives it. The
run knows its learning rate (linear scaling by the replicas in the job, but
DiLoCo's inner one, see :func:`~ddpkit.train.recipe.lr_scale`; reached over
``--warmup-epochs``: a function of the step alone, so a resumed
run takes the same rates), what to trace, and how to checkpoint: a
checkpoint that cannot be written warns once per run of failures and
training goes on (see :mod:`ddpkit.train.loop`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.data.datasets import TensorDataset
from ddpkit.integrations.tensorboard import EpochBoard
from ddpkit.parallel.common.trace import UNTRACED, Recorder, Untraced
from ddpkit.runtime import events
from ddpkit.runtime.devices import comm_device, comm_tensor
from ddpkit.runtime.durable import CheckpointError, describe_write_error
from ddpkit.runtime.group import print0
from ddpkit.train import rundir
from ddpkit.train.train_config import TrainConfig
from ddpkit.train.recipe import lr_scale, replicas, warmup_lr, whole_epoch_steps
from ddpkit.train.state import TrainState, checkpoint_files
from ddpkit.train.strategy import Strategy

__all__ = ["Run"]


@dataclass
class Run:
    """What one worker trains with: the saved state, its live objects, and the data."""

    state: TrainState
    config: TrainConfig
    model: torch.nn.Module
    """The model as the engine wrapped it."""
    strategy: Strategy
    device: torch.device
    world: int
    out: Path
    train_data: tuple[torch.Tensor, torch.Tensor]
    test: TensorDataset
    recorder: Recorder | None = None
    """``--trace``: the spans of this rank."""
    traced_until: int = 0
    """``--trace``: the optimizer step after the last one recorded."""
    evaluation: tuple[float, float, int] = (float("nan"), float("nan"), 0)
    trained: int = 0
    """Samples trained in this attempt, summed over ranks."""
    seen: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))
    """How often this rank trained each sample since the counts were last settings (on the device)."""
    board: EpochBoard | None = None
    forward: Any = None
    """What a training step calls: :attr:`model`, or ``--compile``'s compiled form of it."""
    """``--tensorboard``, on rank 0."""
    unwritten: int = 0
    """Checkpoints of this attempt that could not be written."""
    failing: bool = False
    """Whether the newest checkpoint could not be written (one warning per run of failures, not one each)."""

    @property
    def progress(self) -> dict[str, Any]:
        """Where the run stands (saved in every checkpoint as ``extra``)."""
        return self.state.extra

    @property
    def scale(self) -> int:
        """Model replicas in the job: processes, times DataParallel's replicas in each."""
        return self.world * replicas(self.config)

    @property
    def lr(self) -> float:
        return self.config.lr * self.lr_scale

    @property
    def lr_scale(self) -> int:
        """How many times ``--lr`` the optimizer steps with (:func:`~ddpkit.train.recipe.lr_scale`): the
        replicas, but for DiLoCo, whose inner optimizer steps on one process's batch."""
        return lr_scale(self.config, self.world)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in an epoch of this rank's shard."""
        return whole_epoch_steps(self.config, self.state.sampler)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (from 0): :attr:`lr`, reached linearly from one process's
        over ``--warmup-epochs`` (a function of the step alone, so a resumed run takes the same rates)."""
        return warmup_lr(self.config, self.lr_scale, step, self.steps_per_epoch)

    @property
    def batch(self) -> int:
        """Samples one process takes per micro-batch (all its replicas together)."""
        return self.config.batch_size * replicas(self.config)

    def tracer(self) -> Recorder | Untraced:
        """What records this optimizer step: the recorder for the first ``--trace-steps``, else nothing."""
        if self.recorder is None:
            return UNTRACED
        self.recorder.enabled = self.state.step < self.traced_until
        return self.recorder if self.recorder.enabled else UNTRACED

    def checkpoint(self, consumed: int, loss_sum: torch.Tensor, count: int) -> None:
        """Save the whole state now (a collective), with each rank's partial loss sums of the epoch."""
        self.strategy.consensus(self.state.optimizer)
        mine = comm_tensor(torch.stack([loss_sum.detach().double().cpu(),
                                        torch.tensor(float(count), dtype=torch.float64)]))
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        events.collective("train: gather the epoch's partial loss sums", nbytes=mine.numel() * mine.element_size())
        dist.all_gather(parts, mine)
        self.progress["partial"] = torch.stack(parts).cpu()
        self.sum_seen()
        self.save(consumed)
        self.strategy.after_consensus(self.state.optimizer)

    def sum_seen(self) -> None:
        """Add every rank's count of the samples trained since the last settling to the run's (a collective)."""
        seen = self.seen.to(comm_device(like=self.seen), copy=True)
        events.collective("train: sum the samples trained", nbytes=seen.numel() * seen.element_size())
        dist.all_reduce(seen)
        self.progress["seen"] = self.progress.get("seen", torch.zeros_like(seen.cpu())) + seen.cpu()
        self.seen.zero_()

    def save(self, consumed: int) -> None:
        """A checkpoint of now; one that cannot be written warns and training goes on (see the module notes).

        The first of a run of failures warns; the ones after it are counted, and a checkpoint written again
        says how many were skipped.
        """
        if self.board is not None:
            self.board.flush()  # the events so far: a resume from this checkpoint keeps its step's (EpochBoard.rewrite)
        try:
            self.state.save(self.out / rundir.CHECKPOINT_DIR, self.state.step, sampler_consumed=consumed,
                            within=self.out)
        except CheckpointError as e:
            if e.gone:
                raise CheckpointError(f"the run directory {self.out} was removed while the run was going on: "
                                      "stopping here; restore it and --resume, or start again", gone=True) from e
            self.unwritten += 1
            if not self.failing:
                print0(f"ddpkit train: warning: {e}; training goes on (a restart would resume from "
                       f"{self.last_good()}), but the final weights must be written; the checkpoints after this "
                       "one that cannot be written either are counted, not each reported")
            self.failing = True
            return
        if self.failing:
            print0(f"ddpkit train: checkpoints are written again ({self.unwritten} could not be written so far)")
        self.failing = False

    def last_good(self) -> str:
        """The newest checkpoint on disk, which a restart would resume from."""
        kept = checkpoint_files(self.out / rundir.CHECKPOINT_DIR)
        return str(kept[-1][1]) if kept else "the start (no checkpoint was written)"

    def publish(self, record: dict[str, Any]) -> None:
        """Rank 0 adds a finished epoch to the TensorBoard files (``--tensorboard``); a failure warns."""
        if self.board is not None:
            self.board.publish(record)

    def publish_step(self, step: int, loss: float) -> None:
        """Rank 0's mean loss of optimizer step ``step`` to the TensorBoard files (a failure warns once, and the
        run's per-step points end)."""
        if self.board is not None:
            self.board.publish_step(step, loss)

    def write_metrics(self) -> None:
        """Rank 0 rewrites ``metrics.jsonl``; a failure warns (the history is in every checkpoint too)."""
        if dist.get_rank() != 0:
            return
        try:
            rundir.write_metrics(self.out, self.progress["history"])
        except OSError as e:
            print(f"ddpkit train: warning: could not write {self.out / 'metrics.jsonl'}: {describe_write_error(e)}; "
                  "training goes on", flush=True)
