"""``weight-avg``: each worker applies its own update; weights are averaged every ``period`` steps.

Period 1 is SHM-Learn-Dist Eq. 2.2 (with plain SGD it equals gradient averaging); longer periods
are local SGD / post-local SGD. Optimizer state stays local to each worker.

With ``overlap`` or ``compression`` the exchange is of each round's progress (``DeltaAverager``:
``theta <- theta - mean delta``, which is the mean of the replicas), in the background and applied
one round late with ``overlap``; without either, the weights themselves are averaged as before.

Floating-point buffers (batch-norm running statistics) are averaged with the weights, in the same
allreduce: they are part of each replica's model, estimated from that worker's data. Integer buffers
(batch-norm's step counter) advance alike on every worker and are left alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from pydantic import Field

from parambox.strategies.base import Context, StepResult, Strategy, averaged_buffers, loss_value, period_end
from parambox.strategies.exchange import DeltaAverager, ExchangeOptions, SumExchange
from parambox.strategies.tensors import flatten, trainable


class WeightAvgOptions(ExchangeOptions):
    period: int = Field(1, ge=1, description="average the weights every `period` steps")


class WeightAveraging(Strategy):
    name = "weight-avg"
    float32_weights = False  # the parameters as they are
    period_options = ("period",)
    Options = WeightAvgOptions
    survives_in_place = True
    per_rank_state = ("averager.error",)  # the error feedback a rank owes is its own

    def __init__(self, ctx: Context, options: WeightAvgOptions):
        super().__init__(ctx, options)
        self.params = trainable(self.model)
        self.buffers = averaged_buffers(self.model)
        self.optimizer = ctx.make_optimizer(self.params)
        self.averager: DeltaAverager | None = None
        if self.survival.joining:
            self.survival.share_state()  # a replacement: a survivor's weights and optimizer state
        else:
            self._average(-1)
        if options.overlap or options.compression != "none":
            flat = flatten(self.params + self.buffers).detach().clone()
            n = self.world.world_size
            exchange = SumExchange(
                flat.numel(),
                n,
                n,
                options.compression,
                options.compression_block,
                flat.device,
                lambda: self.collective("weight averaging"),
                ratio=options.compression_ratio,
            )
            self.averager = DeltaAverager(flat, flat.sub_, exchange, options.overlap, self.world.rank)
            if self.survival.joining:
                exchange.compressor.forget_error_()  # the error it owes is its own: none yet

    def _average(self, step: int) -> None:
        if self.world.world_size == 1:
            return
        tensors = self.params + self.buffers

        def average() -> None:
            flat = flatten(tensors).detach()  # a copy: a failed allreduce leaves the weights
            with self.timers.phase("allreduce"), self.collective("weight averaging"):
                dist.all_reduce(flat, async_op=True).wait()  # (nccl: see ElasticGroup._init)
            flat.div_(self.survival.group_size)
            with torch.no_grad():
                for t, mean in zip(tensors, torch.split(flat, [t.numel() for t in tensors])):
                    t.copy_(mean.view_as(t))

        self.exchange(average, step)  # survives in place: the survivors average their own weights

    def begin_step(self, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.survival.admit(step)

    def next_exchange(self, step: int) -> int:
        return period_end(step, self.options.period)

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        self.optimizer.step()
        extra: dict[str, float] = {}
        if (step + 1) % self.options.period == 0:
            if self.averager is None:
                self._average(step)
                extra["exchange_bytes"] = 4.0 * sum(t.numel() for t in self.params + self.buffers)
            else:
                self._round_end(step)
                extra["exchange_bytes"] = float(self.averager.exchange.bytes_sent)
        extra["exchange_wait_s"] = self._waited()
        return StepResult(loss_value(loss), samples, self.timers.pop(), extra)

    def _round_end(self, step: int) -> None:
        """The round's progress exchanged (compressed, or overlapped). In a run that survives in place a lost
        peer makes the survivors repeat it among themselves (``redo_``), as the plain average does."""
        local = self.averager.flatten_(self.params + self.buffers)
        keep = self.survival.group is not None
        with self.timers.phase("allreduce"):
            x_next = self.exchange(
                lambda: self.averager.round_end_(local, keep=keep), step, self.averager.redo_
            )
        self._copy_in(x_next)

    def _copy_in(self, flat: torch.Tensor) -> None:
        tensors = self.params + self.buffers
        with torch.no_grad():
            for t, value in zip(tensors, torch.split(flat, [t.numel() for t in tensors])):
                t.copy_(value.view_as(t))

    def _waited(self) -> float:
        if self.averager is not None:
            return self.averager.exchange.pop_wait()
        return self.timers.seconds.get("allreduce", 0.0)  # a blocking allreduce is all wait

    def finish(self) -> None:
        # The result is the average of the replicas, also when the run did not end on a period.
        if self.averager is None:
            self._average(self.ctx.steps)
        else:
            self._round_end(self.ctx.steps)  # the last (partial) round, then what is still pending
            with self.timers.phase("allreduce"):
                self.averager.flush_()
            self._copy_in(self.averager.theta)
        self.timers.pop()

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.averager is not None:
            state["averager"] = self.averager.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.averager is not None:
            self.averager.load_state_dict(state.get("averager", {}))
