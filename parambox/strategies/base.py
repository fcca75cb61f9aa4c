"""The protocol every strategy implements: the update rule's interface, and the helpers the rules share.

A strategy owns one training step, ``step(batch, step) -> StepResult`` (pipeline parallelism and
L-BFGS must own forward and backward), so the loop in ``parambox.training.loop`` never branches on the
strategy. A batch is any structure of tensors (a tensor, or tuples, lists and dicts of them) already
on the device; the loss is the user's ``loss_fn(model, batch) -> scalar tensor`` (the default,
``parambox.workload.losses.default_loss``, is the cross-entropy of ``model(x)`` against ``y``). The
shared step's forward/backward with the loop's features (micro-batches, autocast, the loss scaler,
clipping) is :mod:`parambox.strategies.microsteps`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict
from torch import nn

from parambox.box import BoxConfig
from parambox.errors import CommTimeout, UserError
from parambox.runtime.dist import ProgressBoard
from parambox.runtime.survival import InPlace
from parambox.runtime.world import World
from parambox.strategies.microsteps import run_step

if TYPE_CHECKING:
    from parambox.strategies.grads import BackwardPasses

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
    scaler: Any = None  # fp16: a torch.amp.GradScaler of the device's type
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
    # ... rank 0 included: another worker then takes its part (the result) at the end. Not where rank 0
    # holds what the others need to train (dogwild's master).
    tolerates_rank0_loss: ClassVar[bool] = False
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
    # It keeps a copy of the weights it was built with (a center, the master's, DiLoCo's global weights):
    # weights loaded into the model after ``DistributedOptimizer`` wrapped it would never reach that copy,
    # so they are refused at the first step.
    copies_the_weights: ClassVar[bool] = False
    # It keeps the weights or the gradients in float32 buffers (flat buffers, the box): a model whose
    # parameters are another dtype (model.to(torch.bfloat16)) is refused in one line when it is built.
    float32_weights: ClassVar[bool] = True
    # Every rank steps the same averaged gradient, so torch's ZeroRedundancyOptimizer (each rank steps its
    # shard and broadcasts it) may be the optimizer under DistributedOptimizer, as under DDP.
    takes_sharded_optimizer: ClassVar[bool] = False
    # The rule steps the user's optimizer on every rank (where it steps it at all: eamsgd and dogwild
    # step their own). False where the leading rank alone does (ps-sync's server): a fresh wrap's
    # template for torch.distributed.checkpoint then asks every rank for the state the server wrote.
    optimizer_on_every_rank: ClassVar[bool] = True
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
    # ... those of them that differ on a registered data set of sequences (``text``); ...
    default_run_sequence: ClassVar[dict[str, Any]] = {}
    # ... and option defaults of this form where they differ from the Options model's (one Options model
    # serves both of diloco's forms), each where the user did not set it.
    default_options: ClassVar[dict[str, Any]] = {}

    @classmethod
    def options_defaults(cls, options: Options) -> dict[str, Any]:
        """``default_options`` for a run whose options (the user's over these defaults) are ``options``:
        a form may bring other defaults with a choice the user made (diloco's with compression)."""
        return cls.default_options

    @classmethod
    def resolve(cls, options: Options) -> type[Strategy]:
        """The class that really runs with these options (e.g. easgd's synchronous form); ``cls`` here."""
        return cls

    # ``box.spare_ranks``: ranks of the MPI job that wait to take a dead worker's place (AsyncStrategy)
    takes_spare_ranks: ClassVar[bool] = False

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
        if self.float32_weights:
            check_float32(self.name, ctx.model)
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

    @property
    def leads(self) -> bool:
        """This rank holds the run's result and writes it (:attr:`InPlace.leads`): rank 0, or the
        oldest surviving member of a run that survives in place."""
        return self.survival.leads

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

    def admit(self, step: int) -> None:
        """At the start of ``step``: workers that join come in (:meth:`InPlace.admit`)."""
        self.survival.admit(step)

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
        clipping (``ctx.grad_clip``), then ``end_step`` with the batch's mean loss and all its samples
        (:func:`parambox.strategies.microsteps.run_step`)."""
        return run_step(self, batch, step)

    def no_sync(self) -> AbstractContextManager[None]:
        """Around the backward of every micro-batch but the last (gradient accumulation, DDP's name):
        the gradients add up in ``.grad`` and the strategy does not exchange them; the step's exchange
        sends the sum. Only rules that average by the end of backward (``self.passes``) have anything
        to hold back."""
        return self.passes.no_sync() if self.passes is not None else nullcontext()

    def grads_cleared(self) -> None:
        """``opt.zero_grad()`` in the middle of a step (after a backward, before ``step()``; a GAN's
        loop zeroes the gradients the other model's backward made): what the passes so far accumulated
        is gone, and the next backward exchanges afresh, as each backward does under DDP."""
        if self.passes is not None:
            self.passes.clear()

    def settle_grads(self) -> None:
        """Before ``end_step`` under ``DistributedOptimizer``: a rule whose ``.grad`` are views into a
        buffer it reads moves there a gradient the loop detached from them (``GradViews.settle_``)."""

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
    def result_from_box(self) -> bool:
        """After ``finish``, where a rank of the run died and its process group with it: True once this
        rank's model holds the run's result read from the box (no broadcast). Not collective."""
        return False

    def eval_model(self) -> nn.Module | None:
        """The model whose weights are the run's result, on the leader (None elsewhere). Collective."""
        return self.model if self.leads else None

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
        """Samples every worker consumed, given this rank's (the value on the leader counts).
        Collective here: an allreduce over the workers; in a run that survives in place, the count of
        every member's (an allreduce would miss the lost ranks' lives)."""
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


def averaged_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The float buffers a weight-averaging rule averages: those that hold finite values. A buffer of
    ``-inf`` (a causal mask registered as a buffer) is a constant of the model, not state that
    training moves: averaging it would make NaN of it and reject every exchange as non-finite.

    >>> m = nn.BatchNorm1d(2); m.register_buffer("mask", torch.full((2,), float("-inf")))
    >>> [b.shape for b in averaged_buffers(m)]
    [torch.Size([2]), torch.Size([2])]
    """
    return [b for b in model.buffers() if b.is_floating_point() and bool(torch.isfinite(b).all())]


def check_float32(name: str, model: nn.Module) -> None:
    """A ``UserError`` naming the dtypes where ``model``'s parameters are not all float32."""
    dtypes = sorted(
        {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.dtype != torch.float32}
    )
    if dtypes:
        raise UserError(
            f"{name} keeps the weights in float32 buffers (its exchanges and the box are float32), and the "
            f"model's parameters are {', '.join(dtypes)}: keep the model in float32 and train in lower "
            "precision under torch.autocast (bf16: no loss scaler needed), or use ps-sync or weight-avg, "
            "which take the parameters as they are"
        )


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
