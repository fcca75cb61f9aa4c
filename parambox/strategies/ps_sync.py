"""``ps-sync``: a synchronous parameter server on rank 0 (SHM-Learn-Dist §6).

Each step rank 0 gathers every worker's gradient, averages them, applies its optimizer and
broadcasts the new weights. The time of gather, average and broadcast is recorded per step
(the report's Figs. 6.4-6.6).

Each gathered gradient ends with one flag per parameter ("this rank computed its gradient"): a
parameter no rank computed a gradient for in a step has ``.grad = None`` on the server, so its
optimizer leaves it alone, as in one process. Frozen parameters are not exchanged. Buffers
(batch-norm statistics) are rank 0's, broadcast before each forward pass, as DDP does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from parambox.strategies.base import (
    Context,
    Options,
    StepResult,
    Strategy,
    loss_value,
    trainable,
)


class ParameterServerSync(Strategy):
    name = "ps-sync"
    comm_topology = "ps"  # perfmodel's: rank 0's link carries every gradient in and every copy out (pick)

    def __init__(self, ctx: Context, options: Options):
        super().__init__(ctx, options)
        self.params = trainable(self.model)
        self.flat = parameters_to_vector(self.params).detach()
        if self.world.world_size > 1:
            dist.broadcast(self.flat, src=0)
            vector_to_parameters(self.flat, self.params)
        if self.world.rank == 0:  # only the server holds an optimizer
            self.optimizer = ctx.make_optimizer(self.params)
            size = self.flat.numel() + len(self.params)  # gradients, then a flag per parameter
            self.inbox = [self.flat.new_empty(size) for _ in range(self.world.world_size)]

    def begin_step(self, step: int) -> None:
        for p in self.params:
            p.grad = None
        self.sync_buffers()

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        got = torch.tensor([p.grad is not None for p in self.params], dtype=self.flat.dtype)
        grad = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params]
            + [got.to(self.flat.device)]
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
                offset, got = 0, mean[self.flat.numel() :].tolist()
                for p, anyone in zip(self.params, got):  # no rank computed it: as in one process
                    p.grad = mean[offset : offset + p.numel()].view_as(p) if anyone else None
                    offset += p.numel()
            self.optimizer.step()
            self.flat = parameters_to_vector(self.params).detach()
        with self.timers.phase("broadcast"), self.collective("weight broadcast"):
            if self.world.world_size > 1:
                dist.broadcast(self.flat, src=0)
        if not server:
            vector_to_parameters(self.flat, self.params)
        return StepResult(loss_value(loss), samples, self.timers.pop())
