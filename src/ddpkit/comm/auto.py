"""``comm="auto"``: the gradient reduction chosen from the measured link, at the user's model, batch and optimizer.

Which reduction is fastest depends on the network: on a fast link the exact all-reduce hides behind the backward
and compression only adds work; at 1 Gbit/s half precision halves the wire time; at 100 Mbit/s PowerSGD's low-rank
factors make a step many times shorter. :class:`AutoComm` is a comm hook's state (register it with
:func:`auto_hook`, or pass ``comm="auto"`` to :class:`ddpkit.DistributedDataParallel`) that decides as training
runs, in three phases:

1. **Start** (``start`` steps, default 10): the exact all-reduce, as DDP without a hook (the same bits; the start
   of training is where compression hurts most, as PowerSGD's own start steps), timing each step: from one step's
   first bucket to the next step's.
2. **Probe and predict**: a short probe of the link with all-reduces of growing sizes, up to the model's largest
   bucket (every rank takes part; the slowest rank's times count): the bandwidth from the large ones, the latency
   from the small ones. A cost model
   of each candidate's bytes and collectives per step over the model's buckets (and PowerSGD's products, timed on
   this machine) predicts its step time as the exact step's minus the exact reduction's time plus the candidate's
   (where the probe's exact reduction alone outlasts the measured step, the measures disagree: the step in the
   proportion of the candidate's reduction to the exact one's).
   Candidates: fp16, bf16 and PowerSGD at ranks 16 and 32 (or the list given, ``comm="auto:bf16,powersgd:4"``;
   lower ranks cost a language model's loss too much to be tried unasked:
   :data:`~ddpkit.comm.schemes.CANDIDATE_SPECS`).
   A candidate is tried only if predicted at least 5 % faster than the exact step (when none is, the exact
   all-reduce stays without a trial), and one half precision at most (both send the same bytes: bf16 first).
3. **Trial** (``trial`` steps each, default 8) of the exact all-reduce and of the ``tries`` best-predicted
   candidates (default 3), on the real steps, each timed from its second step (its first settles in: PowerSGD
   allocates its factors). PowerSGD compresses from its first step there (its exact start is for a model's first
   steps, long past), and when the scheme changes its error is fed back through the next step's buckets, whatever
   reduces them: nothing of the gradient is dropped. The slowest rank's median step of each counts; the fastest
   wins, and a less lossy one within 5 % of it is preferred (exact, then half precision, then PowerSGD by falling
   rank). Every rank computes the same choice from the same all-reduced numbers.

Where steps are slow the decision keeps to a budget (``budget_s``, :data:`BUDGET_S`): the start and the trials
end early, and the exact all-reduce is not tried again when its trial would not fit. Where the run's length is
known (``run_steps``; ``ddpkit train`` gives it) the trials also keep to :data:`STEP_SHARE` of its steps: fewer and
shorter trials (the best-predicted first, the exact all-reduce's own trial the first to go), and in a run too short
for one trial of :data:`MIN_TRIAL` steps, none: a candidate is then chosen on its prediction alone, and only where
it is predicted to take at most :data:`UNTRIED` of the exact step.

Each decision is printed (rank 0, and the ``ddpkit.comm.auto`` logger) as one line that says what was measured,
what was predicted, what each trial took, what was chosen and why, ending with the spec that pins it
(``comm="powersgd:4"``): a run given the spec repeats the choice without measuring.

**Drift.** After the decision the step times go on being watched: every 25 steps the median of the last 20 (the
slowest rank's) is compared with the chosen scheme's trial, and a change by ``drift`` times or more (default 2)
re-opens the decision (exact steps, probe, trials): a step that a link's change makes that much slower or faster
is answered within 50 steps. A change the step does not feel is not seen (PowerSGD's step barely depends on the
link: a link that becomes fast again under it goes unnoticed).

**Accuracy.** Compression begins only after the exact start; PowerSGD keeps error feedback, across scheme changes
too; the choice among near-equals goes to the less lossy. And a *guard* (``guard``, default 0.5) watches the
gradient while a lossy scheme is in force, as Accordion (Agarwal et al., MLSys '21) does to find the critical
regimes of training, where compression costs accuracy: every 25 steps the norm of the local gradients of the
window's last :data:`GUARD_STEPS` steps (every rank's, averaged; a rank whose gradients were all zero, shadowing
under ``join()``, not counted) is compared with the last window's; a change by ``guard`` or more, either way (half
of it, by default: a schedule's step, a loss spike, the fast early phase), hands the next window to the exact
all-reduce, and the chosen scheme comes back after a window without such a change. No drift is judged on a guarded
window (its steps are exact). A comm hook does not see the loss; the gradient's norm is what it can watch (one pass
over each bucket, on 4 steps of 25). It sees scaled gradients under a loss scaler: ``guard=None`` there. A scheme
pinned with the printed spec runs without the guard (and without its exact windows).

**Checkpoints.** :meth:`AutoComm.state_dict` is what a resumed run needs (each rank's: PowerSGD's error differs
between ranks): the decision in force goes on after :meth:`AutoComm.load_state_dict`, with PowerSGD's state, given
the saved run's buckets (``DistributedDataParallel.restore_buckets``); a decision under way starts again.
``ddpkit train`` keeps both in its checkpoints.

Not chosen here (yet): the bucket size (the model's ``bucket_cap_mb`` stays) and the all-reduce algorithm (the
backend's own).
"""

