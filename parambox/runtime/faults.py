"""The fault plan of ``PARAMBOX_FAULT="RANK:STEP:KIND[,...]"``, parsed: what the runtime and the strategies
read of it (a rank's ``lose-exchange`` step). Its kinds, and their injection into a training step, are in
:mod:`parambox.training.faults`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from parambox.runtime.control import current_life


@dataclass(frozen=True)
class FaultPlan:
    """The faults to inject, as ``(rank, step, kind)``; empty (and false) in a normal run.

    >>> plan = FaultPlan.parse("1:20:nan"); bool(plan), plan.faults
    (True, ((1, 20, 'nan'),))
    """

    faults: tuple[tuple[int, int, str], ...] = field(default_factory=tuple)

    @classmethod
    def parse(cls, spec: str | None) -> FaultPlan:
        faults = []
        for item in (spec or "").split(","):
            if item.strip():
                rank, step, kind = item.strip().split(":")
                if int(rank) < 0 or int(step) < 0:
                    raise ValueError(f"PARAMBOX_FAULT {item.strip()!r}: RANK and STEP are counts from 0")
                faults.append((int(rank), int(step), kind))
                if kind.startswith("partition"):
                    partition_seconds(kind)  # a malformed duration fails at start-up, not at the step
        return cls(tuple(faults))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FaultPlan:
        """The plan in ``PARAMBOX_FAULT``; empty in a replacement or restarted worker (its first life
        had the fault: a second one would only fault again)."""
        env = os.environ if env is None else env
        if current_life(env) > 0:
            return cls()
        return cls.parse(env.get("PARAMBOX_FAULT"))

    def exchange_fault(self, rank: int) -> int | None:
        """The step whose exchange ``lose-exchange`` fails on ``rank``; None if none."""
        return next((st for r, st, kind in self.faults if r == rank and kind == "lose-exchange"), None)

    def kills_at_join(self, rank: int) -> bool:
        """``kill-join``: ``rank`` dies as it is about to join its process group."""
        return any(r == rank and kind == "kill-join" for r, _, kind in self.faults)

    def __bool__(self) -> bool:
        return bool(self.faults)


def partition_seconds(kind: str) -> float:
    """``partition=T`` -> T (seconds, > 0)."""
    try:
        seconds = float(kind.split("=", 1)[1])
    except (IndexError, ValueError):
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"PARAMBOX_FAULT kind {kind!r}: expected partition=SECONDS, e.g. partition=2")
    return seconds
