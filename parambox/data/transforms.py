"""Preprocessing as Lerat et al. list it (crop, random horizontal flip, normalise), in torch, batched.

Augmentations take a whole (N, C, H, W) batch and a ``torch.Generator`` and draw one random
choice per sample with vectorised indexing, so they cost a few tensor ops per batch, not a Python
loop per image, and the same generator seed gives the same batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def channel_stats(x: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of an (N, C, H, W) batch, shaped (1, C, 1, 1) or (1, 1, 1, 1) to broadcast.

    >>> m, s = channel_stats(torch.ones(4, 3, 2, 2))
    >>> m.shape
    torch.Size([1, 3, 1, 1])
    """
    assert x.dim() == 4, f"expected (N, C, H, W), got {tuple(x.shape)}"
    dims = (0, 2, 3) if per_channel else (0, 1, 2, 3)
    # var_mean is one Welford pass: float32-accurate on 150M values with no float64 copy.
    var, mean = torch.var_mean(x, dim=dims, correction=0, keepdim=True)
    return mean, var.sqrt().clamp_min(1e-8)


def normalise_(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``x = (x - mean) / std`` in place (data sets are large; no second copy); returns ``x``."""
    return x.sub_(mean).div_(std)


def random_crop(x: torch.Tensor, padding: int, generator: torch.Generator) -> torch.Tensor:
    """Zero-pad each side by ``padding`` and cut a random (H, W) window per sample.

    Data are normalised before augmentation, so the zero padding is the data set's mean colour.

    >>> random_crop(torch.ones(2, 3, 8, 8), 2, torch.Generator().manual_seed(0)).shape
    torch.Size([2, 3, 8, 8])
    """
    n, _, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    # Draws come from the (CPU) generator, so a CUDA batch gets the same crops as a CPU one.
    dy = torch.randint(0, 2 * padding + 1, (n,), generator=generator).to(x.device)
    dx = torch.randint(0, 2 * padding + 1, (n,), generator=generator).to(x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device))[:, :, None]  # (N, H, 1)
    cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, :]  # (N, 1, W)
    batch = torch.arange(n, device=x.device)[:, None, None]
    # Advanced indices split by the channel slice move to the front: the result is (N, H, W, C).
    return padded[batch, :, rows, cols].permute(0, 3, 1, 2).contiguous()


def random_flip(x: torch.Tensor, generator: torch.Generator, p: float = 0.5) -> torch.Tensor:
    """Mirror each sample left-right with probability ``p``.

    >>> random_flip(torch.ones(2, 1, 4, 4), torch.Generator().manual_seed(0)).shape
    torch.Size([2, 1, 4, 4])
    """
    flip = (torch.rand(x.shape[0], generator=generator) < p).to(x.device)
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


def crop_and_flip(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The CIFAR-10 training augmentation: 4-pixel padded random crop, then random horizontal flip."""
    return random_flip(random_crop(x, 4, generator), generator)
