"""Audit item 7: sandblaster's slow worker computes slowly (its portion's gradient again and again), instead
of sleeping, so ``bench sandblaster`` measures the backups against a worker that is busy; the result is the
fast worker's, and a stop still cuts the extra passes short."""

from __future__ import annotations

import time

import torch

from parambox.strategies.sandblaster.portions import compute_portion


def _counted():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    calls = []

    def loss(m, batch):
        calls.append(time.perf_counter())
        x, y = batch
        return torch.nn.functional.mse_loss(m(x), y)

    return model, loss, calls


def test_a_slow_portion_computes_its_gradient_again_and_gives_the_same_result():
    batch = (torch.randn(64, 4), torch.randn(64, 1))
    model, loss, calls = _counted()
    fast = compute_portion(model, loss, batch, (0, 64))
    assert len(calls) == 1
    calls.clear()
    slow = compute_portion(model, loss, batch, (0, 64), slow_factor=4.0)
    assert len(calls) >= 2  # its own pass, then passes again until 4x its time: computing, not asleep
    assert torch.equal(slow[3:], fast[3:]) and slow[:2].tolist() == fast[:2].tolist()


def test_a_stop_cuts_the_extra_passes_short():
    batch = (torch.randn(64, 4), torch.randn(64, 1))
    model, loss, calls = _counted()
    asked = []

    def stopped():
        asked.append(1)
        return len(calls) >= 3  # the evaluation is over after the 2nd extra pass

    assert compute_portion(model, loss, batch, (0, 64), slow_factor=1000.0, stopped=stopped) is None
    assert len(calls) == 3
