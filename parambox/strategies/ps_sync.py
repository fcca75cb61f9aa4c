"""``ps-sync``: a synchronous parameter server on rank 0 (SHM-Learn-Dist §6).

Each step rank 0 gathers every worker's gradient, averages them, applies its optimizer and
broadcasts the new weights. The time of gather, average and broadcast is recorded per step
(the report's Figs. 6.4-6.6).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from parambox.strategies.base import Context, Options, StepResult, Strategy, loss_value


class ParameterServerSync(Strategy):
    name = "ps-sync"

    def __init__(self, ctx: Context, options: Options):
        super().__init__(ctx, options)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.flat = parameters_to_vector(self.params).detach()
        if self.world.world_size > 1:
            dist.broadcast(self.flat, src=0)
            vector_to_parameters(self.flat, self.params)
        if self.world.rank == 0:  # only the server holds an optimizer
            self.optimizer = ctx.make_optimizer(self.params)
            self.inbox = [torch.empty_like(self.flat) for _ in range(self.world.world_size)]

    def begin_step(self, step: int) -> None:
        for p in self.params:
            p.grad = None

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        grad = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params]
        )
        server = self.world.rank == 0
        with self.timers.phase("gather"), self.collective("gradient gather"):
            if self.world.world_size > 1:
                dist.gather(grad, self.inbox if server else None, dst=0)
            else:  # one worker (a scaling study's baseline): no process group, the server is the worker
                self.inbox[0] = grad
        if server:
            with self.timers.phase("average"):
                mean = torch.stack(self.inbox).mean(dim=0)
                offset = 0
                for p in self.params:
                    p.grad = mean[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
            self.optimizer.step()
            self.flat = parameters_to_vector(self.params).detach()
        with self.timers.phase("broadcast"), self.collective("weight broadcast"):
            if self.world.world_size > 1:
                dist.broadcast(self.flat, src=0)
        if not server:
            vector_to_parameters(self.flat, self.params)
        return StepResult(loss_value(loss), samples, self.timers.pop())
