"""The protocol every strategy implements, and the forward/backward they share.

A strategy owns one training step, ``step(batch, step) -> StepResult`` (pipeline parallelism and
L-BFGS must own forward and backward), so the loop in ``parambox.training.loop`` never branches on the
strategy. A batch is any structure of tensors (a tensor, or tuples, lists and dicts of them) already
on the device; the loss is the user's ``loss_fn(model, batch) -> scalar tensor`` (the default,
``parambox.workload.losses.default_loss``, is the cross-entropy of ``model(x)`` against ``y``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict
from torch import nn

from parambox.box import BoxConfig, Layout
from parambox.errors import CommTimeout, UserError
from parambox.runtime.dist import ProgressBoard
from parambox.runtime.elastic import PeerLost
from parambox.runtime.survival import CAUGHT_UP, InPlace
from parambox.runtime.world import World

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[nn.Module, Any], torch.Tensor]  # (model, batch) -> scalar loss, the user's style


class Options(BaseModel):
    """Base of each strategy's typed options (``[strategy_name]`` in TOML, ``--set name.key=v``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


@dataclass
class StepResult:
    loss: float  # mean loss over this worker's batch
    samples: int  # samples this worker consumed in the step
    comm: dict[str, float] = field(default_factory=dict)  # seconds spent per communication phase
    extra: dict[str, float] = field(default_factory=dict)  # e.g. staleness


@dataclass
class Context:
    """What the loop hands a strategy: the plain PyTorch pieces it wraps."""

    world: World
    model: nn.Module  # same initial weights on every rank
    make_optimizer: OptimizerFactory
    loss_fn: LossFn
    steps: int  # target steps per worker
    timeout_s: float
    run_dir: Any = None  # pathlib.Path of the run directory
    box: BoxConfig = field(default_factory=BoxConfig)  # the run's box: open_box(ctx.box, ...)
    seed: int = 0
    board: ProgressBoard | None = None  # where ranks post their step, so timeouts name who is missing
    resuming: bool = False  # a --resume life: every rank's state comes from the run's checkpoints
    # The loop's training features (``parambox.training.loop.make_context`` sets them from the config),
    # run by the shared :meth:`Strategy.step`:
    grad_accum: int = 1  # micro-batches per step: the batch split in K, one backward each, one update
    grad_clip: float | None = None  # the gradient's global L2 norm clipped to this before the update
    precision: str = "fp32"  # "bf16" / "fp16": forward and loss under autocast; weights stay fp32
    scaler: Any = None  # fp16: a torch.amp.GradScaler("cuda")
    # fp16: while a step the scaler skips runs its update, every optimizer's rate is 0 (the exchanges
    # still run, so collectives stay aligned; the weights stay where they are)
    pause_rates: Callable[[], AbstractContextManager[None]] | None = None
    # What this rank's loss is scaled by in backward: 1, but for a run resized to a worker count that
    # does not divide its global batch (slices one sample apart), where ``slice * n / global`` makes the
    # ranks' mean gradient the global batch's exact mean (``GlobalBatchSampler.loss_weight``).
    loss_weight: float = 1.0


