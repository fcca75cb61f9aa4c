"""The single-neuron study (SHM-Learn-Dist §3): the simulation against the real model and real runs, and
the report's result that more workers give a smoother loss curve."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from parambox.cli import main
from parambox.data import BatchSource
from parambox.models import build_model
from parambox.presets import preset
from parambox.studies.neuron import (
    SCHEMES,
    TOLERANCE,
    cross_check,
    initial_state,
    rank_losses,
    roughness,
    simulate,
)


def emulate_with_the_real_model(workers: int, lr: float, steps: int, seed: int = 0) -> torch.Tensor:
    """Gradient averaging written the plain way: the real model, autograd, one BatchSource per rank."""
    ds, _, _ = initial_state(seed)
    torch.manual_seed(seed)
    model = build_model("neuron", ds.input_shape, ds.num_classes)
    sources = [BatchSource(ds, 1, r, workers, seed, augment=False) for r in range(workers)]
    losses = torch.empty(steps, workers)
    for t in range(steps):
        grads = []
        for r, src in enumerate(sources):
            model.zero_grad()
            loss = F.cross_entropy(model(src.batch(t)[0]), src.batch(t)[1])
            loss.backward()
            losses[t, r] = loss.detach()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= lr * sum(g[i] for g in grads) / workers
    return losses


@pytest.mark.parametrize("workers", [2, 4])
def test_simulation_matches_the_real_model_and_sampler(workers):
    sim, _ = simulate(workers, "gradient-averaged", lr=0.5, steps=40)
    assert (sim - emulate_with_the_real_model(workers, 0.5, 40)).abs().max() <= TOLERANCE


def test_weight_averaging_every_step_equals_gradient_averaging():
    # Eq. 2.3: with plain SGD and equal replicas the two schemes are the same update.
    grad, (w1, b1) = simulate(4, "gradient-averaged", 0.5, 500)
    weight, (w2, b2) = simulate(4, "weight-averaged", 0.5, 500)
    assert (grad - weight).abs().max() <= TOLERANCE and abs(w1 - w2) <= TOLERANCE * abs(w1)
    local, _ = simulate(4, "weight-averaged", 0.5, 500, period=10)  # local SGD does differ
    assert (grad - local).abs().max() > 1e-3


def test_more_workers_give_a_smoother_loss_curve():
    rough = [roughness(simulate(n, "gradient-averaged", 0.5, 2000)[0].mean(dim=1)) for n in (2, 4, 8, 16)]
    assert all(a > b for a, b in zip(rough, rough[1:])), rough
    # Averaging n independent one-sample losses: roughly 1/sqrt(2) per doubling of the workers.
    for a, b in zip(rough, rough[1:]):
        assert 0.55 < b / a < 0.85, rough


def test_the_neuron_learns_the_step():
    _, (w, b) = simulate(8, "gradient-averaged", 0.5, 3000)
    assert abs(-b / w - 0.5) < 0.03  # the decision boundary of sigmoid(w x + b)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_simulation_matches_real_multiprocess_runs(tmp_path):
    base = {k: v for k, v in preset("neuron-study").items() if k not in ("workers", "steps")}
    report = cross_check(tmp_path, base, workers=(2,), steps=30)
    assert set(report) == {f"{s}-w2" for s in SCHEMES.values()}
    for diffs in report.values():
        assert diffs["max_abs_loss_diff"] <= TOLERANCE and diffs["max_rel_weight_diff"] <= TOLERANCE
    assert rank_losses(tmp_path / "allreduce-w2", 2).shape == (30, 2)  # every step of every worker compared


def test_study_command_writes_its_files(tmp_path, capsys):
    out = tmp_path / "neuron"
    assert main(["sweep", "--study", "neuron", "--steps", "400", "--no-cross-check", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["setup"]["lr"] == 0.5 and results["setup"]["workers"] == [2, 4, 8, 16]
    assert results["smoother_with_more_workers"] == {"gradient-averaged": True, "weight-averaged": True}
    assert (out / "loss_curves.png").stat().st_size > 0 and (out / "smoothness.png").stat().st_size > 0
    assert "roughness" in capsys.readouterr().out
    assert main(["sweep", "--study", "neuron", "--set", "momentum=0.9", "--out", str(out)]) == 2
