"""The loss the training loop hands a strategy when the user gives none: ``loss(model, batch)``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from parambox.errors import UserError


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Cross-entropy of ``model(x)`` against the labels ``y`` of an ``(x, y)`` batch."""
    if not (isinstance(batch, tuple | list) and len(batch) == 2):  # (a pipeline stage's x may be a tuple)
        raise UserError(
            "the default loss is the cross-entropy of model(x) against y and expects (x, y) batches, "
            f"got {describe(batch)}: give your own loss(model, batch) with --loss module:function"
        )
    x, y = batch
    out = model(x)
    if not isinstance(out, torch.Tensor):
        raise UserError(
            f"model {type(model).__name__} returned a {describe(out).removeprefix('a ')}; the default loss is "
            "the cross-entropy of model(x) against y and needs a tensor of class scores: give your own "
            "loss(model, batch) with --loss module:function"
        )
    return F.cross_entropy(out, y)


def sequence_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The mean cross-entropy per position of ``model(x)``, (B, T, C) logits, against ``y``, (B, T)
    class indices: the default loss of a ``sequence`` data set (``text``), in nats per token."""
    x, y = batch
    out = model(x)
    return F.cross_entropy(out.flatten(0, -2), y.flatten().long())


def describe(batch: Any) -> str:
    """A batch's structure in a few words, for error messages.

    >>> describe({"x": 1, "label": 2}), describe((1, 2, 3))
    ("a dict with keys ['x', 'label']", 'a tuple of 3 items')
    """
    if isinstance(batch, dict):
        return f"a dict with keys {list(batch)[:8]}"
    if isinstance(batch, tuple | list):
        return f"a {type(batch).__name__} of {len(batch)} items"
    return f"a {type(batch).__name__}"
