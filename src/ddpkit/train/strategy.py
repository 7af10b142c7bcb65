"""How ``ddpkit train`` keeps the replicas together: one object per ``--strategy``, so the loop has no branches.

The loop calls, for every optimizer step of ``grad_accum`` micro-batches:

``strategy.micro_batch(last)``
    the context of one micro-batch's forward and backward: DDP's
    ``no_sync()`` for all but the last, so gradients accumulate locally and
    the last backward reduces their sum;
``strategy.step(scaler, optimizer)``
    the optimizer step (through the grad scaler), with whatever the strategy
    does around it;
``strategy.consensus(optimizer, final)``
    before an evaluation or a checkpoint: make the replicas one model again
    (local SGD and DiLoCo let them drift apart); ``final``: the last epoch's
    end (the model then saved is the run's result);
``strategy.after_consensus(optimizer)``
    once the evaluation and the checkpoint are done, before training goes on
    (DiLoCo puts each rank's own parameters back).

Strategies:

* ``ddp`` (also ``--engine torch``): the wrapper averages gradients in backward;
  with ``--comm-hook powersgd`` or ``auto`` on ddpkit's engine, the hook's
  state (every rank's: PowerSGD's error feedback and warm start, auto's
  decision) and the buckets ride in the checkpoint, gathered to rank 0's
  ``extra``, and a resumed run takes them back before its first step, so it
  reduces as the run that saved it would have (at another world size the
  hook starts afresh, and a line says so);
* ``optimizer``: :func:`ddpkit.DistributedOptimizer` (Horovod's recipe with a
  grad scaler: the averages first, then unscale and step);
* ``local-sgd``: :class:`ddpkit.LocalSGD`, parameters averaged every
  ``--local-sgd`` steps after ``--local-sgd-warmup`` synchronous ones;
* ``diloco``: :class:`ddpkit.DiLoCo`, an outer step every ``--sync-every``
  steps. Its consensus changes nothing in training (a checkpoint or an
  evaluation must not): the model shows the global parameters, every rank's
  own parameters and inner optimizer state ride in the checkpoint (gathered
  to rank 0's ``extra``), and each rank takes its own back afterwards, or
  on ``--resume`` before its first step (at another world size every rank
  starts from the global model: the inner steps since each fragment's last
  outer step are lost, and a line says so). At the last epoch's end a final
  outer step of every fragment (:meth:`ddpkit.DiLoCo.sync`) takes the inner
  steps since the last one into the final weights, the global model;
* ``ps-sync`` / ``ps-async``: :class:`ddpkit.ParameterServerOptimizer` on the
  ``--num-servers`` servers the run started; ps-sync broadcasts rank 0's
  buffers before every forward, as DDP does, so it makes DDP's update;
* ``ssp``: :func:`ddpkit.StaleSynchronousOptimizer` with ``--staleness``;
* no wrapper (``--engine single`` and ``dp``): a plain step.

``strategy.close()`` ends the run's use of the strategy (the parameter
servers exit once every worker closed), and ``strategy.summary()`` (every
rank) adds what it measured to ``summary.json``: ``wait_s``, each rank's
seconds blocked on the others (DDP's end-of-backward wait and its buffers'
broadcast before the forward, local SGD's averages, the exchange with the
servers and ps-sync's broadcast, the stale all-reduces, and, for every
strategy, the wait at the end of each epoch for the last rank), and, for
the servers and SSP, the staleness each rank saw.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.parallel.common.broadcast import PackedBroadcast
from ddpkit.parallel.common.observer import Observer, WaitEvent
from ddpkit.parallel.ddp.wrapper import DistributedDataParallel
from ddpkit.parallel.diloco import DiLoCo
from ddpkit.parallel.local_sgd import LocalSGD
from ddpkit.parallel.horovod_optimizer import DistributedOptimizer
from ddpkit.parallel.ps.optimizer import ParameterServerOptimizer
from ddpkit.parallel.ssp import StaleSynchronousOptimizer
from ddpkit.parallel.zero.stage1 import ZeroRedundancyOptimizer
from ddpkit.runtime import events
from ddpkit.runtime.objects import all_gather_object
from ddpkit.runtime.options import ConfigError
from ddpkit.train.train_config import SERVER_STRATEGIES, TrainConfig
from ddpkit.train.state import TrainState

__all__ = ["Strategy", "make_strategy"]


class _Waits(Observer):
    """Seconds DDP waited for the others: at the end of backward for reductions still running, and before the
    forward (the buffers' broadcast)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.called = 0.0

    def on_wait(self, event: WaitEvent) -> None:
        self.seconds += event.end - event.start

    def forward_called(self, module: torch.nn.Module, args: Any) -> None:
        self.called = time.perf_counter()

    def module_called(self, module: torch.nn.Module, args: Any) -> None:
        if self.called:
            self.seconds += time.perf_counter() - self.called
            self.called = 0.0


class Strategy:
    """A model whose wrapper averages gradients in backward (DDP), or no wrapper at all (see the module notes)."""

    def __init__(self, model: torch.nn.Module, accumulates: bool) -> None:
        self.model = model
        self.accumulates = accumulates
        """Whether micro-batches before the last run under ``no_sync()``."""
        self.waits = _Waits()
        self.epoch_end_s = 0.0
        """Seconds the loop waited at the ends of epochs for the last rank to finish its shard."""
        if isinstance(model, DistributedDataParallel):
            model.register_observer(self.waits)
            # The buffers' broadcast before the forward waits for the slowest rank too: the time from the
            # wrapper's forward to its module's is counted (public forward pre-hooks, nothing patched).
            model.register_forward_pre_hook(self.waits.forward_called)
            model.module.register_forward_pre_hook(self.waits.module_called)

    def wait_s(self) -> float:
        """Seconds this rank was blocked on the others so far."""
        return self.waits.seconds

    def close(self) -> None:
        """The run is done with the strategy."""

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if last or not self.accumulates else self.model.no_sync()

    def step(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        scaler.step(optimizer)
        scaler.update()

    def consensus(self, optimizer: torch.optim.Optimizer, final: bool = False) -> None:
        """Nothing to do: the replicas never drift apart."""

    def after_consensus(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to undo."""

    def summary(self) -> dict[str, Any]:
        """What ``summary.json`` records of the strategy (a collective: every rank calls it)."""
        return {"wait_s": [round(w, 4) for w in all_gather_object(self.wait_s() + self.epoch_end_s)]}


class HorovodStrategy(Strategy):
    """``--strategy optimizer``: the optimizer averages, so every micro-batch runs as it is."""

    def step(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        # Horovod's recipe with a grad scaler: the averages first, then unscale and step.
        optimizer.synchronize()  # type: ignore[attr-defined]
        with optimizer.skip_synchronize():  # type: ignore[attr-defined]
            scaler.step(optimizer)
        scaler.update()


class LocalSGDStrategy(Strategy):
    """``--strategy local-sgd``: local steps, the parameters averaged every period."""

    def __init__(self, model: torch.nn.Module, local: LocalSGD, config: TrainConfig) -> None:
        super().__init__(model, accumulates=True)
        self.local = local
        self.config = config

    def step(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        super().step(scaler, optimizer)
        start = time.perf_counter()
        if self.local.step():
            self.waits.seconds += time.perf_counter() - start

    def consensus(self, optimizer: torch.optim.Optimizer, final: bool = False) -> None:
        # Parameters and optimizer state averaged, so an evaluation or a checkpoint sees one model, and a
        # resumed run continues exactly as the uninterrupted one.
        self.local.average(optimizer)

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "local_sgd_period": self.config.local_sgd,
                "local_sgd_warmup": self.config.local_sgd_warmup, "parameter_averages": self.local.averages}


class CommHookStrategy(Strategy):
    """``--strategy ddp`` on ddpkit's engine with a comm hook that keeps state (see the module notes)."""

    def __init__(self, model: DistributedDataParallel, state: TrainState) -> None:
        super().__init__(model, accumulates=True)
        self.state = state
        if (saved := state.extra.pop("comm_hook", None)) is not None:
            self._restore(saved)
        elif state.step and dist.get_rank() == 0:
            print("ddpkit train: the checkpoint holds no comm hook state (a ddpkit before 2026-11-29 wrote it): "
                  "the hook starts afresh", flush=True)

    def consensus(self, optimizer: torch.optim.Optimizer, final: bool = False) -> None:
        ranks = _to_rank0(self.model.comm_state.state_dict(), "the comm hook's state")  # CPU copies already
        buckets = self.model.bucket_indices() if self.model.buckets_final else None  # (before the rebuild: none)
        self.state.extra["comm_hook"] = {"buckets": buckets, "ranks": ranks}

    def after_consensus(self, optimizer: torch.optim.Optimizer) -> None:
        self.state.extra.pop("comm_hook", None)

    def _restore(self, saved: dict[str, Any]) -> None:
        """The saved run's buckets, and this rank's hook state (same world size)."""
        if saved["buckets"] is not None:  # saved after the rebuild (before it, the resumed run rebuilds alike)
            self.model.restore_buckets(saved["buckets"])
        ranks, world = saved["ranks"], dist.get_world_size()
        if len(ranks) != world:
            line = (f"ddpkit train: the comm hook's state was saved at world {len(ranks)}, this run has {world}: "
                    "it starts afresh (PowerSGD's error feedback is each rank's own)")
        else:
            device = next(p.device for p in self.model.parameters())
            said = self.model.comm_state.load_state_dict(ranks[dist.get_rank()], device)
            line = f"ddpkit train: {said}" if isinstance(said, str) else (
                f"ddpkit train: PowerSGD resumed at iteration {self.model.comm_state.iter} with each rank's error "
                "feedback and warm start")
        if dist.get_rank() == 0:
            print(line, flush=True)


class DiLoCoStrategy(Strategy):
    """``--strategy diloco``: inner steps alone, outer steps every ``--sync-every`` (see the module notes)."""

    def __init__(self, model: torch.nn.Module, diloco: DiLoCo, config: TrainConfig, state: TrainState) -> None:
        super().__init__(model, accumulates=True)
        self.diloco, self.config, self.state = diloco, config, state
        self._own: list[torch.Tensor] | None = None
        self._resumed: dict[str, Any] | None = None
        """This rank's own parameters and inner state from a checkpoint, taken before the first step."""
        if (saved := state.extra.pop("diloco", None)) is not None:
            self._restore(saved)

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        if self._resumed is not None:
            self._take_own(self._resumed)
            self._resumed = None
        return super().micro_batch(last)

    def step(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        super().step(scaler, optimizer)
        start = time.perf_counter()
        if self.diloco.step():
            self.waits.seconds += time.perf_counter() - start

    def consensus(self, optimizer: torch.optim.Optimizer, final: bool = False) -> None:
        ranks: list[Any] | None = None
        if final:
            self.diloco.sync(optimizer)  # every rank holds the global model and one inner state: nothing its own
        else:
            own = {"params": [p.detach().cpu().clone() for p in self.diloco.params],
                   "inner": _to_cpu(optimizer.state_dict()["state"]),
                   "scaler": self.state.scaler.state_dict() if self.state.scaler is not None else {}}
            ranks = _to_rank0(own, "DiLoCo, every rank's own parameters and inner state")
        self.state.extra["diloco"] = {"outer": _to_cpu(self.diloco.state_dict()), "ranks": ranks}
        self._own = [p.detach().clone() for p in self.diloco.params]
        with torch.no_grad():
            for p, g in zip(self.diloco.params, self.diloco.global_parameters()):
                p.copy_(g)

    def after_consensus(self, optimizer: torch.optim.Optimizer) -> None:
        self.state.extra.pop("diloco", None)
        if self._own is not None:
            with torch.no_grad():
                for p, mine in zip(self.diloco.params, self._own):
                    p.copy_(mine)
            self._own = None

    def _restore(self, saved: dict[str, Any]) -> None:
        """A checkpoint's outer state, and this rank's own parameters and inner state (same world size)."""
        self.diloco.load_state_dict(saved["outer"])
        ranks = saved["ranks"]
        if ranks is None:  # saved after the last outer step of a finished run: every rank held the same
            return
        if len(ranks) != dist.get_world_size():
            if dist.get_rank() == 0:
                print(f"ddpkit train: DiLoCo resumed at world {dist.get_world_size()} from a checkpoint of world "
                      f"{len(ranks)}: every rank starts from the global model (each rank's inner steps since its "
                      "fragments' last outer steps are dropped)", flush=True)
            return
        self._resumed = ranks[dist.get_rank()]  # taken at the first step: a run with none left keeps the global

    def _take_own(self, mine: dict[str, Any]) -> None:
        with torch.no_grad():
            for p, value in zip(self.diloco.params, mine["params"]):
                p.copy_(value)
        inner = self.state.optimizer.state_dict()
        inner["state"] = mine["inner"]
        self.state.optimizer.load_state_dict(inner)
        if mine.get("scaler"):  # each rank's own: without an all-reduce, an inf skips one rank's step alone
            self.state.scaler.load_state_dict(mine["scaler"])

    def summary(self) -> dict[str, Any]:
        c = self.config
        return {**super().summary(), "sync_every": c.sync_every, "fragments": c.fragments,
                "fragment_delay": c.fragment_delay, "fragment_mixing": c.fragment_mixing, "outer_codec": c.outer_codec,
                "outer_syncs": self.diloco.syncs, "outer_bytes_sent": all_gather_object(self.diloco.bytes_sent)}


def _to_rank0(own: Any, what: str) -> list[Any] | None:
    """Every rank's ``own`` (CPU tensors and plain data), on rank 0, which alone writes the checkpoint; None on the
    others (a collective: every rank calls it)."""
    ranks = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    sent = 0 if dist.get_rank() == 0 else sum(t.numel() * t.element_size() for t in _tensors(own))  # rank 0 keeps
    events.collective(f"train: {what} to rank 0", nbytes=sent)  # its own
    dist.gather_object(own, ranks, dst=0)
    return ranks


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value`` (nested dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor a CPU copy (a checkpoint's, gathered as objects)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


class ServerStrategy(Strategy):
    """``--strategy ps-sync`` and ``ps-async``: the servers step; ps-sync broadcasts buffers as DDP does."""

    def __init__(self, model: torch.nn.Module, optimizer: ParameterServerOptimizer, config: TrainConfig) -> None:
        super().__init__(model, accumulates=False)
        self.ps, self.config = optimizer, config
        buffers = list(model.buffers()) if config.strategy == "ps-sync" else []
        # DDP's own mechanism for its buffers: every dtype in one message, nothing allocated per forward.
        self.buffers = PackedBroadcast(buffers, dist.group.WORLD, "train: rank 0's buffers") if buffers else None
        self.broadcast_s = 0.0

    @contextlib.contextmanager
    def _buffers_from_rank0(self) -> Iterator[None]:
        start = time.perf_counter()
        self.buffers(0)  # type: ignore[misc]
        self.broadcast_s += time.perf_counter() - start
        yield

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        return self._buffers_from_rank0() if self.buffers else contextlib.nullcontext()

    def consensus(self, optimizer: torch.optim.Optimizer, final: bool = False) -> None:
        if self.config.strategy == "ps-async":
            # No push in flight once every worker is here: every worker pulls the same parameters.
            dist.barrier()
            self.ps.pull()

    def wait_s(self) -> float:
        return self.ps.stats.wait_s + self.broadcast_s

    def close(self) -> None:
        self.ps.close()

    def summary(self) -> dict[str, Any]:
        seen = all_gather_object(self.ps.stats.as_dict())
        return {**super().summary(), "num_servers": self.config.num_servers, "staleness": self.config.staleness,
                "per_rank": seen}


class StaleStrategy(Strategy):
    """``--strategy ssp``: the all-reduces of the last ``--staleness`` steps in flight."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig) -> None:
        super().__init__(model, accumulates=False)
        self.ssp, self.config = optimizer, config

    def consensus(self, optimizer: torch.optim.Optimizer, final: bool = False) -> None:
        self.ssp.synchronize()  # type: ignore[attr-defined]

    def wait_s(self) -> float:
        return self.ssp.wait_s  # type: ignore[attr-defined]

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "staleness": self.config.staleness,
                "per_rank": all_gather_object(self.ssp.stats())}  # type: ignore[attr-defined]


def make_strategy(state: TrainState, model: torch.nn.Module, config: TrainConfig) -> Strategy:
    """The strategy of ``config`` for ``model`` (as :func:`ddpkit.train.recipe.wrap` wrapped it).

    ``--strategy optimizer`` wraps ``state.optimizer`` in a DistributedOptimizer (the same param groups and
    state, so checkpoints are unchanged).
    """
    if config.engine in ("single", "dp"):
        return Strategy(model, accumulates=False)
    if config.zero and config.zero < 3:
        state.optimizer = _sharded(state.optimizer)
    stateful = config.comm_hook == "powersgd" or config.comm_hook.startswith("auto")
    if config.engine == "ddpkit" and config.strategy == "ddp" and config.zero < 2 and stateful:
        assert isinstance(model, DistributedDataParallel)
        return CommHookStrategy(model, state)
    if config.engine == "torch" and stateful and state.step and dist.get_rank() == 0:
        print(f"ddpkit train: --engine torch --comm-hook {config.comm_hook}: the hook starts afresh on a resume "
              "(torch's DDP lays its buckets out anew, whatever a checkpoint holds); --engine ddpkit goes on with "
              "its state", flush=True)
    if config.engine != "ddpkit" or config.strategy == "ddp":
        return Strategy(model, accumulates=True)
    if config.strategy in SERVER_STRATEGIES:
        mode = "sync" if config.strategy == "ps-sync" else "async"
        if mode == "async":
            _compensate_momentum(state.optimizer, config)
        ps = ParameterServerOptimizer.from_optimizer(state.optimizer, mode=mode, staleness=config.staleness)
        state.optimizer = ps
        return ServerStrategy(model, ps, config)
    if config.strategy == "ssp":
        if config.staleness:
            _compensate_momentum(state.optimizer, config)
        state.optimizer = StaleSynchronousOptimizer(state.optimizer, staleness=config.staleness or 0)
        return StaleStrategy(model, state.optimizer, config)
    if config.strategy == "optimizer":
        state.optimizer = DistributedOptimizer(
            state.optimizer, named_parameters=model.named_parameters(), backward_passes_per_step=config.grad_accum
        )
        return HorovodStrategy(model, accumulates=False)
    if config.strategy == "diloco":
        assert config.sync_every is not None
        params = [p for p in model.parameters() if p.requires_grad]
        outer = torch.optim.SGD(params, lr=config.outer_lr, momentum=config.outer_momentum,
                                nesterov=config.outer_momentum > 0)
        try:
            diloco = DiLoCo(model, config.sync_every, outer, fragments=config.fragments,
                            delay=config.fragment_delay, mixing=config.fragment_mixing, codec=config.outer_codec)
        except ValueError as e:  # a setting this model cannot take (more fragments than parameters)
            raise ConfigError(f"--strategy diloco: {e}") from None
        diloco.step_count = state.step  # the schedule of a fresh run; a checkpoint's state replaces it
        return DiLoCoStrategy(model, diloco, config, state)
    local = LocalSGD(model, period=config.local_sgd, warmup_steps=config.local_sgd_warmup)
    local.load_state_dict({"step_count": state.step})  # one local step per optimizer step, resumed ones too
    return LocalSGDStrategy(model, local, config)


def async_momentum(momentum: float, workers: int) -> float:
    """The SGD momentum of ``--strategy ps-async`` and ``ssp`` (with a staleness > 0): ``momentum`` less what
    asynchrony adds.

    N workers whose updates reach the model late behave as if the update had
    an implicit momentum of about ``1 - 1/N`` on top of the optimizer's
    (Mitliagkas et al., "Asynchrony begets momentum", 2016); with both, the
    default 0.9 diverges early on the digits (ps-async at staleness 0: 13 %
    after the first epoch, against ps-sync's 88 %). So these strategies step
    with ``max(0, momentum - (1 - 1/N))``, and the total is about ``momentum``.
    """
    return max(0.0, momentum - (1.0 - 1.0 / workers))


def _compensate_momentum(optimizer: torch.optim.Optimizer, config: TrainConfig) -> None:
    if config.optimizer == "sgd":
        for group in optimizer.param_groups:
            group["momentum"] = async_momentum(config.momentum, dist.get_world_size())


def _sharded(plain: torch.optim.Optimizer) -> ZeroRedundancyOptimizer:
    """``--zero``: the same optimizer (class, groups, settings and state) sharded over the ranks.

    The state comes through the unsharded format, which is what checkpoints
    hold, so a run resumes at any world size and under any stage.
    """
    groups = [dict(g) for g in plain.param_groups]  # every setting is in the groups
    zero = ZeroRedundancyOptimizer(groups, type(plain), lr=plain.defaults["lr"])
    zero.load_state_dict(plain.state_dict())
    return zero
