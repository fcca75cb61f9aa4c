"""Small convolutional models: ``lenet``, ``cnn`` (the benchmark CNN) and ``alexnet`` (CIFAR-size).

Layers are flat top-level children of one ``nn.Sequential``, so a pipeline may cut between any two
of them and parameter names are the usual ``"3.weight"``. No dropout: runs stay deterministic and
comparable across strategies.
"""

from __future__ import annotations

from torch import nn

from parambox.errors import UserError
from parambox.models.registry import register


def image_shape(name: str, input_shape: tuple[int, ...], min_side: int = 1) -> tuple[int, int, int]:
    """``(C, H, W)`` of an image input, or a UserError naming the model and the shape."""
    if len(input_shape) != 3 or min(input_shape[1:]) < min_side:
        raise UserError(
            f"model {name!r} needs images (C, H, W) of at least {min_side}x{min_side}; "
            f"the data set has samples of shape {tuple(input_shape)}"
        )
    c, h, w = input_shape
    return c, h, w


@register("lenet")
def lenet(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """LeNet-5-like: two padded 5x5 convs with max-pooling, then 120-84-classes fully connected.

    Padding keeps the side until each pooling, so 8x8 digits, 28x28 MNIST and 32x32 CIFAR all fit:
    about 108k parameters on MNIST, 21k on digits.
    """
    c, h, w = image_shape("lenet", input_shape, min_side=4)
    return nn.Sequential(
        nn.Conv2d(c, 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * (h // 4) * (w // 4), 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, num_classes),
    )


@register("cnn")
def cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """The benchmark CNN of MEASURED.md: 1,070,794 parameters on (3, 32, 32) with 10 classes.

    >>> sum(p.numel() for p in cnn((3, 32, 32), 10).parameters())
    1070794
    """
    c, h, w = image_shape("cnn", input_shape, min_side=4)
    return nn.Sequential(
        nn.Conv2d(c, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (h // 4) * (w // 4), 256),
        nn.ReLU(),
        nn.Linear(256, num_classes),
    )


def pool_or_identity(side: int) -> tuple[nn.Module, int]:
    """A 2x2 max-pool and the side after it, or an identity where the map is already 1 pixel.

    The identity keeps the list of children the same for every input size, so pipeline cut
    points mean the same layers on 8x8 digits as on 32x32 CIFAR.
    """
    return (nn.MaxPool2d(2), side // 2) if side >= 2 else (nn.Identity(), side)


@register("alexnet")
def alexnet(input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """The common 5-conv AlexNet adaptation for 32x32 CIFAR (64-192-384-256-256, then 4096-4096).

    A stride-2 first conv and three pools take 32x32 to 2x2; the adaptive pool is an identity
    there and lets smaller inputs (8x8 digits) build too. About 23.3M parameters on CIFAR-10.
    Lerat et al. split it after the 4th conv: a cut before child 10 (the 5th conv).
    """
    c, h, w = image_shape("alexnet", input_shape)
    side = (min(h, w) + 1) // 2
    layers: list[nn.Module] = [nn.Conv2d(c, 64, 3, stride=2, padding=1), nn.ReLU()]
    pool, side = pool_or_identity(side)
    layers += [pool, nn.Conv2d(64, 192, 3, padding=1), nn.ReLU()]
    pool, side = pool_or_identity(side)
    layers += [pool, nn.Conv2d(192, 384, 3, padding=1), nn.ReLU()]
    layers += [nn.Conv2d(384, 256, 3, padding=1), nn.ReLU()]
    layers += [nn.Conv2d(256, 256, 3, padding=1), nn.ReLU()]
    pool, side = pool_or_identity(side)
    layers += [pool, nn.AdaptiveAvgPool2d(2), nn.Flatten()]
    layers += [nn.Linear(256 * 2 * 2, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU()]
    layers.append(nn.Linear(4096, num_classes))
    return nn.Sequential(*layers)
