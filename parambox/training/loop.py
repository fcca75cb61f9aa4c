"""The one training loop: batch, ``strategy.step``, log, evaluate, checkpoint. No strategy branches."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from parambox.config import RunConfig
from parambox.data import BatchSource
from parambox.errors import REQUEUE_REQUESTED, REQUEUE_SIGNAL, BoxLost, Preempted, warn
from parambox.numerics import is_finite
from parambox.runtime import dist as pbdist
from parambox.runtime.control import SPARE_ENV, current_life
from parambox.runtime.heap import keep_freed_memory
from parambox.runtime.world import World
from parambox.strategies import Context, Strategy, build_strategy, strategy_class
from parambox.strategies.tensors import map_tensors
from parambox.training import checkpoint, joining, resize, salvage
from parambox.training.cadence import CheckpointCadence
from parambox.training.faults import FaultPlan
from parambox.training.metrics import MetricsLogger
from parambox.training.progress import Progress
from parambox.training.schedule import Schedule, ScheduledRates
from parambox.workload import Workload, build_workload, check_batch_fits
from parambox.workload.evaluate import evaluate as evaluate_model
from parambox.workload.loader import remove_scratch


@dataclass
class Run:
    cfg: RunConfig
    world: World
    run_dir: Path
    workload: Workload  # model, data, loss and metrics: the zoo's or the user's
    strategy: Strategy
    batches: BatchSource  # or a LoaderSource (a user's Dataset): batch(step), sampler, close()
    board: pbdist.ProgressBoard  # every rank's step, for timeouts that name who is missing
    faults: FaultPlan  # PARAMBOX_FAULT, read once here
    rates: ScheduledRates  # every optimizer the strategy made, and the run's lr schedule over them


def train(
    cfg: RunConfig,
    world: World,
    run_dir: Path,
    resume: bool = False,
    callables: dict[str, Callable] | None = None,
) -> dict[str, Any] | None:
    """Train on this rank; returns the summary on the leader (rank 0, or the oldest survivor of a run
    that survives in place). ``callables``: the user's model, data, loss,
    metrics or collate functions handed in by the library API in this process (else the config's
    names and references are used)."""
    try:
        run = setup(
            cfg, world, run_dir, callables, init_from=None if resume else cfg.init_from, resume=resume
        )
        try:
            with stop_on_signal() as stop:
                return _loop(run, resume, stop)
        finally:
            run.batches.close()  # a user's data: stop the background loaders
            remove_scratch()  # and remove the folder of their temporary files
            run.strategy.close()
            run.board.close()  # drop the board's store before the process group goes
    finally:
        pbdist.destroy_distributed()


class StopRequest(threading.Event):
    """Set by a signal: the loop checkpoints at the next step boundary and stops. ``requeue``: the
    signal was a batch system's before its time limit (SIGUSR1), so the rank exits with REQUEUE_EXIT."""

    requeue = False
    at_once: int | None = None  # inside ``requeue_at_once``: the step to name when the signal ends the rank

    def set_by(self, signum: int) -> None:
        self.requeue = self.requeue or signum == REQUEUE_SIGNAL
        self.set()
        if self.requeue and self.at_once is not None:
            raise Preempted(self.at_once)

    @contextlib.contextmanager
    def requeue_at_once(self, step: int, idle: bool) -> Iterator[None]:
        """A requeue signal ends the code inside at once: ``Strategy.finish()``, where a memory rank
        serves the box until the run's end and has no step boundary to stop at (its box's close waits
        for the workers' checkpoints). ``idle``: the rank took no step in this life, so a request it
        heard before ends it too (a worker that heard it during its last step finishes the run)."""
        if self.requeue and idle:
            raise Preempted(step)
        self.at_once = step
        try:
            yield
        finally:
            self.at_once = None


