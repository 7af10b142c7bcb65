"""``comm="auto"``: the gradient reduction chosen from the measured link, at the user's model, batch and optimizer.

Which reduction is fastest depends on the network: on a fast link the exact all-reduce hides behind the backward
and compression only adds work; at 1 Gbit/s half precision halves the wire time; at 100 Mbit/s PowerSGD's low-rank
factors make a step many times shorter. :class:`AutoComm` is a comm hook's state (register it with
:func:`auto_hook`, or pass ``comm="auto"`` to :class:`ddpkit.DistributedDataParallel`) that decides as training
runs, in three phases:

1. **Start** (``start`` steps, default 10): the exact all-reduce (the start of training is where compression hurts
   most, as PowerSGD's own start steps), timing each step: from one step's first bucket to the next step's.
2. **Probe and predict**: a short probe of the link with all-reduces of growing sizes (every rank takes part; the
   slowest rank's times count), fitted as ``latency + bytes / bandwidth``; a cost model of each candidate's bytes
   and collectives per step over the model's buckets (and PowerSGD's products, timed on this machine) predicts
   its step time as the exact step's minus the exact reduction's time plus the candidate's. Candidates: fp16,
   bf16 and PowerSGD at ranks 1, 2, 4 and 8 (or the list given, ``comm="auto:fp16,powersgd:2"``). A candidate is
   tried only if predicted at least 5 % faster than the exact step; none is: the exact all-reduce stays, without
   a trial.
3. **Trial** (``trial`` steps each, default 8) of the ``tries`` best-predicted (default 3): each runs on the real
   steps; PowerSGD starts with two exact steps (its error feedback needs them); each is timed from its fourth
   step (after its first compressed one, which allocates PowerSGD's factors). The
   slowest rank's median step of each counts; the fastest wins, and a less lossy one within 5 % of it is
   preferred (exact, then half precision, then PowerSGD by falling rank). Every rank computes the same choice from
   the same all-reduced numbers.

The decision is printed once (rank 0, and the ``ddpkit.comm.auto`` logger) as a line that says what was measured,
what was predicted, what each trial took, what was chosen and why, ending with the spec that pins it
(``comm="powersgd:4"``): a run given the spec repeats the choice without measuring.

**Drift.** After the decision the step times go on being watched: 25 steps after it, the median of the last 20
(the slowest rank's) becomes the baseline; every 25 steps after that the median of the last 20 is compared with it,
and a change by ``drift`` times or more (default 2) re-opens the decision (exact steps, probe, trials), so a step
that a link's change makes that much slower or faster is answered within 50 steps.

**Accuracy.** Compression begins only after the exact start; PowerSGD keeps error feedback; the choice among
near-equals goes to the less lossy. The loss is not seen by a comm hook: a guard on it is not part of this.

Not chosen here (yet): the bucket size (the model's ``bucket_cap_mb`` stays) and the all-reduce algorithm (the
backend's own).
"""

# No ``from __future__ import annotations``: torch's DDP compares a hook's annotations with ``dist.GradBucket`` and
# ``torch.futures.Future[torch.Tensor]`` (:func:`auto_hook` is registered with either engine).

import enum
import itertools
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.comm import bucket_hooks, powersgd
from ddpkit.runtime.states import check_move

__all__ = ["AutoComm", "Link", "Scheme", "auto_hook", "parse_comm", "predict", "probe_link"]

log = logging.getLogger(__name__)

SCHEMES = ("none", "fp16", "bf16", "powersgd")
"""The reductions a spec names (``powersgd:R`` with its rank)."""
CANDIDATE_SPECS = ("fp16", "bf16", "powersgd:1", "powersgd:2", "powersgd:4", "powersgd:8")
"""What ``comm="auto"`` considers beside the exact all-reduce."""
PAYS = 0.95
"""A candidate is tried only if predicted at most this fraction of the exact step."""
NEAR = 1.05
"""A less lossy scheme within this factor of the fastest trial is preferred."""
POWERSGD_EXACT = 2
"""PowerSGD's exact steps before it compresses, in a trial and after a decision (its state needs two)."""
PROBE_LIMIT_S = 0.25
"""The probe's sizes grow (4 KiB to 64 MiB, by 4) until one all-reduce takes this long."""


