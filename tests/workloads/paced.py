"""A loss that takes ``PACE_S`` per call, as a worker's own accelerator would: the quorum run's workers
(``tests/test_quorum_run.py``) then compute beside each other on a small shared CPU without contending,
and the ``slow`` fault (0.2 s a step) makes one of them about 5x slower (measured 0.20-0.21 of the others' speed)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

PACE_S = 0.04


def loss(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    if model.training:  # the evaluation is not paced
        time.sleep(PACE_S)
    return F.cross_entropy(model(x), y)
