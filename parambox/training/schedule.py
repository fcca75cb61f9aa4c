"""Learning-rate schedules and warmup: a factor of the run's rate per optimizer step, applied to every
optimizer a strategy makes.

The factor at step ``s`` (0-based, the step about to run) is a pure function of ``s``, the schedule,
the warmup and the horizon (the run's ``steps``): a linear warmup from 0 over ``warmup_steps`` steps
(step ``s < warmup`` runs at ``(s + 1) / warmup``), then ``constant`` (1), ``cosine`` (half a cosine
from 1 down to 0 at the horizon) or ``linear`` (a straight line from 1 down to 0 at the horizon), as
Hugging Face's ``get_cosine_schedule_with_warmup`` / ``get_linear_schedule_with_warmup`` decay. A
resumed run continues where the restored step puts it; the horizon is the one the run started with.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """The factor of the base rate at optimizer step ``step`` (0-based).

    >>> [lr_factor(s, "constant", 2, 10) for s in (0, 1, 2, 9)]
    [0.5, 1.0, 1.0, 1.0]
    >>> [round(lr_factor(s, "cosine", 0, 4), 4) for s in range(5)]
    [1.0, 0.8536, 0.5, 0.1464, 0.0]
    >>> [lr_factor(s, "linear", 1, 5) for s in range(6)]
    [1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


@dataclass
class Schedule:
    """The run's schedule: ``factor(step)``, and its state for checkpoints (the horizon is kept on
    resume, so a resumed run continues the schedule exactly, also when it runs more steps)."""

    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1

    @property
    def active(self) -> bool:
        """Whether the rate ever differs from the base rate (else nothing is touched)."""
        return self.kind != "constant" or self.warmup_steps > 0

    def factor(self, step: int) -> float:
        return lr_factor(step, self.kind, self.warmup_steps, self.total_steps)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kind = str(state.get("kind", self.kind))
        self.warmup_steps = int(state.get("warmup_steps", self.warmup_steps))
        self.total_steps = int(state.get("total_steps", self.total_steps))


OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


class ScheduledRates:
    """Every optimizer made through :meth:`make` (the strategy's ``ctx.make_optimizer``), with the
    rates its groups were made with; :meth:`apply` sets each group's ``lr`` to base times the
    schedule's factor before a step. Strategies that run their own update read the rate from their
    optimizer's ``param_groups`` each step, so the schedule reaches them too.

    >>> rates = ScheduledRates(lambda p: torch.optim.SGD(p, lr=0.1), Schedule("linear", 0, 4))
    >>> opt = rates.make([torch.nn.Parameter(torch.zeros(1))])
    >>> rates.apply(2); opt.param_groups[0]["lr"]
    0.05
    """

    def __init__(self, make: OptimizerFactory, schedule: Schedule):
        self.factory, self.schedule = make, schedule
        self.made: list[tuple[torch.optim.Optimizer, list[float]]] = []
        self.factor: float | None = None  # as last applied

    def make(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """A new optimizer, recorded; made during a step (a pipeline builds its stages in its first),
        it runs at that step's rate at once."""
        optimizer = self.factory(params)
        self.made.append((optimizer, [float(g["lr"]) for g in optimizer.param_groups]))
        if self.factor is not None:
            self._set(self.factor, self.made[-1:])
        return optimizer

    def apply(self, step: int) -> None:
        """Each group's ``lr`` for optimizer step ``step``; nothing at all for a constant schedule
        without warmup (the rates stay exactly as made)."""
        if self.schedule.active:
            self.factor = self.schedule.factor(step)
            self._set(self.factor, self.made)

    def current(self) -> float | None:
        """The rate of the first optimizer made, as the schedule last set it (None: none made)."""
        return self.made[0][0].param_groups[0]["lr"] if self.made else None

    @staticmethod
    def _set(factor: float, made: list[tuple[torch.optim.Optimizer, list[float]]]) -> None:
        for optimizer, bases in made:
            for group, base in zip(optimizer.param_groups, bases):
                group["lr"] = base * factor

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Every rate 0 meanwhile (a step a loss scaler skips: the exchanges still run, the weights
        stay), then as they were."""
        saved = [[g["lr"] for g in opt.param_groups] for opt, _ in self.made]
        self._set(0.0, self.made)
        try:
            yield
        finally:
            for (opt, _), rates in zip(self.made, saved):
                for group, lr in zip(opt.param_groups, rates):
                    group["lr"] = lr