@contextlib.contextmanager
def stop_on_signal() -> Iterator[StopRequest]:
    """SIGTERM (the launcher stopping the run: Ctrl-C), SIGINT or SIGUSR1 (a batch system's warning
    before its time limit) sets the request; the loop checkpoints at the next step boundary and raises
    ``KeyboardInterrupt`` (``Preempted`` after SIGUSR1), so ``--resume`` has where to continue from.
    Only in the main thread (signal handlers can be set nowhere else)."""
    stop = StopRequest()
    if REQUEUE_REQUESTED.is_set():  # heard while this rank started: stop at the first step boundary
        stop.set_by(REQUEUE_SIGNAL)
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    signals = (signal.SIGTERM, signal.SIGINT, REQUEUE_SIGNAL)
    old = {sig: signal.signal(sig, lambda signum, _: stop.set_by(signum)) for sig in signals}
    try:
        yield stop
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _loop(run: Run, resume: bool, stop: StopRequest) -> dict[str, Any] | None:
    cfg, world = run.cfg, run.world
    log = MetricsLogger(run.run_dir, world.rank, cfg.tensorboard, leads=run.strategy.leads)
    step = None
    try:
        step = run.strategy.rejoin_step()  # a replacement carries on where its predecessor was
        resized = None
        if step is None:
            if resume and run.faults:
                run.faults.before_restore(world.rank)
            step, resized = restore(run) if resume else (0, None)
        log.write({"kind": "world", "step": step, **world_record(world), "epoch": round(log.epoch, 6)})
        if resized is not None:
            log.write(dict(resized))  # (write adds its time to what it is given)
        bar = Progress(cfg.steps, enabled=cfg.progress and world.rank == 0, start=step)
        first = step
        samples, joins = 0, joining.Joins(cfg, run.strategy)
        cadence = checkpoint_cadence(run)
        while not run.strategy.should_stop(step):
            if stop.is_set() and _stops_here(run, step):
                save_checkpoint(run, step, barrier=False)
                raise Preempted(step) if stop.requeue else KeyboardInterrupt
            run.board.post(step)
            run.rates.apply(step)
            run.strategy.admit(step)  # workers that join come in here: the batch is cut over the members
            if (joined := joins.follow(step, run.batches)) and run.strategy.leads:
                log.write(joined)
            batch = run.batches.batch(step)
            if run.faults:
                batch = run.faults.inject(world.rank, step, batch)
            result = run.strategy.step(map_tensors(lambda t: t.to(world.device), batch), step)
            step, samples = step + 1, samples + result.samples
            run.strategy.count_step(result.samples)
            _follow_lead(run, log, step)
            if step % cfg.log_every == 0:
                sampler = run.batches.sampler
                rec = step_record(
                    step, result, log.elapsed(), samples * sampler.global_batch_size / sampler.batch_size
                )
                if run.rates.schedule.active:
                    rec["lr"] = run.rates.current()  # the rate this step ran at
                log.write(rec)
            bar.update(step, result.loss)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                log.write({"kind": "eval", "step": step, **evaluate(run), **log.resources()})
            if step < cfg.steps and cadence.due(step):
                save_checkpoint(run, step)
                cadence.saved()
        with stop.requeue_at_once(step, idle=step == first):
            run.strategy.finish()
        _follow_lead(run, log, step)
        wall = log.elapsed()
        bar.close()
        final = evaluate(run)
        log.write({"kind": "eval", "step": step, **final, **log.resources()})
        save_checkpoint(run, step)
        return write_summary(run, step, wall, samples, final, resized)
    except BoxLost:  # the job restarts: the center is rebuilt from the workers' replicas (salvage.py)
        salvage.save(run, step, loop_state(run))
        raise
    finally:
        log.close()


def _follow_lead(run: Run, log: MetricsLogger, step: int) -> None:
    """Where the leader died and this rank took its part (in place after a step; an asynchronous run's
    at the end): it writes ``metrics.jsonl`` from now on, first saying so."""
    if run.strategy.leads and not log.leads:
        lost = _lost_in_place(run.world) or [0]
        log.lead({"kind": "leader", "step": step, "rank": run.world.rank, "lost": lost})


STOP_KEY = "stop_at"  # on the run's board: the step at which a stopped synchronous run leaves


