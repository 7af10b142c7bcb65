"""``ddpkit train --strategy ps-sync|ps-async|ssp|diloco --on-failure continue``: the workers step without the
engine.

Each worker builds the default mode's model and optimizer (the learning rate
scaled by the starting world size, DiLoCo's inner one not, asynchronous
momentum compensated as in the default mode) and either hands the optimizer to the ``--num-servers``
servers (:class:`ddpkit.ParameterServerOptimizer`, ``--ps-replication``
copies of each key range), makes it stale-synchronous
(:func:`ddpkit.StaleSynchronousOptimizer`: all-reduces in flight, at most
``--staleness`` steps old, over the membership's groups), or steps alone
between DiLoCo's outer steps (:class:`ddpkit.DiLoCo`, every ``--sync-every``
steps, over the membership's groups). It trains its own
shard of every epoch (a ``DistributedSampler`` of the starting world) and
steps after each batch. A worker's death leaves the others training
(ps-async: the servers stop waiting for it; ssp: the survivors make good the
steps it left in flight, its share of each applied by all or by none; diloco:
its inner steps since its last outer step are lost, the survivors average
their own over the new size; ps-sync needs every worker and fails naming the
one that left); its remaining data of the epoch is trained by nobody.
DiLoCo counts the samples its global model holds (``summary.json``'s
``diloco``), so the loss is stated, not guessed. A server's death is survived while every
key range has a live server.

At the end of each of its epochs a worker settles (pulls the servers'
parameters; ssp: waits for the all-reduces in flight and averages the
replicas with the others; diloco: evaluates the global model, which the
outer steps made) and evaluates on the whole test split alone; the
first member of the current view writes ``metrics.jsonl`` (its own history).
When every live worker is done (a barrier over the membership that survives
deaths), each settles once more (diloco: the last epoch's outer step, which
ends with the members agreed, made the final model) and the first member writes
``model.safetensors`` and ``summary.json``. Buffers (BatchNorm's statistics)
are each worker's own: the servers, and the replicas' average, hold the
parameters only. ``--compile`` compiles each worker's forward, and with
``--tensorboard`` the first member writes its own epochs' points as
``metrics.jsonl`` holds them (:class:`~ddpkit.integrations.tensorboard.MemberBoard`).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import torch

from ddpkit.data.sampler import DistributedSampler
from ddpkit.integrations.tensorboard import MemberBoard
from ddpkit.parallel.diloco import DiLoCo
from ddpkit.parallel.ps.optimizer import ParameterServerOptimizer
from ddpkit.parallel.ssp import StaleSynchronousOptimizer
from ddpkit.runtime import membership
from ddpkit.runtime.durable import write_or_warn
from ddpkit.train import rundir
from ddpkit.train.checkpoint import save_weights
from ddpkit.train.curves import write_curves
from ddpkit.train.train_config import TrainConfig
from ddpkit.train.evaluate import evaluate_alone
from ddpkit.train.records import epoch_line, epoch_record, micro_batch_loss, result_line, summary_of
from ddpkit.train.recipe import autocast_for, build_state, lr_scale, set_lr, start_survivor, warmup_lr
from ddpkit.train.strategy import async_momentum

__all__ = ["worker"]


def worker(config: TrainConfig) -> dict[str, Any]:
    """One worker of the mode with parameter servers or SSP (see the module notes); the summary."""
    ctx, out, data = start_survivor(config)
    world, rank = ctx.world_size, ctx.rank
    members = membership.current()
    assert members is not None  # ddpkit.init() made it under the mode's launcher
    state = build_state(config, data, world, ctx.device)
    model = state.model
    ssp, diloco = config.strategy == "ssp", config.strategy == "diloco"
    scale = lr_scale(config, world)  # the starting world's, but for DiLoCo's inner optimizer
    mode = "sync" if config.strategy == "ps-sync" else "async"
    if config.optimizer == "sgd" and not diloco and (config.staleness if ssp else mode == "async"):
        for group in state.optimizer.param_groups:
            group["momentum"] = async_momentum(config.momentum, world)
    outer: DiLoCo | None = None
    if diloco:
        opt = state.optimizer
        outer = _diloco(model, config)
        settle = _nothing
    elif ssp:
        opt = StaleSynchronousOptimizer(state.optimizer, staleness=config.staleness or 0)
        settle = opt.synchronize  # type: ignore[attr-defined]
    else:
        opt = ps = ParameterServerOptimizer.from_optimizer(state.optimizer, mode=mode, staleness=config.staleness)
        settle = ps.pull
    members.holds_state()  # past its start: from here on an exit with code 2 is a death, not a usage error
    sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True, seed=config.seed)
    x, y = data.train.images.to(ctx.device), data.train.labels.to(ctx.device)
    autocast = autocast_for(config, ctx.device)
    servers = (f"staleness {config.staleness or 0}" if ssp else f"an outer step every {config.sync_every} steps"
               if diloco else f"{config.num_servers} server(s) (replication {config.ps_replication})")
    if rank == 0:
        print(f"ddpkit train: {config.model} on {config.dataset}, --strategy {config.strategy} --on-failure continue "
              f"with {world} worker(s), {servers}, lr {config.lr:g} x {scale}, output {out}", flush=True)
    history: list[dict[str, Any]] = []
    board = MemberBoard(config.tensorboard)
    # dynamic=False: one kernel per shape (a short last batch is a shape of its own), as in the default mode.
    forward = torch.compile(model, dynamic=False) if config.compile else model
    said = 0  # DiLoCo's changes said so far
    start = time.perf_counter()
    for epoch in range(config.epochs):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), dtype=torch.long)
        loss_sum, count, began = 0.0, 0, time.perf_counter()
        steps_per_epoch = -(-len(order) // config.batch_size)
        for at in range(0, len(order), config.batch_size):
            b = order[at : at + config.batch_size]
            if config.warmup_for(scale):
                set_lr(opt, warmup_lr(config, scale, epoch * steps_per_epoch + at // config.batch_size,
                                      steps_per_epoch))
            opt.zero_grad(set_to_none=True)
            loss = micro_batch_loss(forward, x[b], y[b], autocast)
            loss.backward()
            opt.step()
            if outer is not None:
                outer.step(samples=len(b))
                said = _say_changes(outer, members, said)
            loss_sum += float(loss.detach()) * len(b)
            count += len(b)
            board.applied(epoch * steps_per_epoch + at // config.batch_size + 1, float(loss.detach()))
            board.write(members.latest().members[0] == members.member, history)  # (its own steps, and epochs)
        settle()
        if outer is not None and epoch == config.epochs - 1:
            outer.sync()  # the inner steps since the last outer step, in one more: every member holds the model
            said = _say_changes(outer, members, said)
        with _global_model(outer):
            evaluation = evaluate_alone(model, data.test, ctx.device, autocast)
        view = members.latest()
        record = epoch_record(epoch=epoch + 1, step=(epoch + 1) * steps_per_epoch, train_loss=loss_sum / max(count, 1),
                              evaluation=evaluation, lr=opt.param_groups[0]["lr"],
                              elapsed=time.perf_counter() - began, trained=count, workers=view.size,
                              servers_gone=list(view.servers_gone), samples=count, rank=rank)
        history.append(record)
        board.write(view.members[0] == members.member, history)
        if view.members[0] == members.member:
            left = "" if ssp or diloco else f", {config.num_servers - len(view.servers_gone)} server(s)"
            print(f"{epoch_line(record, config.epochs)} (rank {rank}; {view.size} worker(s){left})", flush=True)
            rundir.write_metrics(out, history, warn=True)
    if outer is not None:  # the last epoch's outer step made the final model, evaluated above
        outer.agree()  # (not members.barrier(): a member may still be in an agreement on the same group)
        view = outer.view
        assert view is not None
    else:
        view = members.barrier()  # every worker still alive has pushed its last gradient
        settle()
        evaluation = evaluate_alone(model, data.test, ctx.device, autocast)
    wall = time.perf_counter() - start
    summary = {**summary_of(config, evaluation=evaluation, world=view.size, global_batch=config.batch_size * world,
                            wall=wall, steps=config.epochs * steps_per_epoch),  # (steps: each worker's)
               "replicas": world, "lr": config.lr * scale, "base_lr": config.lr, "resumed_from_epoch": 0,
               "started_with": world, "servers": config.num_servers, "servers_gone": list(view.servers_gone),
               "ps_replication": config.ps_replication, "on_failure": "continue"}
    if outer is not None:
        planned = len(sampler) * world * config.epochs
        summary.update(servers=0, diloco={
            "sync_every": config.sync_every, "outer_steps": outer.syncs, "samples_in_model": outer.samples,
            "samples_planned": planned, "samples_lost": planned - (outer.samples or 0), "changes": outer.changes,
            "bytes_sent": outer.bytes_sent})
    elif ssp:
        summary.update(servers=0, ssp=opt.stats())  # type: ignore[attr-defined]
    else:
        summary["ps"] = ps.stats.as_dict()
    board.write(view.members[0] == members.member, history)  # (the first member now, maybe not at the last epoch)

    def write(alive: list[int]) -> None:  # (this member's own buffers and history: those of its replica)
        summary["world_size"] = len(alive)
        rundir.write_metrics(out, history, warn=True)
        save_weights(out / "model.safetensors", model.state_dict())
        write_or_warn(out / "summary.json", json.dumps(summary, indent=2, sort_keys=True) + "\n")
        write_curves(out, history)
        left = "" if ssp or diloco else (f" and {config.num_servers - len(view.servers_gone)} of "
                                         f"{config.num_servers} server(s)")
        print(f"{result_line(config, evaluation[1], evaluation[0], evaluation[2])}, {config.epochs} epoch(s) in "
              f"{wall:.1f} s, {len(alive)} of {world} worker(s){left} at the end; weights in "
              f"{out / 'model.safetensors'}", flush=True)
        if outer is not None:
            d = summary["diloco"]
            print(f"DiLoCo: the global model holds {d['samples_in_model']} of the {d['samples_planned']} samples "
                  "planned" + (f" ({d['samples_lost']} lost: the inner steps of the workers that died since their "
                               "last outer step, and the data they had left)" if d["samples_lost"] else ""),
                  flush=True)

    members.by_the_first(view, write)  # a writer that dies before it wrote leaves it to the next first member
    board.close()
    if not ssp and not diloco:
        ps.close()
    return summary


def _diloco(model: torch.nn.Module, config: TrainConfig) -> DiLoCo:
    """``--strategy diloco``'s outer loop over the membership (as the default mode builds it)."""
    assert config.sync_every is not None
    params = [p for p in model.parameters() if p.requires_grad]
    outer = torch.optim.SGD(params, lr=config.outer_lr, momentum=config.outer_momentum,
                            nesterov=config.outer_momentum > 0)
    return DiLoCo(model, config.sync_every, outer, mixing=config.fragment_mixing, codec=config.outer_codec)


def _nothing() -> None:
    """DiLoCo settles nothing at an epoch's end: its workers evaluate the global model."""


@contextlib.contextmanager
def _global_model(outer: DiLoCo | None) -> Iterator[None]:
    """The global model's parameters in the model (DiLoCo; each worker's own put back after); else nothing."""
    if outer is None:
        yield
        return
    own = [p.detach().clone() for p in outer.params]
    with torch.no_grad():
        for p, g in zip(outer.params, outer.global_parameters()):
            p.copy_(g)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, mine in zip(outer.params, own):
                p.copy_(mine)


def _say_changes(outer: DiLoCo, members: membership.Membership, said: int) -> int:
    """The first member says each change DiLoCo met after the first ``said``; how many it met."""
    view = outer.view
    if view is not None and view.members[0] == members.member:
        for change in outer.changes[said:]:
            if change["lost"]:
                print(f"DiLoCo: worker(s) {change['lost']} left at step {change['step']}: the {change['workers']} "
                      f"left go on from outer step {change['outer_steps']}; the inner steps of the lost since their "
                      "last outer step are gone", flush=True)
    return len(outer.changes)
