"""TensorBoard event files of ``ddpkit train``'s epochs (``--tensorboard DIR``), beside ``metrics.jsonl``.

Each finished epoch becomes one point, at the run's optimizer step, of the
scalars ``train/loss``, ``test/loss``, ``test/accuracy``, ``lr``,
``perf/samples_per_s`` and ``perf/epoch_time_s`` (the names of Lightning's and
the Hugging Face Trainer's loggers, ``train/...`` and ``test/...``). Written
by rank 0 through torch's ``SummaryWriter`` (the ``tensorboard`` package,
``pip install 'ddpkit[tensorboard]'``).

A resumed or restarted run writes its whole history again, after a purge
marker at step 0 that hides every earlier point (TensorBoard's own rule for
a restarted run): each epoch shows once, as ``metrics.jsonl`` has it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ddpkit.runtime.options import ConfigError

__all__ = ["SCALARS", "EpochBoard", "check"]

SCALARS = {"train_loss": "train/loss", "test_loss": "test/loss", "test_accuracy": "test/accuracy", "lr": "lr",
           "samples_per_s": "perf/samples_per_s", "epoch_time_s": "perf/epoch_time_s"}
"""``metrics.jsonl`` key -> TensorBoard tag."""


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

    def _open(self, purge: bool) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.directory), purge_step=0 if purge else None)
        return self._writer

    def write(self, record: Mapping[str, Any]) -> None:
        """One finished epoch (a ``metrics.jsonl`` record) at its optimizer step."""
        self._add(self._open(purge=False), record)
        self._writer.flush()

    def rewrite(self, history: Iterable[Mapping[str, Any]]) -> None:
        """A resumed run: hide every point written before, then write ``history`` (see the module notes)."""
        writer = self._open(purge=True)
        for record in history:
            self._add(writer, record)
        writer.flush()

    @staticmethod
    def _add(writer: Any, record: Mapping[str, Any]) -> None:
        for key, tag in SCALARS.items():
            if key in record:
                writer.add_scalar(tag, float(record[key]), global_step=int(record["step"]))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