@dataclass(frozen=True)
class Scheme:
    """One way of reducing a bucket: ``none`` (the exact all-reduce), ``fp16``, ``bf16`` or ``powersgd`` at
    ``rank``."""

    name: str
    rank: int = 0

    @property
    def spec(self) -> str:
        """What pins it: ``comm=`` takes this string."""
        return f"powersgd:{self.rank}" if self.name == "powersgd" else self.name

    @property
    def lossiness(self) -> tuple[int, int]:
        """Order of preference among near-equals: exact, half precision, then PowerSGD by falling rank."""
        return {"none": (0, 0), "bf16": (1, 0), "fp16": (1, 1)}.get(self.name, (2, -self.rank))


def parse_scheme(spec: str) -> Scheme:
    """``none``, ``fp16``, ``bf16`` or ``powersgd:R`` as a :class:`Scheme` (``ValueError`` naming the fix)."""
    name, _, rank = spec.strip().partition(":")
    if name not in SCHEMES:
        raise ValueError(f"comm={spec!r}: {name!r} is not a reduction: use auto, none, fp16, bf16 or powersgd:R")
    if name != "powersgd":
        if rank:
            raise ValueError(f"comm={spec!r}: {name} takes no ':{rank}' (only powersgd:R has a rank)")
        return Scheme(name)
    if not rank.isdigit() or int(rank) < 1:
        raise ValueError(f"comm={spec!r}: PowerSGD needs its rank as a whole number of at least 1, e.g. powersgd:4")
    return Scheme(name, int(rank))


def parse_comm(spec: str) -> tuple[Scheme, ...] | Scheme:
    """``comm=``'s value: a :class:`Scheme` (pinned), or the candidates of ``auto`` (``auto`` alone: all of
    :data:`CANDIDATE_SPECS`; ``auto:fp16,powersgd:2``: those)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"comm={spec!r}: give 'auto', or a reduction to pin: none, fp16, bf16 or powersgd:R")
    head, colon, rest = spec.strip().partition(":")
    if head != "auto":
        return parse_scheme(spec)
    names = [s for s in rest.split(",") if s.strip()] if colon else list(CANDIDATE_SPECS)
    if not names:
        raise ValueError(f"comm={spec!r}: list the candidates after 'auto:' (e.g. auto:fp16,powersgd:2) or give "
                         "'auto' alone")
    schemes = [parse_scheme(s) for s in names]
    return tuple(dict.fromkeys(s for s in schemes if s.name != "none"))  # the exact all-reduce is always there


# ---------------------------------------------------------------- the link and the cost model


@dataclass(frozen=True)
class Link:
    """The link as the group's all-reduce sees it: ``seconds = latency_s + bytes * seconds_per_byte`` (the slowest
    rank's times), and this machine's matrix-product rate (PowerSGD's cost)."""

    latency_s: float
    seconds_per_byte: float
    flops_per_s: float
    world: int

    @property
    def bandwidth(self) -> float:
        """Bytes a second that an all-reduce moves (the payload's, not the wire's)."""
        return 1 / self.seconds_per_byte if self.seconds_per_byte > 0 else float("inf")

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte

    def describe(self) -> str:
        bw = self.bandwidth
        rate = "unbounded" if bw == float("inf") else (f"{bw / 1e9:.2f} GB/s" if bw >= 1e9 else f"{bw / 1e6:.1f} MB/s")
        return f"all-reduce {rate}, latency {self.latency_s * 1e6:.0f} us over {self.world} ranks"


def _timed_all_reduces(group: Any, device: torch.device, nbytes: int, reps: int) -> float:
    t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    dist.all_reduce(t, group=group)  # warm: the connection and the buffers
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(t, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _slowest(values: Sequence[float], group: Any, device: torch.device) -> list[float]:
    """Each value's maximum over the group: every rank then decides from the same numbers."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _matmul_rate(device: torch.device) -> float:
    """Floating-point operations a second of a float32 product the size of a PowerSGD factor's."""
    a = torch.randn(512, 512, device=device)
    b = torch.randn(512, 8, device=device)
    torch.mm(a, b)
    reps, start = 20, time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * 512 * 512 * 8 * reps / max(time.perf_counter() - start, 1e-9)


def probe_link(group: Any = None, device: torch.device | None = None, reps: int = 3) -> Link:
    """Time all-reduces of 4 KiB, 16 KiB, ... (until one takes :data:`PROBE_LIMIT_S`, at most 64 MiB) over the
    group; the bandwidth is the least-squares slope of the slowest rank's medians, the latency the smallest
    message's time less its bytes' share. Every rank of the
    group must call it at once (it is a series of collectives); all get the same :class:`Link`."""
    group = group if group is not None else dist.group.WORLD
    device = device if device is not None else torch.device("cpu")
    sizes, times = [], []
    size = 4096
    while size <= 64 << 20:
        took = _slowest([_timed_all_reduces(group, device, size, reps)], group, device)[0]
        sizes.append(size)
        times.append(took)
        if took >= PROBE_LIMIT_S:
            break
        size *= 4
    rate = _slowest([-_matmul_rate(device)], group, device)[0]  # the slowest rank's rate
    n = len(sizes)
    mean_x, mean_y = sum(sizes) / n, sum(times) / n
    var = sum((x - mean_x) ** 2 for x in sizes)
    slope = max(sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, times)) / var, 0.0) if var else 0.0
    latency = max(times[0] - sizes[0] * slope, 0.0)  # the smallest message's time, less its bytes' share
    return Link(latency_s=latency, seconds_per_byte=slope, flops_per_s=-rate, world=dist.get_world_size(group))


