"""A training run's output directory: claiming it safely, finding what to resume.

Layout of ``<output-dir>``::

    config.json               the run's TrainConfig (written when the run starts)
    metrics.jsonl             one JSON line per finished epoch
    checkpoints/epoch-NNNN.safetensors   full training state after epoch NNNN
    model.safetensors         final weights, plain module names
    summary.json              final figures

Rules that keep data safe:

* A fresh run refuses a directory that holds another run (metrics, a
  summary, weights or checkpoints): nothing already on disk is overwritten.
  A directory holding only a ``config.json`` (a run that died before its
  first checkpoint) or nothing at all may be used.
* ``--resume`` continues from the newest checkpoint and refuses a run whose
  settings differ (other than ``epochs``), a different world size, or a
  corrupt checkpoint (naming the file; it is never deleted for you).
* Without ``--output-dir``, a new ``runs/<dataset>-<model>[-N]`` is picked.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ddpkit.runtime.options import ConfigError
from ddpkit.train.checkpoint import CheckpointError, load_checkpoint, write_atomic

__all__ = ["claim", "latest_checkpoint", "write_json_atomic", "write_metrics", "CHECKPOINT_DIR"]

CHECKPOINT_DIR = "checkpoints"
_CKPT = re.compile(r"^epoch-(\d+)\.safetensors$")
_SCRATCH = {"config.json", CHECKPOINT_DIR}
# Fields that may change between a run and its resumption.
_RESUMABLE_CHANGES = {"epochs", "resume", "output_dir", "progress", "nproc_per_node", "download"}


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` as checkpoints are written (temporary file, fsync, rename)."""
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def latest_checkpoint(out: Path) -> tuple[int, Path] | None:
    """The newest ``(epoch, path)`` in ``out/checkpoints``, or None."""
    found = []
    folder = out / CHECKPOINT_DIR
    if folder.is_dir():
        for p in folder.iterdir():
            m = _CKPT.match(p.name)
            if m:
                found.append((int(m.group(1)), p))
    return max(found) if found else None


def _holds_a_run(out: Path) -> bool:
    for entry in out.iterdir():
        if entry.name == CHECKPOINT_DIR and entry.is_dir() and not any(entry.iterdir()):
            continue
        if entry.name not in _SCRATCH:
            return True
        if entry.name == CHECKPOINT_DIR:
            return True
    return False


def _fresh_default(base: Path) -> Path:
    for n in range(1, 10_000):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            if not _holds_a_run(candidate):
                return candidate
    raise ConfigError(f"no free output directory next to {base}: pass --output-dir")


def claim(config: dict[str, Any], world_size: int) -> tuple[Path, dict[str, Any] | None]:
    """Pick and check the output directory; on ``resume`` load the newest checkpoint.

    Called by one process only (the parent of the workers, or rank 0 under a
    launcher), before training starts.

    Args:
        config: The run's settings as plain data (``TrainConfig.to_dict()``).
        world_size: The number of training processes this run will have.

    Returns:
        The output directory (created, ``config.json`` written) and the
        checkpoint state to resume from, or None for a fresh run.

    Raises:
        ConfigError: the directory holds another run; nothing to resume; the
            checkpoint is corrupt, from a different world size or settings.
    """
    given = config["output_dir"]
    if given is None:
        if config["resume"]:
            raise ConfigError("--resume needs --output-dir: the directory of the run to continue")
        out = _fresh_default(Path("runs") / f"{config['dataset']}-{config['model']}")
        write_json_atomic(out / "config.json", config)
        return out, None
    out = Path(given)
    if not config["resume"]:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--output-dir {str(out)!r} is a file: choose a directory")
        if out.is_dir() and _holds_a_run(out):
            raise ConfigError(
                f"--output-dir {str(out)!r} holds another run (metrics, checkpoints or weights): "
                "choose a new --output-dir, or add --resume to continue that run"
            )
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / "config.json", config)
        return out, None
    return out, _load_resume_state(out, config, world_size)


def _load_resume_state(out: Path, config: dict[str, Any], world_size: int) -> dict[str, Any]:
    latest = latest_checkpoint(out) if out.is_dir() else None
    if latest is None:
        raise ConfigError(
            f"--resume: {str(out)!r} has no checkpoint in {CHECKPOINT_DIR}/ to continue from: "
            "check --output-dir, or drop --resume to start a new run"
        )
    epoch, path = latest
    try:
        state = load_checkpoint(path)
    except CheckpointError as e:
        raise ConfigError(
            f"--resume: {e}. Move that file aside to resume from the checkpoint before it"
        ) from e
    saved = state.get("config", {})
    differs = sorted(
        k for k in set(saved) | set(config)
        if k not in _RESUMABLE_CHANGES and saved.get(k) != config.get(k)
    )
    if differs:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {config.get(k)!r}" for k in differs)
        raise ConfigError(
            f"--resume: the run in {str(out)!r} was started with different settings ({detail}): "
            "resume with the original settings (only --epochs may change)"
        )
    if state["world_size"] != world_size:
        raise ConfigError(
            f"--resume: {path.name} was written by {state['world_size']} processes, this run has "
            f"{world_size}: resume with --nproc-per-node {state['world_size']} (the data order, "
            "learning rate and per-rank RNG states depend on the world size)"
        )
    if epoch >= config["epochs"]:
        raise ConfigError(
            f"--resume: the run in {str(out)!r} has already finished {epoch} epochs: "
            f"pass --epochs greater than {epoch} to train further"
        )
    return state


def write_metrics(out: Path, history: list[dict[str, Any]]) -> None:
    """Rewrite ``metrics.jsonl`` from ``history``, one JSON line per epoch (durable, atomic)."""
    write_atomic(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in history).encode())
