"""parambox: distributed deep-learning training with every parallel strategy, over a shared
parameter box or collectives, and the experiments that compare them."""

__version__ = "0.1.0"
