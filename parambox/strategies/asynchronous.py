"""What every asynchronous strategy shares: the center weights in the box, and a worker's life around them.

Notation of the papers: ``x`` a worker's replica, ``c`` the center (global) weights in the box.

API (kept stable; the asynchronous strategies build on it)
-----------------------------------------------------------
:class:`AsyncOptions`
    ``termination`` (``all`` | ``fastest`` | ``average``, ShmCaffe's termination alignment) and
    ``lost_after_s``. A strategy's options subclass it.
:class:`~parambox.strategies.center.CounterMap`, :class:`~parambox.strategies.center.CenterClient`
    (``strategies/center.py``): where the box's counters are, and one worker's handle on the center
    ``c = box[start:start + numel]`` (``pull``, ``push`` refusing non-finite updates, the fused elastic
    exchange ``elastic_``, ``staleness``).
:func:`~parambox.strategies.base.bind_flat_replica`
    ``x, g = bind_flat_replica(model, layout, device)``: parameters become views into the flat
    ``x``, their ``.grad`` views into ``g`` (also for strategies without a box, e.g. sync EASGD).
:class:`AsyncStrategy`
    A :class:`Strategy` whose replica is one flat buffer ``self.x`` (the parameters are views into
    it) with gradients in ``self.g`` (the ``.grad`` are views), so every exchange is one flat op.
    It opens the box (``c`` first, then ``extra_numel`` elements of the strategy's own at
    ``self.extra_start``), writes the initial weights into ``c``, and gives subclasses
    ``begin_step`` (zeroes ``g``), ``guard(loss, step)`` (halts a worker whose loss is non-finite),
    ``halt(what, step)`` and ``step_result(loss, samples)`` (counts the step, reports comm times,
    ``staleness`` and ``nonfinite``). It implements termination alignment (``should_stop``), the
    wait for the others at the end with lost-worker detection (``finish``; override ``flush`` to push
    what is left), the result model (the center, on rank 0), resume state and
    ``summary_extra`` (``lost_workers``, ``nonfinite_workers``, ``worker_steps``).

Lost workers: rank 0 waits at the end for every worker's ``DONE``; a worker on its host whose
process is gone is lost at once, any other once its step count stood still ``lost_after_s``. On the
``rma`` box a dead worker takes its shard of the box with it (and mpiexec ends the job).

A subclass implements ``end_step`` (and ``begin_step`` where the rule acts before the forward
pass, calling ``super().begin_step(step)``); e.g. the asynchronous EASGD update::

    def end_step(self, loss, samples, step):
        if self.guard(loss, step):
            self.optimizer.step()
            if (step + 1) % tau == 0 and not self.client.elastic_(self.x, alpha):
                self.halt("elastic update", step)
        return self.step_result(loss, samples)
"""

from __future__ import annotations

import copy
import time
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from parambox.box import Layout, open_box
from parambox.errors import CommTimeout, warn
from parambox.numerics import is_finite
from parambox.runtime.spawn import identity_gone, process_identity
from parambox.strategies.base import (
    Context,
    GradViews,
    Options,
    StepResult,
    Strategy,
    bind_flat_replica,
    loss_value,
)
from parambox.strategies.center import DONE, FINAL, NONFINITE, CenterClient, CounterMap

_POLL_S = 0.01


class AsyncOptions(Options):
    termination: Literal["all", "fastest", "average"] = Field(
        "all", description="stop when every worker / the fastest / the average worker has done its steps"
    )
    lost_after_s: float | None = Field(
        None,
        gt=0,
        description="a worker whose step count stops moving this long is lost (default: --timeout)",
    )