def _stops_here(run: Run, step: int) -> bool:
    """Whether a stopped rank (Ctrl-C) leaves at this step boundary. Asynchronous ranks leave where
    they are. Synchronous ranks leave at the step rank 0 names on the board, the boundary after the
    one where it saw the signal: a rank a step ahead or behind would otherwise leave rank 0 inside a
    collective it can never finish, and the run without its checkpoint."""
    store = run.board.store
    if run.strategy.tolerates_worker_loss or store is None:
        return True
    if run.world.rank == 0 and not store.check([STOP_KEY]):
        store.set(STOP_KEY, str(step + 1))  # every rank reaches it: the step between is collective
        return False
    try:
        return store.check([STOP_KEY]) and step >= int(store.get(STOP_KEY))
    except RuntimeError:  # torch's DistNetworkError: the board's host, rank 0, is gone
        # Rank 0 leaves at the step it named, once the step before it (collective, so this rank's
        # too) is done, and takes the board with it: this is that step (or rank 0 died). Under load
        # rank 0 had saved and exited before this rank looked, which then wrote no checkpoint.
        return run.world.rank != 0


def world_record(world: World) -> dict[str, Any]:
    """Where this rank ran, and in which life (a replacement: from a warm spare or not): the first line
    of its metrics file in each life."""
    keys = ("rank", "world_size", "local_rank", "local_world_size", "node_rank", "num_nodes", "launcher")
    return {k: getattr(world, k) for k in keys} | {
        "life": current_life(),
        "from_spare": os.environ.get(SPARE_ENV) == "1",
    }


def setup(
    cfg: RunConfig,
    world: World,
    run_dir: Path,
    callables: dict[str, Callable] | None = None,
    init_from: str | None = None,
    resume: bool = False,
) -> Run:
    torch.set_num_threads(
        cfg.threads or int(os.environ.get("PARAMBOX_THREADS", "0")) or torch.get_num_threads()
    )
    keep_freed_memory()
    if strategy_class(cfg.strategy, cfg.strategy_options()).needs_process_group or (
        cfg.box.needs_process_group(world)
    ):
        shrink = cfg.on_failure == "shrink"
        pbdist.init_distributed(world, cfg.timeout, survive_in_place=shrink, defer_rejoin=True)
    board = pbdist.ProgressBoard()
    try:
        torch.manual_seed(cfg.seed)  # same initial weights on every rank
        workload = build_workload(cfg, callables)
        rates = ScheduledRates(
            make_optimizer_factory(cfg), Schedule(cfg.lr_schedule, cfg.warmup_steps, cfg.steps)
        )
        ctx = make_context(cfg, world, run_dir, workload, board, rates)
        ctx.resuming = resume
        if init_from:  # a new run from another run's weights, before the strategy copies them
            checkpoint.load_init_weights(ctx.model, init_from)
        # A replacement in a run that survives in place asks to join only now, its data and model
        # ready: the members stall from its admission until it has their state (its data set's
        # loading is ~0.5 s on MNIST; a user's data set could take minutes).
        pbdist.finish_rejoin()
        strategy = build_strategy(cfg.strategy, ctx, cfg.strategy_options())
        if getattr(strategy, "spare", None) is not None:  # box.spare_ranks: wait for a dead worker's place
            strategy, world, rates = _take_a_place(
                cfg, world, run_dir, workload, board, strategy, rates, resume
            )
        dp_rank, dp_size, batch_size = _slice(cfg, strategy)
        try:
            check_batch_fits(workload.data, batch_size, dp_size)
        except BaseException:
            strategy.close()  # its box, groups and threads
            raise
    except BaseException:
        board.close()
        raise
    torch.manual_seed(cfg.seed * 1000 + world.rank + 1)  # per-rank stream for dropout and the like
    pin = world.device.type == "cuda"  # page-locked host batches copy to the GPU asynchronously
    batches = workload.data.batch_source(batch_size, dp_rank, dp_size, cfg.seed, cfg.augment, pin)
    return Run(cfg, world, run_dir, workload, strategy, batches, board, FaultPlan.from_env(), rates)


