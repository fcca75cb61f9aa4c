"""``parambox.DistributedOptimizer``: any data-parallel strategy inside a user's own training loop.

It wraps the user's model and torch optimizer (as horovod's ``DistributedOptimizer`` and
``hivemind.Optimizer`` do) and drives the strategy through the protocol the training loop uses:
``begin_step`` runs just before the step's forward pass (a forward pre-hook on the model, or
``zero_grad()``, whichever comes first), ``end_step`` in ``step()``, and ``finish``, ``eval_model``
and ``close`` in ``close()``. No strategy is named here.

It is a drop-in for the torch optimizer it wraps (an ``torch.optim.Optimizer`` itself, so schedulers
and ``torch.amp.GradScaler`` take it): ``param_groups``, ``state_dict()`` / ``load_state_dict()``
with the strategy's own state, ``zero_grad``, ``no_sync()`` and ``backward_passes_per_step`` for
gradient accumulation, ``clip_grad_norm_``. Nothing is left on the user's model: the step begins
through a module-wide forward pre-hook (``register_module_forward_pre_hook``), not one on the model,
so ``torch.save(model)`` pickles it during and after the run.

Limits, by design:
- Strategies build their optimizers with ``ctx.make_optimizer(params)``: for the model's own
  parameters that is the user's optimizer itself (its param groups, state and any scheduler on it
  count). For another set (dogwild's master copy of the weights) it is a new optimizer of the same
  class, with the user's param groups mapped by position, and none of the user's state.
- ``eamsgd`` runs its own momentum step from an SGD optimizer's settings (read each step);
  ``downpour`` with ``adagrad`` its own Adagrad, which a scheduler on the user's optimizer does not
  reach.
- Several optimizers over one model (Muon for the matrices, AdamW for the rest) come as a list, which
  the strategy steps as one (``_Chain``); one ``DistributedOptimizer`` per model.
- ``steps`` (the run's target per worker) matters to the asynchronous strategies' termination
  alignment (``should_stop()``); without it each worker stops when its own loop ends, and
  ``close()`` waits for every worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from pydantic import ValidationError
from torch import nn

from parambox.box import BoxConfig
from parambox.errors import BoxLost, UserError, warn
from parambox.runtime import dist as pbdist
from parambox.runtime import mpi as pbmpi
from parambox.runtime.world import World
from parambox.strategies import Context, StepResult, Strategy, strategy_class
from parambox.strategies.base import broadcast_tensors_
from parambox.strategies.tensors import trainable

NO_TARGET = 2**62  # steps=None: no step target, so no worker stops for the others before close()


@dataclasses.dataclass(frozen=True)
class _ModelWorld(World):
    """The launcher's world, on the device the user put the model on."""

    model_device: torch.device = torch.device("cpu")

    @property
    def device(self) -> torch.device:
        return self.model_device


