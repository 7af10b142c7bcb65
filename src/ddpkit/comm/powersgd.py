"""PowerSGD: low-rank gradient compression as a DDP comm hook (Vogels et al., 2019).

Each gradient matrix M (n x m, a parameter's gradient viewed as rows x the
rest) is sent as two thin factors instead: P = M Q (n x r) and Q = M^T P
(m x r), so n*m numbers become (n + m) * r on the wire. One iteration of
power iteration per step, seeded from the previous step's Q (warm start),
keeps the approximation good; the part of the gradient the approximation
loses is added to the next step's gradient (error feedback), so nothing is
lost over time.

Per bucket and step:

1. Add last step's error (error feedback) and keep a copy of the input.
2. Split the bucket's gradients: matrices worth compressing
   (``(n + m) * r * min_compression_rate < n * m``) and the rest (biases,
   small layers), which are all-reduced together, uncompressed, and averaged.
3. Q: last step's (warm start) or Gaussian from the state's seeded generator;
   orthonormalise its columns. P = M Q; all-reduce the Ps (summed; their
   scale does not matter, they are orthonormalised next).
4. Orthonormalise P; Q = M^T P; all-reduce the Qs and divide by the world size.
5. M = P Q^T, written into the bucket; error = input - M.

For the first ``start_powerSGD_iter`` steps buckets are averaged exactly (the
start of training is sensitive to noisy gradients); iterations are counted
on the last bucket of each step. The arithmetic, its order and the random
stream are those of torch's ``powerSGD_hook`` with the same settings, so both
give the same numbers; ``PowerSGDState`` has torch's attribute names, so
either state works with either hook.

Example::

    state = ddpkit.hooks.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=10)
    model.register_comm_hook(state, ddpkit.hooks.powersgd_hook)

A checkpoint keeps each rank's ``state.state_dict()`` and the buckets (``model.bucket_indices()``); a resumed run
calls ``model.restore_buckets(indices)`` and ``state.load_state_dict(...)`` before its first step and goes on in
the same bits (the memory is per bucket, and torch's DDP would reduce its first step in other buckets).
"""

# No ``from __future__ import annotations``: torch's DDP checks the hook's annotations as objects (see
# ddpkit.comm.bucket_hooks), and powersgd_hook runs on torch's DDP too (one bucket on gloo, as torch's hook).

import logging
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddpkit.comm.bucket import GradBucket
from ddpkit.comm.bucket_hooks import average
from ddpkit.runtime import events

__all__ = ["PowerSGDState", "powersgd_hook"]

log = logging.getLogger(__name__)


