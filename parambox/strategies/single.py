"""``single``: one process, the baseline every other strategy is measured against."""

from __future__ import annotations

from typing import Any

from parambox.strategies.base import Context, Options, StepResult, Strategy, batch_size, forward_backward


class Single(Strategy):
    name = "single"
    max_workers = 1

    def __init__(self, ctx: Context, options: Options):
        super().__init__(ctx, options)
        self.optimizer = ctx.make_optimizer(self.model.parameters())

    def step(self, batch: Any, step: int) -> StepResult:
        self.optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(self.model, self.ctx.loss_fn, batch)
        self.optimizer.step()
        return StepResult(loss.item(), batch_size(batch))
