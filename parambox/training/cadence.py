"""When the loop checkpoints: every ``checkpoint_every`` steps, and once ``checkpoint_interval_s`` seconds
of training have passed since the last checkpoint (the default: a run killed late loses at most about
that much).

A checkpoint of a synchronous run is collective (a barrier, then rank 0 commits): every rank must take
it at the same step, yet their clocks disagree. So rank 0's clock decides, and the decision travels
ahead of the step it names: at every ``probe``-th step rank 0 looks at its clock and, when the interval
has passed, posts on the run's store that step ``s + probe`` checkpoints; the other ranks look for that
word when they reach ``s + probe``. No rank can reach it before rank 0 has passed ``s``: the ranks wait
for each other at least once per exchange, and ``probe`` is longer than two of the rule's periods. One store
read per ``probe`` steps on ranks other than 0, none on rank 0. Asynchronous ranks checkpoint at their
own pace, each by its own clock.

>>> c = CheckpointCadence(every=10, interval_s=600.0, rank=0)
>>> c.due(10), c.due(11)
(True, False)
"""

from __future__ import annotations

import time
from typing import Any

PROBE_STEPS = 10  # steps between rank 0's looks at its clock (at least a period more: see probe_steps)


def probe_steps(period: int) -> int:
    """Steps between two looks, for a rule whose ranks meet every ``period`` steps: more than two
    periods (an exchange that overlaps the next round lets a rank run up to two rounds ahead)."""
    return max(PROBE_STEPS, 2 * period + 2)


class CheckpointCadence:
    """``due(step)``: whether the loop checkpoints at this step boundary (see the module docstring).

    ``clock``: ``"own"`` (each rank by its own clock: one rank, or asynchronous ranks that checkpoint at
    their own pace), ``"rank0"`` (ranks in lockstep: rank 0's clock, posted on ``store``) or
    ``"steps"`` (by step count only: ranks that checkpoint together but do not wait for rank 0).
    """

    def __init__(
        self,
        every: int,
        interval_s: float,
        rank: int,
        clock: str = "own",
        store: Any = None,
        period: int = 1,
        prefix: str = "parambox/checkpoint_at",
    ):
        self.every, self.interval_s, self.rank, self.store = every, interval_s, rank, store
        if clock == "rank0" and store is None:
            clock = "steps"  # nowhere to post rank 0's word
        self.clock = clock if interval_s > 0 else "steps"
        self.probe = probe_steps(period)
        self.prefix = prefix
        self.last = time.monotonic()
        self._posted: int | None = None  # rank 0: the step it named

    def saved(self) -> None:
        """A checkpoint was written: the interval counts from now."""
        self.last = time.monotonic()

    def due(self, step: int) -> bool:
        if self.every and step % self.every == 0:
            return True
        if self.clock == "own":
            return time.monotonic() - self.last >= self.interval_s
        if self.clock == "steps" or step % self.probe:
            return False
        if self.rank == 0:
            due = self._posted == step
            if not due and time.monotonic() - self.last >= self.interval_s:
                self._posted = step + self.probe
                self.store.set(f"{self.prefix}/{self._posted}", "1")
            return due
        try:
            return bool(self.store.check([f"{self.prefix}/{step}"]))
        except RuntimeError:  # the store's host (rank 0) is gone: the run's failure shows elsewhere
            return False
