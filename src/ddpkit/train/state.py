"""``TrainState``: save a run's whole state and restore it, for ``ddpkit train`` and your own loop.

What is saved: the model (its plain state dict, no ``module.`` prefix),
optimizer, grad scaler, sampler position (mid-epoch too), the step, your
``extra`` data (tensors and plain data) and every rank's RNG states (CPU, and
CUDA when in use), gathered so that each rank gets its own back.

Where: one file per save, ``DIR/step-NNNNNNNN.safetensors``, written by rank 0
atomically (temporary file, fsync, rename) with checksums of every tensor;
all ranks return once it is on disk. The ``keep`` newest are kept; older ones
are deleted after a successful save, so the newest valid checkpoint is never
among them.

Restoring picks the newest checkpoint that loads and verifies; a damaged one
is skipped with a warning naming it. Rank 0 chooses and tells the others, so
every rank restores the same file.

Example (your own loop, restartable under ``ddpkit launch --max-restarts 3``)::

    state = ddpkit.TrainState(model=model, optimizer=opt, sampler=sampler)
    state.restore("ckpt")                    # state.step: 0 when there is nothing to resume
    while state.step < total_steps:
        ...one training step (optimizer.step() advances state.step)...
        if state.step % 100 == 0:
            state.save("ckpt")
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.data.sampler import DistributedSampler
from ddpkit.parallel.zero.stage3 import engine_of
from ddpkit.parallel.zero.whole import full_state, shard_optimizer_state
from ddpkit.runtime.devices import comm_tensor
from ddpkit.train.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_model_state,
    save_checkpoint,
)

__all__ = ["TrainState", "checkpoint_files", "newest_valid_checkpoint", "prune_checkpoints"]

_NAME = re.compile(r"^step-(\d+)\.safetensors$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.safetensors"


def checkpoint_files(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint in ``directory``, oldest first."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def prune_checkpoints(directory: str | os.PathLike, keep: int, written: Path) -> None:
    """Delete all but the newest ``keep`` checkpoints of ``directory``, never ``written`` (the one just saved: a
    damaged newer one, skipped by a resume, must not push it out)."""
    for _, old in checkpoint_files(directory)[:-keep]:
        if old != written:
            old.unlink(missing_ok=True)


def newest_valid_checkpoint(directory: str | os.PathLike) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads and verifies, and its contents; None when there is none.

    Damaged ones newer than it are skipped with a ``UserWarning`` naming them
    (they are left on disk for you to inspect).
    """
    for _, path in reversed(checkpoint_files(directory)):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as e:
            warnings.warn(f"skipping checkpoint {path}: {e}", UserWarning, stacklevel=2)
        except FileNotFoundError:
            continue  # removed since the listing (a writer keeping only the newest few): an older one will do
    return None


