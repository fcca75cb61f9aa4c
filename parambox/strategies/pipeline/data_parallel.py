"""``pipeline-dp``: pipelines inside a machine, data parallel between them (Lerat et al., Fig. 1).

The ranks form ``world_size / num_stages`` pipelines of ``num_stages`` consecutive ranks (so a
pipeline stays on one node when the node's rank count is a multiple of ``num_stages``). Each
pipeline trains on its own shard of the global batch (``--batch-size`` is per pipeline); after
the pipeline's backward, each stage's gradients are averaged over the pipelines with one allreduce
among the ranks that hold that stage, so every pipeline applies the same update. With plain SGD, G
pipelines at batch b follow ``single`` at batch G*b.
"""

from __future__ import annotations

import torch.distributed as dist
from pydantic import Field

from parambox.errors import UserError
from parambox.strategies.base import Options
from parambox.strategies.pipeline.strategy import Pipeline, PipelineLayout, PipelineOptions


class PipelineDPOptions(PipelineOptions):
    num_stages: int = Field(2, ge=1, description="ranks per pipeline; the world size must be a multiple")


class PipelineDataParallel(Pipeline):
    """Pipelines of ``num_stages`` ranks, stage gradients averaged across pipelines.

    >>> # parambox train --strategy pipeline-dp --workers 4 --set pipeline-dp.num_stages=2
    """

    name = "pipeline-dp"
    Options = PipelineDPOptions

    @classmethod
    def check_workers(cls, n: int, options: Options | None = None) -> None:
        super().check_workers(n, options)
        num_stages = (options or cls.Options()).num_stages
        if n % num_stages:
            raise UserError(f"pipeline-dp.num_stages={num_stages} must divide the number of workers ({n})")

    def make_layout(self) -> PipelineLayout:
        num_stages, world_size, rank = self.options.num_stages, self.world.world_size, self.world.rank
        return PipelineLayout(num_stages, rank % num_stages, rank // num_stages, world_size // num_stages)

    def make_groups(self) -> None:
        layout = self.layout
        self.dp_group = None
        if layout.num_groups == 1:
            return
        # Every rank creates every group, in the same order, as new_group requires.
        for g in range(layout.num_groups):
            pg = dist.new_group([layout.rank_of(g, s) for s in range(layout.num_stages)])
            if g == layout.group:
                self.pp_group = pg
        for s in range(layout.num_stages):
            pg = dist.new_group([layout.rank_of(g, s) for g in range(layout.num_groups)])
            if s == layout.stage:
                self.dp_group = pg

    def after_build(self) -> None:
        if self.dp_group is not None:  # same start in every pipeline, whatever each rank's seed did
            with self.collective("stage weight broadcast"):
                for p in self.params:
                    dist.broadcast(p.data, src=self.layout.rank_of(0, self.layout.stage), group=self.dp_group)

    def average_gradients(self) -> None:
        if self.dp_group is None:
            return
        with self.timers.phase("stage_allreduce"), self.collective("stage gradient allreduce"):
            dist.all_reduce(self.grad_buffer, group=self.dp_group)
        self.grad_buffer.div_(self.layout.num_groups)
