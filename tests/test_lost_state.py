"""Nothing lost on resume (issue 21): state a strategy keeps beyond the model weights is checkpointed and
restored, and a run that diverges keeps its last finite checkpoint. In-process, one worker."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parambox.runtime.spawn import PREFIX_ENV, new_prefix, remove_segments
from parambox.runtime.world import World
from parambox.strategies import Context, build_strategy
from parambox.training import checkpoint


def ce(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def context(lr: float = 0.1, momentum: float = 0.9, optimizer=torch.optim.SGD) -> Context:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    make = (lambda p: optimizer(p, lr=lr, momentum=momentum)) if optimizer is torch.optim.SGD else None
    return Context(World(), model, make or (lambda p: optimizer(p, lr=lr)), ce, 100, 10.0)


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def train(strategy, n: int = 6) -> None:
    for step, batch in enumerate(batches(n)):
        strategy.step(batch, step)


@pytest.mark.parametrize("name", ["easgd", "eamsgd"])
def test_sync_easgd_checkpoints_its_center_and_velocity(name):
    s = build_strategy(name, context(), {"sync": True, "tau": 2})
    train(s)
    state = s.state_dict()
    assert "center" in state and float((s.c - s.x).abs().max()) > 0
    fresh = build_strategy(name, context(), {"sync": True, "tau": 2})
    fresh.load_model_state(s.model.state_dict())
    fresh.load_state_dict(state)
    assert torch.equal(fresh.c, s.c)  # before: the center was back at the initial weights
    if name == "eamsgd":
        assert float(s.local.v.abs().sum()) > 0 and torch.equal(fresh.local.v, s.local.v)
    for strategy in (s, fresh):
        strategy.close()


def test_downpour_adagrad_sums_survive_a_resume(monkeypatch):
    prefixes = [new_prefix(), new_prefix()]  # two runs' boxes: the first's, and the resumed one's
    monkeypatch.setenv(PREFIX_ENV, prefixes[0])
    opts = {"adagrad": True, "n_fetch": 1, "n_push": 1}
    s = build_strategy("downpour", context(momentum=0.0), opts)
    try:
        train(s)
        sums = s.box.pull(torch.empty(s.numel), s.extra_start).clone()
        assert float(sums.sum()) > 0
        state = s.state_dict()
    finally:
        s.close()
    monkeypatch.setenv(PREFIX_ENV, prefixes[1])
    fresh = build_strategy("downpour", context(momentum=0.0), opts)
    try:
        fresh.load_state_dict(state)
        restored = fresh.box.pull(torch.empty(fresh.numel), fresh.extra_start)
        assert torch.equal(restored, sums)  # before: 0, every rate back to gamma / eps
    finally:
        fresh.close()
        for prefix in prefixes:
            assert remove_segments(prefix) == []


def test_a_diverged_run_keeps_its_last_finite_checkpoint(tmp_path, monkeypatch, capsys):
    """NaN batches from step 7 on: the checkpoint of step 5 stays, those of steps 10 and 12 are refused,
    and the run fails naming it (a diverged run is not a success)."""
    from parambox.cli import main

    monkeypatch.setenv("PARAMBOX_FAULT", "0:7:nan")
    out = tmp_path / "run"
    argv = ["train", "--strategy", "single", "--model", "mlp", "--steps", "12", "--checkpoint-every", "5"]
    assert main([*argv, "--eval-every", "0", "--no-progress", "--out", str(out)]) == 2
    last = checkpoint.load(out / "checkpoints" / "last.pt")
    assert last["step"] == 5
    assert all(bool(t.isfinite().all()) for t in last["model"].values())
    err = capsys.readouterr().err
    assert "not finite" in err and "last good checkpoint is step 5" in err


def test_sync_diloco_rejoins_after_a_nonfinite_round():
    """A NaN batch in round 0 (its docstring: the worker contributes nothing, then rejoins from theta)."""
    ctx = context(lr=1e-2, optimizer=torch.optim.AdamW)
    s = build_strategy("diloco", ctx, {"inner_steps": 2})
    good = batches(6)
    bad = (torch.full_like(good[0][0], float("nan")), good[0][1])
    s.step(good[0], 0)
    s.step(bad, 1)
    assert s.nonfinite == {0}
    theta = s.theta.detach().clone()
    for step in range(2, 6):
        s.step(good[step], step)
    for state in s.optimizer.state.values():  # before: NaN moments, so NaN in every later round
        assert all(bool(v.isfinite().all()) for v in state.values())
    assert float((s.theta.detach() - theta).abs().max()) > 0  # it contributed again
    assert all(bool(p.isfinite().all()) for p in s.params)
    s.close()
