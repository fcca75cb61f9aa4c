"""``allreduce``: synchronous gradient averaging (SHM-Learn-Dist Eq. 2.1), DDP/Horovod style.

Gradients are bucketed in reverse parameter order (the order backward produces them) and each
bucket's allreduce starts as soon as its last gradient has been accumulated, overlapping
communication with the rest of backward. The parameters' ``.grad`` are views into the bucket
buffers, so no gradient is copied before or after communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from pydantic import Field

from parambox.strategies.base import Context, Options, StepResult, Strategy, loss_value


class AllReduceOptions(Options):
    bucket_mb: float = Field(25.0, gt=0, description="bucket size in MB")
    first_bucket_mb: float = Field(1.0, gt=0, description="a small first bucket starts communication early")


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
        offset = 0
        for p in params:
            p.grad = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready = 0
        self.work: dist.Work | None = None


def build_buckets(params: list[torch.nn.Parameter], bucket_mb: float, first_mb: float) -> list[_Bucket]:
    """Group parameters (in the order given) into buckets of about ``bucket_mb``; the first is smaller."""
    buckets, current, size = [], [], 0
    limit = first_mb * 2**20
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= limit:
            buckets.append(_Bucket(current))
            current, size, limit = [], 0, bucket_mb * 2**20
    if current:
        buckets.append(_Bucket(current))
    return buckets


class AllReduce(Strategy):
    name = "allreduce"
    Options = AllReduceOptions

    def __init__(self, ctx: Context, options: AllReduceOptions):
        super().__init__(ctx, options)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.distributed = self.world.world_size > 1 and dist.is_initialized()
        if self.distributed:
            for p in params:  # same start everywhere, whatever each rank's seed did
                dist.broadcast(p.data, src=0)
        self.buckets = build_buckets(list(reversed(params)), options.bucket_mb, options.first_bucket_mb)
        self._bucket_of = {}
        for b in self.buckets:
            for p in b.params:
                self._bucket_of[p] = b
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.optimizer = ctx.make_optimizer(params)

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        b = self._bucket_of[p]
        b.ready += 1
        if b.ready == len(b.params) and self.distributed:
            b.work = dist.all_reduce(b.buffer, async_op=True)

    def begin_step(self, step: int) -> None:
        for b in self.buckets:  # zero in place: .grad must stay views into the buckets
            b.buffer.zero_()
            b.ready, b.work = 0, None

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        if self.distributed:
            with self.timers.phase("allreduce_wait"), self.collective("gradient allreduce"):
                for b in self.buckets:
                    if b.work is None:  # parameters that got no gradient this step
                        b.work = dist.all_reduce(b.buffer, async_op=True)
                    b.work.wait()
                    b.buffer.div_(self.world.world_size)
        self.optimizer.step()
        for b in self.buckets:
            b.work = None  # a finished Work kept alive past destroy_process_group can abort the process
        return StepResult(loss_value(loss), samples, self.timers.pop())