def _take_a_place(
    cfg: RunConfig,
    world: World,
    run_dir: Path,
    workload: Workload,
    board: pbdist.ProgressBoard,
    spare: Strategy,
    rates: ScheduledRates,
    resume: bool,
) -> tuple[Strategy, World, ScheduledRates]:
    """A spare rank (``box.spare_ranks``), once it opened the box with the others: until the memory
    rank gives it a dead worker's place, then that worker from here on (its rank, data, checkpoints and
    steps), a replacement as the local launcher's are: it pulls the center and does the steps its
    predecessor had not. The spare's own strategy stays where the run ends without needing it."""
    from dataclasses import replace

    from parambox.box.node_cache import adopt_box
    from parambox.runtime import spawn
    from parambox.runtime.control import LIFE_ENV, REJOIN_ENV

    spawn.name_this_process(
        f"parambox-spare{spare.spare}"
    )  # not a rank's name (ps, bench chaos) until it has one
    place = spare.await_place()
    if place is None:
        return spare, world, rates
    worker, life = place
    adopt_box(spare.box_name, spare.box)  # the box it opened with the others: no second collective
    # a replacement's life: its predecessor's faults (PARAMBOX_FAULT) are not injected again
    os.environ.update({REJOIN_ENV: "1", SPARE_ENV: "1", LIFE_ENV: str(life)})
    spawn.name_this_process(spawn.rank_name(worker))
    world = replace(world, rank=worker)
    torch.manual_seed(cfg.seed)
    rates = ScheduledRates(
        make_optimizer_factory(cfg), Schedule(cfg.lr_schedule, cfg.warmup_steps, cfg.steps)
    )
    ctx = make_context(cfg, world, run_dir, workload, board, rates)
    ctx.resuming = resume
    return build_strategy(cfg.strategy, ctx, cfg.strategy_options()), world, rates


def _slice(cfg: RunConfig, strategy: Strategy) -> tuple[int, int, int]:
    """This rank's slice of the global batch: (data-parallel rank, ranks, batch size); in a run that
    workers join, cut over the group's members (``training/joining.py``)."""
    dp_rank, dp_size = strategy.data_partition()
    group = strategy.survival.group
    if group is None:
        return dp_rank, dp_size, cfg.batch_size
    return joining.cut(cfg, dp_rank, dp_size, group.group_rank, group.group_size)


def make_context(
    cfg: RunConfig,
    world: World,
    run_dir: Path,
    workload: Workload,
    board: pbdist.ProgressBoard,
    rates: ScheduledRates | None = None,
) -> Context:
    """What the strategy wraps: the model (same initial weights on every rank), optimizer factory (each
    optimizer it makes recorded in ``rates``, for the lr schedule), loss, and the loop's training
    features: micro-batches, clipping, precision (fp16: a loss scaler)."""
    model = workload.build_model().to(world.device)
    rates = rates or ScheduledRates(make_optimizer_factory(cfg), Schedule(total_steps=cfg.steps))
    return Context(
        world,
        model,
        rates.make,
        workload.loss,
        cfg.steps,
        cfg.timeout,
        run_dir,
        cfg.box,
        cfg.seed,
        board,
        grad_accum=cfg.grad_accum,
        grad_clip=cfg.grad_clip or None,
        precision=cfg.precision,
        scaler=torch.amp.GradScaler(world.device.type) if cfg.precision == "fp16" else None,
        pause_rates=rates.paused,
    )


