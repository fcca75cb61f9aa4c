"""``weight-avg``: each worker applies its own update; weights are averaged every ``period`` steps.

Period 1 is SHM-Learn-Dist Eq. 2.2 (with plain SGD it equals gradient averaging); longer periods
are local SGD / post-local SGD. Optimizer state stays local to each worker.

Floating-point buffers (batch-norm running statistics) are averaged with the weights, in the same
allreduce: they are part of each replica's model, estimated from that worker's data. Integer buffers
(batch-norm's step counter) advance alike on every worker and are left alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from pydantic import Field
from torch.nn.utils import parameters_to_vector

from parambox.strategies.base import Context, Options, StepResult, Strategy, loss_value, trainable


class WeightAvgOptions(Options):
    period: int = Field(1, ge=1, description="average the weights every `period` steps")


class WeightAveraging(Strategy):
    name = "weight-avg"
    period_options = ("period",)
    Options = WeightAvgOptions
    survives_in_place = True

    def __init__(self, ctx: Context, options: WeightAvgOptions):
        super().__init__(ctx, options)
        self.params = trainable(self.model)
        self.buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        self.optimizer = ctx.make_optimizer(self.params)
        if self.joining:
            self.share_state()  # a replacement: a survivor's weights and optimizer state
        else:
            self._average(-1)

    def _average(self, step: int) -> None:
        if self.world.world_size == 1:
            return
        tensors = self.params + self.buffers

        def average() -> None:
            flat = parameters_to_vector(tensors).detach()  # a copy: a failed allreduce leaves the weights
            with self.timers.phase("allreduce"), self.collective("weight averaging"):
                dist.all_reduce(flat)
            flat.div_(self.group_size)
            with torch.no_grad():
                for t, mean in zip(tensors, torch.split(flat, [t.numel() for t in tensors])):
                    t.copy_(mean.view_as(t))

        self.exchange(average, step)  # survives in place: the survivors average their own weights

    def begin_step(self, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.admit_replacements(step)

    def next_exchange(self, step: int) -> int:
        period = self.options.period
        return step + (period - 1 - step % period)  # the first a >= step with (a + 1) % period == 0

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        self.optimizer.step()
        if (step + 1) % self.options.period == 0:
            self._average(step)
        return StepResult(loss_value(loss), samples, self.timers.pop())

    def finish(self) -> None:
        # The result is the average of the replicas, also when the run did not end on a period.
        self._average(self.ctx.steps)
        self.timers.pop()