class Strategy:
    """One update rule. Subclasses set ``name`` and ``Options``; a data-parallel rule implements
    :meth:`begin_step` and :meth:`end_step` (the shared :meth:`step` runs the forward/backward in
    between), a rule that owns forward/backward (pipeline, L-BFGS) overrides :meth:`step`.

    >>> from parambox.strategies import STRATEGIES
    >>> sorted(STRATEGIES)[:2]  # doctest: +SKIP
    ['allreduce', 'box-sync']
    """

    name: ClassVar[str]
    Options: ClassVar[type[Options]] = Options
    # Asynchronous strategies carry on when a worker dies; the launcher then does not stop the others.
    tolerates_worker_loss: ClassVar[bool] = False
    # Every rank's steps wait for every other's (a collective each step or each period): no rank can
    # train ahead of rank 0. False where the ranks do not wait for each other (the box, a master).
    lockstep: ClassVar[bool] = True
    # Synchronous strategies that go on as a smaller group when a worker dies (``on_failure = "shrink"``):
    # their exchanges run through ``exchange``, which regroups and repeats them.
    survives_in_place: ClassVar[bool] = False
    # Strategies that need MPI (the rma box) are started through mpiexec by the local launcher.
    needs_mpi: ClassVar[bool] = False
    # torch.distributed's default group (a rendezvous of every rank) is set up before the strategy.
    needs_process_group: ClassVar[bool] = True
    # How many workers the strategy runs with (None: no upper limit); checked when it is built.
    min_workers: ClassVar[int] = 1
    max_workers: ClassVar[int | None] = None
    # A data-parallel strategy's step is a local forward/backward between ``begin_step`` and
    # ``end_step``, so ``DistributedOptimizer`` can drive it inside a user's own loop. Pipeline
    # parallelism and L-BFGS must own forward/backward: they override ``step`` and set this.
    owns_forward_backward: ClassVar[bool] = False
    # The exchange in perfmodel's terms ("ring", "tree", "ps", "box"), for `parambox pick`'s scaling
    # model; None: the box for strategies that survive a lost worker, a ring allreduce for the others.
    comm_topology: ClassVar[str | None] = None
    # Every worker's gradient steps land on one shared center (downpour, hogwild, dogwild): with N
    # writers the center moves N times per step, so the studies train them at lr / N.
    shared_center: ClassVar[bool] = False
    # The options that set how many local steps pass between two exchanges (easgd's tau, diloco's H):
    # what the studies' tau-H tables vary.
    period_options: ClassVar[tuple[str, ...]] = ()
    # Whether a run of this rule resumes at another worker count (``--resume --workers M``): the model,
    # the state of the ranks that stay, and :meth:`joiner_state` for the new ones are enough. Rules whose
    # state is cut by the worker count (pipeline stages, L-BFGS shards) refuse in :meth:`check_resize`.
    resizes: ClassVar[bool] = True
    # The keys of :meth:`state_dict` (dotted for nested ones) that are one rank's own, not the run's: a
    # rank new to a resized run starts them afresh (error feedback it does not owe, a local optimizer's
    # moments of a replica it never had). The rest of rank 0's state is the run's, the same on every rank.
    per_rank_state: ClassVar[tuple[str, ...]] = ()
    # What the strategy trains with when the user did not choose (applied by config resolution, so
    # config.json records it): its optimizer and rate, taken whole unless the user set optimizer or lr
    # (a user's --optimizer sgd must not inherit a rate meant for AdamW); ...
    default_optimizer: ClassVar[dict[str, Any]] = {}
    # ... other run fields, each where the user did not set it (sandblaster's full batch); ...
    default_run: ClassVar[dict[str, Any]] = {}
    # ... and option defaults of this form where they differ from the Options model's (one Options model
    # serves both of diloco's forms), each where the user did not set it.
    default_options: ClassVar[dict[str, Any]] = {}

    @classmethod
    def resolve(cls, options: Options) -> type[Strategy]:
        """The class that really runs with these options (e.g. easgd's synchronous form); ``cls`` here."""
        return cls

    @classmethod
    def memory_ranks(cls, box: BoxConfig, *, emulated_nodes: bool = False) -> int:
        """Processes the run needs beyond its ``--workers``: ranks that hold the rma box and train
        nothing (the Soft Memory Box's memory node). None here: a synchronous strategy's box lives
        on its workers. ``emulated_nodes``: the run is on an emulated cluster."""
        return 0

    @classmethod
    def check_resize(cls, old: int, new: int, options: Options | None = None) -> None:
        """A ``UserError`` when a run of ``old`` workers cannot resume with ``new`` (checked before any
        process starts); then ``new`` must be a count the rule takes."""
        if not cls.resizes:
            raise UserError(
                f"strategy {cls.name!r} cannot resume at another worker count: its state is cut for "
                f"{old} workers; resume with {old} workers, or start a new run of {new} from these weights "
                "with --init-from RUN_DIR"
            )
        cls.check_workers(new, options)

    @classmethod
    def accepts_workers(cls, n: int, options: Options | None = None) -> bool:
        try:
            cls.check_workers(n, options)
        except UserError:
            return False
        return True

    @classmethod
    def check_workers(cls, n: int, options: Options | None = None) -> None:
        """A ``UserError`` naming the strategy when it cannot run with ``n`` workers (and ``options``):
        checked before any process starts."""
        if cls.max_workers == 1 and n != 1:
            raise UserError(f"strategy {cls.name!r} runs one process, not {n}")
        if n < cls.min_workers:
            raise UserError(f"strategy {cls.name!r} needs at least {cls.min_workers} workers, got {n}")
        if cls.max_workers is not None and n > cls.max_workers:
            raise UserError(f"strategy {cls.name!r} runs at most {cls.max_workers} workers, got {n}")

    def __init__(self, ctx: Context, options: Options):
        self.check_workers(ctx.world.world_size, options)
        self.ctx = ctx
        self.world = ctx.world
        self.model = ctx.model
        self.options = options
        self.timers = PhaseTimers()
        self.optimizer: torch.optim.Optimizer | None = None  # set by strategies with a local optimizer
        self.passes: BackwardPasses | None = None  # set by rules that average by the end of backward
        self.backward_passes_per_step = 1  # horovod's name: the passes before the last accumulate locally
        # Surviving a lost peer in place, the runtime's side: this rule answers its small interface
        # (state_dict, load_state_dict, load_model_state, next_exchange, catch_up).
        self.survival = InPlace(self, ctx.world.rank, ctx.world.world_size, ctx.board)

    def collective(self, phase: str) -> AbstractContextManager[None]:
        """Wrap blocking communication (:meth:`InPlace.collective`): a timeout names the phase and the
        missing ranks; in a run that survives in place, a lost peer regroups in :meth:`exchange`."""
        return self.survival.collective(phase)

    def exchange(self, fn: Callable[[], Any], step: int, again: Callable[[], Any] | None = None) -> Any:
        """``fn()``, one exchange of the rule, through the runtime (:meth:`InPlace.exchange`): repeated
        over the survivors (``again()``) after a lost peer; ``CAUGHT_UP`` on a rank that took a
        leader's state for the step instead."""
        return self.survival.exchange(fn, step, again)

    def catch_up(self, src: int, behind: bool, why: str) -> None:
        """After a regroup whose members were a step apart: group rank ``src`` (a step ahead: its update
        of the step the ranks behind failed in is made) gives them its state, and they skip their own
        update of that step. Collective over the new group. A strategy whose state is more than its
        model and :meth:`state_dict` cannot: it raises (the run falls back to a restart)."""
        raise CommTimeout(why)

    def next_exchange(self, step: int) -> int:
        """The first step from ``step`` on whose exchange every rank takes part (every step here;
        ``period_end`` where the exchange comes every few steps): where a replacement is admitted."""
        return step

    # -- data ---------------------------------------------------------------------------------
    def data_partition(self) -> tuple[int, int]:
        """(data-parallel rank, number of data-parallel ranks) for sharding the global batch."""
        return self.world.rank, self.world.world_size

    # -- the step -----------------------------------------------------------------------------
    def step(self, batch: Any, step: int) -> StepResult:
        """One training step on this worker's ``batch`` (already on the device): ``begin_step``, the
        forward and backward passes of its ``ctx.grad_accum`` micro-batches, unscaling (fp16) and
        clipping (``ctx.grad_clip``), then ``end_step`` with the batch's mean loss and all its samples.
        The gradient is the batch's mean gradient, as one backward of the whole batch would give it."""
        self.begin_step(step)
        n = batch_size(batch)
        loss = self._forward_backward(batch, n)
        finite, extra = self._before_update(step)
        pause = self.ctx.pause_rates
        with pause() if not finite and pause is not None else nullcontext():
            result = self.end_step(loss, n, step)
        result.extra.update(extra)
        return result

    def _forward_backward(self, batch: Any, n: int) -> torch.Tensor:
        """Each micro-batch's forward and loss (under :meth:`autocast`) and the backward of its share
        of the loss (scaled, fp16), inside :meth:`no_sync` but for the last; the batch's mean loss."""
        ctx = self.ctx
        parts = split_batch(batch, ctx.grad_accum, n)
        # Nothing may run between the last backward and the update when a strategy updates during
        # backward (downpour's buckets): it gets before_backward only when there is nothing to run.
        direct = not ctx.grad_clip and ctx.scaler is None
        total: torch.Tensor | None = None  # the batch's mean loss: the parts' losses by their shares
        for i, (part, share) in enumerate(parts):
            last = i == len(parts) - 1
            with self.no_sync() if not last else nullcontext():
                with self.autocast():
                    loss = ctx.loss_fn(self.model, part)
                if len(parts) == 1:
                    total = loss.detach()
                else:
                    loss = loss * share
                    total = loss.detach().float() if total is None else total + loss.detach().float()
                if last and direct:
                    self.before_backward(total)
                if ctx.loss_weight != 1.0:
                    loss = loss * ctx.loss_weight
                (ctx.scaler.scale(loss) if ctx.scaler is not None else loss).backward()
        return total

    def _before_update(self, step: int) -> tuple[bool, dict[str, float]]:
        """Between the last backward and the update: the loss scaler's unscaling and overflow check, and
        clipping. (Whether the update may go ahead, the step record's additions.)"""
        ctx = self.ctx
        extra: dict[str, float] = {}
        if ctx.scaler is not None:
            extra["loss_scale"] = float(ctx.scaler.get_scale())
            grads = _Grads(trainable(self.model))
            self._agree_on_overflow(grads.params, step)
            ctx.scaler.unscale_(grads)
        if ctx.grad_clip:
            extra["grad_norm"] = float(self.clip_grad_norm_(ctx.grad_clip))
        if ctx.scaler is None:
            return True, extra
        finite = ctx.scaler.step(grads) is not None  # None: an inf or NaN, the scaler skips the step
        ctx.scaler.update()
        if not finite:  # the update runs (its exchanges too) with zero gradients at rate 0
            extra["skipped"] = 1.0
            for p in grads.params:
                if p.grad is not None:
                    p.grad.zero_()
        return finite, extra

    def _agree_on_overflow(self, params: list[nn.Parameter], step: int) -> None:
        """fp16, a strategy whose ranks run in lockstep over several ranks: an inf or NaN in any rank's
        gradient skips the step on every rank, as DDP's averaged gradient makes it (one allreduce of a
        flag; a rank whose own gradients are finite gets a NaN in one, for its scaler to find), so the
        replicas and the loss scales stay the same everywhere."""
        if not (self.lockstep and self.world.world_size > 1 and dist.is_initialized()):
            return
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

        def agree() -> bool:
            flag = torch.tensor([0.0 if finite else 1.0], device=grads[0].device)
            with self.collective("loss scaler's overflow check"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True).wait()
            return bool(flag.item())

        overflow = self.exchange(agree, step)
        if overflow is not CAUGHT_UP and overflow and finite:
            grads[0].fill_(float("nan"))

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the trainable parameters' ``.grad`` so that their global L2 norm is at most
        ``max_norm`` (``torch.nn.utils.clip_grad_norm_``); returns the norm before clipping. It clips
        what ``.grad`` holds after the last backward: the averaged gradient where the strategy has
        averaged it by then, the local one in strategies that step locally."""
        return torch.nn.utils.clip_grad_norm_(trainable(self.model), max_norm)

    def autocast(self) -> AbstractContextManager[Any]:
        """Forward and loss at ``ctx.precision``: autocast to bf16 or fp16 (the weights, gradients and
        every exchange stay fp32); nothing for fp32."""
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.ctx.precision)
        if dtype is None:
            return nullcontext()
        return torch.autocast(self.world.device.type, dtype=dtype)

    def no_sync(self) -> AbstractContextManager[None]:
        """Around the backward of every micro-batch but the last (gradient accumulation, DDP's name):
        the gradients add up in ``.grad`` and the strategy does not exchange them; the step's exchange
        sends the sum. Only rules that average by the end of backward (``self.passes``) have anything
        to hold back."""
        return self.passes.no_sync() if self.passes is not None else nullcontext()

    def before_backward(self, loss: torch.Tensor) -> None:
        """Between the forward and the backward pass of a step the strategy drives (``step``), with
        the step's loss (with micro-batches: before the last one's backward, with the mean so far);
        not called where clipping or a loss scaler must see the gradients before the update, nor under
        ``DistributedOptimizer``, whose user runs backward."""

    def begin_step(self, step: int) -> None:
        """Before the forward pass of ``step``: zero the gradients (in place where they are views into
        the strategy's buffers), and whatever the rule does first (a pull, a look-ahead)."""
        raise NotImplementedError(f"strategy {self.name!r} owns forward/backward: call step(batch, step)")

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        """After backward: exchange and apply the update. ``loss`` is the detached loss of the step,
        or None where the caller does not know it (``DistributedOptimizer``); ``samples`` may be 0."""
        raise NotImplementedError(f"strategy {self.name!r} owns forward/backward: call step(batch, step)")

    def sync_buffers(self) -> None:
        """Rank 0's buffers (batch-norm statistics) to every rank, as DDP does before each forward pass;
        nothing for a model without buffers. allreduce, ps-sync and box-sync call it at the end of
        their exchange, inside it (the same values: rank 0's after its last forward), so
        that a peer lost during it is survived in place as one lost in the exchange."""
        if (
            self.world.world_size > 1
            and dist.is_initialized()
            and next(self.model.buffers(), None) is not None
        ):
            with self.timers.phase("buffers"), self.collective("buffer broadcast"):
                broadcast_tensors_(list(self.model.buffers()))

    def should_stop(self, step: int) -> bool:
        """Called before each step; asynchronous strategies align termination here."""
        return step >= self.ctx.steps

    def rejoin_step(self) -> int | None:
        """Where a replacement of a dead worker starts; None: a fresh start or resume."""
        return self.survival.rejoin_step()

    def finish(self) -> None:
        """After the last step: synchronise or collect the final weights (collective on all ranks)."""

    # -- evaluation and checkpoints -------------------------------------------------------------
    def eval_model(self) -> nn.Module | None:
        """The model whose weights are the run's result, on rank 0 (None elsewhere). Collective."""
        return self.model if self.world.rank == 0 else None

    def state_dict(self) -> dict[str, Any]:
        """This rank's resume state beyond the model weights (optimizer, counters)."""
        return {"optimizer": self.optimizer.state_dict()} if self.optimizer is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])

    def load_model_state(self, model_state: dict[str, torch.Tensor]) -> None:
        """Restore the whole model's weights on this rank (resume)."""
        self.model.load_state_dict(model_state)

    def joiner_state(self, rank0: dict[str, Any]) -> dict[str, Any]:
        """The state a rank new to a resized synchronous run starts from: rank 0's, without what is rank
        0's own (:attr:`per_rank_state`), which this rank starts afresh."""
        return without_keys(rank0, self.per_rank_state)

    def count_step(self, samples: int) -> None:
        """After each step, this rank's ``samples`` in it (:meth:`InPlace.count_step`)."""
        self.survival.count_step(samples)

    def total_samples(self, local: int) -> float:
        """Samples every worker consumed, given this rank's (the value on rank 0 counts). Collective
        here: an allreduce over the workers; in a run that survives in place, rank 0's count of every
        member's (an allreduce would miss the lost ranks' lives)."""
        counted = self.survival.group_samples()
        if counted is not None:
            return counted
        if self.world.world_size == 1:
            return float(local)

        def reduce() -> float:
            total = torch.tensor([float(local)], device=self.world.device)  # nccl: a GPU tensor
            with self.collective("summary"):
                dist.all_reduce(total, async_op=True).wait()
            return float(total)

        return self.exchange(reduce, self.ctx.steps)

    def wall_time(self, local: float) -> float:
        """The run's training time, given this process's."""
        return local

    def summary_extra(self) -> dict[str, Any]:
        """Rank 0: fields this strategy adds to summary.json (e.g. ``nonfinite_workers``)."""
        return {}

    def close(self) -> None:
        """Release process groups, shared memory and threads. Must not raise."""