def make_optimizer_factory(cfg: RunConfig):
    def make(params):
        params = list(params)
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        if cfg.optimizer == "adam":
            return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        if cfg.optimizer == "adamw":  # decoupled weight decay (--weight-decay), DiLoCo's inner optimizer
            return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        return torch.optim.Adagrad(params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    return make


def step_record(step: int, result, elapsed: float, global_samples: int) -> dict[str, Any]:
    rec = {
        "kind": "step",
        "step": step,
        "time": round(elapsed, 6),
        "loss": result.loss,
        "samples_per_s": global_samples / max(elapsed, 1e-9),
        "comm": result.comm,
    }
    rec.update(result.extra)
    return rec


def evaluate(run: Run) -> dict[str, float]:
    """``test_<metric>`` of the strategy's result model on the leader (empty elsewhere, and without a test
    set): the user's metrics or the default (loss, and accuracy for class logits)."""
    model = run.strategy.eval_model()  # collective: every rank calls it
    if model is None or not run.workload.data.has_test:
        return {}
    w = run.workload
    return evaluate_model(model, w.data.test_batches(), w.metrics, w.loss, run.world.device)


def save_checkpoint(run: Run, step: int, barrier: bool = True) -> None:
    """Synchronous runs: every rank's state at one step, committed by the leader's ``last.pt`` after a
    barrier. Asynchronous runs: each rank at its own pace (no barrier: a dead peer must not block it).
    ``barrier=False`` (a stopped run): each rank at the step it stopped at, no waiting on the others."""
    ckpt_dir = run.run_dir / "checkpoints"
    state = checkpoint.rank_state(run.strategy.model.state_dict(), run.strategy.state_dict(), loop_state(run))
    model = run.strategy.eval_model()
    own_pace = run.strategy.tolerates_worker_loss
    # A memory rank trains nothing (rank 0 saves the box): no state of its own that a worker of a
    # resized run taking its rank could mistake for a trained one.
    if not run.strategy.leads and not getattr(run.strategy, "serves", False):
        checkpoint.save_rank_state(ckpt_dir, run.world.rank, step, state, prune=own_pace)
    if run.world.world_size > 1 and not own_pace and barrier:
        with pbdist.collective("checkpoint barrier", run.board):
            # nccl: this rank's GPU named (torch otherwise warns that it guesses it, on every rank)
            cuda = run.world.device.type == "cuda"
            dist.barrier(device_ids=[torch.cuda.current_device()] if cuda else None)
    if run.strategy.leads:
        weights = model.state_dict()
        # The parameters: a buffer of -inf (a causal mask) is a constant of the model, not a divergence.
        if not all(is_finite(p.detach()) for p in model.parameters()):
            # A diverged run must not replace the only commit point with weights nobody can resume from.
            warn(f"checkpoint at step {step} not written: the model's weights are not finite")
            return
        checkpoint.save_last(
            ckpt_dir,
            step,
            weights,
            run.cfg.model_dump(),
            run.world.world_size,
            state,
            prune_others=not own_pace,
            data=run.batches.sampler.state(step),
        )
        if own_pace:  # a replica rank 0 kept when a box was lost: last.pt holds newer now
            checkpoint.drop_rank_states(ckpt_dir, 0)


def checkpoint_cadence(run: Run) -> CheckpointCadence:
    """The run's checkpoint cadence: asynchronous ranks by their own clocks, ranks in lockstep by rank
    0's, posted on the run's store (``training/cadence.py``)."""
    cfg, strategy = run.cfg, run.strategy
    clock = "own"
    if run.world.world_size > 1 and not strategy.tolerates_worker_loss:
        clock = "rank0" if strategy.lockstep else "steps"
    group = pbdist.elastic_group()
    store = group.store if group is not None else run.board.store
    options = cfg.strategy_options()
    period = max([int(getattr(options, name, 1) or 1) for name in strategy.period_options] or [1])
    return CheckpointCadence(
        cfg.checkpoint_every,
        cfg.checkpoint_interval_s,
        run.world.rank,
        clock,
        store,
        period,
        prefix=f"parambox/checkpoint_at/{current_life()}",
    )


def restore(run: Run) -> tuple[int, dict[str, Any] | None]:
    """This rank's state from the run's last checkpoint, at any worker count (``training/resize.py``):
    the step it continues from, and the record of a resize (None when the size and batch are the same)."""
    resumed = checkpoint.load_resume(
        run.run_dir / "checkpoints",
        run.world.rank,
        run.world.world_size,
        own_pace=run.strategy.tolerates_worker_loss,
    )
    if resumed.world_size != run.world.world_size:  # under torchrun / srun: not checked before
        run.strategy.check_resize(resumed.world_size, run.world.world_size, run.strategy.options)
    salvage.rebuild(run, resumed)  # (an asynchronous run restarted after its box was lost)
    resized = resize.continue_stream(run.batches.sampler, run.cfg, resumed, run.strategy.ctx)
    if resumed.joiner:  # new to the run, or an asynchronous rank that never checkpointed
        run.strategy.load_model_state(resumed.model)  # the run's weights (an asynchronous run's center)
        rank0 = resumed.rank0
        # Asynchronous: its own optimizer starts afresh, and its count of steps in the box starts at
        # the step it continues from (as its loop's does), for a rank the run had that never checkpointed
        fresh = run.strategy.tolerates_worker_loss
        state = (
            {"steps_done": resumed.step} if fresh else run.strategy.joiner_state(rank0.get("strategy", {}))
        )
        run.strategy.load_state_dict(state)
        load_loop_state(run, rank0.get("loop", {}))
    else:
        state = resumed.state
        run.strategy.load_model_state(state["replica"])
        run.strategy.load_state_dict(state["strategy"])
        load_loop_state(run, state.get("loop", {}))
        torch.set_rng_state(state["torch_rng"])
    if run.world.rank == 0:
        resize.announce(run.run_dir / "checkpoints" / "last.pt", resumed.step, run.cfg.steps, resized)
    return resumed.step, resized


def loop_state(run: Run) -> dict[str, Any]:
    """What the loop's own features need to resume: the schedule (its horizon) and the loss scaler."""
    scaler = run.strategy.ctx.scaler
    return {
        "schedule": run.rates.schedule.state_dict(),
        **({"scaler": scaler.state_dict()} if scaler is not None else {}),
    }


def load_loop_state(run: Run, state: dict[str, Any]) -> None:
    """The schedule continues where the restored step puts it, over the horizon it started with."""
    schedule = run.rates.schedule
    if "schedule" in state:
        recorded = state["schedule"].get("total_steps", schedule.total_steps)
        if schedule.active and recorded != schedule.total_steps and run.world.rank == 0:
            warn(
                f"lr_schedule {schedule.kind}: the resumed run keeps the horizon it started with "
                f"({recorded} steps, not {schedule.total_steps})"
            )
        schedule.load_state_dict(state["schedule"])
    scaler = run.strategy.ctx.scaler
    if scaler is not None and "scaler" in state:
        scaler.load_state_dict(state["scaler"])


def write_summary(
    run: Run, step: int, wall: float, samples: int, final: dict[str, float], resized: dict | None = None
) -> dict | None:
    total = run.strategy.total_samples(samples)
    if not run.strategy.leads:
        return None
    wall = run.strategy.wall_time(wall)
    cfg = run.cfg
    summary = {
        "strategy": cfg.strategy,
        "workers": run.world.world_size,
        "steps": step,
        "model": cfg.model,
        "data": cfg.data,
        "batch_size": cfg.batch_size,
        "lr": cfg.lr,
        **{f"final_{k}": v for k, v in final.items()},
        "final_test_loss": final.get("test_loss"),  # always there: None without a test set
        "wall_time_s": wall,
        "samples_per_s": total / max(wall, 1e-9),
        "lost_workers": _lost_in_place(run.world),
        "restarts": 0,  # the local launcher counts them in (replacements or group restarts)
        "launcher": run.world.launcher,
        "num_nodes": run.world.num_nodes,
        "device": run.world.device.type,
        "backend": run.world.backend,
        "config": cfg.model_dump(),
    }
    if resized is not None:  # this life's resume changed the worker count or the batch
        summary["resize"] = {k: v for k, v in resized.items() if k != "kind"}
    summary.update(run.strategy.summary_extra())
    checkpoint.atomic_write_json(run.run_dir / "summary.json", summary)
    return summary


def _lost_in_place(world: World) -> list[int]:
    """The ranks a run that survives in place left behind (its group's members are the others); the
    local launcher adds what only it knows (``run/execute.mark_lost``)."""
    group = pbdist.elastic_group()
    return sorted(set(range(world.world_size)) - set(group.members)) if group is not None else []
