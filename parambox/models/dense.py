"""Fully connected models: ``neuron``, ``logreg``, ``mlp`` (no dropout: used for exact numerics checks)."""

from __future__ import annotations

import math

import torch
from torch import nn

from parambox.models.registry import register


class TwoClassSigmoid(nn.Module):
    """Turns one logit z into the two-class logits [0, z]: softmax gives sigmoid(z) for class 1,
    so cross-entropy on them is exactly the logistic loss of a single sigmoid unit."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.zeros_like(z), z], dim=1)


@register("neuron")
def neuron(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    if num_classes != 2:
        raise ValueError(
            f"model 'neuron' is one sigmoid unit: it needs 2 classes, the data has {num_classes}"
        )
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 1), TwoClassSigmoid())


@register("logreg")
def logreg(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


@register("mlp")
def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 64) -> nn.Sequential:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )
