"""Name -> loader. Each loader: (data_path: Path | None, seed: int) -> Dataset; bad input raises UserError."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from parambox.data.base import Dataset
from parambox.errors import UserError

DATASETS: dict[str, Callable[[Path | None, int], Dataset]] = {}
# The registered data sets of sequences (``Dataset.sequence``), known without loading one: a strategy's
# defaults may differ on them (``Strategy.default_run_sequence``).
SEQUENCE_DATA: set[str] = set()


def register(name: str, sequence: bool = False):
    def deco(fn):
        DATASETS[name] = fn
        if sequence:
            SEQUENCE_DATA.add(name)
        return fn

    return deco


def is_sequence(name: str) -> bool:
    """Whether ``name`` is a registered data set of sequences (False for a factory REF)."""
    _import_loaders()
    return name in SEQUENCE_DATA


def load_dataset(name: str, data_path: str | Path | None = None, seed: int = 0) -> Dataset:
    _import_loaders()
    if name not in DATASETS:
        raise UserError(f"unknown data set {name!r}; choose from {', '.join(sorted(DATASETS))}")
    return DATASETS[name](Path(data_path) if data_path else None, seed)


def _import_loaders() -> None:
    # Loaders register themselves on import; imported lazily so `parambox info` stays fast.
    from parambox.data import cifar10, digits, mnist, synthetic, text  # noqa: F401
