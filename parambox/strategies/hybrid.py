"""``hybrid`` (ShmCaffe-H): synchronous SGD inside a group, asynchronous EASGD between the groups.

Workers are cut into groups of ``group_size`` consecutive ranks (default: the processes of one
node, ``local_world_size``). Inside a group every step is synchronous data parallelism: one
allreduce of the flat gradient over the group's own process group (``torch.distributed.new_group``),
then every member takes the same optimizer step, so the members' replicas stay identical. Every
``tau`` steps the group's leader (its first rank) runs the asynchronous EASGD exchange against the
center in the box (``CenterClient.elastic_``, shared with ``easgd``: ``d = alpha (x - c)``,
``x <- x - d``, ``c <- c + d``) and broadcasts the new replica inside its group. The groups
exchange nothing else: with ``--box rma`` they talk only through the MPI windows, as separate
nodes would.

Who opens the box: every rank (``open_box`` is collective over the run), because the asynchronous
machinery of ``AsyncStrategy`` counts every rank's steps in it (termination, lost workers, summary);
only the leaders move weights through it. Under ``rma`` the box's shards are spread over all ranks.

Because a group is synchronous, a dead member stalls its group: this strategy does not tolerate
worker loss (the launcher stops the run), and it supports only ``termination = "all"``. A
non-finite gradient is detected after the group's allreduce, where every member sees the same
values, so the whole group halts together and never pushes it.

Options: ``group_size``, and EASGD's ``tau`` (default 4), ``alpha`` (default 0.1) or ``rho``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from pydantic import Field, model_validator

from parambox.errors import UserError
from parambox.numerics import is_finite
from parambox.strategies.asynchronous import AsyncStrategy
from parambox.strategies.base import Context, Options, StepResult
from parambox.strategies.easgd import ElasticOptions, make_local_step


class HybridOptions(ElasticOptions):
    """EASGD's period and moving rate between the groups (no ``sync``, ``overlap`` or ``compression``:
    the leaders' exchange is the box's float32 elastic one)."""

    group_size: int | None = Field(
        None, ge=1, description="workers per synchronous group (default: the processes of a node)"
    )

    @model_validator(mode="after")
    def _asynchronous_between_groups(self) -> HybridOptions:
        if self.termination != "all":
            raise ValueError("hybrid supports termination 'all' only: the members of a group step together")
        return self


def build_groups(world_size: int, group_size: int) -> list[list[int]]:
    """Consecutive ranks in groups of ``group_size``; the first rank of each group leads it.

    >>> build_groups(4, 2)
    [[0, 1], [2, 3]]
    """
    if group_size > world_size or world_size % group_size:
        raise UserError(f"hybrid.group_size={group_size} must divide the number of workers ({world_size})")
    return [list(range(k, k + group_size)) for k in range(0, world_size, group_size)]


class Hybrid(AsyncStrategy):
    """Allreduce inside a group, EASGD between the groups' leaders through the box.

    >>> # parambox train --strategy hybrid --workers 4 --box rma --set hybrid.group_size=2
    """

    name = "hybrid"
    resizes = False  # its groups and their leaders are cut for the run's worker count
    period_options = ("tau",)
    Options = HybridOptions
    tolerates_worker_loss = False  # a group's allreduce needs all its members
    needs_process_group = True  # the groups' allreduce and broadcast
    box_name = "hybrid-center"
    rebuilds_center = False  # its ranks hold a group's model, not a whole replica of the center
    caches_center = False  # two levels by construction: a group's allreduce, then its leader's exchange

    @classmethod
    def check_workers(cls, n: int, options: Options | None = None) -> None:
        super().check_workers(n, options)
        group_size = (options or cls.Options()).group_size
        if group_size is not None:
            build_groups(n, group_size)  # a UserError unless the groups divide the workers

    def __init__(self, ctx: Context, options: HybridOptions):
        world = ctx.world
        self.groups = build_groups(world.world_size, options.group_size or world.local_world_size)
        super().__init__(ctx, options)
        self.members = next(g for g in self.groups if world.rank in g)
        self.leader = self.members[0]
        self.group = None
        if world.world_size > 1:
            with self.collective("hybrid group set-up"):
                # new_group is collective over the whole run: every rank creates every group, in order.
                made = [dist.new_group(g) for g in self.groups]
            self.group = made[self.groups.index(self.members)]
        self.local, lr = make_local_step(self, nesterov=False)  # the run's own optimizer
        self.alpha = options.moving_rate(lr)
        self.flag = torch.zeros(1, device=self.x.device)  # nccl broadcasts device tensors

    def end_step(self, loss: torch.Tensor | None, samples: int, step: int) -> StepResult:
        if len(self.members) > 1:
            with self.timers.phase("allreduce"), self.collective("hybrid gradient allreduce"):
                dist.all_reduce(self.g, group=self.group)
            self.g.div_(len(self.members))
        # After the allreduce every member holds the same gradient: the group decides as one.
        if not is_finite(self.g):
            self.halt("gradient", step)
        else:
            self.optimizer.step()
            if (step + 1) % self.options.tau == 0:
                self._exchange(step)
        return self.step_result(loss, samples)

    def _exchange(self, step: int) -> None:
        """The leader's elastic exchange with the center, then the leader's replica to its group."""
        ok = True
        if self.world.rank == self.leader:
            ok = self.client.elastic_(self.x, self.alpha)
        if len(self.members) > 1:
            self.flag.fill_(0.0 if ok else 1.0)
            with self.timers.phase("broadcast"), self.collective("hybrid broadcast in group"):
                dist.broadcast(self.flag, src=self.leader, group=self.group)
                dist.broadcast(self.x, src=self.leader, group=self.group)
            ok = not bool(self.flag)
        if not ok:
            self.halt("elastic update", step)
