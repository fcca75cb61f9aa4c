"""A user's metrics whose accuracy is called ``acc`` (and no ``accuracy``): ``parambox pick`` reaches
its target on it."""

from __future__ import annotations

import torch.nn.functional as F


def metrics(model, batch):
    x, y = batch
    out = model(x)
    return {"loss": float(F.cross_entropy(out, y)), "acc": float((out.argmax(1) == y).float().mean())}
