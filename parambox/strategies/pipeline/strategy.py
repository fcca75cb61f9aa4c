"""``pipeline``: the model cut into stages over ranks, the batch into micro-batches (GPipe, 1F1B).

Rank ``s`` holds stage ``s``: a contiguous run of the model's top-level children, cut by parameter
count (default), by measured forward + backward time, or at explicit ``split_points``. Each step
runs one schedule of ``torch.distributed.pipelining`` over the micro-batches: GPipe (all forwards,
then all backwards) or 1F1B (one forward, one backward in the steady state, fewer activations
alive). Each micro-batch's mean loss is weighted by its share of the batch, so the gradients are
exactly the full batch's mean gradient and the run follows ``single`` at the same batch size.

Per step, every rank records its stage's forward and backward compute time and the rest of the
step, the bubble (waiting for neighbours, sending, receiving); rank 0's metrics hold all stages'.
``eval_model`` gathers the stages onto rank 0's whole model, so checkpoints hold one state_dict with
the usual names whatever the number of stages.

A parameter that two stages hold (tied weights: a GPT's token embedding, which is also its output
layer) is one weight trained from both uses, as Megatron-LM trains its embedding across the first and
last stage: each of those stages holds a copy, the copies start equal (broadcast from the first
holder), and after each backward the stages that hold it add up their gradients of it (one allreduce
among them), so every copy takes the same step with the whole gradient and they stay equal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from parambox.errors import UserError
from parambox.strategies.base import Context, Options, PhaseTimers, StepResult, Strategy
from parambox.strategies.pipeline import stages, tracing
from parambox.strategies.tensors import batch_size

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class PipelineOptions(Options):
    num_microbatches: int = Field(4, ge=1, description="micro-batches per batch (must divide the batch)")
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    balance: Literal["params", "time"] = Field(
        "params", description="cut by parameter count, or by forward+backward time measured on rank 0"
    )
    split_points: list[int] | None = Field(
        None, description="child index each stage after the first starts at; overrides balance"
    )
    split_at: list[str] | None = Field(
        None,
        description="module names each stage after the first begins at, for any model (traced by "
        "torch.distributed.pipelining; an nn.Sequential is cut by child index without it)",
    )


@dataclass(frozen=True)
class PipelineLayout:
    """Which stage of which pipeline this rank runs; ranks of one pipeline are consecutive."""

    num_stages: int
    stage: int
    group: int = 0
    num_groups: int = 1

    def rank_of(self, group: int, stage: int) -> int:
        return group * self.num_stages + stage


class TimedStage(PipelineStage):
    """A ``PipelineStage`` that adds up its compute time in the phases ``forward`` and ``backward``."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.compute = PhaseTimers()

    def forward_one_chunk(self, *args: Any, **kwargs: Any):
        with self.compute.phase("forward"):
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any):
        with self.compute.phase("backward"):
            return super().backward_one_chunk(*args, **kwargs)


class _Returns:
    """A stand-in model whose output is the stage output computed already: ``_Returns(out)(x) is out``."""

    def __init__(self, out: torch.Tensor):
        self.out = out

    def __call__(self, *_: Any) -> torch.Tensor:
        return self.out


