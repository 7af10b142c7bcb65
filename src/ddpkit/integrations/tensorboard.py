"""TensorBoard event files of ``ddpkit train``'s epochs (``--tensorboard DIR``), beside ``metrics.jsonl``.

Each finished epoch becomes one point, at the run's optimizer step, of the
scalars ``train/loss``, ``test/loss``, ``test/accuracy``, ``lr``,
``perf/samples_per_s`` and ``perf/epoch_time_s`` (the names of Lightning's and
the Hugging Face Trainer's loggers, ``train/...`` and ``test/...``). Every
:data:`STEP_EVERY` optimizer steps rank 0 also adds ``train/loss_step``, the
mean loss of its own micro-batches of that step (Lightning's ``*_step``
convention; read back only then, so a GPU step is not made to wait every
time). Written by rank 0 through torch's ``SummaryWriter`` (the
``tensorboard`` package, ``pip install 'ddpkit[tensorboard]'``).

A resumed or restarted run puts a purge marker just after the step it resumes
from (TensorBoard's own rule for a restarted run: every point of an earlier
attempt at or after the marker is hidden) and writes the epochs after it again:
each epoch and each logged step shows once, as the run that never stopped
would show it (the points of the step it resumes from were written, and
flushed, before its checkpoint). Into a directory without earlier event files
it writes the whole history.

Under ``--on-failure continue`` the first member of the membership writes
(the same points; ``train/loss_step`` its own micro-batches' mean loss), and
when a death makes another member first, that one puts a restart marker just
after the step it started training after and writes the run as it holds it
from there before its first point (:class:`MemberBoard`).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ddpkit.runtime.options import ConfigError

__all__ = ["SCALARS", "STEP_EVERY", "EpochBoard", "MemberBoard", "check"]

SCALARS = {"train_loss": "train/loss", "test_loss": "test/loss", "test_accuracy": "test/accuracy", "lr": "lr",
           "samples_per_s": "perf/samples_per_s", "epoch_time_s": "perf/epoch_time_s"}
"""``metrics.jsonl`` key -> TensorBoard tag."""

STEP_EVERY = 10
"""Optimizer steps between two points of ``train/loss_step``."""


def check(directory: Path) -> None:
    """Refuse ``--tensorboard DIR`` before any work: the package missing, or ``DIR`` a file.

    Raises:
        ConfigError: naming the value and the fix.
    """
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(f"--tensorboard {str(directory)!r} needs the tensorboard package, which is not "
                          "installed: pip install 'ddpkit[tensorboard]' (or drop --tensorboard)")
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--tensorboard {str(directory)!r} is a file: give a directory for the event files")


class EpochBoard:
    """One run's event files in ``directory``; :meth:`write` adds an epoch, :meth:`rewrite` a whole history."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._writer: Any = None
        self.steps = True
        """Whether per-step points are written (False after one could not be)."""

    def _open(self, purge_at: int | None) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            if purge_at is not None:
                self._after_the_others()
            self._writer = SummaryWriter(str(self.directory), purge_step=purge_at)
        return self._writer

    def _after_the_others(self) -> None:
        """TensorBoard reads a folder's event files in the order of their names, which begin with the second each
        was opened in, and a restart marker hides only what the files read before its own hold: wait, where need
        be, for a second later than every file already there (a writer of the same second could be read after)."""
        seconds = [int(part) for f in self.directory.glob("events.out.tfevents.*")
                   if (part := f.name.split(".")[3]).isdigit()]
        wait = max(seconds, default=0) + 1 - time.time()
        if wait > 0:
            time.sleep(min(wait, 1.0))  # (a file of a later second, from a clock set ahead: not waited out)

    def write(self, record: Mapping[str, Any]) -> None:
        """One finished epoch (a ``metrics.jsonl`` record) at its optimizer step."""
        self._add(self._open(purge_at=None), record)
        self._writer.flush()

    def step(self, step: int, loss: float) -> None:
        """``train/loss_step`` at optimizer step ``step`` (every :data:`STEP_EVERY`)."""
        self._open(purge_at=None).add_scalar("train/loss_step", loss, global_step=step)

    def rewrite(self, history: Iterable[Mapping[str, Any]], start: int) -> None:
        """A run resumed at optimizer step ``start``: hide what earlier attempts wrote after it, then write the
        epochs of ``history`` after it (all of them into a directory without earlier events). What was written at
        ``start`` itself stays: the run flushes its events before each checkpoint (:meth:`flush`), so that those
        of the step it resumes from are on disk."""
        fresh = not any(self.directory.glob("events.out.tfevents.*"))
        writer = self._open(purge_at=start + 1)
        for record in history:
            if fresh or int(record["step"]) > start:
                self._add(writer, record)
        writer.flush()

    def flush(self) -> None:
        """The events written so far onto disk (before a checkpoint: see :meth:`rewrite`); a failure warns."""
        if self._writer is not None:
            try:
                self._writer.flush()
            except OSError as e:
                self.warn(e)

    @staticmethod
    def _add(writer: Any, record: Mapping[str, Any]) -> None:
        for key, tag in SCALARS.items():
            if record.get(key) is not None:  # (a rate over no time is None)
                writer.add_scalar(tag, float(record[key]), global_step=int(record["step"]))

    def publish(self, record: Mapping[str, Any]) -> None:
        """:meth:`write`, where a failure warns and training goes on."""
        try:
            self.write(record)
        except OSError as e:
            self.warn(e)

    def publish_step(self, step: int, loss: float) -> None:
        """:meth:`step`, where a failure warns once and ends the per-step points of this run (the epochs' go on
        being tried, each failure warning)."""
        if not self.steps:
            return
        try:
            self.step(step, loss)
        except OSError as e:
            self.steps = False
            self.warn(e, ", without per-step points")

    def warn(self, error: OSError, after: str = "") -> None:
        """One line: the events could not be written, and training goes on."""
        from ddpkit.runtime.durable import describe_write_error  # (torch's import: not at the launcher's start)

        print(f"ddpkit train: warning: could not write TensorBoard events to {self.directory}: "
              f"{describe_write_error(error)}; training goes on{after}", flush=True)

    def close(self) -> None:
        """Close the event file; one that cannot be written warns (its last points are lost)."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.close()
            except OSError as e:
                self.warn(e)


class MemberBoard:
    """``--tensorboard`` where the writer can change hands (``--on-failure continue``): whoever is ``first`` (the
    first member of the current membership) writes the run as it holds it, its epochs and its own step points.

    Every process keeps its own ``train/loss_step`` points (one number every :data:`STEP_EVERY` steps) from its
    origin, the step it started training after (0; the step a resumed run starts from; a replacement's first step
    less one), told by :meth:`applied`. A process that becomes first takes over before it writes anything: a
    restart marker after its origin, which hides what any earlier writer put after it, then its epochs and its
    step points after it (:meth:`EpochBoard.rewrite`); from then on :meth:`write` adds what is new, the epochs a
    state transfer brought included. Nothing is written without a directory."""

    def __init__(self, directory: Path | None) -> None:
        self.board = None if directory is None else EpochBoard(directory)
        self.origin: int | None = None
        self._steps: list[tuple[int, float]] = []
        """This process's own step points, from its origin on."""
        self._writing = False
        self._epochs_until = -1
        """The step of the last epoch written."""
        self._steps_written = 0

    def applied(self, step: int, loss: float | None) -> None:
        """Optimizer step ``step`` was applied; ``loss``: this process's own micro-batches' mean loss (None: it
        trained none)."""
        if self.origin is None:
            self.origin = step - 1
        if loss is not None and step % STEP_EVERY == 0:
            self._steps.append((step, loss))

    def write(self, first: bool, history: list[Mapping[str, Any]]) -> None:
        """Where this process is ``first``: take over if it has not written yet, else write the epochs of
        ``history`` and the step points it has not written."""
        board = self.board
        if board is None or not first:
            return
        if not self._writing:
            try:
                # (none applied yet, a replacement at the very end: from the newest epoch it holds)
                origin = self.origin if self.origin is not None else int(history[-1]["step"]) if history else 0
                board.rewrite(history, origin)
                for step, loss in self._steps:
                    board.step(step, loss)
            except OSError as e:
                board.warn(e, ", without TensorBoard events from this worker")
                board.close()
                self.board = None  # (not tried again at every step: a full disk would hold up every one)
                return
            self._writing = True
        else:
            for record in history:
                if int(record["step"]) > self._epochs_until:
                    board.publish(record)
            for step, loss in self._steps[self._steps_written:]:
                board.publish_step(step, loss)
        if history:  # (in step order)
            self._epochs_until = max(self._epochs_until, int(history[-1]["step"]))
        self._steps_written = len(self._steps)

    def flush(self) -> None:
        """Before a checkpoint: the events written so far onto disk (see :meth:`EpochBoard.rewrite`)."""
        if self.board is not None and self._writing:
            self.board.flush()

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
