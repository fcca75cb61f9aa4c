"""(a) Your own model on numpy arrays: a non-Sequential regression network trained with MSE.

    python examples/regression.py                       # 2 workers, allreduce, 600 steps
    python examples/regression.py --strategy easgd --workers 4
    python examples/regression.py --quick               # what the test suite runs

The model, data and loss are plain PyTorch; parambox.train spawns the workers, which import this file
to find make_model, make_data and mse (so the call sits under ``if __name__ == "__main__":``, as with
multiprocessing). The same file runs unchanged under ``torchrun --nproc-per-node 2 examples/regression.py``.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

import parambox


class ResidualMLP(nn.Module):
    """y = head(h + block(h)), h = embed(x): a skip connection, so not an nn.Sequential."""

    def __init__(self, num_features: int = 8, width: int = 64):
        super().__init__()
        self.embed = nn.Linear(num_features, width)
        self.block = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        return self.head(h + self.block(h)).squeeze(-1)


def make_model() -> nn.Module:
    return ResidualMLP()


def make_data() -> tuple[TensorDataset, TensorDataset]:
    """A smooth non-linear target of 8 features, from numpy arrays: 4,096 train and 1,024 test rows."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5120, 8)).astype(np.float32)
    y = np.sin(x[:, 0]) + x[:, 1] * x[:, 2] - 0.5 * x[:, 3] ** 2 + 0.1 * rng.normal(size=5120)
    x_t, y_t = torch.from_numpy(x), torch.from_numpy(y.astype(np.float32))
    return TensorDataset(x_t[:4096], y_t[:4096]), TensorDataset(x_t[4096:], y_t[4096:])


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="allreduce", choices=parambox.STRATEGIES)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="200 steps, for the test suite")
    args = p.parse_args()
    summary = parambox.train(
        model=make_model,
        data=make_data,
        loss=mse,
        strategy=args.strategy,
        workers=args.workers,
        steps=200 if args.quick else args.steps,
        batch_size=32,
        lr=0.05,
        momentum=0.9,
        eval_every=100,
        out=args.out,
        progress=not args.quick,
    )
    if summary is not None:  # rank 0
        # The target's variance is about 2.0 (what predicting the mean scores); the noise alone is 0.01.
        print(f"test MSE {summary['final_test_loss']:.4f} after {summary['steps']} steps")


if __name__ == "__main__":
    main()
