"""``curves.png`` beside ``metrics.jsonl``: a run's training curves, drawn once it has finished.

Two panels over the epochs: the training loss (the epoch's mean) and the
test loss, and the test accuracy, with the world size noted where it
changed (a fault-tolerant run's deaths and joins). matplotlib draws it (a
dependency of ddpkit) on its file canvas, without pyplot (a process that
called ``train()`` in-process keeps its own figures and backend); a failure
to draw or write warns and the run's result stands.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpkit.runtime.durable import write_atomic

__all__ = ["CURVES", "write_curves"]

CURVES = "curves.png"


def write_curves(out: Path, history: Sequence[dict[str, Any]]) -> Path | None:
    """Draw ``history`` (``metrics.jsonl``'s records) into ``out/curves.png``; the file, or None (nothing to draw,
    or a warning said why not)."""
    if not history:
        return None
    path = out / CURVES
    try:
        write_atomic(path, _png(history, out.name))
    except Exception as e:  # noqa: BLE001 - a plot must never fail a finished run
        print(f"ddpkit train: warning: could not draw {path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return None
    return path


def _png(history: Sequence[dict[str, Any]], title: str) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    epochs = [r["epoch"] for r in history]
    fig = Figure(figsize=(9, 3.6))
    FigureCanvasAgg(fig)
    losses, accuracy = fig.subplots(1, 2)
    losses.plot(epochs, [r["train_loss"] for r in history], "o-", label="train (epoch mean)")
    losses.plot(epochs, [r["test_loss"] for r in history], "s-", label="test")
    losses.set_ylabel("loss")
    losses.legend()
    accuracy.plot(epochs, [100 * r["test_accuracy"] for r in history], "o-", color="tab:green")
    accuracy.set_ylabel("test accuracy (%)")
    worlds = [r.get("world_size", r.get("workers")) for r in history]
    for i in range(1, len(history)):
        if worlds[i] != worlds[i - 1] and worlds[i] is not None:
            for ax in (losses, accuracy):
                ax.axvline(epochs[i], linestyle=":", color="grey")
            accuracy.annotate(f"{worlds[i]} workers", (epochs[i], accuracy.get_ylim()[0]), fontsize="small",
                              rotation=90, va="bottom", ha="right")
    for ax in (losses, accuracy):
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()