class BackwardPasses:
    """A step's backward passes, for the rules whose ``.grad`` is averaged when ``backward()`` returns
    (DDP's contract: clipping, ``GradScaler.unscale_`` and inf checks between backward and the step see
    the averaged gradient).

    A pass communicates (``syncs``) unless it runs inside :meth:`no_sync` or is one of the first
    ``backward_passes_per_step - 1`` of the step; those accumulate locally. ``on_end(syncs)`` runs at
    the end of every pass (an autograd callback, queued by the pass's first gradient: the hooks are
    registered before any other on the parameters, so ``syncs`` is known when theirs run). A peer lost
    while a pass communicates is kept (``lost``) for the step's exchange to answer by regrouping:
    raised from a callback it would surface from the user's ``backward()``.
    """

    def __init__(self, owner: Strategy, params: list[nn.Parameter], on_end: Callable[[bool], None]):
        self.owner, self.on_end = owner, on_end
        self.local_only = False
        self._handles = [p.register_post_accumulate_grad_hook(self._first_gradient) for p in params]
        self.reset()

    def reset(self) -> None:
        """A new step: no pass yet."""
        self.passes = 0  # passes finished
        self.syncs: bool | None = None  # whether the pass under way communicates (None: none under way)
        self.synced = False  # a pass of this step communicated
        self.lost: PeerLost | None = None

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        before, self.local_only = self.local_only, True
        try:
            yield
        finally:
            self.local_only = before

    def _first_gradient(self, p: torch.Tensor) -> None:
        if self.syncs is None:
            self.syncs = not self.local_only and self.passes + 1 >= self.owner.backward_passes_per_step
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        syncs, self.syncs = self.syncs, None
        self.passes += 1
        try:
            self.on_end(bool(syncs))
        except PeerLost as e:
            self.lost = e
        self.synced = self.synced or bool(syncs)

    def raise_lost(self) -> None:
        """In the step's exchange: a peer lost during the last pass's communication, if any."""
        lost, self.lost = self.lost, None
        if lost is not None:
            raise lost

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class PhaseTimers:
    """Accumulates wall time per communication phase over one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


def period_end(step: int, period: int) -> int:
    """The first step ``a >= step`` with ``(a + 1) % period == 0``: the last of ``step``'s period.

    >>> period_end(5, 4), period_end(7, 4), period_end(3, 1)
    (7, 7, 3)
    """
    return step + (period - 1 - step % period)


def loss_value(loss: torch.Tensor | None) -> float:
    """The step's loss as a float for the metrics; NaN where it is not known."""
    return float("nan") if loss is None else float(loss)


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it (tuples, lists and dicts are walked).

    >>> map_tensors(lambda t: t * 2, {"x": torch.ones(1), "n": 3})
    {'x': tensor([2.]), 'n': 3}
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(fn, v) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(map_tensors(fn, v) for v in batch)
    return batch