def predict(scheme: Scheme, link: Link, buckets: Sequence[Sequence[torch.Size]], element_size: int = 4,
            min_compression_rate: float = 2) -> float:
    """Seconds a step spends reducing ``buckets`` (each a list of its gradients' shapes) with ``scheme`` over
    ``link``, one bucket after the other: each collective's latency and bytes, and PowerSGD's products."""
    total = 0.0
    for shapes in buckets:
        numel = sum(s.numel() for s in shapes)
        if scheme.name == "none":
            total += link.seconds(numel * element_size)
        elif scheme.name in ("fp16", "bf16"):
            total += link.seconds(numel * 2)
        else:
            plain, ps, qs, flops = 0, 0, 0, 0.0
            r = scheme.rank
            for s in shapes:
                rows = s[0] if len(s) else 1
                cols = s.numel() // rows if rows else 0
                if len(s) >= 2 and (rows + cols) * r * min_compression_rate < rows * cols:
                    ps, qs = ps + rows * r, qs + cols * r
                    flops += 2 * rows * cols * r * 3 + 2 * rows * r * r  # P = MQ, Q = M^T P, M = P Q^T, P's QR
                else:
                    plain += s.numel()
            total += link.seconds(plain * element_size) + link.seconds(ps * element_size)
            total += link.seconds(qs * element_size) + flops / link.flops_per_s
    return total


# ---------------------------------------------------------------- the hook's state


class Phase(enum.Enum):
    """Where the decision stands."""

    START = "timing exact steps"
    TRIAL = "trying candidates"
    DECIDED = "decided"


MOVES = {
    Phase.START: frozenset({Phase.TRIAL, Phase.DECIDED}),
    Phase.TRIAL: frozenset({Phase.DECIDED}),
    Phase.DECIDED: frozenset({Phase.START}),
}
"""The moves :meth:`AutoComm._move` allows (a re-opened decision goes back to the start)."""


@dataclass
class _Trial:
    scheme: Scheme
    periods: list[float] = field(default_factory=list)


