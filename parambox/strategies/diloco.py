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
With ``overlap`` the allreduce runs behind the next round, and a worker goes on from the delayed global
weights plus its own progress (``strategies/exchange.py``): parambox's rule, neither Streaming DiLoCo's
mixing nor Kale et al.'s eager update.

Streaming DiLoCo (Douillard et al. 2025; torchft's ``DiLoCo`` with ``fragment_sync_delay`` and
``fragment_update_alpha``), over allreduce (and asynchronous over the box: ``AsyncStreamingDiloco``,
below): ``fragments`` (F) cuts the flat state in F equal slices,
fragment ``f`` exchanged after the steps ``t`` with ``t % H == H f // F`` (so the link carries ``1/F`` of
the model every ``H/F`` steps, not the whole model every H); ``fragment_sync_delay`` (tau) lets the
allreduce run behind tau inner steps before the fragment's outer step lands; ``fragment_update_alpha``
(alpha) then sets the replica's fragment to ``alpha local + (1 - alpha) global``, the local including
the tau steps of progress made meanwhile (alpha 0 drops them, as torchft's default). ``StreamingDiloco``
runs it; F = 1, tau = 0, alpha = 0 is this class. Streaming and ``overlap`` are exclusive (a one-line
error): both hide the exchange, tau per fragment and a few steps, ``overlap`` the whole model a round,
with different rules for the worker's progress meanwhile. ``compression`` applies per fragment.

Asynchronous form (``asynchronous: true``), over the box (Liu et al. 2024, asynchronous Local-SGD): a
worker pushes its pseudo-gradient ``g`` (relative to the ``theta`` it pulled) as soon as it finishes its
round, and pulls the new ``theta``. The outer step is Delayed Nesterov (their Algorithm 3): arrivals
are numbered by a ticket counter in the box; every arrival moves ``theta`` by ``-lr g / N`` at once,
and only every ``N``-th arrival (``buffer_size``, default the number of workers) updates the momentum
with the block's accumulated pseudo-gradients and applies it. Each worker's ``H`` adapts to its speed
(DyLU, their Eq. 6): ``H_w = v_w / max v * inner_steps`` rounded (held at ``inner_steps`` within 5 %
of the fastest), the speeds posted in the box.

Who applies the outer step: the pushing worker, and the box stays storage. The outer step reads and
writes the momentum ``m`` and the block accumulator, so arrivals take it in turns, in ticket order: a
ticket lock made of two box counters (``ticket``, fetch-and-add, and ``served``); arrival ``t`` waits
until ``served == t`` and adds one when done. Two workers closing different blocks (any
``buffer_size``) can then no longer both read the old ``m``, and every block holds exactly its ``N``
arrivals: ``theta`` follows Alg. 3 applied in ticket order. The wait is short (an outer step is a few
box operations, once per round). A worker killed in the middle of a round takes only its own unpushed
round with it; a turn whose holder died or stalled past ``lost_after_s`` (``--timeout``) is passed
over by the next waiter, and that one arrival's step is lost (``TicketLock``): on the memory server
(``--box rma``) the step commits whole, per shard, once the arrival has landed (``box/server.py``); applied by
the worker itself (the shm box) a death inside the turn can leave it partly applied. ``theta``, ``m`` and
the accumulator live in the box, so they outlive any worker (with ``--box rma``, on its memory rank).
``compression`` encodes each arrival's ``g`` with the worker's error feedback: the memory server takes the
codes and decodes them before its fused step (``CenterClient.outer_step`` with ``messages``); on the other
boxes the worker decodes and the step takes float32 (``box_compressor``'s warning). The error is in each
worker's checkpoint.

With ``quorum`` Q (Decoupled DiLoCo, Google DeepMind 2026; ``QuorumNesterov``), the box is the
synchroniser: arrivals accumulate, weighted by their round's samples, until Q distinct workers have
arrived or one arrives ``grace_s`` after the pending step's first; that arrival applies ONE outer
Nesterov step on their weighted mean. Every push gets the center back at once, and the worker's next
round starts from it (its own contribution possibly still pending): nobody waits for the quorum. On the
memory server the step is applied there, whole per shard; on the shm box by the pushing worker.

Asynchronous Streaming DiLoCo (``asynchronous: true`` with ``fragments``, ``fragment_sync_delay`` or
``fragment_update_alpha``; ``AsyncStreamingDiloco``): each fragment of the center is an asynchronous
DiLoCo of its own, pushed at its offset in the worker's round (the synchronous schedule on the worker's
own steps), its outer step Delayed Nesterov's under a ticket lock of its own, so the link carries a
fragment at a time and two workers' arrivals of different fragments never wait for each other.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from pydantic import Field, model_validator

from parambox.box import Layout
from parambox.errors import UserError, warn
from parambox.numerics import is_finite
from parambox.strategies.asynchronous import AsyncOptions, AsyncStrategy
from parambox.strategies.base import Context, StepResult, Strategy, averaged_buffers, loss_value, period_end
from parambox.strategies.center import DONE, LOST, NONFINITE
from parambox.strategies.delayed_nesterov import (
    QUORUM_COUNTERS,
    DelayedNesterov,
    QuorumNesterov,
    TicketLock,
    local_steps,
)
from parambox.strategies.exchange import (
    Background,
    DeltaAverager,
    ExchangeOptions,
    LowRankExchange,
    LowRankOptions,
    SumExchange,
    box_compressor,
    box_encoder,
)
from parambox.strategies.streaming import Fragment, cut, read_slice, write_slice_
from parambox.strategies.tensors import flatten, trainable


def _state_finite(optimizer: torch.optim.Optimizer) -> bool:
    """True when every floating-point tensor of the inner optimizer's state (momentum, Adam's moments)
    is finite: a worker whose state is not contributes no pseudo-gradient."""
    return all(
        is_finite(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    )


class DilocoOptions(AsyncOptions, ExchangeOptions, LowRankOptions):
    takes_powersgd = True  # the synchronous form's outer gradients, without fragments or overlap
    inner_steps: int = Field(20, ge=1, description="H: inner optimizer steps per round (the paper: 500)")
    outer_lr: float = Field(0.7, gt=0, description="outer SGD learning rate")
    outer_momentum: float = Field(
        0.9,
        ge=0,
        lt=1,
        description="outer Nesterov momentum (0: plain SGD); the default is 0.7 with a compression other than bf16",
    )
    asynchronous: bool = Field(False, description="over the box, Delayed Nesterov + DyLU (Liu et al. 2024)")
    buffer_size: int | None = Field(
        None, ge=1, description="asynchronous: N, arrivals per momentum update (default: the workers)"
    )
    momentum_activation: float = Field(
        0.0, ge=0, description="asynchronous: c in [0, 1/N], momentum applied between updates (0: plain DN)"
    )
    dynamic_inner_steps: bool = Field(True, description="asynchronous: DyLU, each worker's H from its speed")
    quorum: int | None = Field(
        None,
        ge=0,
        description="asynchronous: Q, one outer step when Q workers' rounds have arrived, on their "
        "sample-weighted mean (Decoupled DiLoCo; 0 or unset: Delayed Nesterov, every arrival on its own)",
    )
    grace_s: float | None = Field(
        None,
        gt=0,
        description="asynchronous with quorum: an arrival this long after the pending step's first one "
        "applies the step with fewer than Q (unset: wait for Q)",
    )
    fragments: int = Field(
        1,
        ge=1,
        description="Streaming DiLoCo: F, the model cut in F fragments, each exchanged at its own step of the round",
    )
    fragment_sync_delay: int = Field(
        0,
        ge=0,
        description="Streaming DiLoCo: tau, a fragment's outer step lands tau inner steps after its exchange began",
    )
    fragment_update_alpha: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Streaming DiLoCo: alpha, a fragment after its outer step is alpha local + (1 - alpha) global",
    )

    @model_validator(mode="after")
    def _activation_within_buffer(self) -> DilocoOptions:
        if self.buffer_size is not None and self.momentum_activation > 1 / self.buffer_size:
            raise ValueError("diloco.momentum_activation must be at most 1 / diloco.buffer_size")
        if self.fragments > self.inner_steps:
            raise ValueError(
                "diloco.fragments must be at most diloco.inner_steps (one exchange a step at most)"
            )
        if self.fragment_sync_delay >= self.inner_steps:
            raise ValueError(
                "diloco.fragment_sync_delay must be below diloco.inner_steps (a fragment's outer step lands "
                "before its next exchange)"
            )
        return self

    @property
    def streaming(self) -> bool:
        """Streaming DiLoCo: fragments, a delayed outer step or mixing (F = 1, tau = 0, alpha = 0 is not)."""
        return self.fragments > 1 or self.fragment_sync_delay > 0 or self.fragment_update_alpha > 0


ASYNC_ONLY = {
    "buffer_size",
    "momentum_activation",
    "dynamic_inner_steps",
    "termination",
    "lost_after_s",
    "grace_s",
}


class Diloco(Strategy):
    """Synchronous DiLoCo over allreduce. ``parambox train --preset digits-diloco``

    A worker whose round turned non-finite contributes nothing to that round's mean (a count rides in
    the allreduce) and starts the next round from ``theta`` like the others.
    """

    name = "diloco"
    copies_the_weights = True  # the global weights
    period_options = ("inner_steps",)
    Options = DilocoOptions
    # The paper's inner optimizer: under the outer Nesterov step the run's default SGD (lr 0.03, momentum
    # 0.9) diverged (0.10-0.19 test accuracy on digits). 10 inner steps, as the digits-diloco preset
    # (0.947 at 20).
    default_optimizer = {"optimizer": "adamw", "lr": 1e-3}
    default_options = {"inner_steps": 10}
    survives_in_place = True  # the synchronous form, without overlap

    @classmethod
    def options_defaults(cls, options: Options) -> dict[str, Any]:
        """With a compression that keeps an error (all but bf16): outer momentum 0.7, the error feedback
        carrying part of what momentum did (SparseLoCo drops the momentum for it); topk: 20 % of the
        elements a round (0.16 bytes an element a step over rounds of 10, 0.4x float32 diloco's).
        bench defaults on digits, seeds 0-4, at momentum 0.9: int8 0.939-0.964, sign 0.858-0.930, topk
        at 1 % 0.825-0.919; at 0.7: int8 0.961-0.972, int4 0.958-0.969, int2 0.953-0.969, sign
        0.953-0.964, powersgd 0.958-0.972, topk at 10 % 0.950-0.967 and at 20 % 0.958-0.967."""
        out = dict(cls.default_options)
        if options.compression not in ("none", "bf16"):
            out["outer_momentum"] = min(out.get("outer_momentum", 0.9), 0.7)
        if options.compression == "topk":
            out["compression_ratio"] = 0.2
        return out

    per_rank_state = ("averager.error",)  # the error feedback a rank owes is its own

    @classmethod
    def resolve(cls, options: DilocoOptions) -> type[Strategy]:
        if options.streaming and options.quorum:
            raise UserError(
                "diloco: a quorum's outer step and Streaming DiLoCo (fragments, fragment_sync_delay, "
                "fragment_update_alpha) do not combine: the quorum steps the whole model at once"
            )
        if options.streaming and options.overlap:
            raise UserError(
                "diloco: overlap and Streaming DiLoCo (fragments, fragment_sync_delay, fragment_update_alpha) are "
                "exclusive: use fragment_sync_delay to hide the exchange"
            )
        if options.compression == "powersgd" and (
            options.asynchronous or options.streaming or options.overlap
        ):
            raise UserError(
                "diloco.compression=powersgd is for the synchronous form without fragments or overlap (its two "
                "allreduces need the whole model's shapes, at once)"
            )
        if options.quorum and not options.asynchronous:
            raise UserError(
                "diloco.quorum is a rule of the box's outer step: set diloco.asynchronous=true (the synchronous "
                "form waits for every worker each round)"
            )
        if options.asynchronous:
            if options.quorum:
                return QuorumDiloco
            return AsyncStreamingDiloco if options.streaming else AsyncDiloco
        return StreamingDiloco if options.streaming else cls

    def __init__(self, ctx: Context, options: DilocoOptions):
        super().__init__(ctx, options)
        self.params = trainable(self.model)
        self.buffers = averaged_buffers(self.model)
        self.optimizer = ctx.make_optimizer(self.params)
        self.numel = sum(p.numel() for p in self.params)
        # theta: the parameters, then the float buffers (averaged plainly, no outer step)
        flat = flatten([*self.params, *self.buffers]).detach().clone()
        self.theta = torch.nn.Parameter(flat[: self.numel])  # a view: the outer step moves `flat`
        mu = options.outer_momentum
        # torch refuses nesterov=True without momentum: momentum 0 is plain SGD.
        # foreach: Nesterov's lookahead is added to the gradient in place (the exchange's sums, which
        # this step may change), not to a fresh model-sized tensor
        self.outer = torch.optim.SGD(
            [self.theta], lr=options.outer_lr, momentum=mu, nesterov=mu > 0, foreach=True
        )
        n = self.world.world_size
        guard = lambda: self.collective("diloco outer step")  # noqa: E731
        if options.compression == "powersgd":
            shapes = [t.shape for t in [*self.params, *self.buffers]]
            exchange: SumExchange = LowRankExchange(shapes, n, n, options.powersgd_rank, flat.device, guard)
        else:
            exchange = SumExchange(
                flat.numel(),
                n,
                n,
                options.compression,
                options.compression_block,
                flat.device,
                guard,
                ratio=options.compression_ratio,
            )
        self.averager = DeltaAverager(flat, self._outer_step_, exchange, options.overlap, self.world.rank)
        self.round_steps = 0
        self.nonfinite: set[int] = set()
        # outer steps, and those in which every worker's round was non-finite
        self.rounds = self.rejected_rounds = 0
        if (
            self.survival.joining
        ):  # a replacement: a survivor's theta, outer momentum and inner optimizer state
            self.survival.share_state()
            exchange.compressor.forget_error_()  # the error it owes is its own: none yet
        ignored = sorted(ASYNC_ONLY & options.model_fields_set)
        if ignored:
            warn(
                f"diloco: {', '.join(ignored)} apply to the asynchronous form only (diloco.asynchronous=true)"
            )

    def begin_step(self, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.survival.admit(step)  # at a round's start (next_exchange)

    def next_exchange(self, step: int) -> int:
        return period_end(step, self.options.inner_steps)  # the round's last step

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        self.optimizer.step()
        self.round_steps += 1
        extra = {}
        # The same schedule as weight-avg (after steps where (step + 1) % period == 0).
        if (step + 1) % self.options.inner_steps == 0:
            self.outer_step_(step)
            extra["exchange_bytes"] = float(self.averager.exchange.bytes_sent)
        extra["exchange_wait_s"] = self.averager.exchange.pop_wait()
        return StepResult(loss_value(loss), samples, self.timers.pop(), extra)

    def outer_step_(self, step: int) -> None:
        """Send this round's pseudo-gradient (and float buffers); apply the mean outer step (at once, or
        with ``overlap`` one round late) and continue from what the averager gives back. In a run that
        survives in place, a lost peer makes the survivors repeat the exchange among themselves: the
        mean is then theirs (the flags count who contributed)."""
        tensors = [*self.params, *self.buffers]
        local = self.averager.flatten_(tensors)
        contribute = is_finite(local) and _state_finite(self.optimizer)
        if not contribute:
            warn(
                f"rank {self.world.rank}: non-finite diloco round; it contributes nothing to this outer step"
            )
            # It rejoins from theta: with its NaN moments kept, AdamW would poison every later round.
            self.optimizer.state.clear()
        keep = self.survival.group is not None
        with self.timers.phase("allreduce"):
            x_next = self.exchange(
                lambda: self.averager.round_end_(local, contribute, keep), step, self.averager.redo_
            )
        self.nonfinite.update(int(r) for r in (self.averager.contributors == 0).nonzero().flatten())
        self.rounds += 1
        self.rejected_rounds += int(not bool(self.averager.contributors.any()))
        with torch.no_grad():
            # copies (torch's vector_to_parameters would make the parameters views of theta)
            for t, value in zip(tensors, torch.split(x_next, [t.numel() for t in tensors])):
                t.copy_(value.view_as(t))
        self.round_steps = 0

    def _outer_step_(self, mean: torch.Tensor) -> None:
        """theta's parameters by the outer optimizer on the mean pseudo-gradient; its buffers by the mean."""
        self.theta.grad = mean[: self.numel]  # a view of the exchange's sums, read by this step only
        self.outer.step()
        self.theta.grad = None
        self.averager.theta[self.numel :].sub_(mean[self.numel :])

    def finish(self) -> None:
        # A last partial round still counts (weight-avg averages at the end too); none after a full one,
        # since a zero pseudo-gradient would still move theta by the momentum.
        if self._any_pending():
            self.outer_step_(self.ctx.steps)
        if self.averager.exchange.pending:  # overlap: the last round's mean is applied now
            with self.timers.phase("allreduce"):
                self.averager.flush_()
            self._load_theta()
        self.timers.pop()
        self.averager.exchange.pop_wait()
        if self.rounds and self.rejected_rounds == self.rounds:
            # A run that applied no outer step has trained nothing: it must not end as a success.
            raise UserError(
                f"diloco: every one of the {self.rounds} outer steps was rejected (every worker's round "
                "was non-finite): the model did not train; lower lr or check the loss"
            )

    def _load_theta(self) -> None:
        tensors = [*self.params, *self.buffers]
        with torch.no_grad():
            for t, value in zip(tensors, torch.split(self.averager.theta, [t.numel() for t in tensors])):
                t.copy_(value.view_as(t))

    def _any_pending(self) -> bool:
        pending = torch.tensor([float(self.round_steps)], device=self.world.device)
        if self.world.world_size > 1:
            with self.collective("diloco finish"):
                dist.all_reduce(pending, async_op=True).wait()
        return float(pending) > 0

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "outer": self.outer.state_dict(),
            "theta": self.theta.detach().clone(),
            "round_steps": self.round_steps,
            "averager": self.averager.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "theta" in state:
            self.theta.data.copy_(state["theta"])
        if "outer" in state:
            self.outer.load_state_dict(state["outer"])
        self.averager.load_state_dict(state.get("averager", {}))
        self.round_steps = int(state.get("round_steps", 0))

    def summary_extra(self) -> dict[str, Any]:
        return {"nonfinite_workers": sorted(self.nonfinite)}


class StreamingDiloco(Strategy):
    """Streaming DiLoCo over allreduce. ``--set diloco.fragments=2 --set diloco.fragment_sync_delay=1``

    The flat state (parameters, then float buffers) is cut in ``fragments`` (F) slices of equal size
    (``strategies/streaming.py``). Fragment ``f`` keeps its own slice of the global weights ``theta_f``
    and its own outer Nesterov SGD. After the steps ``t`` with ``t % H == H f // F`` it starts the
    allreduce of its pseudo-gradient ``delta_f = theta_f - x_f`` (global minus this worker's replica)
    and the worker trains on; ``fragment_sync_delay`` (tau) steps later the mean lands::

        theta_f <- outer(theta_f, mean delta_f);  x_f <- alpha x_f + (1 - alpha) theta_f

    where ``x_f`` is the replica's fragment *then*, its progress of the tau steps in flight included,
    and alpha is ``fragment_update_alpha``: with alpha 0 that progress is dropped and every worker
    continues from the new global fragment, with alpha > 0 a share of it is kept (the paper's mixing,
    torchft's ``lerp`` of the global towards the local fragment). The next pseudo-gradient is again
    measured from ``theta_f``, so what the mix kept is sent in the fragment's next exchange.

    F = 1, tau = 0, alpha = 0 is synchronous DiLoCo: one exchange after every H steps, the replica set
    to ``theta``. ``overlap`` is exclusive with these options (tau is Streaming DiLoCo's overlap: the
    exchange of one fragment runs behind tau steps, where ``overlap`` delays the whole model's by a
    round and keeps the worker's own progress whole). ``compression`` applies per fragment, each with
    its own error feedback. A fragment whose replica turned non-finite sends nothing (the flags count
    who did), and the worker starts over from ``theta`` with a fresh inner optimizer state.

    At the end of the run every fragment's exchange in flight lands, every fragment with progress not
    yet sent is exchanged once more and applied at once, and every worker ends at ``theta``.
    """

    name = "diloco"
    copies_the_weights = True  # the global weights
    period_options = ("inner_steps",)
    Options = DilocoOptions
    default_optimizer = Diloco.default_optimizer
    default_options = Diloco.default_options
    # An exchange in flight across steps cannot be repeated over the survivors: on_failure=restart
    survives_in_place = False

    def __init__(self, ctx: Context, options: DilocoOptions):
        super().__init__(ctx, options)
        self.params = trainable(self.model)
        self.buffers = averaged_buffers(self.model)
        self.tensors = [*self.params, *self.buffers]
        self.optimizer = ctx.make_optimizer(self.params)
        self.numel = sum(p.numel() for p in self.params)
        self.theta = flatten(self.tensors).detach().clone()
        self.fragments = cut(self.theta.numel(), options.fragments, options.inner_steps)
        mu = options.outer_momentum
        n = self.world.world_size
        # per fragment: its parameters' part of theta (a view the outer step moves), its optimizer, its
        # exchange (and compressor, with its own error feedback), the step its outer step lands after
        self.outer_params: list[torch.nn.Parameter | None] = []
        self.outers: list[torch.optim.SGD | None] = []
        self.exchanges: list[SumExchange] = []
        self.land_after: list[int | None] = [None] * len(self.fragments)
        for fr in self.fragments:
            stop = min(fr.stop, self.numel)
            p = torch.nn.Parameter(self.theta[fr.start : stop]) if fr.start < stop else None
            self.outer_params.append(p)
            self.outers.append(
                None if p is None else torch.optim.SGD([p], lr=options.outer_lr, momentum=mu, nesterov=mu > 0)
            )
            self.exchanges.append(
                SumExchange(
                    fr.numel,
                    n,
                    n,
                    options.compression,
                    options.compression_block,
                    self.theta.device,
                    lambda f=fr.index: self.collective(f"diloco fragment {f} exchange"),
                    ratio=options.compression_ratio,
                )
            )
        self.nonfinite: set[int] = set()
        self.rounds = self.rejected_rounds = 0  # fragment outer steps, and those nobody contributed to
        self.contributed = [True] * len(self.fragments)
        self.sent_bytes = 0
        ignored = sorted(ASYNC_ONLY & options.model_fields_set)
        if ignored:
            warn(
                f"diloco: {', '.join(ignored)} apply to the asynchronous form only (diloco.asynchronous=true)"
            )

    def begin_step(self, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        self.optimizer.step()
        t = step + 1  # steps done
        extra = {}
        self.sent_bytes = 0
        with self.timers.phase("allreduce"):
            for fr in self.fragments:
                if fr.sends_after(t):
                    self._send(fr, t)
            for fr in self.fragments:
                if self.land_after[fr.index] == t:
                    self._land(fr, self.options.fragment_update_alpha)
        if self.sent_bytes:
            extra["exchange_bytes"] = float(self.sent_bytes)
        extra["exchange_wait_s"] = sum(ex.pop_wait() for ex in self.exchanges)
        return StepResult(loss_value(loss), samples, self.timers.pop(), extra)

    def _send(self, fr: Fragment, t: int) -> None:
        """Start the allreduce of fragment ``fr``'s pseudo-gradient; its outer step lands tau steps on."""
        local = read_slice(self.tensors, fr.start, fr.stop)
        contribute = is_finite(local) and _state_finite(self.optimizer)
        flags = torch.zeros(self.world.world_size, device=local.device)
        if contribute:
            flags[self.world.rank] = 1.0
            delta = self.theta[fr.start : fr.stop] - local
        else:
            warn(
                f"rank {self.world.rank}: non-finite diloco fragment {fr.index}; it contributes nothing to "
                "this outer step and the worker starts over from theta"
            )
            self.optimizer.state.clear()  # NaN moments would poison every later step
            self._load_theta()
            delta = torch.zeros_like(local)
            self.exchanges[fr.index].compressor.forget_error_()
        ex = self.exchanges[fr.index]
        ex.start(delta, flags)
        self.sent_bytes += ex.bytes_sent
        self.land_after[fr.index] = t + self.options.fragment_sync_delay

    def _land(self, fr: Fragment, alpha: float) -> None:
        """The mean of fragment ``fr``'s exchange: its outer step, then the replica's fragment mixed."""
        total, flags = self.exchanges[fr.index].wait()
        self.land_after[fr.index] = None
        self.nonfinite.update(int(r) for r in (flags == 0).nonzero().flatten())
        count = float(flags.sum())
        self.rounds += 1
        self.rejected_rounds += int(count == 0)
        theta = self.theta[fr.start : fr.stop]
        if count > 0:
            mean = total / count
            split = min(fr.stop, self.numel) - fr.start  # its parameters, then its float buffers
            p, outer = self.outer_params[fr.index], self.outers[fr.index]
            if p is not None and outer is not None:
                p.grad = mean[:split].clone()
                outer.step()
            theta[max(split, 0) :].sub_(mean[max(split, 0) :])
        if alpha == 0:
            write_slice_(self.tensors, fr.start, theta)
        else:
            local = read_slice(self.tensors, fr.start, fr.stop)
            write_slice_(self.tensors, fr.start, torch.lerp(theta, local, alpha))

    def _load_theta(self) -> None:
        write_slice_(self.tensors, 0, self.theta)

    def finish(self) -> None:
        # Every exchange in flight lands; progress not yet sent goes once more, applied at once; every
        # worker ends at theta (alpha would leave each its own mix).
        t = self.ctx.steps
        with self.timers.phase("allreduce"):
            for fr in self.fragments:
                if self.land_after[fr.index] is not None:
                    self._land(fr, self.options.fragment_update_alpha)
            for fr in self.fragments:
                if fr.steps_since_send(t) > 0:
                    self._send(fr, t)
                    self._land(fr, 0.0)
        self._load_theta()
        self.timers.pop()
        for ex in self.exchanges:
            ex.pop_wait()
        if self.rounds and self.rejected_rounds == self.rounds:
            raise UserError(
                f"diloco: every one of the {self.rounds} fragment outer steps was rejected (every worker's "
                "fragment was non-finite): the model did not train; lower lr or check the loss"
            )

    def state_dict(self) -> dict[str, Any]:
        fragments = []
        for fr, outer, ex in zip(self.fragments, self.outers, self.exchanges):
            state: dict[str, Any] = {"land_after": self.land_after[fr.index]}
            if outer is not None:
                state["outer"] = outer.state_dict()
            if ex.compressor.error is not None:
                state["error"] = ex.compressor.error.clone()
            pending = ex.peek()  # an exchange in flight: completed now, still to land
            if pending is not None:
                state["pending"] = [pending[0].clone(), pending[1].clone()]
            fragments.append(state)
        return {**super().state_dict(), "theta": self.theta.clone(), "fragments": fragments}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "theta" in state:
            self.theta.copy_(state["theta"])
        saved = state.get("fragments", [])
        if saved and len(saved) != len(self.fragments):
            raise UserError(
                f"diloco: the checkpoint has {len(saved)} fragments, this run {len(self.fragments)}; resume "
                "with the same diloco.fragments"
            )
        for fr, outer, ex, s in zip(self.fragments, self.outers, self.exchanges, saved):
            if outer is not None and "outer" in s:
                outer.load_state_dict(s["outer"])
            if "error" in s and ex.compressor.error is not None:
                ex.compressor.error.copy_(s["error"])
            if "pending" in s:
                ex.restore((s["pending"][0], s["pending"][1]))
            self.land_after[fr.index] = s.get("land_after")

    def summary_extra(self) -> dict[str, Any]:
        return {"nonfinite_workers": sorted(self.nonfinite)}


class AsyncDiloco(AsyncStrategy):
    """Asynchronous DiLoCo over the box. ``--set diloco.asynchronous=true``"""

    name = "diloco"
    period_options = ("inner_steps",)
    Options = DilocoOptions
    per_rank_state = ("error",)  # the error feedback a worker owes is its own
    default_optimizer = Diloco.default_optimizer
    # At the synchronous 0.9 the result depended on the arrival order (about half of 10 digits runs
    # reached 0.95). With the outer step atomic (arrivals in ticket order) 0.8 gave 0.889 at seed 0,
    # 0.7 gave 0.925-0.967; 0.5 gave 0.967-0.972 at seeds 0-3.
    default_options = {**Diloco.default_options, "outer_momentum": 0.5}
    # The memory server applies the outer step itself, one request each way an arrival, in ticket
    # order; a node's cache would apply Alg. 3's step to a stale theta. Its exchange is every H steps.
    caches_center = False
    # the outer momentum is in the box's extra state; the ticket lock and a quorum's counts beside it
    box_state_keys = ("box_extra", "outer_state", "ticket", "quorum")

    def __init__(self, ctx: Context, options: DilocoOptions):
        numel = Layout.from_model(ctx.model).numel
        # extra counters: the ticket lock (ticket, served), each rank's microseconds per inner step
        # (DyLU), then the ticket each rank holds (the lock's slots)
        # (with a quorum, then the quorum's counters: QuorumNesterov)
        size = ctx.world.world_size
        quorum = QUORUM_COUNTERS + size if options.quorum else 0
        fragments = (options.fragments - 1) * (2 + size)  # Streaming: each further fragment's ticket lock
        super().__init__(
            ctx, options, extra_numel=2 * numel, extra_counters=2 + 2 * size + quorum + fragments
        )
        self.optimizer = ctx.make_optimizer(self.params)
        n = options.buffer_size or self.num_workers
        if options.momentum_activation > 1 / n:
            raise UserError(f"diloco.momentum_activation must be at most 1 / buffer_size = {1 / n:g}")
        lock = TicketLock(
            self.box,
            self.counters.extra(0),
            self.counters.extra(1),
            self.counters.extra(2 + size),
            ctx.world.rank,
            self.num_workers,
            self.membership.lost_after_s,
        )
        m_start, a_start = self.extra_start, self.extra_start + self.numel
        self.outer: DelayedNesterov | QuorumNesterov
        if options.quorum:
            self._check_quorum(options)
            self.outer = QuorumNesterov(
                self.box,
                self.numel,
                m_start,
                a_start,
                lock,
                self.counters.extra(2 + 2 * size),
                options.outer_lr,
                options.outer_momentum,
                options.quorum,
                ctx.world.rank,
                options.grace_s,
                live=self._active_workers,
            )
        else:
            if options.grace_s is not None:
                warn("diloco.grace_s applies with diloco.quorum only: ignored")
            self.outer = DelayedNesterov(
                self.box,
                self.numel,
                m_start,
                a_start,
                self.counters.extra(0),
                options.outer_lr,
                options.outer_momentum,
                n,
                options.momentum_activation,
                lock,
            )
        self.round_samples = 0  # this round's samples: its weight in a quorum's step
        self.finishing = False  # the last push: with a quorum, made also without a round (weight 0)
        self.pulled = self.x.clone()  # theta as this round started: g = pulled - x
        # compression: where the box applies the outer step (the rma memory server) the arrival goes encoded
        # and the server decodes it, then steps; elsewhere the worker decodes it (box_compressor's warning)
        self.encoder, self.compressor = None, None
        if self.box.fuses_outer_step:
            warns = self.world.rank == 0
            self.encoder = box_encoder(self.name, options, self.box, self.numel, 0, self.x.device, warns)
        else:
            self.compressor = box_compressor(self.name, options, self.numel, self.x.device)
        # overlap: the round's push and pull run in a thread while the next round computes
        self.background = Background(ctx.timeout_s, "asynchronous diloco push") if options.overlap else None
        self.theta_next = torch.empty_like(self.x)  # what the background pull brings
        self.waited = 0.0
        self.round_steps = 0
        self.round_target = options.inner_steps
        self.step_end = time.perf_counter()
        self.step_s: list[float] = []  # this round's seconds per step, end to end (DyLU's speed)
        self.s_per_step = 0.0

    @property
    def error(self) -> torch.Tensor | None:
        """What this worker's compressed pushes still owe (error feedback), or None without compression."""
        owner = self.encoder if self.encoder is not None else self.compressor
        return None if owner is None else owner.error

    def _check_quorum(self, options: DilocoOptions) -> None:
        """A quorum's options that cannot apply: one line each."""
        if options.quorum > self.num_workers:
            raise UserError(f"diloco.quorum={options.quorum} is more than the {self.num_workers} workers")
        if options.buffer_size is not None or options.momentum_activation > 0:
            raise UserError(
                "diloco.quorum replaces Delayed Nesterov's buffer: unset diloco.buffer_size and "
                "diloco.momentum_activation"
            )

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        now = time.perf_counter()
        self.step_s.append(now - self.step_end)
        self.step_end = now
        if self.guard(loss, step):
            self.optimizer.step()
            self.round_steps += 1
            self.round_samples += samples
            if self.round_steps >= self.round_target:
                self._push_round(step)
        extra = {"inner_steps": float(self.round_target), "exchange_wait_s": self.waited}
        if self.round_steps == 0:
            extra["exchange_bytes"] = 4.0 * self.numel  # the box stores float32
        self.waited = 0.0
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
        coded = (
            None  # g as the encoder sent it: encoded here, not in the thread (the error is a checkpoint's)
        )
        if self.encoder is not None:
            coded = self.encoder.encode(g)
        elif self.compressor is not None:
            g = self.compressor.round_trip(g)
        t0 = time.perf_counter()
        if self.background is None:
            # The outer step's push of theta and the pull of the new theta: one request (where the box
            # applies the step itself, the pseudo-gradient goes and theta comes back).
            enc = self.encoder
            pushed = self._outer_step(
                g,
                lambda u, scale: (
                    self.client.push_pull(u, self.x, scale)
                    if coded is None
                    else self.client.push_encoded(enc, u, self.x, scale, self._coded_g(u, g, coded))
                ),
                lambda g, k, last: self.client.outer_step(g, self.x, k, last, enc, coded),
            )
            if not pushed:
                self.client.pull(self.x)
        else:  # theta after our last push, plus this round's own progress; then push it meanwhile
            if self.background.busy:
                self.background.wait()
                self.x.add_(self.theta_next - self.pulled)
            self.background.start(lambda: self._push_pull(g, self.theta_next, coded))
        self.waited += time.perf_counter() - t0
        self.pulled.copy_(self.x)
        self.round_steps = self.round_samples = 0
        self.round_target = self._next_target()
        self.step_end = time.perf_counter()

    def _measure_speed(self) -> None:
        """This worker's seconds per step for DyLU: the median of the round's steps, end to end, so a
        pause between two steps (an evaluation, a checkpoint, a benchmark's barrier) is not read as a
        slow worker. As the round's mean, the pause of one of ``bench cluster``'s barriers cut rank 0's
        next rounds to 8, 10, 13 and 14 steps of 16, of two equal workers."""
        if not self.step_s:
            return
        s = statistics.median(self.step_s)
        self.step_s.clear()
        self.s_per_step = s if self.s_per_step == 0 else 0.5 * self.s_per_step + 0.5 * s
        self.box.set_counter(self._speed(self.world.rank), max(1, int(self.s_per_step * 1e6)))

    def _speed(self, r: int) -> int:
        return self.counters.extra(2 + r)

    def _next_target(self) -> int:
        """DyLU: this worker's H from its speed and the active workers' (those not done, lost or halted)."""
        h = self.options.inner_steps
        if not self.options.dynamic_inner_steps or self.num_workers == 1:
            return h
        others = [self.box.read_counter(self._speed(r)) / 1e6 for r in self._active(others_only=True)]
        return local_steps(self.s_per_step, others, h)

    def _active(self, others_only: bool = False) -> list[int]:
        """The workers not done, lost or halted (this one included unless ``others_only``)."""
        return [
            r
            for r in range(self.num_workers)
            if not (others_only and r == self.world.rank)
            and not self.box.read_counter(self.counters.status(r)) & (DONE | LOST | NONFINITE)
            and not (self.membership.board is not None and self.membership.board.dead(r))
        ]

    def _active_workers(self) -> int:
        return len(self._active())

    @staticmethod
    def _coded_g(u: torch.Tensor, g: torch.Tensor, coded: list[torch.Tensor]) -> list[torch.Tensor]:
        """The messages of a push of theta's update ``u`` where the memory server applies the outer step:
        only Delayed Nesterov without momentum pushes (``g`` itself, scaled), which the messages encode."""
        assert u is g, "on a box that fuses the outer step, theta's update is pushed only as g itself"
        return coded

    def _push_pull(
        self,
        g: torch.Tensor,
        out: torch.Tensor,
        coded: list[torch.Tensor] | None = None,
        outer: DelayedNesterov | None = None,
        encoder: Any = None,
        start: int = 0,
    ) -> None:
        """The outer step with ``g`` (``coded``: as the encoder sent it) and the pull of the new theta (in
        the background thread: the box directly, not the client whose timers the step reports). A
        fragment of theta (``AsyncStreamingDiloco``): its ``outer`` step, ``encoder``, and ``start``."""
        enc = encoder or self.encoder

        def push_pull(u: torch.Tensor, scale: float) -> bool:
            if coded is None:
                self.box.push_pull(u, out, scale, start)
            else:
                messages = self._coded_g(u, g, coded)
                self.box.push_encoded_async(
                    messages, u.numel(), enc.code, enc.params, scale, start, out
                ).wait()
            return True

        def outer_step(g: torch.Tensor, k: tuple, last: bool) -> bool:
            if coded is None:
                self.box.outer_step_async(g, out, k, last, start).wait()
            else:
                self.box.outer_step_encoded_async(
                    coded, g.numel(), enc.code, enc.params, out, k, last, start
                ).wait()
            return True

        if not self._outer_step(
            g, push_pull, outer_step, outer
        ):  # no step of theta by this arrival: fetch it
            self.box.pull(out, start)
        self.box.add_counter(self.counters.version, 1)

    def _outer_step(self, g: torch.Tensor, push_pull: Any, outer_step: Any, outer: Any = None) -> bool:
        """The outer step with ``g`` (Delayed Nesterov's, or the quorum's, weighted by the round's
        samples; ``outer``: a fragment's instead of the whole model's): its push of theta made by
        ``push_pull(u, scale)`` (which pulls the new theta too), or where the box applies the step,
        ``outer_step(g, coefficients, last)`` (which brings theta back); False if nothing was pushed into
        theta (refused, or a quorum's arrival that closed no step): the caller pulls theta."""
        done = []
        (outer or self.outer).apply_(
            g,
            lambda u, scale: done.append(push_pull(u, scale)),
            lambda g, k, last: done.append(outer_step(g, k, last)),
            weight=self.round_samples if self.finishing else max(1, self.round_samples),
        )
        return bool(done and done[0])

    def flush(self) -> None:
        # The last partial round counts too (as the synchronous form's last outer step does); with a
        # quorum, a last push also without a round of its own: the last worker's closes the pending step.
        self.finishing = isinstance(self.outer, QuorumNesterov)
        if self.round_steps > 0 or self.finishing:
            self._push_round(self.ctx.steps)
        if self.background is not None and self.background.busy:
            self.background.wait()
            self.x.copy_(self.theta_next)

    def close(self) -> None:
        if self.background is not None and self.background.busy:
            try:  # a halted worker's last push: let it land before the box goes
                self.background.wait()
            except Exception as e:
                warn(f"rank {self.world.rank}: asynchronous diloco push failed at close: {e}")
        super().close()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.serves:
            return state
        state.update(
            pulled=self.pulled.clone(),
            round_steps=self.round_steps,
            round_target=self.round_target,
            round_samples=self.round_samples,
        )
        if self.error is not None:  # what this worker's pushes still owe: its own, not the run's
            state["error"] = self.error.clone()
        if self.world.rank == 0:
            state["outer_state"] = self.outer.state()
            state["ticket"] = self.box.read_counter(self.counters.extra(0))
            if isinstance(
                self.outer, QuorumNesterov
            ):  # the pending step: its arrivals' mean is in outer_state
                state["quorum"] = self.outer.counters(self.world.world_size)
        return state

    def restart_from_center(self) -> None:
        self.pulled.copy_(self.x)  # a round starts at the rebuilt center
        self.round_steps, self.round_samples = 0, 0
        self.round_target = self.options.inner_steps

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.serves and self.world.rank == 0 and "outer_state" in state:
            # before super() bumps `ready`: nobody pushes before the momentum is back
            self.outer.load_state(state["outer_state"])
            self.outer.lock.reset(int(state.get("ticket", 0)))  # no turn in flight
            if isinstance(self.outer, QuorumNesterov) and "quorum" in state:
                self.outer.load_counters(state["quorum"])
        super().load_state_dict(state)
        if not self.serves and "pulled" in state:
            self.pulled.copy_(state["pulled"])
            self.round_steps = int(state.get("round_steps", 0))
            self.round_target = int(state.get("round_target", self.options.inner_steps))
            self.round_samples = int(state.get("round_samples", 0))
            if self.error is not None and "error" in state:
                self.error.copy_(state["error"])


class QuorumDiloco(AsyncDiloco):
    """Asynchronous DiLoCo with a quorum (``--set diloco.asynchronous=true --set diloco.quorum=Q``): the
    same rule, with its own default ``outer_lr``.

    A quorum's step moves further than Delayed Nesterov's arrivals do (the module docstring), so the
    outer learning rate that suits Delayed Nesterov overshoots: on digits (4 workers, the default 600
    steps, seeds 0-3) ``outer_lr`` 0.7 reached 0.90-0.97 test accuracy at Q = 2, 0.935-0.969 at Q = 3 and
    0.89-0.96 at Q = 4; 0.35 reached 0.963-0.974, 0.952-0.963 and 0.935-0.966 (0.25: 0.952-0.963,
    0.947-0.961, 0.913-0.955)."""

    default_options = {**AsyncDiloco.default_options, "outer_lr": 0.35}


class AsyncStreamingDiloco(AsyncDiloco):
    """Streaming DiLoCo, asynchronous, over the box: ``--set diloco.asynchronous=true --set diloco.fragments=2``.

    The center is cut in ``fragments`` (F) slices (``strategies/streaming.py``), and each is an
    asynchronous DiLoCo of its own: its pseudo-gradient ``g_f = theta_f - x_f`` (the center's fragment as
    this worker last received it, minus its replica's) is pushed after the step of the worker's round at
    the fragment's offset (``H f // F`` of the round's H steps, DyLU's H where it adapts; fragment 0 at the
    round's end: :class:`StreamingDiloco`'s schedule on the worker's own steps), and its outer step is
    Delayed Nesterov's on that slice of ``theta``, ``m`` and the block's accumulator, in turns of a ticket
    lock of the fragment's own (so arrivals of different fragments never wait for each other). The new
    center's fragment comes back with it; ``fragment_sync_delay`` (tau) runs the push and pull behind tau
    inner steps, and then the replica's fragment becomes ``alpha x_f + (1 - alpha) theta_f``
    (``fragment_update_alpha``), the next pseudo-gradient measured from ``theta_f``. ``compression`` encodes
    each fragment's pushes with an error feedback of its own. At the end every exchange in flight lands
    and every fragment's progress not yet pushed goes, as the synchronous form's last outer steps.

    With one worker (Delayed Nesterov with N = 1 is Nesterov SGD) it is synchronous Streaming DiLoCo
    exactly. Exclusive with ``quorum`` (one step of the whole model) and ``overlap``.
    """

    box_state_keys = (*AsyncDiloco.box_state_keys, "tickets")

    def __init__(self, ctx: Context, options: DilocoOptions):
        super().__init__(ctx, options)
        size, n = ctx.world.world_size, options.buffer_size or self.num_workers
        self.fragments = cut(self.numel, options.fragments, options.inner_steps)
        m_start, a_start = self.extra_start, self.extra_start + self.numel
        self.outers: list[DelayedNesterov] = []
        for fr in self.fragments:
            lock = self.outer.lock  # fragment 0: the whole model's counters; then a lock each
            if fr.index > 0:
                base = 2 + 2 * size + (fr.index - 1) * (2 + size)
                lock = TicketLock(
                    self.box,
                    self.counters.extra(base),
                    self.counters.extra(base + 1),
                    self.counters.extra(base + 2),
                    ctx.world.rank,
                    self.num_workers,
                    self.membership.lost_after_s,
                )
            self.outers.append(
                DelayedNesterov(
                    self.box,
                    fr.numel,
                    m_start + fr.start,
                    a_start + fr.start,
                    lock.ticket,
                    options.outer_lr,
                    options.outer_momentum,
                    n,
                    options.momentum_activation,
                    lock,
                )
            )
        # each fragment's error feedback (the whole model's encoder of the base class, which warned
        # where the box takes no codes, is not used)
        self.encoder = self.compressor = None
        device, fused = self.x.device, self.box.fuses_outer_step
        self.encoders = [
            box_encoder(self.name, options, self.box, fr.numel, fr.start, device, warns=False)
            if fused
            else None
            for fr in self.fragments
        ]
        self.compressors = [
            None if fused else box_compressor(self.name, options, fr.numel, device, warns=False)
            for fr in self.fragments
        ]
        tau = options.fragment_sync_delay
        self.backgrounds = [
            Background(ctx.timeout_s, f"asynchronous diloco fragment {fr.index} push") if tau else None
            for fr in self.fragments
        ]
        self.incoming = [torch.empty(fr.numel, device=device) for fr in self.fragments]  # theta_f, back
        self.land_in: list[int | None] = [None] * len(self.fragments)  # steps until its outer step lands
        self.unsent = [0] * len(self.fragments)  # steps of progress not yet pushed, per fragment
        self.sent_numel = 0

    @property
    def error(self) -> torch.Tensor | None:
        owners = [e if e is not None else c for e, c in zip(self.encoders, self.compressors)]
        return None if owners[0] is None else torch.cat([o.error for o in owners])

    def _position(self, fr: Fragment) -> int:
        """The step of the worker's round (1..H) after which ``fr`` is pushed."""
        h = self.round_target
        return h if fr.index == 0 else max(1, h * fr.index // len(self.fragments))

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        now = time.perf_counter()
        self.step_s.append(now - self.step_end)
        self.step_end = now
        self.sent_numel = 0
        if self.guard(loss, step):
            self.optimizer.step()
            self.round_steps += 1
            self.round_samples += samples
            for fr in self.fragments:
                self.unsent[fr.index] += 1
                if self.land_in[fr.index] is not None:
                    self.land_in[fr.index] -= 1
                    if self.land_in[fr.index] <= 0:
                        self._land(fr)
            for fr in self.fragments:
                if self.round_steps == self._position(fr) and not self.halted:
                    self._send(fr, step)
            if self.round_steps >= self.round_target:
                self._measure_speed()
                self.round_steps = self.round_samples = 0
                self.round_target = self._next_target()
                self.step_end = time.perf_counter()
        extra = {"inner_steps": float(self.round_target), "exchange_wait_s": self.waited}
        if self.sent_numel:
            extra["exchange_bytes"] = 4.0 * self.sent_numel  # the box stores float32
        self.waited = 0.0
        result = self.step_result(loss, samples)
        result.extra.update(extra)
        return result

    def _send(self, fr: Fragment, step: int, inline: bool = False) -> None:
        """Push fragment ``fr``'s pseudo-gradient (its outer step) and pull its new center: at once with
        tau = 0 (or ``inline``), else behind the next tau steps."""
        i, lo, hi = fr.index, fr.start, fr.stop
        if self.land_in[i] is not None:  # its last exchange first (DyLU shortened the round)
            self._land(fr)
        g = self.pulled[lo:hi] - self.x[lo:hi]
        if not is_finite(g):
            self.halt(f"pseudo-gradient of fragment {i}", step)
            return
        coded = None
        if self.encoders[i] is not None:
            coded = self.encoders[i].encode(g)
        elif self.compressors[i] is not None:
            g = self.compressors[i].round_trip(g)
        self.unsent[i] = 0
        self.sent_numel += fr.numel
        background = self.backgrounds[i]
        if background is None or inline:
            t0 = time.perf_counter()
            with self.timers.phase("push_pull"):
                self._exchange(fr, g, coded)
            self.waited += time.perf_counter() - t0
            self.land_in[i] = 0
            self._land(fr)
        else:
            background.start(lambda: self._exchange(fr, g, coded))
            self.land_in[i] = self.options.fragment_sync_delay

    def _exchange(self, fr: Fragment, g: torch.Tensor, coded: list[torch.Tensor] | None) -> None:
        """Fragment ``fr``'s outer step with ``g`` and the pull of its new center into ``incoming``."""
        i = fr.index
        self._push_pull(g, self.incoming[i], coded, self.outers[i], self.encoders[i], fr.start)

    def _land(self, fr: Fragment) -> None:
        """Fragment ``fr``'s new center arrived: the next pseudo-gradient is measured from it, and the
        replica's fragment mixes it with its own (alpha)."""
        i, lo, hi = fr.index, fr.start, fr.stop
        if self.backgrounds[i] is not None:
            self.waited += self.backgrounds[i].wait()
        self.land_in[i] = None
        theta, alpha = self.incoming[i], self.options.fragment_update_alpha
        self.pulled[lo:hi].copy_(theta)
        self.x[lo:hi].copy_(theta if alpha == 0 else torch.lerp(theta, self.x[lo:hi], alpha))

    def flush(self) -> None:
        for fr in self.fragments:
            if self.land_in[fr.index] is not None:
                self._land(fr)
        for fr in self.fragments:
            if self.unsent[fr.index] > 0 and not self.halted:
                self._send(fr, self.ctx.steps, inline=True)

    def close(self) -> None:
        for fr, background in zip(self.fragments, self.backgrounds):
            if background is not None and background.busy:
                try:  # a halted worker's last pushes: let them land before the box goes
                    background.wait()
                except Exception as e:
                    warn(
                        f"rank {self.world.rank}: asynchronous diloco fragment {fr.index} push failed at close: {e}"
                    )
        super().close()

    def state_dict(self) -> dict[str, Any]:
        for background in self.backgrounds:  # an exchange in flight lands in the box; its theta_f is kept
            if background is not None and background.busy:
                self.waited += background.wait()
        state = super().state_dict()
        if self.serves:
            return state
        state["fragments"] = [
            {
                "land_in": self.land_in[fr.index],
                "unsent": self.unsent[fr.index],
                **(
                    {"incoming": self.incoming[fr.index].clone()}
                    if self.land_in[fr.index] is not None
                    else {}
                ),
            }
            for fr in self.fragments
        ]
        if self.world.rank == 0:
            state["tickets"] = [self.box.read_counter(o.lock.ticket) for o in self.outers]
        return state

    def restart_from_center(self) -> None:
        super().restart_from_center()
        self.land_in = [None] * len(self.fragments)
        self.unsent = [0] * len(self.fragments)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("fragments", [])
        if saved and len(saved) != len(self.fragments):
            raise UserError(
                f"diloco: the checkpoint has {len(saved)} fragments, this run {len(self.fragments)}; resume "
                "with the same diloco.fragments"
            )
        if not self.serves and self.world.rank == 0 and "tickets" in state:  # before super() bumps `ready`
            for outer, ticket in zip(self.outers[1:], state["tickets"][1:]):
                outer.lock.reset(int(ticket))
        super().load_state_dict(state)
        if self.serves:
            return
        owners = [e if e is not None else c for e, c in zip(self.encoders, self.compressors)]
        if "error" in state and owners[0] is not None:
            for fr, owner in zip(self.fragments, owners):
                owner.error.copy_(state["error"][fr.start : fr.stop])
        for fr, s in zip(self.fragments, saved):
            self.land_in[fr.index] = s.get("land_in")
            self.unsent[fr.index] = int(s.get("unsent", 0))
            if "incoming" in s:
                self.incoming[fr.index].copy_(s["incoming"])
