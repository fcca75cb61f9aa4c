"""``resnet18``: CIFAR-style ResNet-18 (3x3 stem, no stem pool, BasicBlocks [2, 2, 2, 2]).

As an ``nn.Sequential``: stem, the eight residual blocks, global average pool, flatten, fc, so a
pipeline cuts between blocks, never inside a residual connection. About 11.2M parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from parambox.models.cnn import image_shape
from parambox.models.registry import register


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers plus the identity (or a 1x1 conv-BN projection where shape changes).

    >>> BasicBlock(16, 32, stride=2)(torch.zeros(2, 16, 8, 8)).shape
    torch.Size([2, 32, 4, 4])
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


@register("resnet18")
def resnet18(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """Stages of 64, 128, 256, 512 channels; each later stage halves the side with a stride-2 block.

    Stride-2 convs with padding 1 never go below 1 pixel, so 8x8 inputs build as they are.
    """
    c, _, _ = image_shape("resnet18", input_shape)
    stem = nn.Sequential(nn.Conv2d(c, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
    layers: list[nn.Module] = [stem]
    in_channels = 64
    for out_channels, first_stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers.append(BasicBlock(in_channels, out_channels, first_stride))
        layers.append(BasicBlock(out_channels, out_channels, 1))
        in_channels = out_channels
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)