class AutoComm:
    """The state of :func:`auto_hook`: the reduction chosen as training runs (see the module notes).

    Args:
        process_group: the group DDP reduces over (``None``: the world).
        candidates: the schemes considered beside the exact all-reduce (default :data:`CANDIDATE_SPECS`).
        start: exact steps timed before the probe (at least 3).
        trial: steps each tried candidate runs; the last ``trial - 3`` are timed (at least 6).
        tries: how many of the best-predicted candidates are tried.
        drift: the change in step time (a factor) that re-opens the decision; ``None``: never.
        say: where the decision's line goes on rank 0 (default: standard error).
        pin: how the line names what pins a scheme (default ``comm='powersgd:4'``, the wrapper's argument).
        probe: how the link is measured, ``probe(group, device) -> Link`` (default :func:`probe_link`): a link
            known in advance, or a test's.
    """

    def __init__(self, process_group: Any = None, candidates: Sequence[Scheme] | None = None, *, start: int = 10,
                 trial: int = 8, tries: int = 3, drift: float | None = 2.0,
                 say: Callable[[str], None] | None = None, pin: Callable[[Scheme], str] | None = None,
                 probe: Callable[[Any, torch.device], Link] | None = None) -> None:
        if start < 3:
            raise ValueError(f"start={start}: at least 3 exact steps are timed before the probe")
        if trial < POWERSGD_EXACT + 4:
            raise ValueError(f"trial={trial}: a trial needs at least {POWERSGD_EXACT + 4} steps (PowerSGD's "
                             f"{POWERSGD_EXACT} exact ones, its first compressed one, then three timed)")
        if tries < 1:
            raise ValueError(f"tries={tries}: try at least one candidate")
        if drift is not None and not drift > 1:
            raise ValueError(f"drift={drift}: a factor above 1 (2: a step twice as long or half), or None")
        self.process_group = process_group
        self.candidates = tuple(candidates) if candidates is not None else tuple(
            parse_scheme(s) for s in CANDIDATE_SPECS)
        self.start, self.trial, self.tries, self.drift = start, trial, tries, drift
        self.say = say
        self.pin = pin or (lambda scheme: f"comm={scheme.spec!r}")
        self.probe = probe or probe_link
        self.phase = Phase.START
        self.scheme = Scheme("none")
        self.steps = 0
        """Steps whose reduction began (one per synchronised backward)."""
        self.decisions: list[dict[str, Any]] = []
        """Each decision as a record (what was measured, predicted, tried, chosen): the last is in force."""
        self._powersgd: powersgd.PowerSGDState | None = None
        self._open = False
        self._starts: list[float] = []
        self._since = 0
        self._shapes: dict[int, list[torch.Size]] = {}
        self._layout: dict[int, list[torch.Size]] = {}
        self._queue: list[_Trial] = []
        self._done: list[_Trial] = []
        self._exact: float = 0.0
        self._link: Link | None = None
        self._predicted: dict[Scheme, float] = {}
        self._decided_period = 0.0

    # -- the hook's entry

    def reduce(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """Reduce ``bucket`` with the scheme in force, moving the decision on at each step's first bucket."""
        index = bucket.index()
        if not self._open or index in self._shapes:  # a step begins (a bucket seen in this one: a skipped last)
            self._open = True
            self._layout, self._shapes = self._shapes or self._layout, {}  # the last whole step's buckets
            self._step_begins(bucket.buffer().device)
        self._shapes[index] = [g.shape for g in bucket.gradients()]
        if bucket.is_last():
            self._open = False
        return self._reduce_with(self.scheme, bucket)

    def _reduce_with(self, scheme: Scheme, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        group = self.process_group
        if scheme.name == "none":
            return bucket_hooks.allreduce_hook(group, bucket)
        if scheme.name == "fp16":
            return bucket_hooks.fp16_compress_hook(group, bucket)
        if scheme.name == "bf16":
            return bucket_hooks.bf16_compress_hook(group, bucket)
        assert self._powersgd is not None
        return powersgd.powersgd_hook(self._powersgd, bucket)

    # -- the steps

    def _step_begins(self, device: torch.device) -> None:
        now = time.perf_counter()
        self._starts.append(now)
        self._starts = self._starts[-64:]
        self.steps += 1
        self._since += 1
        period = self._starts[-1] - self._starts[-2] if len(self._starts) >= 2 else None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if self.phase is Phase.START:
            if self._since > self.start:
                self._after_start(group, device)
        elif self.phase is Phase.TRIAL:
            current = self._queue[0]
            # Its step j has _since = j - 1 and the period just ended is step _since's: timed after PowerSGD's
            # exact steps and its first compressed one (which allocates its factors).
            if period is not None and self._since >= POWERSGD_EXACT + 2:
                current.periods.append(period)
            if self._since >= self.trial:
                self._done.append(self._queue.pop(0))
                if self._queue:
                    self._use(self._queue[0].scheme)
                else:
                    self._decide(group, device)
        elif self.drift is not None and self._since % 25 == 0:
            recent = [b - a for a, b in itertools.pairwise(self._starts[-21:])]
            [now_median] = _slowest([statistics.median(recent)], group, device)
            if self._since == 25:  # the steady step under the choice (its first steps settle in): the baseline
                self._decided_period = now_median
                return
            ratio = now_median / self._decided_period if self._decided_period > 0 else 1.0
            if ratio >= self.drift or ratio <= 1 / self.drift:
                self._tell(f"comm auto: the step went from {self._decided_period * 1e3:.1f} to "
                           f"{now_median * 1e3:.1f} ms ({ratio:.2f}x) under {self.scheme.spec}: deciding again")
                self._move(Phase.START)
                self._use(Scheme("none"))

    def _periods(self) -> list[float]:
        """The periods of the exact start's steps after its first two (connections, allocations)."""
        starts = self._starts[-(self.start - 1):]
        return [b - a for a, b in itertools.pairwise(starts)]

    def _after_start(self, group: Any, device: torch.device) -> None:
        [self._exact] = _slowest([statistics.median(self._periods())], group, device)
        self._link = link = self.probe(group, device)
        buckets = [self._layout[i] for i in sorted(self._layout)]
        exact = predict(Scheme("none"), link, buckets)
        self._predicted = {Scheme("none"): self._exact}
        for scheme in self.candidates:
            self._predicted[scheme] = max(self._exact - exact, 0.0) + predict(scheme, link, buckets)
        worth = sorted((s for s in self.candidates if self._predicted[s] <= PAYS * self._exact),
                       key=lambda s: (self._predicted[s], s.lossiness))[: self.tries]
        self._done = [_Trial(Scheme("none"), [self._exact])]
        if not worth:
            self._decide(group, device)
            return
        self._queue = [_Trial(s) for s in worth]
        self._move(Phase.TRIAL)
        self._use(worth[0])

    def _decide(self, group: Any, device: torch.device) -> None:
        medians = [statistics.median(t.periods) if t.periods else float("inf") for t in self._done]
        medians = _slowest(medians, group, device)
        fastest = min(medians)
        near = [(t.scheme.lossiness, i) for i, (t, m) in enumerate(zip(self._done, medians)) if m <= NEAR * fastest]
        chosen_index = min(near)[1]
        chosen = self._done[chosen_index].scheme
        self._decided_period = medians[chosen_index]
        record = {
            "step": self.steps, "link": self._link, "exact_step_s": self._exact,
            "predicted_s": {s.spec: p for s, p in self._predicted.items()},
            "tried_s": {t.scheme.spec: m for t, m in zip(self._done, medians)}, "chosen": chosen.spec,
        }
        self.decisions.append(record)
        self._tell(self._line(record, chosen, fastest))
        self._move(Phase.DECIDED)
        self._use(chosen)

    def _line(self, record: dict[str, Any], chosen: Scheme, fastest: float) -> str:
        def ms(seconds: float) -> str:
            return f"{seconds * 1e3:.1f} ms"

        link = record["link"]
        predicted = ", ".join(f"{k} {ms(v)}" for k, v in sorted(record["predicted_s"].items(), key=lambda kv: kv[1]))
        tried = ", ".join(f"{k} {ms(v)}" for k, v in record["tried_s"].items())
        if len(record["tried_s"]) == 1:
            why = "no candidate was predicted 5 % faster than the exact step"
        elif record["tried_s"][chosen.spec] == fastest:
            why = "the fastest trial"
        else:
            why = f"within 5 % of the fastest trial ({ms(fastest)}) and less lossy"
        return (f"comm auto at step {record['step']}: measured {link.describe()}, exact step "
                f"{ms(record['exact_step_s'])}; predicted {predicted}; tried {tried}; chose {chosen.spec} ({why}); "
                f"pin it with {self.pin(chosen)}")

    def _use(self, scheme: Scheme) -> None:
        self.scheme = scheme
        self._since = 0
        self._powersgd = powersgd.PowerSGDState(self.process_group, matrix_approximation_rank=scheme.rank,
                                                start_powerSGD_iter=POWERSGD_EXACT) if scheme.name == "powersgd" \
            else None

    def _move(self, to: Phase) -> None:
        check_move(MOVES, self.phase, to, "comm auto")
        self.phase = to

    def _tell(self, line: str) -> None:
        log.info("%s", line)
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if dist.get_rank(group) == 0:
            (self.say or _stderr)(line)


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


def auto_hook(state: AutoComm, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce ``bucket`` as :class:`AutoComm` decides (for ``register_comm_hook(AutoComm(...), auto_hook)``)."""
    return state.reduce(bucket)


def pinned(scheme: Scheme, process_group: Any = None, powersgd_start: int = 10) -> tuple[Any, Callable[..., Any]]:
    """``(state, hook)`` that reduce with ``scheme`` from the first step (``comm="fp16"`` and the like); PowerSGD
    after ``powersgd_start`` exact steps."""
    if scheme.name == "none":
        return process_group, bucket_hooks.allreduce_hook
    if scheme.name == "powersgd":
        return (powersgd.PowerSGDState(process_group, matrix_approximation_rank=scheme.rank,
                                       start_powerSGD_iter=powersgd_start), powersgd.powersgd_hook)
    return process_group, {"fp16": bucket_hooks.fp16_compress_hook, "bf16": bucket_hooks.bf16_compress_hook}[
        scheme.name]