# No ``from __future__ import annotations``: torch's DDP compares a hook's annotations with ``dist.GradBucket`` and
# ``torch.futures.Future[torch.Tensor]`` (:func:`auto_hook` is registered with either engine).

import enum
import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.comm import bucket_hooks, powersgd
from ddpkit.comm.link_model import Link, predict, probe_link, slowest
from ddpkit.comm.schemes import CANDIDATE_SPECS, Scheme, parse_scheme
from ddpkit.runtime import events
from ddpkit.runtime.states import check_move

__all__ = ["TRIES", "AutoComm", "auto_hook", "worth_trying"]

log = logging.getLogger(__name__)

PAYS = 0.95
"""A candidate is tried only if predicted at most this fraction of the exact step."""
NEAR = 1.05
"""A less lossy scheme within this factor of the fastest trial is preferred."""
TRIES = 3
"""How many of the best-predicted candidates a decision tries by default (beside the exact all-reduce)."""
GUARD_STEPS = 4
"""The steps at the end of each 25 whose gradient norms the guard compares (see the module notes)."""


def worth_trying(predicted: dict[Scheme, float], limit: float, tries: int) -> list[Scheme]:
    """The candidates a decision tries, best first: those predicted at most ``limit``, by predicted time, then the
    less lossy first (bf16 before fp16); one half precision (fp16's and bf16's bytes are the same); ``tries`` at
    most."""
    ranked = sorted((s for s, t in predicted.items() if t <= limit), key=lambda s: (predicted[s], s.lossiness))
    worth: list[Scheme] = []
    for scheme in ranked:
        half = scheme.name in ("fp16", "bf16")
        if len(worth) < tries and not (half and any(w.name in ("fp16", "bf16") for w in worth)):
            worth.append(scheme)
    return worth


class Phase(enum.Enum):
    """Where the decision stands."""

    START = "timing exact steps"
    TRIAL = "trying candidates"
    DECIDED = "decided"
    GUARDED = "exact while the gradient changes"


MOVES = {
    Phase.START: frozenset({Phase.TRIAL, Phase.DECIDED}),
    Phase.TRIAL: frozenset({Phase.DECIDED}),
    Phase.DECIDED: frozenset({Phase.START, Phase.GUARDED}),
    Phase.GUARDED: frozenset({Phase.DECIDED}),
}
"""The moves :meth:`AutoComm._move` allows (a re-opened decision goes back to the start; a guarded window ends in
the decision it interrupted)."""
DRIFT_EVERY = 25
"""Steps between two looks at the step time after a decision (each: the median of the last 20)."""
STEP_SHARE = 0.02
"""The share of a run's steps (``run_steps``) a decision's trials may take: a run of 512 steps tries for 10."""
MIN_TRIAL = 4
"""The fewest steps a trial runs: one to settle in, three timed."""
UNTRIED = 0.5
"""A candidate chosen without a trial (a run too short for one) must be predicted to take at most this fraction of
the exact step: the cost model has been off by about 2x (on loopback it predicted PowerSGD 20 % faster than the
exact step, and the trial found it 70 % slower), so only a prediction that wide is taken on trust."""
BUDGET_S = 30.0
"""The seconds a decision aims to take (``budget_s``). At its third step each phase takes its length from the
slowest rank's second step (the first timed one): the exact start as many steps as fit in a third of the budget
(3 to ``start``), each trial as many as fit in its share of the last third (4 to ``trial``: three timed); the
exact all-reduce is tried again only if its whole trial fits in a third."""


@dataclass
class _Trial:
    scheme: Scheme
    periods: list[float] = field(default_factory=list)


def _whole(value: Any, name: str, least: int, most: int = 1 << 30) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ValueError(f"{name}={value!r}: a whole number from {least} to {most}" if most < 1 << 30
                         else f"{name}={value!r}: a whole number of at least {least}")
    return value


