"""What every training loop of ``ddpkit train`` computes and writes alike: a micro-batch's loss, an epoch's record
and line, the run's summary and its result line.

The default loop (:mod:`ddpkit.train.loop`) and the fault-tolerant ones (:mod:`ddpkit.train.fault_tolerant_loop`,
:mod:`ddpkit.train.fault_tolerant_async`) drive their steps differently, and each adds its own keys; the keys, the
words and the numbers they share are made here, once, so that ``metrics.jsonl``, ``summary.json`` and the lines a
run prints read the same whichever mode ran it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F

from ddpkit.train.train_config import TrainConfig

__all__ = ["epoch_line", "epoch_record", "micro_batch_loss", "result_line", "summary_of"]


def micro_batch_loss(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                     autocast: Callable[[], AbstractContextManager[Any]]) -> torch.Tensor:
    """The training loss of one micro-batch: cross-entropy of the logits (computed under ``autocast``, taken in
    float32) against the labels, over every position (a language model's every token)."""
    with autocast():
        logits = forward(x)
    return F.cross_entropy(logits.float().flatten(0, -2), y.flatten())


def epoch_record(*, epoch: int, step: int, train_loss: float, evaluation: tuple[float, float, int], lr: float,
                 elapsed: float, trained: int, seen: torch.Tensor | None = None, **more: Any) -> dict[str, Any]:
    """One line of ``metrics.jsonl``: the epoch (counted from 1), the steps so far, the mean training loss, the
    test loss and accuracy of ``evaluation``, the learning rate, the epoch's seconds and samples a second
    (``trained`` samples in ``elapsed`` seconds), how often the least and most trained sample was trained
    (``seen``, per sample), then the loop's own keys (``more``)."""
    record: dict[str, Any] = {
        "epoch": epoch, "step": step, "train_loss": train_loss, "test_loss": evaluation[0],
        "test_accuracy": evaluation[1], "lr": lr, "epoch_time_s": round(elapsed, 4),
        "samples_per_s": round(trained / elapsed, 1) if elapsed > 0 else None}
    if seen is not None:
        record.update(min_seen=int(seen.min()), max_seen=int(seen.max()))
    return {**record, **more}


def epoch_line(record: dict[str, Any], epochs: int) -> str:
    """The line a run prints after each epoch (a loop adds its own words after it)."""
    return (f"epoch {record['epoch']}/{epochs}: train loss {record['train_loss']:.4f}, test loss "
            f"{record['test_loss']:.4f}, test accuracy {100 * record['test_accuracy']:.2f}%")


def result_line(config: TrainConfig, accuracy: float, loss: float, samples: int) -> str:
    """The start of the line a run prints at its end (a loop adds how long, on how many, and where)."""
    what = "symbols" if config.dataset == "shakespeare" else "images"
    return f"test accuracy: {100 * accuracy:.2f}% on {samples} {what} (test loss {loss:.4f})"


def summary_of(config: TrainConfig, *, evaluation: tuple[float, float, int], world: int, global_batch: int,
               wall: float, steps: int) -> dict[str, Any]:
    """``summary.json``'s keys that every mode writes: the final test loss and accuracy (``evaluation``), the
    world at the end, the global batch, the run's seconds and steps and its settings (a loop adds its own)."""
    test_loss, accuracy, samples = evaluation
    return {
        "test_accuracy": accuracy, "test_loss": test_loss, "test_samples": samples, "epochs": config.epochs,
        "world_size": world, "global_batch_size": global_batch, "wall_time_s": round(wall, 3),
        "engine": config.engine, "strategy": config.strategy if config.engine == "ddpkit" else None,
        "model": config.model, "dataset": config.dataset, "amp": config.amp, "grad_accum": config.grad_accum,
        "steps": steps}