class AsyncStrategy(Strategy):
    """Base of the asynchronous strategies (see the module docstring for its API and an example step).

    >>> Downpour(ctx, DownpourOptions(n_push=4)).step((x, y), step=0)  # doctest: +SKIP
    """

    Options = AsyncOptions
    tolerates_worker_loss = True
    box_name: ClassVar[str] = "center"

    def __init__(self, ctx: Context, options: AsyncOptions, *, extra_numel: int = 0, extra_counters: int = 0):
        super().__init__(ctx, options)
        rank, n = self.world.rank, self.world.world_size
        self.layout = Layout.from_model(self.model)
        self.numel = self.layout.numel
        self.params = list(self.model.parameters())
        self.result: nn.Module | None = None  # rank 0: a model bound to its own copy of the center
        if rank == 0:
            self.result = copy.deepcopy(self.model)
            self.result_x = torch.empty(self.numel, device=ctx.world.device)
            self.layout.bind_params_(self.result, self.result_x)
        self.x, self.g = bind_flat_replica(self.model, self.layout, ctx.world.device)
        self.grad_views = GradViews.of_flat(self.model, self.layout, self.g)
        self.counters = CounterMap(n, extra_counters)
        self.extra_start = self.numel
        self.box = open_box(
            ctx.box,
            self.world,
            self.numel + extra_numel,
            self.counters.num_counters,
            name=self.box_name,
            layout_hash=self.layout.fingerprint(),
            timeout=ctx.timeout_s,
        )
        self.client = CenterClient(self.box, self.numel, timers=self.timers)
        if rank == 0:
            self.box.write(self.x)  # every rank starts from the same weights (same seed)
        self.box.add_counter(self.counters.ident(rank), process_identity())
        self.box.barrier()
        self.lost_after_s = options.lost_after_s or ctx.timeout_s
        self.halted = False
        self.lost: set[int] = set()
        self._final = False
        self._reached = False

    # -- the step ------------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Zero ``g`` in place: backward accumulates the step's gradient into it (the ``.grad`` views,
        bound again where a user's ``zero_grad(set_to_none=True)`` dropped them)."""
        self.g.zero_()
        self.grad_views.rebind_()

    def guard(self, loss: torch.Tensor | None, step: int) -> bool:
        """False (and the worker halts) when the loss is not finite: nothing of this step is pushed.
        An unknown loss (None) passes: every push refuses a non-finite update anyway."""
        if loss is None or is_finite(loss):
            return True
        self.halt("loss", step)
        return False

    def halt(self, what: str, step: int) -> None:
        """This worker's loss or update became non-finite: it stops pushing and leaves the run."""
        if self.halted:
            return
        self.halted = True
        self.box.add_counter(self.counters.status(self.world.rank), NONFINITE)
        warn(f"rank {self.world.rank}: non-finite {what} at step {step}; it stops pushing and leaves the run")

    def step_result(self, loss: torch.Tensor | None, samples: int) -> StepResult:
        """Count the step in the box (heartbeat, termination) and report comm times and staleness."""
        m, rank = self.counters, self.world.rank
        done = self.box.add_counter(m.steps(rank), 1) + 1
        self.box.add_counter(m.total, 1)
        if done >= self.ctx.steps and not self._reached:
            self._reached = True
            self.box.add_counter(m.reached, 1)
        extra = {"staleness": float(self.client.staleness)}
        if self.halted:
            extra["nonfinite"] = 1.0
        return StepResult(loss_value(loss), samples, self.timers.pop(), extra)

    def flush(self) -> None:
        """Called once after the last step, before the worker says it is done: push what is left."""

    # -- termination alignment -------------------------------------------------------------------------
    def should_stop(self, step: int) -> bool:
        if self.halted:
            return True
        target, mode = self.ctx.steps, self.options.termination
        if mode == "all" or self.world.world_size == 1:
            return step >= target
        if mode == "fastest":
            return step >= target or self.box.read_counter(self.counters.reached) > 0
        return self.box.read_counter(self.counters.total) >= target * self.world.world_size

    def finish(self) -> None:
        """Push what is left, say DONE; rank 0 waits for the others (or finds them lost) and takes the center."""
        if not self.halted:
            self.flush()
        rank = self.world.rank
        self.box.add_counter(self.counters.status(rank), DONE)
        if rank == 0:
            self._await_peers()
            self.box.pull(self.result_x)
            self._final = True
            self.box.add_counter(self.counters.status(0), FINAL)
        elif not self.box.outlives_processes:
            self._await_final()  # the box's shards live on the workers: keep ours until rank 0 has read c
        self.timers.pop()

    def _await_peers(self) -> None:
        pending = set(range(1, self.world.world_size))
        seen = {r: (-1, 0.0) for r in pending}
        while pending:
            for r in sorted(pending):
                if self.box.read_counter(self.counters.status(r)) & DONE:
                    pending.discard(r)
                elif self._is_lost(r, seen):
                    pending.discard(r)
                    self.lost.add(r)
                    warn(f"worker rank {r} is lost (it died or stalled); finishing without it")
            if pending:
                time.sleep(_POLL_S)

    def _is_lost(self, r: int, seen: dict[int, tuple[int, float]]) -> bool:
        """A local worker whose process is gone, or any worker whose step count stood still too long."""
        if identity_gone(self.box.read_counter(self.counters.ident(r))):
            return True
        count, now = self.box.read_counter(self.counters.steps(r)), time.monotonic()
        if count != seen[r][0]:
            seen[r] = (count, now)
            return False
        return now - seen[r][1] > self.lost_after_s

    def _await_final(self) -> None:
        deadline = time.monotonic() + self.lost_after_s
        while not self.box.read_counter(self.counters.status(0)) & FINAL:
            if identity_gone(self.box.read_counter(self.counters.ident(0))) or time.monotonic() > deadline:
                raise CommTimeout("asynchronous finish: rank 0 did not take the final center weights")
            time.sleep(_POLL_S)

    # -- results, checkpoints, summary ------------------------------------------------------------------
    def eval_model(self) -> nn.Module | None:
        """Rank 0: a model holding the center weights (the run's result); None elsewhere."""
        if self.result is None:
            return None
        if not self._final:
            self.box.pull(self.result_x)
        with torch.no_grad():  # buffers (batch-norm statistics) are not in the box: rank 0's own
            for dst, src in zip(self.result.buffers(), self.model.buffers()):
                dst.copy_(src)
        return self.result

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["steps_done"] = self.box.read_counter(self.counters.steps(self.world.rank))
        if self.world.rank == 0:
            state["center"] = self.box.pull(torch.empty(self.numel)).clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume (every rank): counters carry on and rank 0 puts the saved center back in the box."""
        super().load_state_dict(state)
        m, rank = self.counters, self.world.rank
        self.box.add_counter(m.steps(rank), int(state.get("steps_done", 0)))
        self.box.add_counter(m.total, int(state.get("steps_done", 0)))
        if rank == 0 and "center" in state:
            self.box.write(state["center"])
        self.box.barrier()  # nobody pulls before the center is back

    def summary_extra(self) -> dict[str, Any]:
        """Rank 0: the workers lost or halted on non-finite values, and every worker's step count."""
        m, n = self.counters, self.world.world_size
        return {
            "lost_workers": sorted(self.lost),
            "nonfinite_workers": [r for r in range(n) if self.box.read_counter(m.status(r)) & NONFINITE],
            "worker_steps": [self.box.read_counter(m.steps(r)) for r in range(n)],
        }

    def close(self) -> None:
        for p in self.params:
            p.grad = None
        self.box.close()
