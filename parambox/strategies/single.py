"""``single``: one process, the baseline every other strategy is measured against."""

from __future__ import annotations

import torch

from parambox.strategies.base import Context, Options, StepResult, Strategy, loss_value


class Single(Strategy):
    name = "single"
    float32_weights = False  # the parameters as they are
    max_workers = 1
    # The global batch of the default run (2 workers x 32), so that the baseline sees the samples of
    # each step of a default data-parallel run (the same ones: data/base.py's sampler). At 32 it saw
    # half of them: 3 of 10 default digits runs ended at 0.941-0.947; at 64, 0.961-0.981.
    default_run = {"batch_size": 64}

    def __init__(self, ctx: Context, options: Options):
        super().__init__(ctx, options)
        self.optimizer = ctx.make_optimizer(self.model.parameters())

    def begin_step(self, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        self.optimizer.step()
        return StepResult(loss_value(loss), samples)