class PowerSGDState:
    """Hyper-parameters and per-bucket memory of :func:`powersgd_hook`.

    Args:
        process_group: the group to reduce over; ``None``: the world.
        matrix_approximation_rank: r, the rank of the approximation (1-4
            usually; higher is more accurate and sends more).
        start_powerSGD_iter: exact averaging before this step (at least 2 with
            error feedback or warm start, because the buckets are rebuilt after
            the first step).
        min_compression_rate: compress a matrix only if it shrinks by more
            than this factor.
        use_error_feedback: carry each step's approximation error to the next.
        warm_start: start each step's power iteration from the last Q.
        orthogonalization_epsilon: added to column norms, against all-zero
            columns (0: exact).
        random_seed: seed of the initial Qs (the same on every rank).
        compression_stats_logging_frequency: log the compression rate every
            this many steps (logger ``ddpkit.hooks``, level INFO).
        batch_tensors_with_same_shape: compress same-shaped matrices in one
            batched product.

    Raises:
        ValueError: ``start_powerSGD_iter <= 1`` with error feedback or warm
            start; a rank below 1; a negative epsilon.
    """

    __slots__ = [
        "process_group", "matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
        "orthogonalization_epsilon", "use_error_feedback", "warm_start", "batch_tensors_with_same_shape", "rng",
        "error_dict", "p_memory_dict", "q_memory_dict", "iter", "total_numel_before_compression",
        "total_numel_after_compression", "compression_stats_logging_frequency", "next_stats_report",
    ]

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,  # noqa: N803 - torch's name
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        if isinstance(matrix_approximation_rank, bool) or not isinstance(matrix_approximation_rank, int) \
                or matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank={matrix_approximation_rank!r} must be an integer >= 1")
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                f"start_powerSGD_iter={start_powerSGD_iter}: expect `start_powerSGD_iter` > 1 if "
                "`use_error_feedback` or `warm_start` is enabled, because PowerSGD can only be applied after "
                "the first two iterations in DDP (the buckets are rebuilt after the first one)"
            )
        if orthogonalization_epsilon < 0:
            raise ValueError(f"orthogonalization_epsilon={orthogonalization_epsilon} must be >= 0 (try 1e-8)")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.next_stats_report = 0
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape

    def __getstate__(self) -> dict[str, Any]:
        # The process group belongs to this process; the world's is taken on load.
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot != "process_group"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None
        for slot, value in state.items():
            setattr(self, slot, value)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps to go on exactly (this rank's: the error differs between ranks): the step count,
        the generator's state, each bucket's error and P and Q memory (on the CPU), the compression counts. The
        settings are the constructor's; the process group is this process's.

        Resume it with a model that reduces in the same buckets (``DistributedDataParallel.restore_buckets``),
        since the memory is kept per bucket."""
        def cpu(tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            return {int(i): t.detach().cpu().clone() for i, t in tensors.items()}

        kind, keys, position, has_gauss, gauss = self.rng.get_state()
        return {"iter": self.iter, "rng": {"kind": kind, "keys": keys.copy(), "position": int(position),
                                           "has_gauss": int(has_gauss), "gauss": float(gauss)},
                "error": cpu(self.error_dict), "p": cpu(self.p_memory_dict), "q": cpu(self.q_memory_dict),
                "numel": [self.total_numel_before_compression, self.total_numel_after_compression],
                "next_stats_report": self.next_stats_report}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str | None = None) -> None:
        """Take back :meth:`state_dict` (copies of its tensors, on ``device``; without one they move to the
        buckets' device at their first use).

        Raises:
            ValueError: ``state`` is not a PowerSGD state (a key missing).
        """
        missing = {"iter", "rng", "error", "p", "q", "numel", "next_stats_report"} - set(state)
        if missing:
            raise ValueError(f"PowerSGDState.load_state_dict: not a PowerSGD state, {sorted(missing)} missing")
        rng = state["rng"]
        self.rng.set_state((rng["kind"], np.asarray(rng["keys"], dtype=np.uint32), int(rng["position"]),
                            int(rng["has_gauss"]), float(rng["gauss"])))
        self.iter = int(state["iter"])
        self.error_dict, self.p_memory_dict, self.q_memory_dict = (
            {int(i): t.to(device, copy=True) if device is not None else t.clone() for i, t in state[key].items()}
            for key in ("error", "p", "q"))
        self.total_numel_before_compression, self.total_numel_after_compression = (int(n) for n in state["numel"])
        self.next_stats_report = int(state["next_stats_report"])

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count a step when its last bucket passes."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                log.info("PowerSGD: compression starts after %d exact iterations", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """(rate, elements before, elements after) over every compressed step so far."""
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after > 0 else 0
        return rate, self.total_numel_before_compression, after


def _orthonormalise(matrices: torch.Tensor, epsilon: float) -> None:
    """Orthonormalise the columns of each matrix of a (batch, rows, r) tensor, in place.

    Gram-Schmidt for r <= 2 and for half precision (QR has no half kernels);
    a QR factorisation otherwise.
    """
    batch, _, rank = matrices.shape
    if rank > 2 and matrices.dtype not in (torch.float16, torch.bfloat16):
        r = torch.empty(batch, rank, rank, device=matrices.device, dtype=matrices.dtype)
        torch.linalg.qr(matrices, out=(matrices, r))
        return
    for i in range(rank):
        col = matrices[:, :, i : i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        col /= norm if epsilon == 0 else norm + epsilon
        if i + 1 < rank:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def _split(state: Any, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(matrices worth compressing, tensors sent as they are), counting the elements either way."""
    compress, plain = [], []
    for t in tensors:
        matrix = t.view(t.shape[0], -1)
        n, m = matrix.shape
        rank = min(n, m, state.matrix_approximation_rank)
        before, after = n * m, (n + m) * rank
        state.total_numel_before_compression += before
        if after * state.min_compression_rate < before:
            compress.append(matrix)
            state.total_numel_after_compression += after
        else:
            plain.append(t)
            state.total_numel_after_compression += before
    return compress, plain


def _log_stats(state: Any, bucket: GradBucket) -> None:
    if bucket.is_last() and state.iter >= state.next_stats_report:
        rate, before, after = state.compression_stats()
        log.info("PowerSGD: iteration %d, %d elements before compression, %d after, rate %.1f",
                 state.iter, before, after, rate)
        state.next_stats_report = state.iter + state.compression_stats_logging_frequency


def _error_feedback(state: Any, index: int, flat: torch.Tensor) -> torch.Tensor | None:
    """Add the bucket's kept error to it; return a copy of the corrected bucket (None without error feedback)."""
    if not state.use_error_feedback:
        return None
    if index in state.error_dict:
        if state.error_dict[index].device != flat.device:  # loaded from a checkpoint onto another device
            state.error_dict[index] = state.error_dict[index].to(flat.device)
        flat.add_(state.error_dict[index])
    else:
        state.error_dict[index] = torch.zeros(flat.shape[0], device=flat.device, dtype=flat.dtype)
    return flat.detach().clone()


def _batch(matrices: list[torch.Tensor], stack: bool,
           ) -> tuple[dict[torch.Size, list[torch.Tensor]], list[torch.Tensor]]:
    """Same-shaped matrices grouped in first-seen order, and one (1, n, m) view each, or (``stack``) stacked."""
    by_shape: dict[torch.Size, list[torch.Tensor]] = {}
    for matrix in matrices:
        by_shape.setdefault(matrix.shape, []).append(matrix)
    batches: list[torch.Tensor] = []
    for same in by_shape.values():
        if stack:
            batches.append(same[0].unsqueeze(0) if len(same) == 1 else torch.stack(same))
        else:
            batches.extend(m.unsqueeze(0) for m in same)
    return by_shape, batches


def _factors(state: Any, index: int, batches: list[torch.Tensor], device: torch.device,
             dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each batch's P and Q, views into the bucket's P and Q memory; the Qs orthonormalised (fresh: drawn)."""
    ranks = [min(b.shape[1], b.shape[2], state.matrix_approximation_rank) for b in batches]
    p_size = sum(b.shape[0] * b.shape[1] * r for b, r in zip(batches, ranks))
    q_size = sum(b.shape[0] * b.shape[2] * r for b, r in zip(batches, ranks))
    fresh = not state.warm_start or index not in state.p_memory_dict
    if not fresh and state.p_memory_dict[index].device != device:  # loaded from a checkpoint onto another device
        state.p_memory_dict[index] = state.p_memory_dict[index].to(device)
        state.q_memory_dict[index] = state.q_memory_dict[index].to(device)
    if fresh:
        state.p_memory_dict[index] = torch.empty(p_size, device=device, dtype=dtype)
        state.q_memory_dict[index] = torch.empty(q_size, device=device, dtype=dtype)
    ps, qs = [], []
    p_at = q_at = 0
    for b, r in zip(batches, ranks):
        k, n, m = b.shape
        ps.append(state.p_memory_dict[index][p_at : p_at + k * n * r].view(k, n, r))
        qs.append(state.q_memory_dict[index][q_at : q_at + k * m * r].view(k, m, r))
        p_at += k * n * r
        q_at += k * m * r
    if fresh:
        # Every rank draws the same Qs: the state's generator, seeded alike, on the CPU.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=dtype))
                _orthonormalise(q, state.orthogonalization_epsilon)
    else:
        for q in qs:
            _orthonormalise(q, state.orthogonalization_epsilon)
    return ps, qs


def powersgd_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce one bucket with PowerSGD (see the module notes); for ``register_comm_hook``.

    ``state`` is a :class:`PowerSGDState` (or torch's, which has the same
    fields). The future's value is the bucket's averaged (approximated)
    gradients, written into the bucket itself.
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    flat = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return average(group, flat)
    index = bucket.index()
    device, dtype = flat.device, flat.dtype

    kept = _error_feedback(state, index, flat)
    matrices, plain = _split(state, bucket.gradients())
    _log_stats(state, bucket)
    plain_flat = torch.cat([t.view(-1) for t in plain]) if plain else torch.tensor([], device=device, dtype=dtype)
    by_shape, batches = _batch(matrices, state.batch_tensors_with_same_shape)
    ps, qs = _factors(state, index, batches, device, dtype)
    for b, q, p in zip(batches, qs, ps):
        torch.bmm(b, q, out=p)

    def unpack_plain(averaged: torch.Tensor) -> None:
        averaged.div_(world)
        at = 0
        for t in plain:
            t.copy_(averaged[at : at + t.numel()].view_as(t))
            at += t.numel()

    def compute_qs(summed_ps: torch.Tensor) -> torch.Tensor:
        state.p_memory_dict[index] = summed_ps
        for p in ps:
            _orthonormalise(p, state.orthogonalization_epsilon)
        for b, p, q in zip(batches, ps, qs):
            torch.bmm(b.transpose(1, 2), p, out=q)
        return state.q_memory_dict[index]

    def decompress(summed_qs: torch.Tensor) -> torch.Tensor:
        state.q_memory_dict[index] = summed_qs.div_(world)
        for p, q, b in zip(ps, qs, batches):
            torch.bmm(p, q.transpose(1, 2), out=b)
        if state.batch_tensors_with_same_shape:
            for b in batches:
                if b.shape[0] > 1:  # a stacked copy: back into the bucket
                    for original, approx in zip(by_shape[b.shape[1:]], b):
                        original.copy_(approx)
        if flat.is_cuda:
            torch.cuda.synchronize(device)
        if kept is not None:
            state.error_dict[index] = kept - flat
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        state.maybe_increase_iter(bucket)
        return flat

    def all_reduce(t: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        return dist.all_reduce(t, group=group, async_op=True).get_future()

    if isinstance(bucket, GradBucket):
        # ddpkit's reducer: the uncompressed part and the Ps go out now (P = M Q
        # needs nothing from the others); the Q stage runs when the reducer
        # collects this bucket, in bucket order, so every rank issues the
        # collectives of all buckets in one order.
        p_memory = state.p_memory_dict[index]
        events.collective("PowerSGD bucket {}: all-reduce the uncompressed part and P", index,
                          nbytes=(plain_flat.numel() + p_memory.numel()) * flat.element_size())
        plain_work, p_work = all_reduce(plain_flat), all_reduce(p_memory)

        def finish() -> torch.Tensor:
            unpack_plain(plain_work.wait()[0])
            qs_flat = compute_qs(p_work.wait()[0])
            events.collective("PowerSGD bucket {}: all-reduce Q", index,
                              nbytes=qs_flat.numel() * qs_flat.element_size())
            return decompress(all_reduce(qs_flat).wait()[0])

        return _OnWait(finish)
    # torch's reducer (one bucket per step on gloo): torch's chain of callbacks.
    return (
        all_reduce(plain_flat)
        .then(lambda f: (unpack_plain(f.value()[0]), all_reduce(state.p_memory_dict[index]).wait()[0])[1])
        .then(lambda f: all_reduce(compute_qs(f.value())).wait()[0])
        .then(lambda f: decompress(f.value()))
    )


class _OnWait(torch.futures.Future):
    """A future whose remaining work runs on the thread that first waits for it.

    Collectives issued from future callbacks run on whichever thread completes
    the previous step, in an order that differs between ranks when several
    buckets are in flight (with gloo this deadlocks: torch's own PowerSGD
    hook hangs with more than one bucket). Running the last stage where the
    reducer waits, bucket by bucket, keeps the order the same everywhere.
    """

    def __init__(self, finish: Any) -> None:
        super().__init__()
        self._finish = finish

    def wait(self) -> Any:
        finish, self._finish = self._finish, None
        if finish is not None:
            try:
                self.set_result(finish())
            except BaseException as exc:
                self.set_exception(exc)
                raise
        return super().wait()

    def value(self) -> Any:
        self.wait()
        return super().value()

    def then(self, callback: Any) -> torch.futures.Future:
        """As ``Future.then``, run where the returned future is first waited for (a compression wrapper's
        ``hook(state, bucket).then(decompress)``): this future's own work would otherwise never run."""
        def finish() -> Any:
            self.wait()
            return callback(self)

        return _OnWait(finish)
