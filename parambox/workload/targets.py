"""A study's target: a test metric, the value to reach, and which way is better.

This module is the one place that says which way a metric improves. The losses (``loss``, any
``*_loss``), ``bits_per_byte`` and ``perplexity`` (the text set's metrics) fall as a model learns;
``accuracy`` and every other metric rise. A user whose own metric falls says so in the target.

A target is written ``METRIC=VALUE`` (the direction from the metric's name), or ``METRIC<=VALUE`` /
``METRIC>=VALUE`` (the direction said outright: a user's error rate, ``wer<=0.2``). ``METRIC`` is a name of
the evaluations (``test_`` prefix optional): ``accuracy``, ``perplexity``, ``bits_per_byte``, ``loss`` or a
key of the user's ``metrics()``.

>>> t = Target.parse("perplexity=8")
>>> str(t), t.reached(7.5), t.reached(9.0), t.reached(None)
('perplexity <= 8', True, False, False)
>>> t.first([(1, 12.0), (2, 7.9), (3, 7.0)]), t.best([12.0, 7.9, 9.1])
(2, 7.9)
>>> str(Target.parse("test_wer<=0.2")), str(Target.of("accuracy", 0.98))
('wer <= 0.2', 'accuracy >= 0.98')
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from parambox.errors import UserError

LOWER_IS_BETTER = frozenset({"loss", "bits_per_byte", "perplexity"})
_FORM = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(<=|>=|=)\s*(\S+)\s*$")

X = TypeVar("X")


def lower_is_better(metric: str) -> bool:
    """Whether a smaller value of ``metric`` (``perplexity`` or ``test_perplexity``) is the better one.

    >>> lower_is_better("test_perplexity"), lower_is_better("bits_per_byte"), lower_is_better("accuracy")
    (True, True, False)
    """
    name = metric.removeprefix("test_")
    return name in LOWER_IS_BETTER or name.endswith("_loss")


@dataclass(frozen=True)
class Target:
    """Reach test ``metric`` at ``value``: at most it where ``lower_is_better``, else at least it."""

    metric: str  # the evaluations' name without ``test_``
    value: float
    lower_is_better: bool = False

    @classmethod
    def of(cls, metric: str, value: float) -> Target:
        """The target with the direction of ``metric`` (:func:`lower_is_better`), its value checked."""
        name = metric.removeprefix("test_")
        return cls(name, value, lower_is_better(name)).checked()

    @classmethod
    def parse(cls, text: str) -> Target:
        """``METRIC=VALUE``, ``METRIC<=VALUE`` or ``METRIC>=VALUE``; a one-line ``UserError`` otherwise."""
        m = _FORM.match(text)
        try:
            value = float(m.group(3)) if m else math.nan
        except ValueError:
            value = math.nan
        if m is None or not math.isfinite(value):
            raise UserError(
                f"--target {text!r}: expected METRIC=VALUE (e.g. perplexity=8, accuracy=0.95), or METRIC<=VALUE / "
                "METRIC>=VALUE to say which way is better"
            )
        name, op = m.group(1).removeprefix("test_"), m.group(2)
        if op == "=":
            return cls.of(name, value)
        return cls(name, value, op == "<=").checked()

    def checked(self) -> Target:
        """Self, or a ``UserError`` for a value the metric cannot take."""
        if not math.isfinite(self.value):
            raise UserError(f"target {self}: the value must be a finite number")
        if self.metric == "accuracy" and not 0 < self.value <= 1:
            raise UserError(f"target {self}: accuracy is a fraction within (0, 1]")
        if self.metric == "perplexity" and self.value < 1:
            raise UserError(f"target {self}: a perplexity is at least 1")
        if self.metric in ("bits_per_byte", "loss") and self.value <= 0:
            raise UserError(f"target {self}: {self.metric} must be > 0 to be reachable")
        return self

    @property
    def key(self) -> str:
        """The metric's key in an evaluation record (``test_perplexity``)."""
        return f"test_{self.metric}"

    def reached(self, value: float | None) -> bool:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return False
        return value <= self.value if self.lower_is_better else value >= self.value

    def first(self, points: Iterable[tuple[X, float | None]]) -> X | None:
        """The ``x`` of the first ``(x, value)`` that reaches the target; None if none does."""
        return next((x for x, v in points if self.reached(v)), None)

    def best(self, values: Iterable[float | None]) -> float | None:
        """The best of ``values`` in this metric's direction (None left out); None if there are none."""
        vs = [v for v in values if v is not None and not math.isnan(v)]
        if not vs:
            return None
        return min(vs) if self.lower_is_better else max(vs)

    def as_json(self) -> dict:
        return {"metric": self.metric, "value": self.value, "lower_is_better": self.lower_is_better}

    def __str__(self) -> str:
        return f"{self.metric} {'<=' if self.lower_is_better else '>='} {self.value:g}"