def split_batch(batch: Any, k: int, n: int | None = None) -> list[tuple[Any, float]]:
    """``batch`` in ``k`` micro-batches along dim 0 (as equal as they come: ``torch.tensor_split``),
    each with its share of the samples; tensors whose first dimension is not the batch's ``n``
    samples go whole into every part. Fewer parts where the batch has fewer than ``k`` samples.

    >>> [(x.tolist(), s) for (x, _), s in split_batch((torch.arange(4), torch.zeros(())), 2)]
    [([0, 1], 0.5), ([2, 3], 0.5)]
    """
    n = batch_size(batch) if n is None else n
    k = max(1, min(k, n))
    if k == 1:
        return [(batch, 1.0)]
    sizes = [len(r) for r in torch.arange(n).tensor_split(k)]
    starts = [sum(sizes[:i]) for i in range(k)]

    def part(i: int) -> Any:
        def cut(t: torch.Tensor) -> torch.Tensor:
            return t.narrow(0, starts[i], sizes[i]) if t.dim() > 0 and len(t) == n else t

        return map_tensors(cut, batch)

    return [(part(i), sizes[i] / n) for i in range(k)]


class _Grads(torch.optim.Optimizer):
    """The trainable parameters as an optimizer that moves nothing: what a ``GradScaler`` unscales
    and checks. ``scaler.step(_Grads(...))`` is True where the gradients are finite, None where the
    scaler skips the step."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        super().__init__(params, {})

    def step(self, closure: Any = None) -> bool:  # type: ignore[override]
        return True


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: the length of its first tensor.

    >>> batch_size((torch.zeros(8, 3), torch.zeros(8)))
    8
    """
    if isinstance(batch, torch.Tensor):
        return len(batch)
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, tuple | list) else ()
    for value in values:
        try:
            return batch_size(value)
        except ValueError:
            continue
    raise ValueError(f"a batch needs at least one tensor, got {type(batch).__name__}")


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer may move: ``requires_grad`` ones, each once (tied weights once)."""
    return [p for p in model.parameters() if p.requires_grad]


def averaged_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The float buffers a weight-averaging rule averages: those that hold finite values. A buffer of
    ``-inf`` (a causal mask registered as a buffer) is a constant of the model, not state that
    training moves: averaging it would make NaN of it and reject every exchange as non-finite.

    >>> m = nn.BatchNorm1d(2); m.register_buffer("mask", torch.full((2,), float("-inf")))
    >>> [b.shape for b in averaged_buffers(m)]
    [torch.Size([2]), torch.Size([2])]
    """
    return [b for b in model.buffers() if b.is_floating_point() and bool(torch.isfinite(b).all())]


