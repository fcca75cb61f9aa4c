"""Name -> loader. Each loader: (data_path: Path | None, seed: int) -> Dataset; bad input raises UserError."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from parambox.data.base import Dataset
from parambox.errors import UserError

DATASETS: dict[str, Callable[[Path | None, int], Dataset]] = {}


def register(name: str):
    def deco(fn):
        DATASETS[name] = fn
        return fn

    return deco


def load_dataset(name: str, data_path: str | Path | None = None, seed: int = 0) -> Dataset:
    _import_loaders()
    if name not in DATASETS:
        raise UserError(f"unknown data set {name!r}; choose from {', '.join(sorted(DATASETS))}")
    return DATASETS[name](Path(data_path) if data_path else None, seed)


def _import_loaders() -> None:
    # Loaders register themselves on import; imported lazily so `parambox info` stays fast.
    from parambox.data import cifar10, digits, mnist, synthetic, text  # noqa: F401
