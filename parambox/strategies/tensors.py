"""What a step walks: a batch of any structure (a tensor, or tuples, lists and dicts of them) and a
model's trainable parameters.

>>> batch_size({"x": torch.zeros(4, 2), "y": torch.zeros(4)})
4
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it (tuples, lists and dicts are walked).

    >>> map_tensors(lambda t: t * 2, {"x": torch.ones(1), "n": 3})
    {'x': tensor([2.]), 'n': 3}
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(fn, v) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(map_tensors(fn, v) for v in batch)
    return batch


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: the length of its first tensor.

    >>> batch_size((torch.zeros(8, 3), torch.zeros(8)))
    8
    """
    if isinstance(batch, torch.Tensor):
        return len(batch)
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, tuple | list) else ()
    for value in values:
        try:
            return batch_size(value)
        except ValueError:
            continue
    raise ValueError(f"a batch needs at least one tensor, got {type(batch).__name__}")


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer may move: ``requires_grad`` ones, each once (tied weights once)."""
    return [p for p in model.parameters() if p.requires_grad]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors laid end to end, each in its logical (row-major) order: a new tensor. As torch's
    ``parameters_to_vector``, which fails on a non-contiguous parameter (a ``channels_last``
    convolution's weight, a transposed one)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])
