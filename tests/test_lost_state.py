"""Nothing lost on resume (issue 21): state a strategy keeps beyond the model weights is checkpointed and
restored, and a run that diverges keeps its last finite checkpoint. In-process, one worker."""

from __future__ import annotations

import copy

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


@pytest.mark.parametrize(
    "name,opts",
    [
        ("downpour", {"n_fetch": 2, "n_push": 2}),  # a push every other step: step 7's carries step 7's
        ("diloco", {"asynchronous": True, "inner_steps": 2, "outer_lr": 1.0, "outer_momentum": 0.0}),
    ],
)
def test_a_lost_box_is_rebuilt_from_the_replicas_and_each_worker_starts_from_it(
    name, opts, tmp_path, monkeypatch, capsys
):
    """Issue 50: a box lost across nodes (``training/salvage.py``). The workers keep their replicas; the
    restart puts back their mean as the center (not the checkpoint's), rank 0 goes on at its own step,
    and its next exchange carries only what it did since: here one worker, so the center equals ``x``
    after it (downpour's push; diloco's round with outer lr 1 and no momentum). Before, ``x - snap``
    (``pulled - x``) would have carried the whole run since the start a second time."""
    from types import SimpleNamespace

    from parambox.training import salvage

    prefixes = [new_prefix(), new_prefix()]  # the lost box, and the restarted job's
    monkeypatch.setenv(PREFIX_ENV, prefixes[0])
    s = build_strategy(name, context(momentum=0.0), opts)
    data = batches(8)
    try:
        train(s, 4)
        committed = checkpoint.rank_state(s.model.state_dict(), s.state_dict())  # last.pt's, at step 4
        for step in range(4, 7):
            s.step(data[step], step)
        salvage.save(SimpleNamespace(strategy=s, world=s.world, run_dir=tmp_path), 7, {})
        mine = {k: v.clone() for k, v in s.model.state_dict().items()}
        other = {k: v + 0.5 for k, v in mine.items()}  # another worker's replica of the same box
        ckpt = tmp_path / "checkpoints"
        checkpoint.save_rank_state(ckpt, 1, 6, checkpoint.rank_state(other, s.salvage_state(6)))
        older = {**s.salvage_state(3), "box": s.membership.born - 1}  # a box before the commit's
        checkpoint.save_rank_state(ckpt, 2, 3, checkpoint.rank_state(other, older))
        checkpoint.save_rank_state(ckpt, 3, 9, checkpoint.rank_state(other, s.state_dict()))  # not salvaged
        assert salvage.salvaged(ckpt, s.membership.born + 1) == ([], [], [])  # a later commit: none
    finally:
        s.close()
    monkeypatch.setenv(PREFIX_ENV, prefixes[1])
    fresh = build_strategy(name, context(momentum=0.0), opts)
    try:
        resumed = checkpoint.Resumed(4, committed, 1, {}, 4, rank0=committed)
        salvage.rebuild(SimpleNamespace(strategy=fresh, world=fresh.world, run_dir=tmp_path), resumed)
        assert "rebuilt from the replicas that ranks 0, 1 kept" in capsys.readouterr().err
        assert resumed.step == 7 and resumed.state["replica"].keys() == mine.keys()
        assert fresh.rebuilt == {"ranks": [0, 1], "steps": [7, 6], "checkpoint_step": 4}
        fresh.load_model_state(resumed.state["replica"])
        fresh.load_state_dict(resumed.state["strategy"])
        vector = nn.utils.parameters_to_vector
        mean = torch.cat([(mine[k] + other[k]).flatten() / 2 for k, _ in fresh.model.named_parameters()])
        center = fresh.box.pull(torch.empty(fresh.numel))
        assert torch.allclose(center, mean) and torch.equal(fresh.x, center)
        assert torch.equal(vector(fresh.model.parameters()), fresh.x)  # (the layout is the parameters')
        taken = [data[7]] if name == "downpour" else [data[7], data[6]]  # to the next exchange
        for step, batch in enumerate(taken, start=7):
            fresh.step(batch, step)
        # The closed form: plain SGD from the rebuilt center over those steps (outer lr 1: diloco's
        # theta - (pulled - x) is x when pulled is the center)
        ref = copy.deepcopy(fresh.model)
        nn.utils.vector_to_parameters(center, ref.parameters())
        sgd = torch.optim.SGD(ref.parameters(), lr=fresh.optimizer.param_groups[0]["lr"])
        for batch in taken:
            sgd.zero_grad()
            ce(ref, batch).backward()
            sgd.step()
        assert torch.allclose(fresh.box.pull(torch.empty(fresh.numel)), vector(ref.parameters()), atol=1e-6)
    finally:
        fresh.close()
        for prefix in prefixes:
            assert remove_segments(prefix) == []
