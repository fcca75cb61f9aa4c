"""A run's workload, from the zoo or from the user: model, data, loss, metrics, and the references
(``module:function``, ``file.py:function``) that carry a user's functions to worker processes."""

from parambox.workload.refs import is_reference, reference_of, resolve
from parambox.workload.workload import (
    CALLABLE_FIELDS,
    Workload,
    build_workload,
    check_batch_fits,
    resolve_callables,
)

__all__ = [
    "CALLABLE_FIELDS",
    "Workload",
    "build_workload",
    "check_batch_fits",
    "is_reference",
    "reference_of",
    "resolve",
    "resolve_callables",
]