def bind_flat_replica(
    model: nn.Module, layout: Layout, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Make the parameters views into one flat buffer ``x`` and their ``.grad`` views into ``g``.

    Pulls, pushes and elastic updates are then single flat operations; backward accumulates
    straight into ``g`` (zero it, not the optimizer's ``zero_grad``, which would drop the views).
    Frozen parameters (``requires_grad=False``) get no ``.grad``: an optimizer never moves them,
    not even by weight decay; their part of ``g`` stays zero.
    """
    x = torch.empty(layout.numel, device=device)
    layout.bind_params_(model, x, copy_values=True)
    g = torch.zeros_like(x)
    GradViews.of_flat(model, layout, g)
    return x, g


class GradViews:
    """The trainable parameters' ``.grad`` as views into a strategy's buffers.

    Backward then accumulates straight into the buffers. ``rebind_()`` (in ``begin_step``) restores
    the views a user's ``optimizer.zero_grad(set_to_none=True)`` dropped. With ``track``, a
    post-accumulate hook per parameter notes which parameters got a gradient this step (``used``),
    moves a gradient that autograd put elsewhere into its view, and calls ``on_ready(i, first)``;
    ``close()`` removes the hooks, since a user's model outlives the strategy.

    >>> lin = nn.Linear(2, 1); flat = torch.zeros(3)
    >>> gv = GradViews(list(lin.parameters()), [flat[:2].view(1, 2), flat[2:]], track=True)
    >>> lin(torch.ones(1, 2)).sum().backward(); flat.tolist(), gv.used
    ([1.0, 1.0, 1.0], [True, True])
    >>> gv.close()
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        views: list[torch.Tensor],
        track: bool = False,
        on_ready: Callable[[int, bool], None] | None = None,
    ):
        self.params, self.views, self.on_ready = params, views, on_ready
        self.used = [False] * len(params)
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params) if track
        ]
        self.rebind_()

    @classmethod
    def of_flat(cls, model: nn.Module, layout: Layout, flat: torch.Tensor, **kw: Any) -> GradViews:
        """Views into ``flat`` laid out as ``layout`` (every parameter), bound for the trainable ones."""
        pairs = [(p, v) for p, v in zip(model.parameters(), layout.views(flat).values()) if p.requires_grad]
        return cls([p for p, _ in pairs], [v for _, v in pairs], **kw)

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def ready(p: torch.Tensor) -> None:
            first = not self.used[i]
            self.used[i] = True
            view = self.views[i]
            if p.grad is not view:  # the .grad was dropped after begin_step: autograd made a new one
                if first:
                    view.copy_(p.grad)
                else:
                    view.add_(p.grad)
                p.grad = view
            if self.on_ready is not None:
                self.on_ready(i, first)

        return ready

    def rebind_(self) -> None:
        """Every trainable parameter's ``.grad`` is its view again; ``used`` starts over."""
        self.used = [False] * len(self.params)
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                p.grad = view

    def drop_unused_(self, got_gradient: list[bool] | list[float]) -> None:
        """``.grad = None`` where no gradient came (plain PyTorch then skips the parameter)."""
        for p, got in zip(self.params, got_gradient):
            if not got:
                p.grad = None

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for p in self.params:
            p.grad = None


