"""parambox: distributed deep-learning training with every parallel strategy, over a shared
parameter box or collectives, and the experiments that compare them.

The library API, for a user's own model, data, loss and script::

    import parambox

    def make_model(): ...            # -> any torch.nn.Module
    def make_data(): ...             # -> (train, test) Datasets: map-style, or IterableDatasets

    if __name__ == "__main__":       # local workers import this script to find make_model
        summary = parambox.train(model=make_model, data=make_data, strategy="easgd", workers=4,
                                 options={"tau": 4}, steps=1000, batch_size=32, lr=0.05)

In a training loop of your own, ``parambox.DistributedOptimizer(model, torch_optimizer,
strategy="easgd")`` (see :class:`parambox.optim.DistributedOptimizer`).

``parambox.train`` (see :func:`parambox.api.train.train`), ``parambox.DistributedOptimizer``,
``parambox.UserError`` (a ``ValueError``: bad input, one line naming it), ``parambox.BoxLost`` (a rank
that held part of the rma box died: what ``DistributedOptimizer`` raises then) and
``parambox.STRATEGIES`` (the strategy names) are imported on first use,
so ``import parambox`` itself loads neither torch nor pydantic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["STRATEGIES", "BoxLost", "DistributedOptimizer", "UserError", "train"]

if TYPE_CHECKING:
    from parambox.api.train import train
    from parambox.errors import BoxLost, UserError
    from parambox.optim import DistributedOptimizer

# name -> (module, attribute): the public API, resolved lazily by __getattr__.
_LAZY = {
    "train": ("parambox.api.train", "train"),
    "UserError": ("parambox.errors", "UserError"),
    "BoxLost": ("parambox.errors", "BoxLost"),
    "DistributedOptimizer": ("parambox.optim", "DistributedOptimizer"),
}


def __getattr__(name: str) -> Any:
    if name == "STRATEGIES":
        from parambox.strategies import STRATEGIES

        return tuple(STRATEGIES)
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'parambox' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "STRATEGIES", *_LAZY])
