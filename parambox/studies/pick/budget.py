"""``parambox pick --budget``: a pick that answers within a time limit, and a ranking at any moment.

Every measurement (the reference run, each probe, each run of the race and of validation) gets at
most the time the budget has left. A run the budget cuts short counts for nothing (its candidate is
*unmeasured*, not excluded), the phases after it are skipped, and the pick ends with the ranking of
what it measured (``partial``: true, ``unmeasured``: the candidates it never probed).

Order, so that an early stop still ranks the strategies: the reference first (every prediction
needs it, and it is ``allreduce``'s own measurement), then one probe per strategy (its first preset's
options), then the other options of each strategy, then the compressed variants (``--compression``)
in the same order, then the race and validation (long runs to the target). A strategy's variants
differ less from one another than strategies do, and a probe costs the same few dozen steps whichever
it is, so breadth over strategies is the most informative use of each probe's time.

After each measurement the ranking so far is written to ``pick.json`` (a temporary file, then
``os.replace``: a reader never sees half a file), so a pick stopped by Ctrl-C has an answer too.

>>> parse_duration("10m"), parse_duration("90s"), parse_duration("1h30m"), parse_duration("45")
(600.0, 90.0, 5400.0, 45.0)
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parambox.errors import UserError

UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)([hms])")


def _clock() -> float:
    return time.monotonic()


class BudgetSpent(Exception):
    """The budget ran out: the measurement under way was cut, and what comes after is skipped."""


def parse_duration(text: str) -> float:
    """Seconds of ``10m``, ``90s``, ``1h30m``, ``2.5m`` or a bare number of seconds; a UserError for
    anything else, or for no time at all.

    >>> parse_duration("2.5m")
    150.0
    """
    t = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        seconds = float(t)
    elif t and _PART.sub("", t) == "" and len({u for _, u in _PART.findall(t)}) == len(_PART.findall(t)):
        seconds = sum(float(n) * UNITS[u] for n, u in _PART.findall(t))
    else:
        raise UserError(f"--budget takes a duration such as 10m, 90s or 1h30m, got {text!r}")
    if not seconds > 0:
        raise UserError(f"--budget must be more than no time, got {text!r}")
    return seconds


@dataclass
class Budget:
    """The time a pick has left (``seconds`` None: no limit).

    >>> b = Budget(None)
    >>> b.timeout(180.0), b.left() == math.inf
    (180.0, True)
    """

    seconds: float | None
    started: float = field(default_factory=lambda: _clock())
    spent_in: str | None = None  # the phase the budget ran out in

    def left(self) -> float:
        if self.seconds is None:
            return math.inf
        return self.seconds - (_clock() - self.started)

    def timeout(self, cap: float) -> float:
        """A measurement's time limit: its own ``cap``, or what the budget has left if less."""
        return max(min(cap, self.left()), 0.0)

    def check(self, phase: str) -> None:
        """Raise ``BudgetSpent`` (noting ``phase``) if no time is left to start a measurement."""
        if self.left() <= 0:
            self.spend(phase)

    def cut(self, error: str | None, phase: str) -> None:
        """After a measurement: raise ``BudgetSpent`` if it failed with the budget gone (the budget
        cut it short: it says nothing of its candidate)."""
        if error and self.left() <= 0:
            self.spend(phase)

    def spend(self, phase: str) -> None:
        self.spent_in = self.spent_in or phase
        raise BudgetSpent(phase)

    def as_json(self) -> dict[str, Any] | None:
        if self.seconds is None:
            return None
        return {"seconds": self.seconds, "spent": self.spent_in is not None, "spent_in": self.spent_in}


def breadth_first(labels: list[tuple[str, str]]) -> list[int]:
    """Indices of ``(strategy, label)`` pairs: each strategy's first, in the given order, then each
    strategy's second, and so on.

    >>> breadth_first([("a", "a 1"), ("a", "a 2"), ("b", "b"), ("c", "c 1"), ("c", "c 2")])
    [0, 2, 3, 1, 4]
    """
    seen: dict[str, int] = {}
    depth = []
    for strategy, _ in labels:
        depth.append(seen.get(strategy, 0))
        seen[strategy] = depth[-1] + 1
    return sorted(range(len(labels)), key=lambda i: (depth[i], i))


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """``obj`` as indented JSON at ``path``, whole or not at all (a temporary file, then ``os.replace``)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