class Pipeline(Strategy):
    """GPipe / 1F1B over all ranks, one stage each.

    >>> # parambox train --strategy pipeline --workers 2 --model lenet \\
    >>> #     --set pipeline.num_microbatches=4 --set pipeline.schedule=gpipe
    """

    name = "pipeline"
    resizes = False  # each rank's state is its stage's, cut for the run's worker count
    owns_forward_backward = True  # the schedule runs forward and backward stage by stage
    Options = PipelineOptions
    min_workers = 2  # one stage per rank
    # --batch-size is a pipeline's batch: the default run's global batch (2 workers x 32), as single
    # takes it. At 32 a default run saw half the samples per step of a data-parallel one: 3 of 10
    # default digits runs (pipeline and pipeline-dp alike) ended at 0.936-0.950; at 64, 0.961-0.981.
    default_run = {"batch_size": 64}

    def __init__(self, ctx: Context, options: PipelineOptions):
        super().__init__(ctx, options)
        if not dist.is_initialized():
            raise UserError(f"strategy {self.name!r} cuts the model over ranks: it needs torch.distributed")
        self.layout = self.make_layout()
        self.traced = options.split_at is not None or not isinstance(self.model, nn.Sequential)
        if self.traced:
            tracing.check_split_at(self.name, self.model, options, self.layout.num_stages)
        elif self.layout.num_stages > len(self.model):
            raise UserError(
                f"{self.layout.num_stages} pipeline stages but the model has only {len(self.model)} layers"
            )
        if options.schedule == "1f1b" and options.num_microbatches < self.layout.num_stages:
            raise UserError(
                f"{self.name}.num_microbatches={options.num_microbatches}: schedule 1f1b needs at least "
                f"one micro-batch per stage ({self.layout.num_stages})"
            )
        self.pp_group: dist.ProcessGroup | None = None  # None: the default group
        self.make_groups()
        # parameters several stages hold (make_shared_groups): (this rank's copy, group, first holder)
        self.shared: list[tuple[nn.Parameter, dist.ProcessGroup, int]] = []
        self.shared_names: list[str] = []
        self.split_points: list[int] | None = None
        self.schedule = None
        self._pending_optimizer: dict | None = None
        self._batch_size = 0
        self.stage_keys: list[list[str]] = []  # the whole model's state_dict names of each stage
        if self.traced:
            return  # traced at the first step, on a micro-batch of its input
        n, num_stages = len(self.model), self.layout.num_stages
        if options.split_points is not None:
            self.build(stages.check_split(options.split_points, n, num_stages))
        elif options.balance == "params":
            self.build(stages.balanced_split(stages.parameter_costs(self.model), num_stages))
        # balance == "time": cut at the first step, when there is an input to time the layers on

    # -- hooks for pipeline-dp ------------------------------------------------------------------
    def make_layout(self) -> PipelineLayout:
        return PipelineLayout(self.world.world_size, self.world.rank)

    def make_groups(self) -> None:
        """Process groups beyond the default one (pipeline-dp)."""

    def average_gradients(self) -> None:
        """Average this stage's gradients (and the loss riding with them) across pipelines."""

    def data_partition(self) -> tuple[int, int]:
        return self.layout.group, self.layout.num_groups

    def after_build(self) -> None:
        """Once the stage is built (pipeline-dp: equal stage weights across pipelines)."""

    # -- building the stage ---------------------------------------------------------------------
    def build(self, split_points: list[int]) -> None:
        """Cut an ``nn.Sequential`` at child indices: stage ``s`` is a run of children."""
        layout = self.layout
        self.split_points = list(split_points)
        bounds = stages.stage_bounds(self.split_points, len(self.model))
        shared = stages.shared_parameters(self.model, bounds)
        self.make_shared_groups([(dict.fromkeys(held_by, name), self.model) for name, held_by in shared])
        self.stage_keys = [stages.stage_state_keys(self.model, b) for b in bounds]
        self.stage_mod = stages.stage_module(self.model, bounds[layout.stage])
        stage = TimedStage(
            self.stage_mod, layout.stage, layout.num_stages, self.world.device, group=self.pp_group
        )
        self.install(stage)

    def make_shared_groups(self, shared: list[tuple[dict[int, str], nn.Module]]) -> None:
        """For each parameter several stages hold (its name in each holder's module, and this rank's
        module that names it), a process group of the ranks that hold it in this rank's pipeline:
        every rank creates every group, in one order, as ``new_group`` requires."""
        layout = self.layout
        self.shared = []  # (this rank's copy, its holders' group, the first holder's rank)
        self.shared_names = [names[min(names)] for names, _ in shared]
        with self.collective("pipeline shared-weight groups"):
            for names, module in shared:
                held_by = sorted(names)
                for g in range(layout.num_groups):
                    ranks = [layout.rank_of(g, s) for s in held_by]
                    pg = dist.new_group(ranks)
                    if g == layout.group and layout.stage in held_by:
                        self.shared.append((module.get_parameter(names[layout.stage]), pg, ranks[0]))

    def sum_shared_gradients(self) -> None:
        """A shared parameter's gradient from each of its stages, added up in every copy."""
        for p, pg, _ in self.shared:
            with self.timers.phase("shared_allreduce"), self.collective("pipeline shared-weight allreduce"):
                dist.all_reduce(p.grad, group=pg)

    def build_traced(self, x: torch.Tensor) -> None:
        """Cut any model at the module names ``split_at``, traced on one micro-batch of ``x``."""
        probe = x[: max(1, len(x) // self.options.num_microbatches)]
        pipe = tracing.trace(self.name, self.model, self.options.split_at or [], probe)
        self.stage_keys = [list(pipe.get_stage_module(s).state_dict()) for s in range(pipe.num_stages)]
        self.stage_mod = pipe.get_stage_module(self.layout.stage)
        # torch names each holder by its submodule ("submod_pp_1"), its stage index last
        held = [{int(k.rsplit("_", 1)[-1]): v for k, v in names.items()} for names in pipe.replicated_params]
        self.make_shared_groups([(names, self.stage_mod) for names in held])
        stage = pipe.build_stage(self.layout.stage, self.world.device, group=self.pp_group)
        self.install(tracing.timed(stage))

    def install(self, stage: Any) -> None:
        """Gradient buffer, schedule and optimizer around this rank's built ``stage``."""
        opts = self.options
        self.params = [p for p in self.stage_mod.parameters() if p.requires_grad]
        # One flat buffer holds the gradients (the .grad are views into it) and, last, the loss, so
        # pipeline-dp averages both in one allreduce.
        self.grad_buffer = torch.zeros(sum(p.numel() for p in self.params) + 1, device=self.world.device)
        offset = 0
        for p in self.params:
            p.grad = self.grad_buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.stage = stage
        self.schedule = SCHEDULES[opts.schedule](
            self.stage, opts.num_microbatches, loss_fn=self._microbatch_loss, scale_grads=False
        )
        self.optimizer = self.ctx.make_optimizer(self.params) if self.params else None
        if self._pending_optimizer is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(self._pending_optimizer)
        self._pending_optimizer = None
        self.after_build()
        for p, pg, first in self.shared:  # one start for every copy, whatever each rank's seed did
            with self.collective("pipeline shared-weight broadcast"):
                dist.broadcast(p.data, src=first, group=pg)

    def _timed_split(self, x: torch.Tensor) -> list[int]:
        """Rank 0 times each layer on one micro-batch and cuts; every rank gets its cut."""
        num_stages = self.layout.num_stages
        points = torch.zeros(num_stages - 1, dtype=torch.long, device=self.world.device)
        if self.world.rank == 0:
            probe = x[: max(1, len(x) // self.options.num_microbatches)]
            cut = stages.balanced_split(stages.measured_costs(self.model, probe), num_stages)
            points = torch.tensor(cut, device=self.world.device)
        if self.world.world_size > 1:
            with self.collective("pipeline balance"):
                dist.broadcast(points, src=0)
        return [int(p) for p in points]

    def _microbatch_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The user's loss(model, (x, y)) on the last stage's output: a stand-in model returns it, so
        # any loss of the form f(model(x), y) works. Weighted by the micro-batch's share of the batch:
        # the sum over micro-batches is the batch's mean loss, its gradient the batch's mean gradient.
        return self.ctx.loss_fn(_Returns(out), (None, y)) * (len(y) / self._batch_size)

    # -- the step -------------------------------------------------------------------------------
    def step(self, batch: Any, step: int) -> StepResult:
        if not (isinstance(batch, tuple | list) and len(batch) == 2):
            parts = f"{len(batch)} parts" if isinstance(batch, tuple | list) else f"a {type(batch).__name__}"
            raise UserError(
                f"{self.name} takes batches of (inputs, target): the inputs enter the first stage, the "
                f"target meets your loss at the last (a loss of the form f(model(x), y)); this batch is {parts}"
            )
        x, y = batch  # a pipeline needs (inputs, target): inputs enter stage 0, target meets the last
        if self.schedule is None:
            self.build_traced(x) if self.traced else self.build(self._timed_split(x))
        self._check_batch(batch_size(batch))
        layout, stage = self.layout, self.stage
        self._batch_size = batch_size(batch)
        self.grad_buffer.zero_()  # in place: the .grad stay views into it
        stage.compute.pop()
        losses: list[torch.Tensor] = []
        t0 = time.perf_counter()
        with self.collective("pipeline schedule"):
            self.schedule.step(
                *((x,) if stage.is_first else ()),
                target=y if stage.is_last else None,
                losses=losses if stage.is_last else None,
                return_outputs=False,
            )
        compute = stage.compute.pop()
        forward_s, backward_s = compute.get("forward", 0.0), compute.get("backward", 0.0)
        bubble = time.perf_counter() - t0 - forward_s - backward_s
        if stage.is_last:
            self.grad_buffer[-1] = sum(float(v.detach()) for v in losses)
        self.sum_shared_gradients()
        self.average_gradients()
        stats = self._share_stats([forward_s, backward_s, bubble])
        if self.optimizer is not None:
            self.optimizer.step()
        comm = {"bubble": bubble, **self.timers.pop()}
        samples = self._batch_size if layout.stage == 0 else 0  # the batch enters once, at stage 0
        return StepResult(stats.pop("loss"), samples, comm, {"stage": float(layout.stage), **stats})

    def _check_batch(self, batch_size: int) -> None:
        m = self.options.num_microbatches
        if batch_size % m:
            raise UserError(
                f"{self.name}.num_microbatches={m} must divide the batch size {batch_size} "
                "(--batch-size is the pipeline's batch)"
            )

    def _share_stats(self, times: list[float]) -> dict[str, float]:
        """One small allreduce in the pipeline: every stage's (forward, backward, bubble) seconds and
        the last stage's loss."""
        num_stages, s = self.layout.num_stages, self.layout.stage
        stats = torch.zeros(3 * num_stages + 1, device=self.world.device)
        stats[3 * s : 3 * s + 3] = torch.tensor(times)
        if self.stage.is_last:
            stats[-1] = self.grad_buffer[-1]
        if num_stages > 1:
            with self.timers.phase("stats_allreduce"), self.collective("pipeline stats"):
                dist.all_reduce(stats, group=self.pp_group)
        values = stats.tolist()
        out = {"loss": values[-1]}
        for j in range(num_stages):
            for i, name in enumerate(("forward_s", "backward_s", "bubble_s")):
                out[f"stage{j}_{name}"] = values[3 * j + i]
        return out

    # -- results and checkpoints ----------------------------------------------------------------
    def eval_model(self) -> nn.Module | None:
        """Pipeline 0's stages send their weights into rank 0's whole model. Collective in pipeline 0."""
        layout = self.layout
        if self.schedule is None or layout.group != 0:
            return self.model if self.world.rank == 0 else None
        state = self.model.state_dict()  # detached views: receiving into them updates the model
        # A traced stage names its tensors as the model does, and holds a copy of a weight that it shares
        # with another stage (pipe.replicated_params): the stage's own values are the trained ones.
        mine = self.stage_mod.state_dict() if self.traced else state
        if self.world.rank == 0 and self.traced:
            for key in self.stage_keys[0]:
                if mine[key].data_ptr() != state[key].data_ptr():
                    state[key].copy_(mine[key])
        with self.collective("gather stages to rank 0"):
            for s in range(1, layout.num_stages):
                for key in self.stage_keys[s]:
                    if self.world.rank == 0:
                        dist.recv(state[key], src=layout.rank_of(0, s))
                    elif layout.stage == s:
                        dist.send(mine[key].contiguous(), dst=0)
        return self.model if self.world.rank == 0 else None

    def summary_extra(self) -> dict[str, Any]:
        opts = self.options
        return {
            "pipeline": {
                "num_stages": self.layout.num_stages,
                "num_pipelines": self.layout.num_groups,
                "split_points": self.split_points,
                "split_at": self.options.split_at,
                "schedule": opts.schedule,
                "num_microbatches": opts.num_microbatches,
                "shared_parameters": self.shared_names,
            }
        }

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"split_points": self.split_points}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # This rank's replica holds its own stage's weights; the cut must be the one they came from.
        points = state.get("split_points")
        self._pending_optimizer = state.get("optimizer")
        if self.schedule is None and points is not None and not self.traced:
            self.build(points)
        elif points is not None and points != self.split_points:
            raise UserError(
                f"the checkpoint's pipeline was cut at {points}, this run cuts at {self.split_points}; "
                "resume with the same split_points / balance"
            )
        elif self.optimizer is not None and self._pending_optimizer is not None:
            self.optimizer.load_state_dict(self._pending_optimizer)
            self._pending_optimizer = None
