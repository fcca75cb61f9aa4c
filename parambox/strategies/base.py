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
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict
from torch import nn

from parambox.box import BoxConfig, Layout
from parambox.errors import CommTimeout, UserError
from parambox.runtime.dist import ProgressBoard, collective, elastic_group
from parambox.runtime.elastic import PeerLost, broadcast_state
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
        self.elastic = elastic_group()  # set when the run survives a lost worker in place
        self._group_samples, self._pending_samples = 0.0, 0  # every member's samples (count_step)
        self._exchanges = self._counted = 0  # exchanges passed, and up to which the samples count
        self._awaits_state = self.joining  # a replacement, until share_state has given it a peer's state
        self._exchange_fault = _exchange_fault(ctx.world.rank) if self.elastic is not None else None

    def collective(self, phase: str) -> AbstractContextManager[None]:
        """Wrap blocking communication: a timeout becomes a ``CommTimeout`` naming the phase, the step
        and the ranks that never arrived (read from the run's progress board); in a run that survives
        in place, a ``PeerLost`` that :meth:`exchange` answers by regrouping."""
        if self.elastic is not None:
            return self.elastic.guard(phase, self.ctx.board.step if self.ctx.board is not None else None)
        return collective(phase, self.ctx.board)

    def exchange(self, fn: Callable[[], Any], step: int, again: Callable[[], Any] | None = None) -> Any:
        """``fn()``, an exchange whose collectives run under :meth:`collective`. In a run that survives
        in place, a lost peer makes the survivors regroup and repeat it (``again()``, where a first
        attempt already spent its input, as an in-place allreduce does). Returns ``CAUGHT_UP`` on a
        rank that the regroup found a step behind the others and that took a leader's state for this
        step (:meth:`catch_up`): its own update of the step must not be applied."""
        self._exchanges += 1
        try:
            result = fn()
            if self._exchange_fault == step:  # PARAMBOX_FAULT lose-exchange: as a last send to a dead peer
                self._exchange_fault = None
                raise PeerLost(
                    f"step {step}: injected (lose-exchange), after the others finished the exchange"
                )
            return result
        except PeerLost:
            if self.elastic is None:
                raise
        while True:
            self.elastic.regroup(step)
            try:
                lag = self.elastic.lag
                if lag is not None:
                    self.catch_up(lag.src, lag.behind, lag.why())
                    if lag.behind:
                        return CAUGHT_UP
                return (again or fn)()
            except PeerLost:
                continue

    def catch_up(self, src: int, behind: bool, why: str) -> None:
        """After a regroup whose members were a step apart: group rank ``src`` (a step ahead: its update
        of the step the ranks behind failed in is made) gives them its state, and they skip their own
        update of that step. Collective over the new group. A strategy whose state is more than its
        model and :meth:`state_dict` cannot: it raises (the run falls back to a restart)."""
        raise CommTimeout(why)

    @property
    def joining(self) -> bool:
        """This process replaces a lost rank of a run that survives in place: its state comes from a peer."""
        return self.elastic is not None and self.elastic.joined_at is not None

    def admit_replacements(self, step: int) -> None:
        """At the start of ``step`` (survives in place, ``--max-restarts``): replacements that asked to
        join come in, and receive the model and the strategy's state from group rank 0."""
        if self.elastic is not None:
            plan = self.elastic.admission(step, self.next_exchange(step))
            if plan is not None:
                self.elastic.admit(plan)
                self.share_state()

    def next_exchange(self, step: int) -> int:
        """The first step from ``step`` on whose exchange every rank takes part (every step here;
        ``period_end`` where the exchange comes every few steps)."""
        return step

    def share_state(
        self, src: int = 0, receive: bool | None = None, phase: str = "state to a replacement"
    ) -> None:
        """Group rank ``src``'s weights and resume state (optimizer, counters) to a replacement that
        joined (or, with ``receive``, to the ranks that say so)."""
        if receive is None:
            receive = self._awaits_state
        self._awaits_state = False
        mine = {"model": self.model.state_dict(), "strategy": self.state_dict()}
        with self.collective(phase):
            state = broadcast_state(mine if self.elastic.group_rank == src else None, src)
        if receive:
            self.load_model_state(state["model"])
            self.load_state_dict(state["strategy"])

    @property
    def group_size(self) -> int:
        """Ranks in the exchange now: the launch's, less those lost in a run that survives in place."""
        return self.elastic.group_size if self.elastic is not None else self.world.world_size

    # -- data ---------------------------------------------------------------------------------
    def data_partition(self) -> tuple[int, int]:
        """(data-parallel rank, number of data-parallel ranks) for sharding the global batch."""
        return self.world.rank, self.world.world_size

    # -- the step -----------------------------------------------------------------------------
    def step(self, batch: Any, step: int) -> StepResult:
        """One training step on this worker's ``batch`` (already on the device): ``begin_step``,
        forward/backward of the user's loss, ``end_step``."""
        self.begin_step(step)
        loss = self.ctx.loss_fn(self.model, batch)
        self.before_backward(loss)
        loss.backward()
        return self.end_step(loss.detach(), batch_size(batch), step)

    def before_backward(self, loss: torch.Tensor) -> None:
        """Between the forward and the backward pass of a step the strategy drives (``step``), with
        the step's loss; not called under ``DistributedOptimizer``, whose user runs backward."""

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
        return self.elastic.joined_at if self.joining else None

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

    def count_step(self, samples: int) -> None:
        """After each step, this rank's ``samples`` in it. A run that survives in place counts every
        member's (rank 0 is a member throughout): the steps since the last exchange once one has
        passed, times the members it had (a rank lost within a round of local steps, found out at
        the round's exchange, trained nothing the survivors kept); so a lost rank's samples count up
        to its death and a replacement's from its joining."""
        if self.elastic is None:
            return
        self._pending_samples += samples
        if self._exchanges != self._counted:
            self._group_samples += self._pending_samples * self.elastic.group_size
            self._pending_samples, self._counted = 0, self._exchanges

    def total_samples(self, local: int) -> float:
        """Samples every worker consumed, given this rank's (the value on rank 0 counts). Collective
        here: an allreduce over the workers; in a run that survives in place, rank 0's count of every
        member's (:meth:`count_step`: an allreduce would miss the lost ranks' lives)."""
        if self.elastic is not None:
            return self._group_samples + self._pending_samples * self.elastic.group_size
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


CAUGHT_UP = object()  # Strategy.exchange's word to a rank that took a leader's state for the step


def _exchange_fault(rank: int) -> int | None:
    """The step whose exchange ``PARAMBOX_FAULT``'s ``lose-exchange`` fails on this rank, if any."""
    from parambox.runtime.faults import FaultPlan

    return FaultPlan.from_env().exchange_fault(rank)


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