class TrainState:
    """The objects a training run needs to continue exactly where it stopped.

    Args:
        model: the model; a DDP/DataParallel wrapper is unwrapped for saving.
        optimizer: its state (momentum, Adam moments, the step count).
        sampler: a :class:`ddpkit.DistributedSampler`; its epoch and position.
        scaler: a ``torch.amp.GradScaler``.
        extra: your own data (epoch, metrics, ...): tensors and plain data.
            :meth:`restore` replaces it with the saved one.
        keep: how many checkpoints to keep in the directory (default 3).
        count_steps: advance :attr:`step` at every ``optimizer.step()`` (a
            step post-hook), so ``save(dir)`` needs no step. Default True.

    Warning:
        :meth:`save` and :meth:`restore` are collectives: every rank calls them.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: DistributedSampler | None = None,
        scaler: torch.amp.GradScaler | None = None,
        extra: dict[str, Any] | None = None,
        keep: int = 3,
        count_steps: bool = True,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} must be at least 1: the newest checkpoint is always kept")
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.scaler = scaler
        self.extra: dict[str, Any] = dict(extra or {})
        self.keep = keep
        self.step = 0
        """Optimizer steps taken (counted when ``count_steps``), or as last saved, restored or set."""
        if optimizer is not None and count_steps:
            optimizer.register_step_post_hook(self._count_step)

    def _count_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step += 1

    # -- contents ---------------------------------------------------------------

    def _plain_model(self) -> nn.Module:
        model = self.model
        while hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        return getattr(model, "_orig_mod", model)

    def payload(self, step: int, *, sampler_consumed: int | None = None) -> dict[str, Any]:
        """The checkpoint contents at ``step``; a collective (every rank's RNG state is gathered).

        A ZeRO-3 model's (and optimizer's) state is gathered unit by unit into the writing rank's CPU memory: no
        rank holds it whole on its device, and the other ranks hold none of it.
        """
        out: dict[str, Any] = {"step": int(step), "extra": self.extra, "rng": _gather_rng_states()}
        engine = engine_of(self._plain_model())
        if engine is not None:
            out["model"], optim = full_state(engine, self._plain_model(), self.optimizer, to=0)
            if self.optimizer is not None:
                out["optimizer"] = optim
        else:
            out["model"] = self._plain_model().state_dict()
            if self.optimizer is not None:
                out["optimizer"] = self._optimizer_state()
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        if self.sampler is not None:
            out["sampler"] = self.sampler.state_dict(consumed=sampler_consumed)
        return out

    def _optimizer_state(self) -> dict[str, Any] | None:
        """The optimizer's state dict; a sharded optimizer's (``ddpkit.ZeroRedundancyOptimizer``) is gathered on
        the writing rank first (a collective), in the unsharded format, so it loads at any world size."""
        consolidate = getattr(self.optimizer, "consolidate_state_dict", None)
        if consolidate is None:
            return self.optimizer.state_dict()  # type: ignore[union-attr]
        consolidate(to=0)
        return self.optimizer.state_dict() if _is_writer() else None  # type: ignore[union-attr]

    def load(self, payload: dict[str, Any], source: str | os.PathLike | None = None) -> int:
        """Put a :meth:`payload` back (this rank takes its own RNG state); return its step.

        Raises:
            CheckpointError: the payload is another model's (a tensor missing, extra, or of another shape),
                naming the first such tensor and ``source`` (the file it came from).
        """
        engine = engine_of(self._plain_model())
        with engine.sharded_state() if engine is not None else contextlib.nullcontext():  # shapes, no gathering
            _same_model(self._plain_model(), payload["model"], source)
            wants_prefix = any(k.startswith("module.") for k in self._plain_model().state_dict())
        load_model_state(self._plain_model(), payload["model"], wants_prefix=wants_prefix)
        for name in ("optimizer", "scaler", "sampler"):
            target = getattr(self, name)
            if target is None:
                continue
            if name not in payload:
                raise CheckpointError(f"the checkpoint holds no {name} state, but this TrainState has one")
            sharded = engine is not None and name == "optimizer"  # each rank keeps its rows: copies, not views
            target.load_state_dict(shard_optimizer_state(engine, target, payload[name]) if sharded else payload[name])
        self.extra = dict(payload.get("extra", {}))
        _set_rng_states(payload["rng"])
        self.step = int(payload["step"])
        return self.step

    # -- files ------------------------------------------------------------------

    def save(self, directory: str | os.PathLike, step: int | None = None, *,
             sampler_consumed: int | None = None, within: str | os.PathLike | None = None) -> Path:
        """Save to ``directory/step-NNNNNNNN.safetensors`` (rank 0 writes; all return once on disk).

        Args:
            directory: the checkpoint folder (created if needed).
            step: the step to record (default: :attr:`step`, which counts
                optimizer steps); :meth:`restore` returns it.
            sampler_consumed: samples of the current epoch this rank has used,
                when a ``DataLoader`` prefetches ahead of the loop (see
                :meth:`ddpkit.DistributedSampler.state_dict`).
            within: a folder that must still exist (the run directory): if it
                was removed, the save fails instead of creating it again.

        Raises:
            CheckpointError: on every rank, naming the file and the cause;
                the checkpoints already written are left as they were.

        Returns:
            The file written.
        """
        step = self.step if step is None else int(step)
        path = Path(directory) / checkpoint_name(step)
        save_checkpoint(path, self.payload(step, sampler_consumed=sampler_consumed), within=within)
        self.step = step
        if _is_writer():
            prune_checkpoints(directory, self.keep, path)
        return path

    def restore(self, directory: str | os.PathLike) -> int:
        """Restore the newest valid checkpoint in ``directory``; return its step (0: none found)."""
        found = newest_valid_checkpoint(directory) if _is_writer() else None
        chosen = [str(found[0]) if found else None]
        if _grouped():
            # Rank 0 chooses, so every rank restores the same file even if
            # one was damaged between two ranks' reads.
            dist.broadcast_object_list(chosen, src=0)
        if chosen[0] is None:
            return 0
        payload = found[1] if found is not None else load_checkpoint(chosen[0])
        return self.load(payload)


def _same_model(model: nn.Module, saved: dict[str, Any], source: str | os.PathLike | None) -> None:
    """Raise :class:`CheckpointError` unless ``saved`` holds exactly ``model``'s tensors, in its shapes."""
    where = f"checkpoint {source}" if source is not None else "the checkpoint"
    mine = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k.removeprefix("module."): tuple(getattr(v, "shape", ())) for k, v in saved.items()}
    for name, shape in mine.items():
        if name not in theirs:
            raise CheckpointError(f"{where} is not of this model: it has no tensor {name!r} (this model's is "
                                  f"{list(shape)}): resume from a checkpoint of the same model")
        if theirs[name] != shape:
            raise CheckpointError(f"{where} is not of this model: its tensor {name!r} has shape "
                                  f"{list(theirs[name])}, this model's {list(shape)}: resume from a checkpoint "
                                  "of the same model")
    if extra := sorted(set(theirs) - set(mine)):
        raise CheckpointError(f"{where} is not of this model: it has tensors this model lacks ({', '.join(extra[:3])}"
                              f"{', ...' if len(extra) > 3 else ''}): resume from a checkpoint of the same model")


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _is_writer() -> bool:
    return not _grouped() or dist.get_rank() == 0


def _rank() -> int:
    return dist.get_rank() if _grouped() else 0


def _gather_rng_states() -> dict[str, torch.Tensor]:
    """Every rank's RNG states, stacked by rank (a collective)."""
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    if not _grouped():
        return {name: s.unsqueeze(0) for name, s in states.items()}
    out = {}
    for name, s in states.items():
        mine = comm_tensor(s)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        out[name] = torch.stack(parts).cpu()
    return out


def _set_rng_states(rng: dict[str, torch.Tensor]) -> None:
    rank = _rank()
    states = rng["torch"]
    if rank >= len(states):
        # More ranks than saved them (an elastic job grew): a new stream per
        # rank, derived from rank 0's saved state so it is reproducible.
        g = torch.Generator()
        g.set_state(states[0].clone())
        torch.manual_seed(int(torch.randint(2**62, (1,), generator=g)) + rank)
        return
    torch.set_rng_state(states[rank].clone())
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"][rank].clone())
