"""A training run's output directory: claiming it safely, finding what to resume.

Layout of ``<output-dir>``::

    config.json               the run's TrainConfig (written when the run starts)
    metrics.jsonl             one JSON line per finished epoch
    checkpoints/step-NNNNNNNN.safetensors   full training state after step N
    model.safetensors         final weights, plain module names
    summary.json              final figures
    curves.png                the losses and the accuracy over the epochs (at the end)

Rules that keep data safe:

* A fresh run refuses a directory that holds another run (metrics, a
  summary, weights or checkpoints): nothing already on disk is overwritten.
  A directory holding only a ``config.json`` (a run that died before its
  first checkpoint) or nothing at all may be used.
* ``--resume`` continues from the newest *valid* checkpoint (a damaged newer
  one is skipped with a warning and left on disk). It refuses settings that
  would change the result (model, data, seed, batch, learning rate,
  optimizer, precision, strategy, ...), listing each difference, and a
  different world size. Operational settings may change (:data:`OPERATIONAL`:
  ``--epochs``, ``--checkpoint-every``, ``--keep-checkpoints``, progress,
  tracing, restarts), and the run says in one line what changed. The data
  folder is compared resolved, and by the content of its files when the path
  differs (:func:`ddpkit.data.datasets.fingerprint`, recorded in
  ``config.json`` when the run starts).
* A restarted attempt (``TORCHELASTIC_RESTART_COUNT`` > 0, or ``ddpkit train
  --max-restarts``) resumes by itself: from the newest valid checkpoint of
  its output directory, or from scratch in that directory when the first
  attempt died before its first checkpoint. Without ``--output-dir`` the
  directory is the newest unfinished ``runs/<dataset>-<model>[-N]`` with the
  same settings.
* Without ``--output-dir``, a fresh run picks a new ``runs/<dataset>-<model>[-N]``.
* One job writes a directory at a time: :mod:`ddpkit.train.lock`. A second job
  started on it, or ``--resume`` into it while its job runs, is refused with an
  error naming that job; a restarted attempt, or a new job after a crash,
  takes the lock over.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from ddpkit.data.datasets import fingerprint
from ddpkit.runtime.durable import write_atomic, write_or_warn
from ddpkit.runtime.options import ConfigError
from ddpkit.train.train_config import TrainConfig, without_inert
from ddpkit.train.lock import LOCK_FILE, RunLock
from ddpkit.train.state import checkpoint_files, newest_valid_checkpoint

__all__ = ["CHECKPOINT_DIR", "Claim", "claim", "release", "write_json_atomic", "write_metrics"]

CHECKPOINT_DIR = "checkpoints"
_SCRATCH = {"config.json", CHECKPOINT_DIR, LOCK_FILE}
_locks: dict[Path, RunLock] = {}
"""The run directories this process holds (one lock each, kept across its attempts)."""
OPERATIONAL = frozenset({"epochs", "resume", "output_dir", "progress", "nproc_per_node", "download", "max_restarts",
                         "trace", "trace_steps", "checkpoint_every", "keep_checkpoints", "tensorboard", "zero",
                         "num_servers", "straggler", "deterministic"})
"""Settings that may change between a run and its resumption: none of them changes the arithmetic (the world
size, which does, is checked on its own; ``zero`` shards the same update, and its checkpoints hold the unsharded
state; ``deterministic`` picks among kernels that compute the same thing)."""
_EXPECTED = {"epochs", "resume", "output_dir", "nproc_per_node"}
"""Operational settings a resumption is expected to change: not worth a line."""
FINGERPRINT = "data_fingerprint"
"""The key of ``config.json`` that holds the data's fingerprint."""


