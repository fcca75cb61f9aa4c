"""``vgg16``: CIFAR-style VGG-16 with batch normalisation (13 convs, one 512->classes classifier).

Each conv + BatchNorm + ReLU is one top-level child (a pipeline never splits a conv from its
normalisation), the pools are children of their own. About 14.7M parameters on CIFAR-10.
"""

from __future__ import annotations

from torch import nn

from parambox.models.cnn import image_shape, pool_or_identity
from parambox.models.registry import register

# Channels per conv, "M" a 2x2 max-pool: configuration D of Simonyan and Zisserman.
VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def conv_bn_relu(in_channels: int, out_channels: int) -> nn.Sequential:
    # No conv bias: BatchNorm's shift makes it redundant.
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
    )


@register("vgg16")
def vgg16(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """Five pools take 32x32 to 1x1, where the adaptive pool is an identity; smaller inputs skip
    pools that would go below 1 pixel (kept as identities, so the children line up for every size).

    Lerat et al. split it after the 8th conv: a cut before child 11.
    """
    channels, h, w = image_shape("vgg16", input_shape)
    side = min(h, w)
    layers: list[nn.Module] = []
    for spec in VGG16:
        if spec == "M":
            pool, side = pool_or_identity(side)
            layers.append(pool)
        else:
            layers.append(conv_bn_relu(channels, spec))
            channels = spec
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)