class DistributedOptimizer(torch.optim.Optimizer):
    """A strategy in your own loop: ``loss.backward(); opt.step(); opt.zero_grad()``, then ``opt.close()``.

    After ``close()`` the model holds the run's result on every rank (for the asynchronous strategies
    the center weights). Under torchrun, srun or mpiexec it joins the launcher's process group, or
    uses the one you initialised. Any data-parallel strategy: ``allreduce``, ``ps-sync``,
    ``weight-avg``, ``box-sync``, ``downpour``, ``easgd``, ``eamsgd``, ``dynsgd``, ``hogwild``,
    ``dogwild``, ``hybrid``, ``diloco``.

    >>> model = nn.Linear(4, 2)
    >>> with DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), "easgd") as opt:
    ...     for _ in range(3):
    ...         opt.zero_grad()
    ...         model(torch.ones(8, 4)).square().mean().backward()
    ...         opt.step()
    >>> (opt.rank, opt.world_size)
    (0, 1)

    ``optimizer`` may be a list of torch optimizers over disjoint parameters of the model (Muon for
    the weight matrices and AdamW for the rest): the strategy steps them as one, ``param_groups`` are
    theirs in order, ``state_dict()`` holds their state as one optimizer's, and a scheduler on each
    works. ``state_dict()`` is torch's layout plus the strategy's part under ``"parambox"``;
    ``torch.distributed.checkpoint``'s ``get_state_dict`` and ``set_state_dict`` take it too.

    Gradient clipping between ``backward()`` and ``step()`` sees the averaged gradient under the
    synchronous gradient-averaging rules (``allreduce``, ``box-sync``, and ``ps-sync`` on its server),
    as with DDP, and the local gradient under the local-step rules (``easgd``, ``downpour``,
    ``diloco``'s inner steps, ...), as their papers clip. Accumulate with ``with opt.no_sync():``
    around the micro-steps before the last (DDP's name) or ``backward_passes_per_step=K`` (horovod's).
    """

    # torch.amp.GradScaler hands the scale and the inf flag to step(): every rank of a synchronous
    # rule then makes the same skip decision (an inf on one rank skips the step on all), as DDP's.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        strategy: str = "allreduce",
        options: dict[str, Any] | None = None,
        *,
        box: str | dict[str, Any] | BoxConfig = "shm",
        timeout: float = 300.0,
        steps: int | None = None,
        backward_passes_per_step: int = 1,
    ):
        cls, opts = _strategy(strategy, options)
        optimizer = _one_optimizer(optimizer)
        _check_pair(model, optimizer)
        if not cls.takes_sharded_optimizer and any(_shards_itself(o) for o in _members(optimizer)):
            raise UserError(
                f"DistributedOptimizer({strategy!r}): a ZeroRedundancyOptimizer steps each rank's shard of the "
                "parameters and broadcasts it, which only a rule that averages the gradients first can take "
                f"(allreduce); give {strategy} the plain optimizer (ZeroRedundancyOptimizer's optimizer_class)"
            )
        if steps is not None and steps < 1:
            raise UserError(f"DistributedOptimizer: steps must be at least 1, got {steps}")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise UserError(
                f"DistributedOptimizer: backward_passes_per_step must be an int of at least 1, "
                f"got {backward_passes_per_step!r}"
            )
        self.model, self.optimizer = model, optimizer
        self.world = _world(model)
        self._own_group = self.world.world_size > 1 and not dist.is_initialized()
        if self._own_group:
            pbdist.init_distributed(self.world, timeout)
        self.board: pbdist.ProgressBoard | None = None
        try:
            self.board = pbdist.ProgressBoard()
            if self.world.world_size > 1:  # everyone starts from rank 0's weights and buffers, as DDP
                with pbdist.collective("initial weights broadcast", self.board):
                    broadcast_tensors_(_state(model))
            ctx = Context(
                self.world,
                model,
                factory := _optimizer_factory(model, optimizer),
                _loss_outside,
                steps or NO_TARGET,
                timeout,
                box=_box_config(box),
                board=self.board,
            )
            self.strategy: Strategy = cls(ctx, opts)
            self._copies = factory.copies  # optimizers of the strategy's own (dogwild's master copy)
            self.strategy.backward_passes_per_step = backward_passes_per_step
        except BaseException:
            self._release()
            raise
        self.name = strategy
        self.step_count = 0
        self.last_result: StepResult | None = None  # the last step's comm times, staleness, ...
        self.closed = False
        self._begun = False
        self._warned = False
        self._detached = False  # the parameters still live in the strategy's buffers
        self._stepped = False  # a step ran in this process (load_state_dict must come before)
        self._initialised = False  # torch.distributed.checkpoint just created the optimizer's state
        self._hook = _watch_forward(self)
        self._placed = _placement(model)  # where the strategy put the parameters: checked every step
        self._frozen = [p for p in model.parameters() if not p.requires_grad]  # outside every exchange
        # No gradient until the first backward, as a fresh model has (the strategy's views are bound
        # again then): torch.distributed.checkpoint creates the optimizer's state only where no
        # parameter has a .grad, and a template without that state would load none of the checkpoint's
        for p in model.parameters():
            p.grad = None
        # The weights the strategy copied (a center, ...): weights loaded into the model before the
        # first step would not reach its copy, so the first step compares (a load_state_dict() of a
        # DistributedOptimizer's state restores the copy too, and clears it)
        self._start = _fingerprint(model) if cls.copies_the_weights else None
        # ... and between steps, the parameters' version counters as the last step left them: a
        # load_state_dict() or in-place write to them after that would never reach its copy either
        self._versions: list[int] | None = None
        # The wrapped optimizer's step() called by the script itself skips the exchange: refused (the
        # strategy's own calls run inside this object's methods, or on threads of its own)
        self._inside, self._thread, self._base_steps = 0, threading.get_ident(), 0
        direct = functools.partial(_direct_step, weakref.ref(self))
        self._guards = [o.register_step_pre_hook(direct) for o in _members(optimizer)]
        # Synchronous rules pair every rank's collectives step by step: a rank that stops early would
        # have its close() matched against another's gradient exchange (a silently wrong model). Each
        # step opens with a one-element allreduce of "still stepping" (close() sends 0), so uneven step
        # counts are refused on every rank, as DDP's join() detects them.
        self._aligned = self.world.world_size > 1 and not cls.tolerates_worker_loss
        self._unclosed = weakref.finalize(
            self,
            warn,
            f"rank {self.rank}: DistributedOptimizer({strategy!r}) was never closed: call "
            "opt.close() (or use it in a with block) after the loop, or the run's result is never published",
        )

    # -- who am I --------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def workers(self) -> int:
        """The ranks that train, ``0`` to ``workers - 1``: ``world_size`` less the rma box's memory
        ranks, which read no data. Shard your data over them, on each rank where :attr:`trains`:
        ``DistributedSampler(data, num_replicas=opt.workers, rank=opt.rank)``."""
        return self.strategy.data_partition()[1]

    @property
    def trains(self) -> bool:
        """False on a rank that only holds the box (the rma box's memory rank of an asynchronous
        strategy): its ``step()`` does nothing, and ``close()`` serves the workers until they end."""
        return not getattr(self.strategy, "serves", False)

    # -- the torch optimizer it stands for ----------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's: set ``lr`` here or with a scheduler, every step, on any strategy."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise UserError(
            "DistributedOptimizer.add_param_group(): the strategy laid out its buffers for the parameters "
            "it was given; give the optimizer every param group before wrapping it"
        )

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` in torch's layout (``state``, ``param_groups``: a
        plain torch optimizer loads it, and ``torch.distributed.checkpoint``'s ``get_state_dict`` keys it
        by parameter name), plus under ``"parambox"`` what the strategy needs to resume (EASGD's center,
        DiLoCo's outer momentum, the step count). This rank's: save it with the model's ``state_dict()``;
        load both on every rank before the first step to resume. Loaded on another rank (rank 0's file
        on every rank), what a rank owes of its own (its error feedback) starts afresh there instead of
        being counted twice."""
        own = self.strategy.optimizer is self.optimizer  # its state is torch's part already
        with self._box_lost():
            state = self.strategy.state_dict()
        rule = {k: v for k, v in state.items() if not (own and k == "optimizer")}
        return {
            **self.optimizer.state_dict(),
            "parambox": {"strategy": self.name, "step": self.step_count, "rank": self.rank, "rule": rule},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (every rank, before the first step), or a plain torch optimizer's
        ``state_dict()`` (a checkpoint of a run without parambox, or ``torch.distributed.checkpoint``'s
        ``set_state_dict``: the optimizer's state alone)."""
        if not isinstance(state_dict, dict):
            raise UserError(
                f"DistributedOptimizer.load_state_dict(): expected a dict, got {type(state_dict).__name__}"
            )
        if self._stepped or self._begun:
            raise UserError(
                "DistributedOptimizer.load_state_dict(): call it before the first forward pass or step"
            )
        ours = state_dict.get("parambox")
        if ours is not None and ours.get("strategy") != self.name:
            raise UserError(
                f"DistributedOptimizer.load_state_dict(): the state was saved by strategy "
                f"{ours.get('strategy')!r}, this optimizer runs {self.name!r} (to go on under {self.name!r} "
                "from the torch optimizer's state alone, drop the state's 'parambox' entry)"
            )
        self.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != "parambox"})
        if not self._holds_optimizer_state():  # never stepped here: no stale copy for a checkpoint to take
            for o in _members(self.optimizer):
                o.state.clear()
        if ours is None:
            return
        rule = ours["rule"]
        if ours.get("rank", self.rank) != self.rank:
            # Another rank's state (DDP's habit: rank 0 saves, every rank loads): what a rank owes of
            # its own (error feedback) starts afresh here, as for a rank new to a resized run
            rule = self.strategy.joiner_state(rule)
        self.strategy.load_state_dict(rule)
        self._start = None  # the strategy's copy of the weights came with its state
        self.step_count = int(ours["step"])
        self._placed = _placement(self.model)

    # -- the loop ----------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients for the next backward, in place: they may be views into the strategy's
        buffers, so they are zeroed whatever ``set_to_none`` says."""
        if not self._begun and self._initialised:  # after torch's state initialisation: no step begins
            self._initialised = False
            for p in self.model.parameters():
                p.grad = None
            return
        if not self._begun:
            self._begin()  # begin_step zeroes them, and does what the rule does before a forward pass
            return
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        self.strategy.grads_cleared()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate this rank's gradients without communicating (DDP's
        ``no_sync``): put the micro-steps before a step's last inside it."""
        if not self._begun:
            self._begin()
        with self.strategy.no_sync():
            yield

    def synchronize(self) -> None:
        """Horovod's name: make ``.grad`` what the step will apply. Nothing to do: a synchronous
        rule's gradients are averaged when ``backward()`` returns, a local rule applies its own."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's clipping idiom, kept working: ``opt.synchronize()``, clip, then ``with
        opt.skip_synchronize(): opt.step()``. The step inside exchanges as any step does (what horovod
        skips there, the gradient allreduce, was done by ``backward()``)."""
        yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the model's trainable parameters, in one call;
        returns the total norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(trainable(self.model), max_norm, norm_type)

    @contextlib.contextmanager
    def _own_call(self) -> Iterator[None]:
        """The wrapped optimizer may be stepped in here (by the strategy, or for a memory rank)."""
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1

    def _begin(self) -> None:
        if self.closed:
            raise UserError("DistributedOptimizer: used after close()")
        if _placement(self.model) != self._placed:
            self.abort()
            raise UserError(
                f"DistributedOptimizer({self.name!r}): the model's parameters were moved, cast or replaced "
                "after it was wrapped (model.to(), .double(), .cuda(), a new layer); the strategy would "
                "train its own copy: do that before creating the DistributedOptimizer, as with DDP"
            )
        thawed = sum(p.requires_grad for p in self._frozen)
        if thawed:
            self.abort()
            raise UserError(
                f"DistributedOptimizer({self.name!r}): {thawed} parameter(s) frozen when it was created now "
                "require grad (requires_grad_(True) after wrapping): the strategy laid out its exchange for "
                "the parameters trainable then, and would never exchange theirs; unfreeze before wrapping, "
                "or close() it and wrap the model again"
            )
        if self._start is not None:
            start, self._start = self._start, None
            if _fingerprint(self.model) != start:
                self.abort()
                raise UserError(
                    f"DistributedOptimizer({self.name!r}): the model's weights changed between wrapping and the "
                    f"first step (model.load_state_dict() after creating it?), and {self.name} keeps a copy of "
                    "the weights it was given (its center, the master's, the global weights) that would never "
                    "see them: load them before creating the DistributedOptimizer, as with DDP (with "
                    "torch.distributed.checkpoint: set_model_state_dict before, set_optimizer_state_dict after), "
                    "or with opt.load_state_dict() of its state_dict()"
                )
        if self._versions is not None and _versions(self.model) != self._versions:
            self.abort()
            raise UserError(
                f"DistributedOptimizer({self.name!r}): the model's weights were written between steps "
                f"(model.load_state_dict() mid-run, or an in-place write to a parameter), and {self.name} "
                "keeps a copy of the weights (its center, the master's, the global weights) that would undo "
                "or misread it: to go on from other weights, close() it, load them and wrap the model "
                "again; to evaluate other weights, load them into a copy of the model (copy.deepcopy)"
            )
        self._begun, self._initialised = True, False
        self._check_aligned(stepping=True)
        with self._box_lost(), self._own_call():
            self.strategy.begin_step(self.step_count)
        self._settle_versions()  # (a pull of the center is the rule's own write; a step the scaler or
        # the rule's end skips settles nothing after it)

    @contextlib.contextmanager
    def _box_lost(self) -> Iterator[None]:
        """A lost box (an asynchronous rule's over ``box="rma"`` across nodes) as this loop can act on
        it: this rank released, its model keeping its replica, and what to do said for a script."""
        try:
            yield
        except BoxLost as e:
            self.abort()
            raise BoxLost(e.lost, LOOP_REMEDY) from None

    def _check_aligned(self, stepping: bool) -> None:
        """Every rank steps, or every rank closes; anything else is a ``UserError`` on every rank."""
        if not self._aligned:
            return
        flag = torch.tensor([1.0 if stepping else 0.0], device=self.world.device)
        with pbdist.collective("step alignment", self.board):
            dist.all_reduce(flag)
        others = int(flag) - (1 if stepping else 0)
        if others == (self.world_size - 1 if stepping else 0):
            return
        self.abort()
        closed = self.world_size - int(flag)
        raise UserError(
            f"DistributedOptimizer({self.name!r}): rank {self.rank} is at step {self.step_count} and "
            f"{'stepping' if stepping else 'closing'}, while {closed if stepping else int(flag)} rank(s) "
            f"{'closed' if stepping else 'still step'}: every rank must run the same number of steps "
            "(give steps=N to end them together)"
        )

    def step(
        self, closure: Callable[[], torch.Tensor] | None = None, *, loss: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Exchange and apply this step's gradients the strategy's way (``closure``: as torch's).
        ``loss``: the step's loss, for ``last_result.loss`` and the strategies that watch it (a closure's
        return value serves the same; without either, ``last_result.loss`` is NaN)."""
        if closure is None and self._torch_initialises_state():
            template = not self._stepped and not self.strategy.optimizer_on_every_rank  # the server saves it
            if self._holds_optimizer_state() or template:
                with self._own_call():  # no exchange, no step counted: the state is about to be loaded
                    self.optimizer.step()
            self._initialised = not self._begun  # (torch's zero_grad next must not begin a step)
            self._settle_versions()  # (a rate-0 step of its own: no write of the user's)
            return None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._begun:
            raise UserError(
                "DistributedOptimizer.step(): no forward pass through the model and no zero_grad() "
                "since the last step; call opt.zero_grad() before the forward pass"
            )
        if self._skip_for_scaler():
            self._begun = False  # the same step begins again with the next forward pass
            return None
        self._begun = False
        self._stepped = True
        if not self.trains:  # the wrapped optimizer steps with no gradient: a scheduler on it sees a step
            if not self._warned:
                self._warned = True
                warn(
                    f"rank {self.rank} holds {self.name}'s box and trains nothing (box 'rma' keeps the box on "
                    "the last rank, where no dead worker takes it along): its step() does nothing and close() "
                    "serves the workers; skip its loop with `if opt.trains:`, or give "
                    "box={'backend': 'rma', 'memory_ranks': 0} to train on every rank"
                )
            for p in self.model.parameters():
                p.grad = None
            with self._own_call():
                self.optimizer.step()
            return loss
        if self.should_stop():
            if not self._warned:
                self._warned = True
                warn(f"rank {self.rank}: {self.name} has ended this worker's run; step() does nothing now")
            return loss
        detached = loss.detach() if isinstance(loss, torch.Tensor) else None
        for copy in self._copies:  # a scheduler (or the script) set the rates on the user's optimizer
            _follow_rates(copy, self.optimizer)
        before = self._base_steps
        with self._box_lost(), self._own_call():
            self.strategy.settle_grads()
            self.last_result = self.strategy.end_step(detached, 0, self.step_count)
            unstepped = self._base_steps == before and not isinstance(self.optimizer, torch.optim.LBFGS)
            if unstepped and all(p.grad is None for p in self.model.parameters()):
                self.optimizer.step()  # (dogwild's master applied it with its copy) a scheduler sees a step
        self.step_count += 1
        self._placed = _placement(self.model)  # (a rule may rebind them as it steps)
        self._settle_versions()
        return loss

    def _settle_versions(self) -> None:
        """Where the rule keeps a copy of the weights, what the next step checks them against."""
        if self.strategy.copies_the_weights:
            self._versions = _versions(self.model)

    def _torch_initialises_state(self) -> bool:
        """``torch.distributed.checkpoint``'s ``get_state_dict`` and ``set_state_dict`` step an optimizer
        with no state once, every rate 0 and every gradient a zero tensor, to create its state: that
        step is the wrapped optimizer's alone (a real step has gradients, or state, or a rate). Where
        the rule never steps that optimizer (eamsgd's own Nesterov step, dogwild's master copy, ps-sync's
        workers) it creates no state, so the checkpoint's one copy of each tensor is the server's, or
        there is none; except on ps-sync's workers in a fresh wrap: the template, which asks for the
        state its server wrote."""
        groups = self.optimizer.param_groups  # (the rates first: a real step's rate is not 0)
        if any(float(g.get("lr", 0.0)) != 0.0 for g in groups) or self.optimizer.state:
            return False
        params = [p for g in groups for p in g["params"] if p.requires_grad]
        return bool(params) and all(p.grad is not None and not p.grad.any() for p in params)

    def _holds_optimizer_state(self) -> bool:
        """The rule steps the wrapped optimizer on this rank (its state is the run's)."""
        return self.strategy.optimizer is self.optimizer

    def _skip_for_scaler(self) -> bool:
        """Under ``GradScaler.step(opt)``: True where a gradient is not finite on this rank (or, in a
        synchronous rule, on any rank): the step is skipped. Otherwise the gradients are unscaled
        here if the user did not call ``scaler.unscale_(opt)``."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return False
        flag = found_inf.detach().float().reshape(1).to(self.world.device)
        if self._aligned:
            with pbdist.collective("gradient scaler inf check", self.board):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if float(flag) > 0:
            return True
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            grads = [p.grad for p in trainable(self.model) if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scale.double().reciprocal().float().to(grads[0].device))
        return False

    def should_stop(self) -> bool:
        """True once this worker should leave the loop: ``steps`` done, termination alignment of the
        asynchronous strategies (``termination = fastest | average``), or a non-finite update."""
        with self._box_lost():
            return self.strategy.should_stop(self.step_count)

    # -- the end -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """End the run on every rank (collective): afterwards ``model`` holds the run's result, in memory
        of its own, and the process group parambox started, if any, is gone."""
        if self.closed:
            return
        self._check_aligned(stepping=False)
        self.closed = True
        self._unclosed.detach()
        self._hook.remove()
        try:
            with self._box_lost(), self._own_call():
                self.strategy.finish()
                result = self.strategy.eval_model()
                from_box = self.strategy.result_from_box()  # a rank died: no broadcast over its group
            _own_memory_(self.model)
            self._detached = True
            self._publish(result, from_box)
        finally:
            self._release()

    def _publish(self, result: nn.Module | None, from_box: bool = False) -> None:
        """Rank 0's result model into every rank's ``model``; ``from_box``: a rank died, and every rank
        read the result's weights from the box already (each keeps its own buffers)."""
        if result is not None and result is not self.model:
            with torch.no_grad():
                for dst, src in zip(_state(self.model), _state(result)):
                    dst.copy_(src)
        if from_box:
            pbmpi.finalize_at_exit()  # under ULFM, after a death, MPI_Finalize may never return
            if result is not None:
                has_buffers = next(self.model.buffers(), None) is not None
                buffers = "; buffers (batch-norm statistics) stay each rank's own" if has_buffers else ""
                warn(
                    f"rank {self.rank}: a rank of the run died, so every rank read the run's result from the "
                    f"box instead of a broadcast over the broken process group{buffers}"
                )
            return
        if self.world.world_size > 1:
            with pbdist.collective("result weights broadcast", self.board):
                broadcast_tensors_(_state(self.model))

    def abort(self) -> None:
        """Release everything without waiting for the other ranks (after an error on this one); the
        model keeps this rank's current weights."""
        if not self.closed:
            self.closed = True
            self._unclosed.detach()
            self._hook.remove()
            self._release()

    def _release(self) -> None:
        """Not collective: the strategy's buffers, boxes and threads, then the process group we made."""
        strategy = getattr(self, "strategy", None)
        for guard in getattr(self, "_guards", []):
            guard.remove()
        try:
            if not getattr(self, "_detached", True):
                _own_memory_(self.model)
            if strategy is not None:
                strategy.close()
            for p in self.model.parameters():
                p.grad = None
        finally:
            if self.board is not None:
                self.board.close()
            if self._own_group:
                pbdist.destroy_distributed()

    def __enter__(self) -> DistributedOptimizer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # the others may never get to close(): release without waiting for them
            self.abort()

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.name!r}, rank={self.rank}, world_size={self.world_size})"


_WATCHED: dict[int, weakref.ReferenceType[DistributedOptimizer]] = {}  # id(model) -> its optimizer
_GLOBAL_HOOK: Any = None


# What a script does when the box is lost (BoxLost's remedy under DistributedOptimizer).
LOOP_REMEDY = (
    "This rank's model keeps its weights (an asynchronous rule's replica: the center as it last pulled it, "
    "plus its own steps since); restart the job from your last checkpoint (opt.state_dict() holds what "
    "the box held as of then). Across nodes the box is held by its memory ranks (box.memory_ranks) or, "
    "without them, by the workers"
)


def _watch_forward(opt: DistributedOptimizer) -> _Unwatch:
    """The step begins with the first forward pass of ``opt.model`` that records a graph. One hook for
    every module of the process (``register_module_forward_pre_hook``), none on the user's model:
    ``torch.save(model)`` and ``copy.deepcopy(model)`` see a plain module."""
    global _GLOBAL_HOOK
    if _GLOBAL_HOOK is None:
        _GLOBAL_HOOK = torch.nn.modules.module.register_module_forward_pre_hook(_on_forward)
        # torch.compile warns that a global hook fires once more for the OptimizedModule: this one
        # begins a step at most once, so the extra call is harmless.
        warnings.filterwarnings(
            "ignore", message=r"Using `torch.compile\(module\)` when there are global hooks"
        )
    _WATCHED[id(opt.model)] = weakref.ref(opt)
    return _Unwatch(id(opt.model))


def _on_forward(module: nn.Module, args: Any) -> None:
    ref = _WATCHED.get(id(module))
    opt = ref() if ref is not None else None
    if opt is not None and opt.model is module and not opt._begun and torch.is_grad_enabled():
        opt._begin()


class _Unwatch:
    def __init__(self, key: int):
        self.key = key

    def remove(self) -> None:
        global _GLOBAL_HOOK
        _WATCHED.pop(self.key, None)
        if not _WATCHED and _GLOBAL_HOOK is not None:
            _GLOBAL_HOOK.remove()
            _GLOBAL_HOOK = None


def _strategy(name: str, options: dict[str, Any] | None) -> tuple[type[Strategy], Any]:
    """The strategy class that runs ``name`` with ``options``; a ``UserError`` naming what is wrong."""
    base = strategy_class(name)
    try:
        opts = base.Options(**(options or {}))
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise UserError(f"{name} option {where!r}: {err['msg']}") from None
    except TypeError:
        raise UserError(f"{name} options must be a dict of option names to values") from None
    cls = base.resolve(opts)
    if cls.owns_forward_backward:
        raise UserError(
            f"strategy {name!r} runs the forward and backward passes itself and cannot sit inside your "
            f"loop; use parambox.train(model=..., data=..., strategy={name!r})"
        )
    return cls, opts


# Wrappers that exchange gradients themselves, by class name (FSDP's import alone takes half a second)
_DATA_PARALLEL = {"DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "FSDPModule"}


def _exchanges_itself(module: nn.Module) -> bool:
    return any(
        c.__name__ in _DATA_PARALLEL and c.__module__.startswith("torch.") for c in type(module).__mro__
    )


def _shards_itself(optimizer: torch.optim.Optimizer) -> bool:
    """torch's ``ZeroRedundancyOptimizer``: it broadcasts each rank's shard of the parameters."""
    return any(
        c.__name__ == "ZeroRedundancyOptimizer" and c.__module__.startswith("torch.")
        for c in type(optimizer).__mro__
    )


def _one_optimizer(optimizer: Any) -> Any:
    """The optimizer a strategy steps: the user's, or for a list of them (over disjoint parameters) one
    :class:`_Chain` of them; a ``UserError`` where the list is not that."""
    if not isinstance(optimizer, (list, tuple)):
        return optimizer
    if not optimizer:
        raise UserError("DistributedOptimizer: the list of optimizers is empty")
    for i, o in enumerate(optimizer):
        if not isinstance(o, torch.optim.Optimizer):
            raise UserError(
                f"DistributedOptimizer: optimizer {i} of the list must be a torch.optim.Optimizer, "
                f"got {type(o).__name__}"
            )
    if len(optimizer) == 1:
        return optimizer[0]
    seen: dict[int, int] = {}
    for i, o in enumerate(optimizer):
        for g in o.param_groups:
            for p in g["params"]:
                if seen.setdefault(id(p), i) != i:
                    raise UserError(
                        f"DistributedOptimizer: optimizers {seen[id(p)]} and {i} of the list both hold a "
                        "parameter; each parameter belongs to one of them"
                    )
    return _Chain(list(optimizer))


class _Chain(torch.optim.Optimizer):
    """Several torch optimizers over disjoint parameters of one model, stepped as one (Muon for the
    weight matrices and AdamW for the rest, as current GPT recipes pair them): what a strategy steps
    where ``DistributedOptimizer`` was given a list. Its param groups are the members', in order.

    >>> lin = nn.Linear(2, 2)
    >>> chain = _Chain([torch.optim.SGD([lin.weight], lr=0.1), torch.optim.Adam([lin.bias], lr=0.01)])
    >>> [g["lr"] for g in chain.param_groups], [g["params"] for g in chain.state_dict()["param_groups"]]
    ([0.1, 0.01], [[0], [1]])
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        # (Optimizer.__init__ is not called: the groups and the state are the members')
        self.optimizers = optimizers
        self._optimizer_step_pre_hooks: dict[int, Callable] = {}
        self._optimizer_step_post_hooks: dict[int, Callable] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizers[0].defaults

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The members' states as one optimizer's (torch's layout): the groups in order, each member's
        parameters numbered on from the previous member's, as ``get_state_dict`` merges optimizers."""
        state: dict[Any, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for o in self.optimizers:
            own = o.state_dict()
            state.update({offset + k: v for k, v in own["state"].items()})
            groups += [{**g, "params": [offset + i for i in g["params"]]} for g in own["param_groups"]]
            offset += sum(len(g["params"]) for g in o.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`state_dict`'s layout split back by the members' group counts (the keys may be
        numbers or, from ``torch.distributed.checkpoint``, parameter names)."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        counts = [len(o.param_groups) for o in self.optimizers]
        if not isinstance(groups, list) or len(groups) != sum(counts):
            raise UserError(
                f"DistributedOptimizer.load_state_dict(): expected the state of {len(self.optimizers)} "
                f"optimizers with {sum(counts)} param groups in all (a DistributedOptimizer's state_dict() "
                "over the same list)"
            )
        state = state_dict.get("state", {})
        for o, n in zip(self.optimizers, counts):
            mine, groups = groups[:n], groups[n:]
            keys = [k for g in mine for k in g["params"]]
            o.load_state_dict({"state": {k: state[k] for k in keys if k in state}, "param_groups": mine})


def _members(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers a ``_Chain`` holds, or ``optimizer`` itself."""
    return optimizer.optimizers if isinstance(optimizer, _Chain) else [optimizer]


def _check_pair(model: Any, optimizer: Any) -> None:
    if not isinstance(model, nn.Module):
        raise UserError(f"DistributedOptimizer: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(
            f"DistributedOptimizer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    wrapped = next((m for m in model.modules() if _exchanges_itself(m)), None)
    if wrapped is not None:
        raise UserError(
            f"DistributedOptimizer: the model is wrapped in {type(wrapped).__name__}, which exchanges the "
            "gradients itself; pass the plain module (model.module): the strategy does the exchange"
        )
    ref = _WATCHED.get(id(model))
    other = ref() if ref is not None else None
    if other is not None and other.model is model and not other.closed:
        raise UserError(
            f"DistributedOptimizer: the model is wrapped already, by DistributedOptimizer({other.name!r}); one "
            "per model: give several torch optimizers as a list, DistributedOptimizer(model, [muon, adamw], ...)"
        )
    own = {id(p) for p in model.parameters()}
    if not own:
        raise UserError("DistributedOptimizer: the model has no parameters")
    lazy = [name for name, p in model.named_parameters() if nn.parameter.is_lazy(p)]
    if lazy:
        raise UserError(
            f"DistributedOptimizer: the model's parameters {', '.join(lazy[:3])}{' ...' if len(lazy) > 3 else ''} "
            "are not initialised yet (a Lazy module): run one forward pass on a batch before wrapping, as with DDP"
        )
    foreign = sum(id(p) not in own for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise UserError(
            f"DistributedOptimizer: the optimizer holds {foreign} parameters that are not the model's"
        )


def _world(model: nn.Module) -> _ModelWorld:
    """Rank and sizes from the launcher, or from the process group the user initialised."""
    world = World.from_env()
    if dist.is_initialized() and (world.rank, world.world_size) != (dist.get_rank(), dist.get_world_size()):
        rank, size = dist.get_rank(), dist.get_world_size()
        world = World(rank, size, rank, size, launcher=world.launcher)  # one node: nothing says otherwise
    device = next(model.parameters()).device
    return _ModelWorld(
        **{f.name: getattr(world, f.name) for f in dataclasses.fields(World)}, model_device=device
    )


def _box_config(box: str | dict[str, Any] | BoxConfig) -> BoxConfig:
    try:
        config = (
            box
            if isinstance(box, BoxConfig)
            else BoxConfig(backend=box)
            if isinstance(box, str)
            else BoxConfig(**box)
        )
    except ValidationError as e:
        err = e.errors()[0]
        raise UserError(f"box {'.'.join(str(x) for x in err['loc'])!r}: {err['msg']}") from None
    if config.spare_ranks:  # a spare becomes a worker inside parambox's loop; a user's loop has no such place
        raise UserError(
            "box.spare_ranks is for `parambox train` (its loop hands a dead worker's place to a spare); "
            "DistributedOptimizer takes none"
        )
    return config


def _state(model: nn.Module) -> list[torch.Tensor]:
    """Parameters, then buffers: each once (tied weights once), in a fixed order on every rank."""
    return [p.data for p in model.parameters()] + list(model.buffers())


def _direct_step(ref: weakref.ref, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The wrapped optimizer's step pre-hook: its ``step()`` called by the script, not through the
    DistributedOptimizer, is a ``UserError`` (the exchange would be skipped: a silent local run)."""
    opt = ref()
    if opt is not None and opt._inside:
        opt._base_steps += 1
    if opt is None or opt.closed or opt._inside or threading.get_ident() != opt._thread:
        return
    opt.abort()
    raise UserError(
        f"the {type(optimizer).__name__} wrapped by DistributedOptimizer({opt.name!r}) was stepped directly: "
        f"call step() on the DistributedOptimizer (and scaler.step(opt) with it), or {opt.name} never exchanges"
    )


def _placement(model: nn.Module) -> list[tuple[int, int]]:
    """Each parameter and where its data lives: a ``model.to()`` or a new layer after wrapping changes it."""
    return [(id(p), p.data_ptr()) for p in model.parameters()]


def _versions(model: nn.Module) -> list[int]:
    """Each parameter's version counter: an in-place write (``load_state_dict``'s ``copy_``, an
    optimizer's step) moves it; a write through ``.data`` does not."""
    return [p._version for p in model.parameters()]


def _fingerprint(model: nn.Module) -> list[tuple[float, float]]:
    """Each parameter's sum and sum of squares (float64): changed by any load of other weights."""
    with torch.no_grad():
        return [(float(p.double().sum()), float(p.double().square().sum())) for p in model.parameters()]


def _own_memory_(model: nn.Module) -> None:
    """Give each parameter memory of its own: strategies bind them into flat buffers or the shared box."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()


def _loss_outside(model: nn.Module, batch: Any) -> torch.Tensor:
    raise RuntimeError("DistributedOptimizer: the loss is computed in the user's loop")


def _optimizer_factory(model: nn.Module, optimizer: torch.optim.Optimizer):
    """``ctx.make_optimizer``: the user's optimizer for the model's own parameters, a new one of its
    class (param groups mapped by position) for another set, such as a copy of the model's."""
    own = list(model.parameters())
    own_ids = {id(p) for p in own}

    def make(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        params = list(params)
        if all(id(p) in own_ids for p in params):
            return optimizer
        copy = same_kind(optimizer, own, params)
        make.copies.append(copy)
        return copy

    make.copies = []
    return make


def _follow_rates(copy: torch.optim.Optimizer, optimizer: torch.optim.Optimizer) -> None:
    """Each of ``optimizer``'s group settings (``lr``, ``momentum``, ...) into ``copy``'s group at its
    position, where the groups match one to one (``same_kind`` kept them)."""
    if len(copy.param_groups) != len(optimizer.param_groups):
        return
    for mine, theirs in zip(copy.param_groups, optimizer.param_groups):
        for key, value in theirs.items():
            if key != "params":
                mine[key] = value


def same_kind(
    optimizer: torch.optim.Optimizer, own: list[nn.Parameter], params: list[nn.Parameter]
) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class over ``params``. Where ``params`` match ``own`` one to one
    (a copy of the model) each keeps its counterpart's param group; otherwise one group with the
    optimizer's defaults. No state (momentum) is carried over.

    >>> a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    >>> opt = torch.optim.SGD([{"params": [a.weight], "lr": 0.5}, {"params": [a.bias]}], lr=0.1)
    >>> [g["lr"] for g in same_kind(opt, list(a.parameters()), list(b.parameters())).param_groups]
    [0.5, 0.1]
    """
    if isinstance(optimizer, _Chain):
        if len(params) != len(own):
            raise UserError(
                "DistributedOptimizer: this strategy needs an optimizer over tensors other than the model's, "
                "made from one of yours: give one optimizer, not a list"
            )
        return _Chain([same_kind(o, own, params) for o in optimizer.optimizers])
    accepted = inspect.signature(type(optimizer).__init__).parameters
    # Only what the constructor takes: AdamW's defaults hold decoupled_weight_decay, its __init__ does not.
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    if len(params) != len(own):
        return type(optimizer)(params, **defaults)
    position = {id(p): i for i, p in enumerate(own)}
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [params[position[id(p)]] for p in g["params"]],
        }
        for g in optimizer.param_groups
    ]
    return type(optimizer)(groups, **defaults)
