"""``diloco``: H inner steps of the run's optimizer, then an outer Nesterov step on the pseudo-gradient.

DiLoCo (Douillard et al. 2023). Every worker starts a round from the global weights ``theta``, runs
``inner_steps`` steps of its own optimizer (AdamW in the paper; its state stays on the worker across
rounds), and the pseudo-gradient ``delta = theta - theta_local`` (global minus local: it points
downhill, like a gradient) feeds the outer optimizer, SGD with Nesterov momentum (outer_lr 0.7,
outer_momentum 0.9), exactly as ``torch.optim.SGD(nesterov=True)`` applies it with ``theta.grad = delta``::

    b <- mu b + delta;  theta <- theta - lr (delta + mu b)

Synchronous form (the default), over collectives: one allreduce of ``delta`` per round, every worker
applies the same outer step to its own copy of ``theta``. With ``outer_lr=1, outer_momentum=0`` the
step is ``theta - (theta - mean theta_i) = mean theta_i``: periodic weight averaging (``weight-avg``).

Asynchronous form (``asynchronous: true``), over the box (Liu et al. 2024, asynchronous Local-SGD): a
worker pushes its pseudo-gradient ``g`` (relative to the ``theta`` it pulled) as soon as it finishes its
round, and pulls the new ``theta``. The outer step is Delayed Nesterov (their Algorithm 3): arrivals
are numbered by a ticket counter in the box; every arrival moves ``theta`` by ``-lr g / N`` at once,
and only every ``N``-th arrival (``buffer_size``, default the number of workers) updates the momentum
with the block's accumulated pseudo-gradients and applies it. Each worker's ``H`` adapts to its speed
(DyLU, their Eq. 6): ``H_w = floor(v_w / max v * inner_steps)``, the speeds posted in the box.

Who applies the outer step: the pushing worker, and the box stays storage. No lock is needed: every
change to ``theta`` and to the block accumulator is an accumulate (atomic per element in both box
backends), and the momentum ``m`` (a read-modify-write) is changed only by the holder of a block's
last ticket, one worker per block. The block's sum is taken by subtracting what was read, so a push
that lands while it is read counts in the next block instead of being lost. A worker killed in the
middle of a round takes only its own unpushed round with it; killed after its ticket, the block
applies the momentum with what arrived (or the next block does). ``theta``, ``m`` and the accumulator
live in the box, so they outlive any worker (with ``--box rma``, on its memory rank).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from pydantic import Field, model_validator
from torch.nn.utils import parameters_to_vector

from parambox.box import Layout
from parambox.errors import UserError, warn
from parambox.numerics import is_finite
from parambox.strategies.asynchronous import AsyncOptions, AsyncStrategy
from parambox.strategies.base import Context, StepResult, Strategy, loss_value, trainable
from parambox.strategies.center import DONE, LOST, NONFINITE


class DilocoOptions(AsyncOptions):
    inner_steps: int = Field(20, ge=1, description="H: inner optimizer steps per round (the paper: 500)")
    outer_lr: float = Field(0.7, gt=0, description="outer SGD learning rate")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="outer Nesterov momentum (0: plain SGD)")
    asynchronous: bool = Field(False, description="over the box, Delayed Nesterov + DyLU (Liu et al. 2024)")
    buffer_size: int | None = Field(
        None, ge=1, description="asynchronous: N, arrivals per momentum update (default: the workers)"
    )
    momentum_activation: float = Field(
        0.0, ge=0, description="asynchronous: c in [0, 1/N], momentum applied between updates (0: plain DN)"
    )
    dynamic_inner_steps: bool = Field(True, description="asynchronous: DyLU, each worker's H from its speed")

    @model_validator(mode="after")
    def _activation_within_buffer(self) -> DilocoOptions:
        if self.buffer_size is not None and self.momentum_activation > 1 / self.buffer_size:
            raise ValueError("diloco.momentum_activation must be at most 1 / diloco.buffer_size")
        return self


ASYNC_ONLY = {"buffer_size", "momentum_activation", "dynamic_inner_steps", "termination", "lost_after_s"}


class Diloco(Strategy):
    """Synchronous DiLoCo over allreduce. ``parambox train --preset digits-diloco``

    A worker whose round turned non-finite contributes nothing to that round's mean (a count rides in
    the allreduce) and starts the next round from ``theta`` like the others.
    """

    name = "diloco"
    Options = DilocoOptions
    # The paper's inner optimizer: under the outer Nesterov step the run's default SGD (lr 0.03, momentum
    # 0.9) diverged (0.10-0.19 test accuracy on digits). 10 inner steps, as the digits-diloco preset
    # (0.947 at 20).
    default_optimizer = {"optimizer": "adamw", "lr": 1e-3}
    default_options = {"inner_steps": 10}

    @classmethod
    def resolve(cls, options: DilocoOptions) -> type[Strategy]:
        return AsyncDiloco if options.asynchronous else cls

    def __init__(self, ctx: Context, options: DilocoOptions):
        super().__init__(ctx, options)
        self.params = trainable(self.model)
        self.buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        self.optimizer = ctx.make_optimizer(self.params)
        self.numel = sum(p.numel() for p in self.params)
        self.theta = torch.nn.Parameter(parameters_to_vector(self.params).detach().clone())
        mu = options.outer_momentum
        # torch refuses nesterov=True without momentum: momentum 0 is plain SGD.
        self.outer = torch.optim.SGD([self.theta], lr=options.outer_lr, momentum=mu, nesterov=mu > 0)
        self.round_steps = 0
        self.nonfinite: set[int] = set()
        ignored = sorted(ASYNC_ONLY & options.model_fields_set)
        if ignored:
            warn(
                f"diloco: {', '.join(ignored)} apply to the asynchronous form only (diloco.asynchronous=true)"
            )

    def begin_step(self, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        self.optimizer.step()
        self.round_steps += 1
        # The same schedule as weight-avg (after steps where (step + 1) % period == 0).
        if (step + 1) % self.options.inner_steps == 0:
            self.outer_step_()
        return StepResult(loss_value(loss), samples, self.timers.pop())

    def outer_step_(self) -> None:
        """Average the pseudo-gradients (and the float buffers), apply the outer step, restart from theta."""
        n, rank, numel = self.world.world_size, self.world.rank, self.numel
        local = parameters_to_vector(self.params).detach()
        parts = [self.theta.detach() - local, *(b.reshape(-1) for b in self.buffers)]
        # then one slot per rank: 1 where it contributed
        buf = torch.cat([*parts, torch.zeros(n, device=local.device)])
        if is_finite(buf) and self._inner_state_finite():
            buf[numel + self._buffer_numel() + rank] = 1.0
        else:
            warn(f"rank {rank}: non-finite diloco round; it contributes nothing to this outer step")
            buf.zero_()
            # It rejoins from theta: with its NaN moments kept, AdamW would poison every later round.
            self.optimizer.state.clear()
        if n > 1:
            with self.timers.phase("allreduce"), self.collective("diloco outer step"):
                dist.all_reduce(buf)
        slots = buf[-n:]
        self.nonfinite.update(int(r) for r in (slots == 0).nonzero().flatten())
        mean = buf[:-n] / max(float(slots.sum()), 1.0)
        self.theta.grad = mean[:numel].clone()
        self.outer.step()
        with torch.no_grad():
            # copies (torch's vector_to_parameters would make the parameters views of theta)
            for p, value in zip(
                self.params, torch.split(self.theta.detach(), [p.numel() for p in self.params])
            ):
                p.copy_(value.view_as(p))
            if float(slots.sum()) > 0:
                offset = numel
                for b in self.buffers:
                    b.copy_(mean[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()
        self.round_steps = 0

    def _inner_state_finite(self) -> bool:
        return all(
            is_finite(v)
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.is_floating_point()
        )

    def _buffer_numel(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def finish(self) -> None:
        # A last partial round still counts (weight-avg averages at the end too); none after a full one,
        # since a zero pseudo-gradient would still move theta by the momentum.
        if self._any_pending():
            self.outer_step_()
        self.timers.pop()

    def _any_pending(self) -> bool:
        pending = torch.tensor([float(self.round_steps)])
        if self.world.world_size > 1:
            with self.collective("diloco finish"):
                dist.all_reduce(pending)
        return float(pending) > 0

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "outer": self.outer.state_dict(),
            "theta": self.theta.detach().clone(),
            "round_steps": self.round_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "theta" in state:
            self.theta.data.copy_(state["theta"])
        if "outer" in state:
            self.outer.load_state_dict(state["outer"])
        self.round_steps = int(state.get("round_steps", 0))

    def summary_extra(self) -> dict[str, Any]:
        return {"nonfinite_workers": sorted(self.nonfinite)}


class DelayedNesterov:
    """The outer step of asynchronous DiLoCo on the box: Delayed Nesterov (Liu et al. 2024, Alg. 3).

    The box holds ``theta`` (at ``0``), the momentum ``m`` (at ``m_start``) and the block accumulator
    ``a`` (at ``a_start``, the block's pseudo-gradients scaled ``1/N``), and the ticket counter. For
    one arrival ``g`` (``apply_``)::

        t <- ticket++;  a += g / N
        if (t + 1) % N == 0:  a_blk <- a; a -= a_blk; m <- beta m + a_blk
                              theta -= lr ((1 - c N + c) beta m + g / N)
        else:                 theta -= lr (c beta m + g / N)

    With ``c = 0`` and the ``N`` pseudo-gradients of a block all taken from the same ``theta``, a block
    is one synchronous Nesterov step on their mean.

    >>> dn = DelayedNesterov(box, numel=4, m_start=4, a_start=8, ticket=12, lr=0.7, momentum=0.9, n=2)  # doctest: +SKIP
    >>> dn.apply_(g, push_theta=lambda u, scale: box.push(u, scale))  # doctest: +SKIP
    """

    def __init__(
        self,
        box: Any,
        numel: int,
        m_start: int,
        a_start: int,
        ticket: int,
        lr: float,
        momentum: float,
        n: int,
        activation: float = 0.0,
    ):
        self.box, self.numel, self.m_start, self.a_start, self.ticket = box, numel, m_start, a_start, ticket
        self.lr, self.beta, self.n, self.c = lr, momentum, n, activation
        self._m = torch.empty(numel)
        self._a = torch.empty(numel)

    def apply_(self, g: torch.Tensor, push_theta: Any) -> bool:
        """One arrival; returns whether this arrival updated the momentum (it held a block's last ticket)."""
        n, beta = self.n, self.beta
        if beta == 0:  # no momentum: every arrival is its own step, scaled 1/N
            push_theta(g, -self.lr / n)
            return False
        t = self.box.add_counter(self.ticket, 1)
        self.box.push(g, 1.0 / n, self.a_start)
        update = g / n
        if (t + 1) % n == 0:
            a = self.box.pull(self._a, self.a_start)
            self.box.push(a, -1.0, self.a_start)  # leaves pushes that land meanwhile for the next block
            m = self.box.pull(self._m, self.m_start)
            new_m = m * beta + a
            self.box.push(new_m - m, 1.0, self.m_start)
            update.add_(new_m, alpha=(1 - self.c * n + self.c) * beta)
            push_theta(update, -self.lr)
            return True
        if self.c > 0:
            update.add_(self.box.pull(self._m, self.m_start), alpha=self.c * beta)
        push_theta(update, -self.lr)
        return False


def local_steps(own_s: float, others_s: list[float], inner_steps: int) -> int:
    """DyLU (Liu et al. 2024, Eq. 6): ``floor(v_w / max v * H)``, at least 1, from seconds per step.

    >>> local_steps(0.02, [0.01], 20), local_steps(0.01, [0.02], 20), local_steps(0.5, [0.01], 20)
    (10, 20, 1)
    """
    fastest = min([own_s, *[s for s in others_s if s > 0]])
    return max(1, int(fastest / own_s * inner_steps + 1e-9)) if own_s > 0 else inner_steps


class AsyncDiloco(AsyncStrategy):
    """Asynchronous DiLoCo over the box. ``--set diloco.asynchronous=true``"""

    name = "diloco"
    Options = DilocoOptions
    default_optimizer = Diloco.default_optimizer
    # At the synchronous 0.9 the result depended on the arrival order (about half of 10 digits runs
    # reached 0.95); at 0.8 all 10 did.
    default_options = {**Diloco.default_options, "outer_momentum": 0.8}

    def __init__(self, ctx: Context, options: DilocoOptions):
        numel = Layout.from_model(ctx.model).numel
        # extra counters: the ticket, then each rank's microseconds per inner step (DyLU)
        super().__init__(ctx, options, extra_numel=2 * numel, extra_counters=1 + ctx.world.world_size)
        self.optimizer = ctx.make_optimizer(self.params)
        n = options.buffer_size or self.num_workers
        if options.momentum_activation > 1 / n:
            raise UserError(f"diloco.momentum_activation must be at most 1 / buffer_size = {1 / n:g}")
        self.outer = DelayedNesterov(
            self.box,
            self.numel,
            self.extra_start,
            self.extra_start + self.numel,
            self.counters.extra(0),
            options.outer_lr,
            options.outer_momentum,
            n,
            options.momentum_activation,
        )
        self.pulled = self.x.clone()  # theta as this round started: g = pulled - x
        self.round_steps = 0
        self.round_target = options.inner_steps
        self.round_start = time.perf_counter()
        self.s_per_step = 0.0

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        if self.guard(loss, step):
            self.optimizer.step()
            self.round_steps += 1
            if self.round_steps >= self.round_target:
                self._push_round(step)
        extra = {"inner_steps": float(self.round_target)}
        result = self.step_result(loss, samples)
        result.extra.update(extra)
        return result

    def _push_round(self, step: int) -> None:
        """Push this round's pseudo-gradient (the outer step), pull the new theta, pick the next H."""
        self._measure_speed()
        g = self.pulled - self.x
        if not is_finite(g):
            self.halt("pseudo-gradient", step)
            return
        self.outer.apply_(g, lambda u, scale: self.client.push(u, scale))
        self.client.pull(self.x)
        self.pulled.copy_(self.x)
        self.round_steps = 0
        self.round_target = self._next_target()
        self.round_start = time.perf_counter()

    def _measure_speed(self) -> None:
        now = time.perf_counter()
        s = (now - self.round_start) / max(self.round_steps, 1)
        self.s_per_step = s if self.s_per_step == 0 else 0.5 * self.s_per_step + 0.5 * s
        self._set_counter(self._speed(self.world.rank), max(1, int(self.s_per_step * 1e6)))

    def _speed(self, r: int) -> int:
        return self.counters.extra(1 + r)

    def _next_target(self) -> int:
        """DyLU: this worker's H from its speed and the active workers' (those not done, lost or halted)."""
        h = self.options.inner_steps
        if not self.options.dynamic_inner_steps or self.num_workers == 1:
            return h
        others = [
            self.box.read_counter(self._speed(r)) / 1e6
            for r in range(self.num_workers)
            if r != self.world.rank
            and not self.box.read_counter(self.counters.status(r)) & (DONE | LOST | NONFINITE)
            and not (self.board is not None and self.board.dead(r))
        ]
        return local_steps(self.s_per_step, others, h)

    def flush(self) -> None:
        # The last partial round counts too (as the synchronous form's last outer step does).
        if self.round_steps > 0:
            self._push_round(self.ctx.steps)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.serves:
            return state
        state.update(pulled=self.pulled.clone(), round_steps=self.round_steps, round_target=self.round_target)
        if self.world.rank == 0:
            state["outer_state"] = self.box.pull(torch.empty(2 * self.numel), self.extra_start).clone()
            state["ticket"] = self.box.read_counter(self.counters.extra(0))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.serves and self.world.rank == 0 and "outer_state" in state:
            # before super() bumps `ready`: nobody pushes before the momentum is back
            self.box.write(state["outer_state"], self.extra_start)
            self._set_counter(self.counters.extra(0), int(state.get("ticket", 0)))
        super().load_state_dict(state)
        if not self.serves and "pulled" in state:
            self.pulled.copy_(state["pulled"])
            self.round_steps = int(state.get("round_steps", 0))
            self.round_target = int(state.get("round_target", self.options.inner_steps))