class FinishedTail:
    """The finished tail of a flat buffer during backward, handed out in buckets of at least ``bucket``.

    The parameters sit in the buffer in order (``offsets[i]``: parameter ``i``'s start, the last entry
    the buffer's end) and backward finishes them roughly last to first, so the finished tail grows
    down; ``finish(i)`` returns the next bucket once it holds ``bucket`` elements: ``(params, lo,
    hi)``, the indices of its parameters and the buffer's ``[lo, hi)``.

    >>> t = FinishedTail([0, 4, 6, 10], bucket=4)
    >>> t.finish(2), t.finish(0), t.finish(1), t.cut
    ((range(2, 3), 6, 10), None, (range(0, 2), 0, 6), 0)
    """

    def __init__(self, offsets: list[int], bucket: int):
        self.offsets, self.bucket = offsets, bucket
        self.reset()

    def reset(self) -> None:
        """A new backward: nothing finished; ``cut``: where the buckets handed out so far begin."""
        n = len(self.offsets) - 1
        self.finished, self.tail, self.cut, self.cut_param = [False] * n, n, self.offsets[-1], n

    def finish(self, i: int) -> tuple[range, int, int] | None:
        self.finished[i] = True
        while self.tail > 0 and self.finished[self.tail - 1]:
            self.tail -= 1
        lo = self.offsets[self.tail]
        if self.cut - lo < self.bucket:
            return None
        bucket = (range(self.tail, self.cut_param), lo, self.cut)
        self.cut, self.cut_param = lo, self.tail
        return bucket