class AutoComm:
    """The state of :func:`auto_hook`: the reduction chosen as training runs (see the module notes).

    Args:
        process_group: the group DDP reduces over (``None``: the world).
        candidates: the schemes considered beside the exact all-reduce (default :data:`CANDIDATE_SPECS`).
        start: exact steps timed before the probe (at least 3).
        trial: steps each tried scheme runs; all but its first are timed (at least 4).
        tries: how many of the best-predicted candidates are tried (beside the exact all-reduce).
        drift: the change in step time (a factor) that re-opens the decision; ``None``: never.
        guard: the relative change in the gradient's norm from one window of 25 steps to the next, either way
            (between 0 and 1), that hands the next window to the exact all-reduce while a lossy scheme is chosen
            (see the module notes); ``None``: no guard. Under a loss scaler (fp16's ``GradScaler``) the hook sees
            scaled gradients, whose scale halves and doubles: pass ``None`` there (``ddpkit train --amp fp16``
            does).
        budget_s: the seconds the decision aims to take (see :data:`BUDGET_S`): where steps are slow, the start and
            the trials end early and the exact all-reduce is not tried again.
        run_steps: the steps the run will take (synchronised backward passes), where known: each decision's trials
            then take at most :data:`STEP_SHARE` of them (see the module notes); ``None``: no bound in steps. It
            may be set on the state before the start ends.
        say: where the decision's line goes on rank 0 (default: standard error).
        pin: how the line names what pins a scheme (default ``comm='powersgd:4'``, the wrapper's argument).
        probe: how the link is measured, ``probe(group, device) -> Link`` (default :func:`probe_link` up to the
            size of the model's largest bucket): a link
            known in advance, or a test's.

    Every rank of the group must use one (its collectives run inside the hook, at the same steps on every rank).
    """

    def __init__(self, process_group: Any = None, candidates: Sequence[Scheme] | None = None, *, start: int = 10,
                 trial: int = 8, tries: int = TRIES, drift: float | None = 2.0, guard: float | None = 0.5,
                 budget_s: float = 30.0, run_steps: int | None = None,
                 say: Callable[[str], None] | None = None, pin: Callable[[Scheme], str] | None = None,
                 probe: Callable[[Any, torch.device], Link] | None = None) -> None:
        self.start = _whole(start, "start", 3, 60)  # a phase's steps are timed from the last 64 kept
        self.trial = _whole(trial, "trial", 4, 60)
        self.tries = _whole(tries, "tries", 1)
        if drift is not None and (isinstance(drift, bool) or not isinstance(drift, (int, float)) or not drift > 1):
            raise ValueError(f"drift={drift!r}: a factor above 1 (2: a step twice as long or half), or None")
        if guard is not None and (isinstance(guard, bool) or not isinstance(guard, (int, float))
                                  or not 0 < guard < 1):
            raise ValueError(f"guard={guard!r}: a relative change of the gradient's norm between 0 and 1 (0.5: by "
                             "half, either way), or None")
        if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not budget_s > 0:
            raise ValueError(f"budget_s={budget_s!r}: the seconds a decision aims to take, a positive number")
        self.budget_s = float(budget_s)
        self.run_steps = None if run_steps is None else _whole(run_steps, "run_steps", 1)
        chosen = tuple(candidates) if candidates is not None else tuple(parse_scheme(s) for s in CANDIDATE_SPECS)
        for scheme in chosen:
            if not isinstance(scheme, Scheme):
                raise TypeError(f"candidates: {scheme!r} is not a Scheme: give parse_scheme('fp16') and the like "
                                 "(or pass comm='auto:bf16,powersgd:4' to the wrapper)")
            scheme.check()
        self.candidates = tuple(dict.fromkeys(s for s in chosen if s.name != "none"))
        self.process_group = process_group
        self.drift = drift
        self.guard = guard
        self.say = say
        self.pin = pin or (lambda scheme: f"comm={scheme.spec!r}")
        self.probe = probe or self._probe_to_the_largest_bucket
        self.phase = Phase.START
        self.scheme = Scheme("none")
        self.steps = 0
        """Steps whose reduction began (one per synchronised backward)."""
        self.decisions: list[dict[str, Any]] = []
        """Each decision as a record (what was measured, predicted, tried, chosen): the last is in force."""
        self._powersgd: dict[int, powersgd.PowerSGDState] = {}
        """One state per PowerSGD rank used, kept for a return to it (its warm start)."""
        self._carry: dict[int, torch.Tensor] = {}
        """PowerSGD's error left when the scheme changed, by bucket: added to the next step's buckets."""
        self._open = False
        self._starts: list[float] = []
        self._since = 0
        """Steps begun under the scheme in force, the current one included."""
        self._length = self.start
        """Steps the phase in force runs (its third step sets it within the budget)."""
        self._trial_most = self.trial
        """The most steps a trial of the decision under way runs (fewer where the run's steps bound it)."""
        self._allowed: int | None = None
        """The steps the decision under way may give its trials (every rank's least), or None: no bound."""
        self._exact_tried = False
        """The decision under way tries the exact all-reduce again (else the start's figure stands for it)."""
        self._shapes: dict[int, list[torch.Size]] = {}
        self._layout: dict[int, list[torch.Size]] = {}
        self._element_size = 4
        self._queue: list[_Trial] = []
        self._trials = 1
        self._done: list[_Trial] = []
        self._exact = 0.0
        self._link: Link | None = None
        self._predicted: dict[Scheme, float] = {}
        self._baseline: float | None = None
        """The chosen scheme's step time the drift compares with (its trial's median); None until measured (a choice
        made on its prediction, :meth:`_drifted`)."""
        self._chosen = Scheme("none")
        """The decision in force (the scheme a guarded window returns to)."""
        self._norm_sq: torch.Tensor | None = None
        """The step in progress's sum of squares of its local gradients, when the guard measures it."""
        self._norms: list[torch.Tensor] = []
        """This window's measured steps' local gradient norms."""
        self._window_norm: float | None = None
        """The last window's norm (every rank's mean), which the guard compares the next one with."""
        self.guards: list[dict[str, Any]] = []
        """Each window the guard acted on: the step, both norms, and what it did."""

    # -- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (this rank's: PowerSGD's error and the guard's measures differ between ranks):
        the decision in force and its records, the step count, each PowerSGD state used and the error carried.
        The step times are not kept: a resumed run's drift is judged from its own (after 20 steps)."""
        def floats(values: list[torch.Tensor]) -> list[float]:
            return [float(v) for v in values]

        return {
            "phase": self.phase.name, "scheme": self.scheme.spec, "chosen": self._chosen.spec, "steps": self.steps,
            "since": self._since, "length": self._length, "baseline": self._baseline, "exact": self._exact,
            "window_norm": self._window_norm, "norms": floats(self._norms),
            "norm_sq": None if self._norm_sq is None else float(self._norm_sq),
            "decisions": [{**record, "link": None if record["link"] is None else asdict(record["link"])}
                          for record in self.decisions],
            "guards": [dict(g) for g in self.guards],
            "powersgd": {rank: state.state_dict() for rank, state in self._powersgd.items()},
            "carry": {int(i): t.detach().cpu().clone() for i, t in self._carry.items()},
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str | None = None) -> str:
        """Take back :meth:`state_dict` (copies of its tensors on ``device``; without one, they move to the
        buckets' device at their first use) before the first step; returns a line that says
        what goes on. A decision in force goes on as it was (no new start, probe or trials). One under way when
        the checkpoint was written (the exact start, or a trial) starts again: step times measured before a
        resume say nothing of the steps after it; PowerSGD's error of a trial is carried into the next steps.

        Raises:
            RuntimeError: after the first step.
            ValueError: a state of another kind (a key missing), or a phase or scheme this version does not
                know (nothing is changed then).
        """
        if self.steps:
            raise RuntimeError(f"AutoComm.load_state_dict: load before the first step (this state took {self.steps})")
        keys = {"phase", "scheme", "chosen", "steps", "since", "length", "baseline", "exact", "window_norm", "norms",
                "norm_sq", "decisions", "guards", "powersgd", "carry"}
        if missing := keys - set(state):
            raise ValueError(f"AutoComm.load_state_dict: not a comm auto state, {sorted(missing)} missing")
        if state["phase"] not in Phase.__members__:
            raise ValueError(f"AutoComm.load_state_dict: phase {state['phase']!r} is not one of "
                             f"{', '.join(Phase.__members__)}")
        phase, scheme, chosen = Phase[state["phase"]], parse_scheme(state["scheme"]), parse_scheme(state["chosen"])

        def here(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, copy=True) if device is not None else t.clone()

        self._powersgd = {}
        for rank, saved in state["powersgd"].items():
            self._powersgd[int(rank)] = powersgd.PowerSGDState(self.process_group, matrix_approximation_rank=int(rank),
                                                              start_powerSGD_iter=2)
            self._powersgd[int(rank)].load_state_dict(saved, device)
        self._carry = {int(i): here(t) for i, t in state["carry"].items()}
        self.steps = int(state["steps"])
        self.decisions = [{**r, "link": None if r["link"] is None else Link(**r["link"])} for r in state["decisions"]]
        self.guards = [dict(g) for g in state["guards"]]
        self.scheme = scheme
        if phase in (Phase.DECIDED, Phase.GUARDED):
            self.phase = phase  # taken back, not moved: the phase the saved run was in
            self._chosen = chosen
            self._since, self._length = int(state["since"]), int(state["length"])
            self._baseline = None if state["baseline"] is None else float(state["baseline"])
            self._exact = float(state["exact"])
            self._window_norm = state["window_norm"]
            self._norms = [torch.tensor(v, dtype=torch.float32, device=device) for v in state["norms"]]
            if state["norm_sq"] is not None:
                self._norm_sq = torch.tensor(state["norm_sq"], dtype=torch.float32, device=device)
            return (f"comm auto resumed at step {self.steps}: {chosen.spec} as decided at step "
                    f"{self.decisions[-1]['step'] if self.decisions else '?'}"
                    + (" (the exact all-reduce while the gradient changes)" if phase is Phase.GUARDED else ""))
        self._use(Scheme("none"))  # the start again (a trial's PowerSGD error is carried into the next steps)
        self._since = 0  # the resumed run's first step settles in, as a fresh start's: not timed
        return (f"comm auto resumed at step {self.steps} while deciding ({phase.value}): deciding again from the "
                "exact all-reduce")

    # -- the hook's entry

    def reduce(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """Reduce ``bucket`` with the scheme in force, moving the decision on at each step's first bucket."""
        index = bucket.index()
        buffer = bucket.buffer()
        if not self._open or index in self._shapes:  # a step begins (a bucket seen in this one: a skipped last)
            self._open = True
            self._layout, self._shapes = self._shapes or self._layout, {}  # the last whole step's buckets
            self._element_size = buffer.element_size()
            self._step_begins(buffer.device)
        self._shapes[index] = [p.shape for p in bucket.parameters()]
        if self._norm_sq is not None:  # the guard's measure: the local gradient, before anything is added to it
            if self._norm_sq.device != buffer.device:  # loaded from a checkpoint without a device
                self._norm_sq = self._norm_sq.to(buffer.device)
            self._norm_sq += torch.linalg.vector_norm(buffer, dtype=torch.float32).square()
        if bucket.is_last():
            self._open = False
        carried = self._carry.pop(index, None)
        if carried is not None:
            if carried.shape == buffer.shape:  # PowerSGD's error from before the change: fed back here, not lost
                buffer.add_(carried.to(buffer.device))
            else:
                log.warning("comm auto: bucket %d changed size (%s to %s) since PowerSGD left an error for it: "
                            "that error is dropped", index, tuple(carried.shape), tuple(buffer.shape))
        return self._reduce_with(self.scheme, bucket)

    def _reduce_with(self, scheme: Scheme, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        group = self.process_group
        if scheme.name == "none":  # as DDP without a hook: times 1/n on the way in, then the sum
            group = group if group is not None else dist.group.WORLD
            buffer = bucket.buffer()
            buffer.mul_(1.0 / dist.get_world_size(group))
            events.collective("comm auto: all-reduce the bucket", nbytes=buffer.numel() * buffer.element_size())
            return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda f: f.value()[0])
        if scheme.name == "fp16":
            return bucket_hooks.fp16_compress_hook(group, bucket)
        if scheme.name == "bf16":
            return bucket_hooks.bf16_compress_hook(group, bucket)
        return powersgd.powersgd_hook(self._powersgd[scheme.rank], bucket)

    # -- the steps

    def _step_begins(self, device: torch.device) -> None:
        self._starts.append(time.perf_counter())
        self._starts = self._starts[-64:]
        self.steps += 1
        self._since += 1
        period = self._starts[-1] - self._starts[-2] if len(self._starts) >= 2 else None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        # Every branch below that runs a collective (the probe, _slowest) is taken at the same step on every rank:
        # the steps are counted alike everywhere, and every number a branch depends on was all-reduced (each
        # rank's own clock decides nothing: a phase's length is set at its third step from the slowest rank's
        # second step, the first timed one).
        if self.phase is Phase.START:
            if self._since == 3 and period is not None:
                self._length = self._within(period, self.budget_s / 3, self.start, 3, group, device)
            if self._since > self._length:
                self._after_start(group, device)
        elif self.phase is Phase.TRIAL:
            ended = self._since - 1  # the trial's step that just ended (its first: settling in, not timed)
            if period is not None and ended >= 2:
                self._queue[0].periods.append(period)
            if self._since == 3 and period is not None:
                share = self.budget_s / 3 / self._trials
                self._length = self._within(period, share, self._trial_most, MIN_TRIAL, group, device)
            if ended >= self._length:
                self._done.append(self._queue.pop(0))
                if self._queue:
                    self._use(self._queue[0].scheme)
                else:
                    self._decide(group, device)
        else:
            self._watch(group, device)

    def _watch(self, group: Any, device: torch.device) -> None:
        """After a decision: the guard's measure of the gradient and, every :data:`DRIFT_EVERY` steps, its check
        and the drift's (both collectives at the same step on every rank)."""
        if self._norm_sq is not None:
            self._norms.append(self._norm_sq.sqrt())  # kept on the device until the look (no wait mid-backward)
            self._norm_sq = None
        at = self._since % DRIFT_EVERY
        guarding = self.guard is not None and self._chosen.name != "none"  # alike on every rank, as the steps
        if guarding and at > DRIFT_EVERY - 1 - GUARD_STEPS:
            self._norm_sq = torch.zeros((), dtype=torch.float32, device=device)
        if at != 0:
            return
        # The drift first, on the chosen scheme's steps (a guarded window's are exact: no drift is judged on them),
        # then the guard: a look answers both.
        if self.phase is Phase.DECIDED and self._drifted(group, device):
            return
        if guarding:
            self._guarded(group, device)

    def _drifted(self, group: Any, device: torch.device) -> bool:
        """The drift's check at a look (see the module notes): whether it re-opened the decision."""
        if self.drift is not None and len(self._starts) > 20:
            recent = [b - a for a, b in itertools.pairwise(self._starts[-21:])]
            [now] = slowest([statistics.median(recent)], group, device)
            if self._baseline is None:  # a choice made on its prediction: its own steps are the baseline, if they pay
                if now < PAYS * self._exact:
                    self._baseline = now
                    return False
                self._fall_back(now)
                return True
            ratio = now / self._baseline if self._baseline > 0 else 1.0
            if ratio >= self.drift or ratio <= 1 / self.drift:
                self._tell(f"comm auto: the step went from {self._baseline * 1e3:.1f} to {now * 1e3:.1f} ms "
                           f"({ratio:.2f}x) under {self.scheme.spec}: deciding again")
                self._move(Phase.START)
                self._window_norm = None
                self._norms = []
                self._use(Scheme("none"))
                return True
        return False

    def _fall_back(self, took: float) -> None:
        """A choice made on its prediction whose steps (``took``, the slowest rank's median) are not 5 % shorter
        than the exact start's: the exact all-reduce from now on, as a decision of its own."""
        untried = self._chosen
        self._tell(f"comm auto at step {self.steps}: {untried.spec}, chosen on its prediction, takes "
                   f"{took * 1e3:.1f} ms a step, not 5 % less than the exact all-reduce's {self._exact * 1e3:.1f}: "
                   f"the exact all-reduce from now on; pin it with {self.pin(Scheme('none'))}")
        self.decisions.append({**self.decisions[-1], "step": self.steps, "chosen": "none", "exact_tried": False,
                               "tried_s": {"none": self._exact, untried.spec: took}})
        self._chosen, self._baseline = Scheme("none"), self._exact
        self._window_norm, self._norms, self._norm_sq = None, [], None
        self._use(Scheme("none"))

    def _guarded(self, group: Any, device: torch.device) -> None:
        """The guard's check at a look (see the module notes)."""
        # A step whose gradient is not finite (a loss scaler's skipped step) is left out; a window with none finite
        # on some rank is not judged (its NaN makes the sum NaN on every rank). A rank whose gradients were all zero
        # (one that joined early, shadowing steps under join()) is not counted in the average.
        norms = torch.stack([n.to(device) for n in self._norms]).double() if self._norms else torch.zeros(
            0, dtype=torch.float64, device=device)
        self._norms = []
        finite = torch.isfinite(norms)
        mine = torch.where(finite, norms, 0.0).sum() / finite.sum()  # NaN when no step was finite
        payload = torch.stack([mine, (mine != 0).double()])
        dist.all_reduce(payload, group=group)
        total, counted = payload.tolist()
        before = self._window_norm
        if not math.isfinite(total) or counted == 0:
            return  # not judged; the last window's norm stays the one to compare with
        now = total / counted
        self._window_norm = now
        change = (now - before) / before if before else 0.0
        critical = bool(before) and abs(change) >= self.guard
        if critical and self.phase is Phase.DECIDED:
            self.guards.append({"step": self.steps, "norm": now, "before": before, "action": "exact"})
            self._tell(f"comm auto at step {self.steps}: the gradient's norm went from {before or 0:.4g} to {now:.4g} "
                       f"({change:+.0%}) in {DRIFT_EVERY} steps: the exact all-reduce until it settles (a look "
                       f"every {DRIFT_EVERY} steps), then {self._chosen.spec} (guard={self.guard:g})")
            self._move(Phase.GUARDED)
            self._use(Scheme("none"))
        elif not critical and self.phase is Phase.GUARDED:
            self.guards.append({"step": self.steps, "norm": now, "before": before, "action": self._chosen.spec})
            self._tell(f"comm auto at step {self.steps}: the gradient's norm settled ({before or 0:.4g} to {now:.4g}): "
                       f"{self._chosen.spec} again")
            self._move(Phase.DECIDED)
            self._use(self._chosen)

    @staticmethod
    def _within(period: float, seconds: float, most: int, least: int, group: Any, device: torch.device) -> int:
        """Steps of a phase that fit in ``seconds`` at the slowest rank's ``period``, from ``least`` to ``most``
        (a collective: every rank calls it at the same step, and all get the same number)."""
        [longest] = slowest([period], group, device)
        return min(most, max(least, math.ceil(seconds / longest) if longest > 0 else most))

    def _probe_to_the_largest_bucket(self, group: Any, device: torch.device) -> Link:
        """The default probe, its sizes up to the model's largest bucket (the same on every rank): at 1 Gbit/s
        probing up to 64 MiB took 4.6 s, up to a 3 MB model's 4 MiB 0.3 s, for the same figures."""
        largest = max((sum(s.numel() for s in shapes) for shapes in self._layout.values()), default=0)
        return probe_link(group, device, most_bytes=largest * self._element_size or None)

    def _after_start(self, group: Any, device: torch.device) -> None:
        starts = self._starts[-(self._since - 1):]  # the start's steps after its first (which settles in)
        [self._exact] = slowest([statistics.median(b - a for a, b in itertools.pairwise(starts))], group, device)
        self._done, self._queue = [], []
        self._allowed, self._exact_tried = None, False
        self._predicted = {Scheme("none"): self._exact}
        if dist.get_world_size(group) == 1:  # nothing to reduce, nothing to choose
            self._link = None
            self._decide(group, device)
            return
        self._link = link = self.probe(group, device)
        buckets = [self._layout[i] for i in sorted(self._layout)]
        exact = predict(Scheme("none"), link, buckets, self._element_size)
        for scheme in self.candidates:
            own = predict(scheme, link, buckets, self._element_size)
            if exact <= self._exact:  # the step's other work stays; its reduction becomes the candidate's
                self._predicted[scheme] = self._exact - exact + own
            else:  # the probe's exact reduction outlasts the measured step (the link changed since the start, or
                # its steps mixed two links): the measures disagree, and the candidate keeps its relative saving
                # (taking its reduction alone as its step would hide any saving below the measured step)
                self._predicted[scheme] = self._exact * own / exact
        worth = worth_trying({s: self._predicted[s] for s in self.candidates}, PAYS * self._exact, self.tries)
        allowed = self._allowed = self._agreed_trial_steps(group, device)
        self._trial_most = self.trial
        if allowed is not None:  # the run's steps bound the trials: the best-predicted first, as many as fit
            worth = worth[: allowed // MIN_TRIAL]
        if not worth:
            self._done = [_Trial(Scheme("none"), [self._exact])]
            best = min(self.candidates, key=lambda s: (self._predicted[s], s.lossiness), default=None)
            if allowed is not None and allowed < MIN_TRIAL and best is not None:
                # too short a run for any trial: the prediction decides, where it leaves no doubt
                self._decide(group, device, untried=best if self._predicted[best] <= UNTRIED * self._exact else None)
                return
            self._decide(group, device)
            return
        if allowed is not None:  # the exact all-reduce tried again only if a trial of it fits beside every candidate
            fits = (len(worth) + 1) * MIN_TRIAL <= allowed
            self._trial_most = min(self.trial, allowed // (len(worth) + fits))
        else:
            fits = True
        exact_again = fits and self._exact * self._trial_most <= self.budget_s / 3  # its whole trial fits the seconds
        if allowed is not None and not exact_again:
            self._trial_most = min(self.trial, allowed // len(worth))
        self._exact_tried = exact_again
        if exact_again:  # the exact all-reduce is tried as the candidates are
            self._queue = [_Trial(Scheme("none")), *(_Trial(s) for s in worth)]
        else:  # its steps are too slow, or the run too short, to try it again: the start's figure stands for it
            self._done = [_Trial(Scheme("none"), [self._exact])]
            self._queue = [_Trial(s) for s in worth]
        self._trials = len(self._queue)
        self._move(Phase.TRIAL)
        self._use(self._queue[0].scheme)

    def _agreed_trial_steps(self, group: Any, device: torch.device) -> int | None:
        """:meth:`trial_steps` as every rank takes it: the fewest of any rank's (a collective; ``run_steps`` given
        otherwise on some rank must not make the ranks take other branches)."""
        mine = self.trial_steps()
        [least] = slowest([-(float(mine) if mine is not None else math.inf)], group, device)
        return None if math.isinf(least) else int(-least)

    def trial_steps(self) -> int | None:
        """The steps a decision's trials may take (:data:`STEP_SHARE` of :attr:`run_steps`), or None: no bound."""
        return None if self.run_steps is None else math.floor(STEP_SHARE * self.run_steps + 1e-9)  # (0.02 * 350)

    def _decide(self, group: Any, device: torch.device, untried: Scheme | None = None) -> None:
        """Choose among the trials done (a collective: the slowest rank's medians); ``untried``: no trial fitted the
        run's steps, and this candidate's prediction is taken instead (None there: the exact all-reduce stays)."""
        done = self._done or [_Trial(Scheme("none"), [self._exact])]
        medians = slowest([statistics.median(t.periods) if t.periods else float("inf") for t in done], group,
                           device)
        fastest = min(medians)
        chosen_index = min((t.scheme.lossiness, i) for i, (t, m) in enumerate(zip(done, medians))
                           if m <= NEAR * fastest)[1]
        chosen = done[chosen_index].scheme
        self._baseline = medians[chosen_index]
        if untried is not None:  # its step is measured at the drift's first look (a prediction may be 2x off)
            chosen, self._baseline = untried, None
        record = {
            "step": self.steps, "link": self._link, "exact_step_s": self._exact,
            "predicted_s": {s.spec: p for s, p in self._predicted.items()},
            "tried_s": {t.scheme.spec: m for t, m in zip(done, medians)} if len(done) > 1 else {},
            "chosen": chosen.spec, "trial_steps": self._allowed, "exact_tried": self._exact_tried,
        }
        self.decisions.append(record)
        self._tell(self._line(record, chosen, fastest))
        self._move(Phase.DECIDED)
        self._chosen = chosen
        self._window_norm = None
        self._use(chosen)

    def _line(self, record: dict[str, Any], chosen: Scheme, fastest: float) -> str:
        def ms(seconds: float) -> str:
            return f"{seconds * 1e3:.1f} ms"

        link = record["link"]
        head = f"comm auto at step {record['step']}: "
        if link is None:
            return head + f"a world of one reduces nothing: {chosen.spec}"
        predicted = ", ".join(f"{k} {ms(v)}" for k, v in sorted(record["predicted_s"].items(), key=lambda kv: kv[1]))
        allowed = record.get("trial_steps")
        if not record["tried_s"] and allowed is not None and allowed < MIN_TRIAL and len(record["predicted_s"]) > 1:
            tried = (f"nothing tried ({allowed} steps for trials, {STEP_SHARE:.0%} of the run's: fewer than a "
                     f"trial's {MIN_TRIAL})")
            why = (f"predicted to take at most {UNTRIED:g} of the exact step" if chosen.name != "none"
                   else f"no candidate was predicted to take at most {UNTRIED:g} of the exact step, which a choice "
                   "without a trial needs")
        elif not record["tried_s"]:
            tried, why = "nothing tried", "no candidate was predicted 5 % faster than the exact step"
        else:
            start = "" if record.get("exact_tried", True) else " (its start's: not tried again)"
            tried = "tried " + ", ".join(f"{k} {ms(v)}{start if k == 'none' else ''}"
                                         for k, v in record["tried_s"].items())
            why = ("the fastest trial" if record["tried_s"][chosen.spec] == fastest
                   else f"within 5 % of the fastest trial ({ms(fastest)}) and less lossy")
        return (head + f"measured {link.describe()}, exact step {ms(record['exact_step_s'])}; predicted {predicted}; "
                f"{tried}; chose {chosen.spec} ({why}); pin it with {self.pin(chosen)}")

    def _use(self, scheme: Scheme) -> None:
        """Reduce with ``scheme`` from the current step on (its first: ``_since`` 1)."""
        if self.scheme.name == "powersgd" and scheme != self.scheme:
            state = self._powersgd[self.scheme.rank]
            for index, error in state.error_dict.items():  # its error is fed back by whatever reduces next
                self._carry[index] = self._carry[index] + error if index in self._carry else error
            state.error_dict = {}
        if scheme.name == "powersgd" and scheme.rank not in self._powersgd:
            # Compressing from its first step: PowerSGD's exact start is for a model's first steps (its buckets
            # are rebuilt after the first), long past here.
            state = powersgd.PowerSGDState(self.process_group, matrix_approximation_rank=scheme.rank,
                                           start_powerSGD_iter=2)
            state.iter = state.start_powerSGD_iter
            self._powersgd[scheme.rank] = state
        self.scheme = scheme
        self._since = 1
        self._length = self.start if self.phase is Phase.START else self._trial_most  # until its third step sets it

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
