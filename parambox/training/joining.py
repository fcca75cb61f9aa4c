"""Workers that join a running synchronous run (``workers = "MIN:MAX"``): each rank's slice of the global
batch, and the ``resize`` line ``metrics.jsonl`` gets where the group grows.

The run's rule (``resize``) says what the global batch does as workers join:

- ``keep-global-batch`` (the default): the global batch stays ``batch_size x workers``; the members of
  each step cut it in equal slices (their group ranks in order), cut again at each join. Every count
  of workers from MIN to MAX must divide it (checked before the run starts).
- ``scale-batch``: each worker keeps ``batch_size``, its slice of the launch's ``workers`` slices; the
  global batch is ``batch_size x`` the members (a slice whose rank has not joined goes untrained, as a
  lost rank's does).

The learning rate stays the run's under both. A rank lost in place leaves the cut as it is (its slice
goes untrained) until the next join.

>>> from types import SimpleNamespace as NS
>>> cfg = NS(batch_size=4, workers=3, start_workers=2, resize="keep-global-batch")
>>> cut(cfg, rank=2, world_size=3, group_rank=1, group_size=2)
(1, 2, 6)
>>> cut(NS(batch_size=4, workers=3, start_workers=2, resize="scale-batch"), 2, 3, 1, 2)
(2, 3, 4)
"""

from __future__ import annotations

from typing import Any

from parambox.errors import UserError


def cut(cfg: Any, rank: int, world_size: int, group_rank: int, group_size: int) -> tuple[int, int, int]:
    """(slice, slices, this rank's batch) of the global batch for a member of a group of ``group_size``."""
    if cfg.start_workers is None or cfg.resize == "scale-batch":
        return rank, world_size, cfg.batch_size
    return group_rank, group_size, cfg.batch_size * cfg.workers // group_size


def check_cuts(cfg: Any) -> None:
    """A ``UserError`` before the run where a count of workers from MIN to MAX cannot cut the global batch
    in equal slices (``keep-global-batch``)."""
    if cfg.start_workers is None or cfg.resize != "keep-global-batch":
        return
    total = cfg.batch_size * cfg.workers
    odd = [n for n in range(cfg.start_workers, cfg.workers + 1) if total % n]
    if odd:
        raise UserError(
            f"workers {cfg.start_workers}:{cfg.workers} with resize=keep-global-batch: the global batch "
            f"{total} (batch_size x workers) does not split evenly over {odd[0]} workers; choose a "
            "batch_size it does, or resize=scale-batch"
        )


class Joins:
    """One rank's view of its group's size, step by step: re-cuts its data where the group grew, and
    says so in ``metrics.jsonl`` on the leader."""

    def __init__(self, cfg: Any, strategy: Any):
        self.cfg, self.strategy = cfg, strategy
        group = strategy.survival.group
        self.size = group.group_size if group is not None else None

    def follow(self, step: int, batches: Any) -> dict[str, Any] | None:
        """At the start of ``step``, after the admissions: the ``resize`` record where the group grew
        since the last step (and this rank's slice cut again), else None."""
        group = self.strategy.survival.group
        if self.cfg.start_workers is None or group is None or group.group_size <= (self.size or 0):
            if group is not None:
                self.size = group.group_size
            return None
        self.size = group.group_size
        world = self.strategy.world
        rank, slices, batch = cut(self.cfg, world.rank, world.world_size, group.group_rank, group.group_size)
        sampler = batches.sampler
        if (sampler.rank, sampler.world_size, sampler.batch_size) != (rank, slices, batch):
            # the stream goes on from the samples consumed before this step, cut again
            sampler.rank = rank
            sampler.continue_at(step, sampler.position(step), batch * slices, slices)
            batches.close()  # a user's loader starts again on the new cut
        return {
            "kind": "resize",
            "step": step,
            "workers": group.group_size,
            "members": list(group.members),
            "rule": self.cfg.resize,
            "global_batch": batch * group.group_size,
            "lr": self.cfg.lr,
        }
