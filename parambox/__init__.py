"""parambox: distributed deep-learning training with every parallel strategy, over a shared
parameter box or collectives, and the experiments that compare them."""

__version__ = "0.1.0"


def __getattr__(name: str):  # the library API, imported on first use: the CLI starts without torch
    if name == "DistributedOptimizer":
        from parambox.optim import DistributedOptimizer

        return DistributedOptimizer
    raise AttributeError(f"module 'parambox' has no attribute {name!r}")