def step_only(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], chosen: range) -> None:
    """``optimizer``'s step of ``params[j]`` for ``j`` in ``chosen`` alone: the others' ``.grad`` are
    hidden meanwhile. Every optimizer of ``torch.optim`` but LBFGS is elementwise and skips a
    parameter without a gradient, so stepping a model bucket by bucket is one step; inside backward
    too (PyTorch's optimizer-in-backward), on the parameters whose gradients are done.

    >>> a, b = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))
    >>> a.grad, b.grad = torch.ones(1), torch.ones(1)
    >>> step_only(torch.optim.SGD([a, b], lr=0.5), [a, b], range(1, 2))
    >>> float(a), float(b)
    (1.0, 0.5)
    """
    if not chosen:
        return
    hidden = [(p, p.grad) for j, p in enumerate(params) if j not in chosen and p.grad is not None]
    for p, _ in hidden:
        p.grad = None
    try:
        optimizer.step()
    finally:
        for p, grad in hidden:
            p.grad = grad


def broadcast_tensors_(tensors: list[torch.Tensor], src: int = 0, group: Any = None) -> None:
    """Rank ``src``'s values into ``tensors`` on every rank: one broadcast per dtype and device."""
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        kinds.setdefault((t.dtype, t.device), []).append(t)
    for same in kinds.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, src=src, group=group, async_op=True).wait()
        offset = 0
        with torch.no_grad():
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def without_keys(state: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """``state`` without ``keys`` (dotted for nested dicts), the dicts on the way copied.

    >>> without_keys({"a": 1, "b": {"c": 2, "d": 3}}, ("a", "b.c"))
    {'b': {'d': 3}}
    """
    out = dict(state)
    for key in keys:
        head, _, rest = key.partition(".")
        if rest and isinstance(out.get(head), dict):
            out[head] = without_keys(out[head], (rest,))
        elif not rest:
            out.pop(head, None)
    return out