@dataclass(frozen=True)
class Claim:
    """The output directory of a run, and the checkpoint it continues from (if any)."""

    out: Path
    checkpoint: Path | None = None
    epoch: int = 0
    step: int = 0
    world_size: int | None = None
    """The number of processes that wrote the checkpoint."""


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` as checkpoints are written (temporary file, fsync, rename)."""
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_metrics(out: Path, history: list[dict[str, Any]], *, warn: bool = False) -> None:
    """Rewrite ``metrics.jsonl`` from ``history``, one JSON line per epoch (durable, atomic); ``warn``: a failure
    is a warning (training goes on), not an OSError."""
    text = "".join(json.dumps(r) + "\n" for r in history)
    if warn:
        write_or_warn(out / "metrics.jsonl", text)
    else:
        write_atomic(out / "metrics.jsonl", text.encode())


def _holds_a_run(out: Path) -> bool:
    for entry in out.iterdir():
        if entry.name == CHECKPOINT_DIR and entry.is_dir() and not checkpoint_files(entry):
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


def _as_saved(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config with the settings it does not name (added in a later version) at their defaults, and those it
    held to no effect too (:func:`~ddpkit.train.train_config.without_inert`)."""
    defaults = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
    return {**defaults, **without_inert({**defaults, **saved})}


def _same(key: str, a: Any, b: Any) -> bool:
    if key == "data_dir" and a is not None and b is not None:
        return Path(a).resolve() == Path(b).resolve()  # the same folder spelled another way
    return a == b


def _differences(saved: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """The settings that differ and would change the result."""
    saved = _as_saved(saved)
    keys = (set(saved) | set(config)) - OPERATIONAL - {FINGERPRINT}
    return sorted(k for k in keys if not _same(k, saved.get(k), config.get(k)))


def _operational_changes(saved: dict[str, Any], config: dict[str, Any]) -> list[str]:
    saved = _as_saved(saved)
    return [f"{k} {saved.get(k)!r} -> {config.get(k)!r}" for k in sorted(OPERATIONAL - _EXPECTED)
            if saved.get(k) != config.get(k)]


def _same_data(out: Path, saved: dict[str, Any], config: dict[str, Any]) -> bool:
    """Whether the data at ``config``'s folder is the run's, by content (the run's fingerprint, else the old
    folder's files when they are still there)."""
    try:
        recorded = json.loads((out / "config.json").read_text()).get(FINGERPRINT)
    except (OSError, json.JSONDecodeError):
        recorded = None
    if recorded is None and saved.get("data_dir") and Path(saved["data_dir"]).is_dir():
        recorded = fingerprint(saved["dataset"], saved["data_dir"])
    return recorded is not None and recorded == fingerprint(config["dataset"], config["data_dir"])


def _write_config(out: Path, config: dict[str, Any]) -> None:
    write_json_atomic(out / "config.json", {**config, FINGERPRINT: fingerprint(config["dataset"], config["data_dir"])})


def _unfinished_default(config: dict[str, Any]) -> Path | None:
    """The newest ``runs/<dataset>-<model>[-N]`` with these settings and no summary yet."""
    base = Path("runs")
    candidates = []
    for d in base.glob(f"{config['dataset']}-{config['model']}*") if base.is_dir() else []:
        cfg = d / "config.json"
        if d.is_dir() and cfg.is_file() and not (d / "summary.json").exists():
            try:
                saved = json.loads(cfg.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if not _differences(saved, config):
                candidates.append((cfg.stat().st_mtime, d))
    return max(candidates)[1] if candidates else None


def claim(config: dict[str, Any], world_size: int, *, restart: bool = False, any_world: bool = False) -> Claim:
    """Pick and check the output directory, and the checkpoint to continue from.

    Called by one process only (the parent of the workers, or rank 0 under a
    launcher), before training starts.

    Args:
        config: The run's settings as plain data (``TrainConfig.to_dict()``).
        world_size: The number of training processes this run will have.
        restart: This is a restarted attempt: resume if there is anything to
            resume, else start in the same directory.
        any_world: A resumed run may have another number of processes (the
            fault-tolerant mode keeps the starting world's batch at any size).

    Raises:
        ConfigError: the directory holds another run; nothing to resume;
            every checkpoint is damaged; a checkpoint from different
            settings, or (unless ``restart``: an elastic job's new round) from
            a different world size.
    """
    given = config["output_dir"]
    if given is None and restart:
        found = _unfinished_default(config)
        given = str(found) if found is not None else None
    if given is None:
        if config["resume"]:
            raise ConfigError("--resume needs --output-dir: the directory of the run to continue")
        out = _fresh_default(Path("runs") / f"{config['dataset']}-{config['model']}")
        _lock(out)
        _write_config(out, config)
        return Claim(out)
    out = Path(given)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir {str(out)!r} is a file: choose a directory")
    _check_writable(out)
    fresh_lock = out.resolve() not in _locks
    _lock(out)
    try:
        return _claim_locked(out, config, world_size, restart, any_world)
    except BaseException:
        if fresh_lock:
            release(out)  # the directory is not ours after all: leave no lock in it
        raise


def _claim_locked(out: Path, config: dict[str, Any], world_size: int, restart: bool, any_world: bool) -> Claim:
    has_checkpoints = bool(checkpoint_files(out / CHECKPOINT_DIR))
    if config["resume"] and not has_checkpoints and _died_before_a_checkpoint(out, config):
        print(f"ddpkit train: {str(out)!r} holds this run's settings but no checkpoint yet (it stopped before its "
              "first): starting it again from the start", flush=True)
        return Claim(out)
    if not config["resume"] and not (restart and has_checkpoints):
        if out.is_dir() and _holds_a_run(out) and not restart:
            raise ConfigError(
                f"--output-dir {str(out)!r} holds another run (metrics, checkpoints or weights): "
                "choose a new --output-dir, or add --resume to continue that run"
            )
        out.mkdir(parents=True, exist_ok=True)
        if not (restart and (out / "config.json").is_file()):
            _write_config(out, config)
        return Claim(out)
    return _resume_claim(out, config, world_size, finished_ok=restart, any_world=any_world)


def _died_before_a_checkpoint(out: Path, config: dict[str, Any]) -> bool:
    """``out`` holds only the ``config.json`` of a run with these settings (it stopped before its first checkpoint)."""
    try:
        saved = json.loads((out / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return not _holds_a_run(out) and not _differences(saved, config)


def _check_writable(out: Path) -> None:
    """Refuse, before anything runs, a run directory this process cannot write (read-only, no permission)."""
    existing = next((p for p in [out, *out.parents] if p.exists()), None)
    if existing is None:
        return
    try:
        probe = existing / f".ddpkit-write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--output-dir {str(out)!r} cannot be written ({e.strerror}: {existing}): choose a "
                          "writable directory") from None


def _lock(out: Path) -> None:
    """Hold ``out``'s lock for this process (see :mod:`ddpkit.train.lock`); once per directory."""
    key = out.resolve()
    if key in _locks:
        return
    lock = RunLock(out)
    note = lock.acquire()
    _locks[key] = lock
    if note:
        print(f"ddpkit train: {note}", flush=True)


def release(out: Path | None = None) -> None:
    """Give up the lock of ``out`` (all this process holds when None): the run has ended, well or not."""
    for key in [k for k in _locks if out is None or k == Path(out).resolve()]:
        _locks.pop(key).release()


def _resume_claim(out: Path, config: dict[str, Any], world_size: int, *, finished_ok: bool,
                  any_world: bool = False) -> Claim:
    folder = out / CHECKPOINT_DIR
    if not checkpoint_files(folder):
        raise ConfigError(
            f"--resume: {str(out)!r} has no checkpoint in {CHECKPOINT_DIR}/ to continue from: "
            "check --output-dir, or drop --resume to start a new run"
        )
    with warnings.catch_warnings(record=True) as skipped:
        warnings.simplefilter("always")
        found = newest_valid_checkpoint(folder)
    for w in skipped:
        warnings.warn(str(w.message), UserWarning, stacklevel=3)
    if found is None:
        raise ConfigError(
            f"--resume: every checkpoint in {folder} is damaged ({'; '.join(str(w.message) for w in skipped)}): "
            "move them aside to start again"
        )
    path, payload = found
    extra = payload.get("extra", {})
    saved = _as_saved(extra.get("config", {}))
    differs = _differences(saved, config)
    notes = _operational_changes(saved, config)
    if "data_dir" in differs and saved.get("dataset") == config["dataset"] and _same_data(out, saved, config):
        differs.remove("data_dir")
        notes.append(f"data_dir {saved.get('data_dir')!r} -> {config.get('data_dir')!r} (the same files)")
    if differs:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {config.get(k)!r}" for k in differs)
        raise ConfigError(
            f"--resume: the run in {str(out)!r} ({path.name}) was started with different settings that would "
            f"change its result ({detail}): resume with the original values (`ddpkit train --resume "
            f"--output-dir {out}` alone takes them from its config.json); only operational settings "
            f"({', '.join(sorted(OPERATIONAL - {'resume', 'output_dir', 'nproc_per_node'}))}) may change, and "
            "--nproc-per-node only to the same world size"
        )
    if notes:
        print(f"ddpkit train: resuming {str(out)!r} with changed settings: {', '.join(notes)}", flush=True)
    if extra.get("world_size") != world_size and not (finished_ok or any_world):
        raise ConfigError(
            f"--resume: {path.name} was written by {extra.get('world_size')} processes, this run has "
            f"{world_size}: resume with --nproc-per-node {extra.get('world_size')} (the data order, "
            "learning rate and per-rank RNG states depend on the world size)"
        )
    epoch = int(extra.get("epoch", 0))
    # A run that trained every epoch but stopped before its final weights and summary may finish with --resume.
    if epoch >= config["epochs"] and not finished_ok and (out / "summary.json").exists():
        raise ConfigError(
            f"--resume: the run in {str(out)!r} has already finished {epoch} epochs: "
            f"pass --epochs greater than {epoch} to train further"
        )
    return Claim(out, path, epoch, int(payload["step"]), extra.get("world_size"))
