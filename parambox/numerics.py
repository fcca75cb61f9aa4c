"""The one test for non-finite values, used by every layer: strategies (never push NaN into the box),
benchmarks, studies and reports (a loss curve that diverged)."""

from __future__ import annotations

import math
from typing import Any


def is_finite(value: Any) -> bool:
    """True when ``value`` holds no NaN or infinity; False for anything that is not a number.

    ``value`` is a number, a tensor, or a list/tuple of either. A tensor is tested with one reduction:
    its sum is non-finite when any element is (NaN and Inf propagate through a sum), which costs one
    pass over memory and one host sync, the cheapest test on a large gradient.

    >>> is_finite(1.0), is_finite(float("nan")), is_finite([1, 2.5]), is_finite(None)
    (True, False, True, False)
    """
    if isinstance(value, int | float):
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        return all(is_finite(v) for v in value)
    if hasattr(value, "isfinite") and hasattr(value, "sum"):  # a torch tensor, without importing torch
        return bool(value.sum().isfinite())
    return False
