"""``easgd`` and ``eamsgd``: elastic averaging SGD (Zhang, Choromanska and LeCun 2015).

Asynchronous form, over the box (``shm`` or ``rma``): every ``tau`` local steps a worker pulls the
center ``c``, computes ``d = alpha (x - c)``, moves ``x <- x - d`` and pushes ``c <- c + d``;
between exchanges it takes local steps ``x <- x - eta g`` (its own optimizer). The exchange runs
block by block over the flat replica (``CenterClient.elastic_``): about one pass over memory. On the
rma box's memory server (across nodes) it is one request a shard: ``x`` goes out, the server moves ``c``
under the shard's lock and answers ``x - c`` as each chunk lands, so no other push lands between the read
of ``c`` and its update, and the link's two directions carry the exchange together.
``compression`` encodes each push with error feedback, ``c <- c + alpha D(Q(x - c + err))`` while ``x`` moves
by the exact ``alpha (x - c)`` (``CenterClient.elastic_encoded_``): the rma box's memory server decodes the
codes, elsewhere the worker (``box_encoder``'s warning); the error is in each worker's checkpoint.

Synchronous form (``sync: true``), over collectives, no box: every ``tau`` steps
``c <- c + alpha sum_i (x_i - c)`` (one allreduce of ``x_i - c``) and ``x_i <- x_i - alpha (x_i - c)``;
every worker keeps its own identical copy of ``c``. With ``overlap`` the allreduce of exchange k runs
in the background and ``c`` takes its sum at exchange k + 1, just before ``c`` is next read: the same
arithmetic as without, only the wait moves (``compression`` encodes ``x_i - c``, error feedback).

``alpha`` is set directly (default 0.1) or through ``rho`` (``alpha = eta rho``). ``eamsgd`` replaces
the local optimizer by the paper's Nesterov momentum step ``v <- delta v - eta g(x + delta v);
x <- x + v`` (``eta`` = ``--lr``, ``delta`` = ``--momentum``). The result is the center weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from pydantic import Field, model_validator
from torch import nn

from parambox.box import Layout
from parambox.errors import UserError, warn
from parambox.numerics import is_finite
from parambox.strategies.asynchronous import AsyncOptions, AsyncStrategy
from parambox.strategies.base import Context, StepResult, Strategy, loss_value, period_end
from parambox.strategies.exchange import ExchangeOptions, SumExchange, box_encoder
from parambox.strategies.grads import GradViews, bind_flat_replica

DEFAULT_ALPHA = 0.1


class ElasticOptions(AsyncOptions):
    """The elastic exchange's period and moving rate (easgd, eamsgd; hybrid's leaders)."""

    tau: int = Field(4, ge=1, description="local steps between two elastic exchanges")
    alpha: float | None = Field(None, gt=0, lt=1, description="elastic moving rate (default 0.1)")
    rho: float | None = Field(None, gt=0, description="elasticity; sets alpha = lr * rho")

    @model_validator(mode="after")
    def _alpha_or_rho(self) -> ElasticOptions:
        if self.alpha is not None and self.rho is not None:
            raise ValueError("give alpha or rho (alpha = lr * rho), not both")
        return self

    def moving_rate(self, lr: float) -> float:
        """``alpha``: set directly, or ``lr * rho``, or 0.1."""
        if self.rho is None:
            return DEFAULT_ALPHA if self.alpha is None else self.alpha
        alpha = lr * self.rho
        if not 0 < alpha < 1:
            raise UserError(f"easgd: alpha = lr * rho = {lr} * {self.rho} = {alpha:g} must be in (0, 1)")
        return alpha


class EasgdOptions(ElasticOptions, ExchangeOptions):
    sync: bool = Field(False, description="synchronous form over collectives instead of the box")


class NesterovStep:
    """EAMSGD's local step on flat tensors: ``v <- delta v - eta g(x + delta v); x <- x + v``.

    ``lookahead_`` moves ``x`` to ``x + delta v`` before forward/backward; ``step_(g)`` then needs
    only the gradient there: ``v <- delta v - eta g`` and ``x <- (x + delta v) - eta g = x_old + v``.
    The group's ``weight_decay`` adds ``wd x`` to ``g`` (SGD's coupled decay, at the point where ``g``
    was taken), where ``decays`` is 1 (the trainable parameters; everywhere without it).

    >>> x = torch.zeros(2); s = NesterovStep(x, lr=0.1, delta=0.5)
    >>> s.lookahead_(); s.step_(torch.ones(2)); s.lookahead_(); s.step_(torch.ones(2)); x.tolist()
    [-0.25, -0.25]
    """

    def __init__(
        self,
        x: torch.Tensor,
        lr: float,
        delta: float,
        group: dict[str, Any] | None = None,
        decays: torch.Tensor | None = None,
    ):
        self.x, self.decays, self._delta = x, decays, delta
        # eta, delta and the weight decay are read at each step from ``group`` (the run's optimizer's
        # param group, where a schedule sets them: OneCycleLR cycles the momentum), or fixed
        self.group = group if group is not None else {"lr": lr}
        self.v = torch.zeros_like(x)

    @property
    def lr(self) -> float:
        return self.group["lr"]

    @property
    def delta(self) -> float:
        return self.group.get("momentum", self._delta)

    def lookahead_(self) -> None:
        self.x.add_(self.v, alpha=self.delta)

    def step_(self, g: torch.Tensor) -> None:
        wd = self.group.get("weight_decay", 0.0)
        if wd:
            g = g + wd * (self.x if self.decays is None else self.x * self.decays)
        self.v.mul_(self.delta).add_(g, alpha=-self.lr)
        self.x.add_(g, alpha=-self.lr)


def make_local_step(strategy: Strategy, nesterov: bool) -> tuple[NesterovStep | None, float]:
    """(local step, lr). EASGD: the run's optimizer (``strategy.optimizer``) and None; EAMSGD: the
    Nesterov step from the run's SGD settings (one lr, momentum and weight decay for every trainable
    parameter, all of them in the optimizer: a ``UserError`` naming what differs), no torch optimizer."""
    optimizer = strategy.ctx.make_optimizer(strategy.params)
    group = optimizer.param_groups[0]
    if not nesterov:
        strategy.optimizer = optimizer
        return None, group["lr"]
    if type(optimizer) is not torch.optim.SGD:
        raise UserError(
            f"eamsgd: its momentum step is SGD's, the optimizer is {_kind(optimizer)}: give it one torch.optim.SGD "
            "(parambox train: --optimizer sgd; --momentum sets delta)"
        )
    for key in ("lr", "momentum", "weight_decay", "dampening"):
        values = sorted({g[key] for g in optimizer.param_groups})
        if len(values) > 1:
            raise UserError(
                f"eamsgd: its Nesterov step takes one {key} for the whole model, and the optimizer's param "
                f"groups have {', '.join(f'{v:g}' for v in values)}: give them one, or use easgd, which "
                "steps the optimizer as it is"
            )
    if group["dampening"]:
        raise UserError("eamsgd: its Nesterov step has no dampening; give the SGD optimizer dampening=0")
    covered = {id(p) for g in optimizer.param_groups for p in g["params"]}
    trainable = [p for p in strategy.params if p.requires_grad]
    left_out = sum(id(p) not in covered for p in trainable)
    if left_out:
        raise UserError(
            f"eamsgd: its Nesterov step moves every trainable parameter, and the optimizer holds "
            f"{len(trainable) - left_out} of the model's {len(trainable)}: give it all of them, or freeze the "
            "others (requires_grad_(False))"
        )
    decays = None
    if len(trainable) < len(strategy.params):  # frozen parameters do not decay
        decays = torch.zeros_like(strategy.x)
        for p, view in zip(strategy.model.parameters(), strategy.layout.views(decays).values()):
            view.fill_(float(p.requires_grad))
    strategy.optimizer = None
    return NesterovStep(strategy.x, group["lr"], group["momentum"], group, decays), group["lr"]


def _kind(optimizer: torch.optim.Optimizer) -> str:
    """``Adam``, or for several (``DistributedOptimizer``'s list) ``[Muon, AdamW]``."""
    members = getattr(optimizer, "optimizers", None)
    if members is None:
        return type(optimizer).__name__
    return f"[{', '.join(type(o).__name__ for o in members)}]"


def sync_elastic_(
    x: torch.Tensor,
    c: torch.Tensor,
    buf: torch.Tensor,
    alpha: float,
    allreduce: Callable[[torch.Tensor], None],
    contribute: bool = True,
    flag: torch.Tensor | None = None,
) -> bool:
    """Synchronous EASGD exchange: ``c <- c + alpha sum_i (x_i - c)``, ``x <- x - alpha (x - c)``.

    ``buf[:n]`` carries ``x - c`` through ``allreduce`` (a sum over the workers; ``buf`` may hold
    more, e.g. flags). A worker that does not contribute, or whose ``x - c`` is not finite, sends
    zeros and sets ``flag`` to 1; returns whether it contributed.
    """
    d = buf[: x.numel()]
    torch.sub(x, c, out=d)
    contribute = contribute and is_finite(d)
    if contribute:
        x.sub_(d, alpha=alpha)
    else:
        d.zero_()
        if flag is not None:
            flag.fill_(1)
    allreduce(buf)
    c.add_(d, alpha=alpha)  # d is now sum_i (x_i - c)
    return contribute


class ElasticAveraging(AsyncStrategy):
    """Asynchronous EASGD over the box. ``parambox train --strategy easgd --set easgd.tau=4``"""

    name = "easgd"
    period_options = ("tau",)
    Options = EasgdOptions
    per_rank_state = ("error",)  # the error feedback a worker owes is its own
    nesterov: ClassVar[bool] = False

    @classmethod
    def resolve(cls, options: EasgdOptions) -> type[Strategy]:
        # ``sync: true`` is another strategy (collectives, no box, no loss tolerance).
        if not options.sync:
            return cls
        return SyncElasticMomentumAveraging if cls.nesterov else SyncElasticAveraging

    def __init__(self, ctx: Context, options: EasgdOptions):
        if options.overlap:
            raise UserError(
                f"{self.name}.overlap needs {self.name}.sync=true (the box exchange is not overlapped)"
            )
        super().__init__(ctx, options)
        self.local, lr = make_local_step(self, self.nesterov)
        self.alpha = options.moving_rate(lr)
        # ``compression``: each push ``alpha Q(e)`` encoded with error feedback; the rma memory server
        # decodes the codes, elsewhere the worker (``box_encoder``'s warning)
        warns = self.world.rank == 0
        self.encoder = box_encoder(
            self.name, options, self.box, self.numel, self.client.start, self.x.device, warns
        )
        self.e = torch.empty_like(self.x) if self.encoder is not None else None

    def begin_step(self, step: int) -> None:
        if self.local is not None:
            self.local.lookahead_()
        super().begin_step(step)

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        if self.guard(loss, step):
            if self.local is not None:
                self.local.step_(self.g)
            else:
                self.optimizer.step()
            if (step + 1) % self.options.tau == 0 and not self._elastic():
                self.halt("elastic update", step)
        return self.step_result(loss, samples)

    def _elastic(self) -> bool:
        """The elastic exchange; with compression ``c += alpha D(Q(e + err))`` (error feedback: ``err``
        keeps what the message left out) while ``x`` moves by the exact ``alpha e``."""
        if self.encoder is None:
            return self.client.elastic_(self.x, self.alpha)
        return self.client.elastic_encoded_(self.x, self.alpha, self.encoder, self.e)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.local is not None:
            state["velocity"] = self.local.v
        if self.encoder is not None:  # what this worker's pushes still owe: its own, not the run's
            state["error"] = self.encoder.error
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.local is not None and "velocity" in state:
            self.local.v.copy_(state["velocity"])
        if self.encoder is not None and "error" in state:
            self.encoder.error.copy_(state["error"])


class ElasticMomentumAveraging(ElasticAveraging):
    """EAMSGD: elastic averaging with a local Nesterov momentum step. ``--strategy eamsgd``"""

    name = "eamsgd"
    nesterov = True


class SyncElasticAveraging(Strategy):
    """Synchronous EASGD/EAMSGD over collectives (``--set easgd.sync=true``); every worker holds ``c``.

    A worker whose replica turns non-finite contributes zeros from then on (a flag per rank rides
    along in the allreduce), so ``c`` stays finite and the leader can name it in the summary.
    """

    name = "easgd"
    copies_the_weights = True  # the center
    period_options = ("tau",)
    Options = EasgdOptions
    tolerates_worker_loss = False  # an allreduce needs every worker
    survives_in_place = True  # without overlap
    nesterov: ClassVar[bool] = False

    def __init__(self, ctx: Context, options: EasgdOptions):
        super().__init__(ctx, options)
        nesterov = self.nesterov
        self.layout = Layout.from_model(self.model)
        self.params = list(self.model.parameters())
        self.numel, n = self.layout.numel, self.world.world_size
        self.x, self.g = bind_flat_replica(self.model, self.layout, ctx.world.device)
        self.grad_views = GradViews.of_flat(self.model, self.layout, self.g)
        self.c = self.x.clone()
        self.buf = torch.zeros(self.numel + n, device=self.x.device)  # x - c, then one flag per rank
        self.local, lr = make_local_step(self, nesterov)
        self.alpha = options.moving_rate(lr)
        self.sums = SumExchange(
            self.numel,
            n,
            n,
            options.compression,
            options.compression_block,
            self.x.device,
            lambda: self.collective("easgd elastic averaging"),
            ratio=options.compression_ratio,
        )
        self.halted, self.nonfinite = False, set()
        self.result: nn.Module | None = None  # the center as a model, made on the leader (eval_model)
        if self.survival.joining:  # a replacement: a survivor's replica, center and optimizer state
            self.survival.share_state()
            self.sums.compressor.forget_error_()  # the error it owes is its own: none yet

    def begin_step(self, step: int) -> None:
        self.survival.admit(step)  # after an exchange (next_exchange)
        if self.local is not None:
            self.local.lookahead_()
        self.g.zero_()
        self.grad_views.rebind_()

    def next_exchange(self, step: int) -> int:
        return period_end(step, self.options.tau)

    def settle_grads(self) -> None:
        self.grad_views.settle_()  # EAMSGD's local step reads g

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        if not (self.halted or loss is None or is_finite(loss)):
            self._halt("loss", step)
        if not self.halted:
            if self.local is not None:
                self.local.step_(self.g)
            else:
                self.optimizer.step()
        extra = {}
        if (step + 1) % self.options.tau == 0:
            self._exchange(step)
            extra["exchange_bytes"] = float(self.sums.bytes_sent)
        extra["exchange_wait_s"] = self.sums.pop_wait()
        if self.halted:
            extra["nonfinite"] = 1.0
        return StepResult(loss_value(loss), samples, self.timers.pop(), extra)

    def _exchange(self, step: int) -> None:
        self.step_now = step
        n, rank = self.world.world_size, self.world.rank
        flags = self.buf[self.numel :]
        with self.timers.phase("allreduce"):
            if self.options.overlap:
                self._apply_pending()
                e, contribute = self.buf[: self.numel], not self.halted
                torch.sub(self.x, self.c, out=e)
                contribute = contribute and is_finite(e)
                if contribute:
                    self.x.sub_(e, alpha=self.alpha)
                else:
                    e.zero_()
                flags.zero_()
                flags[rank] = 0.0 if contribute else 1.0
                self.sums.start(e, flags)
                ok = contribute
            else:
                flags.zero_()
                ok = sync_elastic_(
                    self.x, self.c, self.buf, self.alpha, self._allreduce, not self.halted, flags[rank]
                )
        if not ok and not self.halted:
            self._halt("elastic update", step)
        self.nonfinite.update(int(r) for r in flags[:n].nonzero().flatten())

    def _apply_pending(self) -> None:
        """``c <- c + alpha sum_i (x_i - c)`` of the exchange started one round ago."""
        if self.sums.pending:
            total, flags = self.sums.wait()
            self.c.add_(total, alpha=self.alpha)
            self.nonfinite.update(int(r) for r in flags.nonzero().flatten())

    def _allreduce(self, buf: torch.Tensor) -> None:
        """The sum over the workers of ``buf`` (``x - c``, then the flags), through the exchange's encoding.
        In a run that survives in place, a lost peer makes the survivors repeat it among themselves
        (each from the message it kept): the center then moves by the survivors' sum."""
        self.sums.start(buf[: self.numel], buf[self.numel :], keep=self.survival.group is not None)
        total, flags = self.exchange(self.sums.wait, self.step_now, self._sum_again)
        buf[: self.numel].copy_(total)
        buf[self.numel :].copy_(flags)

    def _sum_again(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept message summed over the survivors (after a lost peer)."""
        self.sums.redo()
        return self.sums.wait()

    def finish(self) -> None:
        with self.timers.phase("allreduce"):
            self._apply_pending()  # overlap: the last exchange's sum reaches c
        self.timers.pop()
        self.sums.pop_wait()

    def _halt(self, what: str, step: int) -> None:
        self.halted = True
        warn(f"rank {self.world.rank}: non-finite {what} at step {step}; it contributes nothing from now on")

    def eval_model(self) -> nn.Module | None:
        if not self.leads:
            return None
        if self.result is None:
            self.result = copy.deepcopy(self.model)
            self.layout.bind_params_(self.result, self.c)
        if self.result is not None:
            with torch.no_grad():
                for dst, src in zip(self.result.buffers(), self.model.buffers()):
                    dst.copy_(src)
        return self.result

    def summary_extra(self) -> dict[str, Any]:
        return {"nonfinite_workers": sorted(self.nonfinite)}

    def state_dict(self) -> dict[str, Any]:
        """The optimizer (EASGD) or the Nesterov velocity (EAMSGD), and the center: without it a resume
        or a group restart would pull every replica back toward the initial weights."""
        state = super().state_dict()
        state["center"] = self.c
        if self.local is not None:
            state["velocity"] = self.local.v
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "center" in state:
            self.c.copy_(state["center"])
        if self.local is not None and "velocity" in state:
            self.local.v.copy_(state["velocity"])

    def close(self) -> None:
        for p in self.params:
            p.grad = None


class SyncElasticMomentumAveraging(SyncElasticAveraging):
    """Synchronous EAMSGD (``--strategy eamsgd --set eamsgd.sync=true``)."""

    name = "eamsgd"
    nesterov = True
