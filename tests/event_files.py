"""TensorBoard's event files read back as TensorBoard shows them, and what ``metrics.jsonl`` says they should hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpkit.integrations.tensorboard import SCALARS


def read_board(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag's points, ``(step, value)``, with the points a restart marker hides left out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))  # purges points hidden by a restart marker, as TensorBoard does
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def epochs_of(board: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """The epochs' tags (all but ``train/loss_step``)."""
    return {tag: points for tag, points in board.items() if tag != "train/loss_step"}


def expected_from_metrics(run: Path) -> dict[str, list[tuple[int, float]]]:
    """The epochs' points that the run's ``metrics.jsonl`` says the board holds (each epoch once)."""
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {tag: [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in history] for key, tag in SCALARS.items()}
