"""The single-neuron study (SHM-Learn-Dist §3, Fig. 2.1): ``parambox sweep --study neuron``.

One sigmoid neuron learns the step function (x in [0, 1), label x >= 0.5) with 2, 4, 8 and 16 workers,
lr 0.5, 10,000 steps per worker, plain SGD, gradient-averaged (Eq. 2.1, the ``allreduce`` strategy) and
weight-averaged (Eq. 2.2, ``weight-avg``, averaging every step). §3 does not give the batch size or the
loss: this study feeds each worker one sample per step (10,000 steps are then one epoch of the step
data set) and uses parambox's ``neuron`` model, whose cross-entropy is the logistic loss. Its settings
come from the ``neuron-study`` preset, so ``parambox train --preset neuron-study`` is one real run of it.

As in the report, the workers are simulated in one process (vectorised over workers). The simulation
consumes exactly the batches of a real run (``GlobalBatchSampler``: worker r takes slice r of the same
global batch) from the same initial weights, so it is cross-checked against real multi-process runs at
2 and 4 workers (1,000 steps by default): every worker's loss at every step must agree within 1e-5,
and the final weights within 1e-5 relative.

With plain SGD and averaging every step, Eq. 2.3 makes weight averaging *equal* to gradient averaging
(the replicas start equal): the two curves coincide up to rounding. ``--set weight-avg.period=K``
averages every K steps instead (local SGD), which makes them differ.

The loss curve of a worker count is the mean of the workers' batch losses at each step; its
roughness (std of the step-to-step differences) measures how noisy it is. The report's result, that
more workers give a smoother curve, is ``roughness`` decreasing with the worker count.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from parambox.config import merge
from parambox.data import load_dataset
from parambox.data.base import Dataset, GlobalBatchSampler
from parambox.errors import UserError
from parambox.models import build_model
from parambox.studies.runs import PlannedRun, ensure_runs, validate

SCHEMES = {"gradient-averaged": "allreduce", "weight-averaged": "weight-avg"}
PLAIN_SGD = {"optimizer": "sgd", "momentum": 0.0, "threads": 1}  # the real runs' defaults, unless base says
# float32 rounding (allreduce sums in another order than the simulation): losses within TOLERANCE,
# final weights within TOLERANCE relative to their size (they grow to ~27 here).
TOLERANCE = 1e-5


def initial_state(seed: int) -> tuple[Dataset, float, float]:
    """The step data set and the neuron's initial (weight, bias), drawn as ``parambox train`` draws them."""
    torch.manual_seed(seed)
    ds = load_dataset("step", None, seed)
    linear = build_model("neuron", ds.input_shape, ds.num_classes)[1]
    return ds, float(linear.weight.detach().reshape(())), float(linear.bias.detach().reshape(()))


def worker_batches(ds: Dataset, workers: int, batch_size: int, steps: int, seed: int):
    """(x, y), each (steps, workers, batch_size): worker r's batch at step t, as in a real run."""
    sampler = GlobalBatchSampler(len(ds.train_y), workers * batch_size, 0, 1, seed)
    idx = torch.stack([sampler.indices(t) for t in range(steps)])
    shape = (steps, workers, batch_size)
    return ds.train_x[idx, 0].reshape(shape), ds.train_y[idx].reshape(shape)


def simulate(
    workers: int, scheme: str, lr: float, steps: int, batch_size: int = 1, seed: int = 0, period: int = 1
) -> tuple[torch.Tensor, tuple[float, float]]:
    """Per-worker batch losses (steps, workers) and the final (weight, bias) of ``workers`` simulated workers.

    >>> losses, (w, b) = simulate(2, "gradient-averaged", lr=0.5, steps=100)
    >>> losses.shape
    torch.Size([100, 2])
    """
    assert scheme in SCHEMES, scheme
    ds, w0, b0 = initial_state(seed)
    xs, ys = worker_batches(ds, workers, batch_size, steps, seed)
    # One replica per worker (all equal under gradient averaging); the weights each step saw are
    # kept so the losses can be computed in one go afterwards.
    ws, bs = torch.empty(steps, workers, 1), torch.empty(steps, workers, 1)
    w, b = torch.full((workers, 1), w0), torch.full((workers, 1), b0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: extra threads only cost, a lot on a loaded machine
    try:
        for t in range(steps):
            ws[t], bs[t] = w, b
            x = xs[t]
            dz = (torch.sigmoid(x * w + b) - ys[t]) / batch_size  # d(mean logistic loss)/dz
            gw, gb = (dz * x).sum(dim=1, keepdim=True), dz.sum(dim=1, keepdim=True)
            if scheme == "gradient-averaged":  # Eq. 2.1: average the gradients, apply to the shared weights
                w, b = w - lr * (gw.sum() / workers), b - lr * (gb.sum() / workers)
            else:  # Eq. 2.2: each worker applies its own gradient; the weights are averaged every period
                w, b = w - lr * gw, b - lr * gb
                if (t + 1) % period == 0 or t + 1 == steps:
                    w, b = _mean_replica(w), _mean_replica(b)
        losses = batch_losses(xs * ws + bs, ys)
    finally:
        torch.set_num_threads(threads)
    return losses, (float(w[0]), float(b[0]))


def _mean_replica(v: torch.Tensor) -> torch.Tensor:
    return (v.sum(0, keepdim=True) / len(v)).expand_as(v)


def batch_losses(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the neuron's logits [0, z] over the last dimension (each worker's batch)."""
    logits = torch.stack([torch.zeros_like(z), z], dim=-1).reshape(-1, 2)
    return F.cross_entropy(logits, y.reshape(-1), reduction="none").reshape_as(z).mean(dim=-1)


def roughness(curve: torch.Tensor) -> float:
    """Standard deviation of the step-to-step changes of a loss curve: 0 for a smooth one."""
    return float(curve.diff().std())


def curve_figures(losses: torch.Tensor, final: tuple[float, float]) -> dict[str, float]:
    curve = losses.mean(dim=1)
    tail = curve[-max(1, len(curve) // 10) :]
    w, b = final
    return {
        "roughness": roughness(curve),
        "total_variation_per_step": float(curve.diff().abs().mean()),
        "final_loss": float(tail.mean()),  # mean over the last 10 % of the steps
        "weight": w,
        "bias": b,
        "decision_boundary": -b / w if w else math.nan,  # where sigmoid(w x + b) = 0.5; ideal 0.5
    }


# -- cross-check against real runs -------------------------------------------------------------------


def rank_losses(run_dir: Path, workers: int) -> torch.Tensor:
    """(steps, workers) batch losses of a real run, from metrics.jsonl and metrics.rank{r}.jsonl."""
    columns = []
    for r in range(workers):
        name = "metrics.jsonl" if r == 0 else f"metrics.rank{r}.jsonl"
        records = [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line.strip()]
        columns.append(
            torch.tensor(  # a diverged step's loss is null in the file
                [_nan_if_none(rec["loss"]) for rec in records if rec["kind"] == "step"], dtype=torch.float64
            )
        )
    return torch.stack(columns, dim=1)


def cross_check(
    out: Path,
    base: dict[str, Any],
    workers: tuple[int, ...] = (2, 4),
    steps: int = 1000,
    run_timeout_s: float = 600.0,
) -> dict[str, dict[str, float]]:
    """Real ``parambox train`` runs of both schemes vs the simulation: max abs differences per run."""
    planned = [
        PlannedRun(
            f"{strategy}-w{n}",
            merge(
                base,
                {"strategy": strategy, "workers": n, "steps": steps, "eval_every": 0, "checkpoint_every": 0},
            ),
        )
        for n in workers
        for strategy in SCHEMES.values()
    ]
    configs = [validate(p.config) for p in planned]
    if any(c.momentum != 0 or c.optimizer != "sgd" for c in configs):
        raise UserError("the neuron study simulates plain SGD: set momentum 0 and optimizer sgd")
    outcomes = ensure_runs(planned, out, run_timeout_s, echo=False)
    report = {}
    for p, cfg, o in zip(planned, configs, outcomes):
        if o.error:
            raise UserError(f"cross-check run {o.run_dir} failed: {o.error}")
        n, scheme = cfg.workers, next(k for k, v in SCHEMES.items() if v == cfg.strategy)
        period = cfg.strategy_options("weight-avg").period
        sim, (w, b) = simulate(n, scheme, cfg.lr, steps, cfg.batch_size, cfg.seed, period)
        model = torch.load(o.run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
        report[p.name] = {
            "max_abs_loss_diff": float((rank_losses(o.run_dir, n) - sim.double()).abs().max()),
            "max_rel_weight_diff": max(
                _rel_diff(float(model["1.weight"]), w), _rel_diff(float(model["1.bias"]), b)
            ),
        }
    return report


def _rel_diff(real: float, sim: float) -> float:
    # Relative for large weights: float32 rounding (~1e-7 of |w| per step) random-walks over the steps.
    return abs(real - sim) / max(1.0, abs(sim))


# -- the study ---------------------------------------------------------------------------------------


def run_neuron_study(
    out: str | Path,
    workers: tuple[int, ...] = (2, 4, 8, 16),
    lr: float = 0.5,
    steps: int = 10_000,
    batch_size: int = 1,
    seed: int = 0,
    period: int = 1,
    cross_check_workers: tuple[int, ...] = (2, 4),
    cross_check_steps: int = 1000,
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Simulate both schemes for every worker count, cross-check, write results.json and the figures.

    >>> run_neuron_study("sweeps/neuron", steps=2000, cross_check_workers=())  # doctest: +SKIP
    """
    from parambox.studies.figures import neuron as neuron_figures

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    curves, figures = simulate_all(workers, lr, steps, batch_size, seed, period)
    setup = {
        "workers": list(workers),
        "lr": lr,
        "steps_per_worker": steps,
        "batch_size": batch_size,
        "seed": seed,
        "weight_avg_period": period,
        "loss": "logistic (cross-entropy of [0, z])",
    }
    results: dict[str, Any] = {
        "study": "neuron",
        "setup": setup,
        "schemes": figures,
        "smoother_with_more_workers": {
            s: all(a["roughness"] > b["roughness"] for a, b in zip(list(f.values()), list(f.values())[1:]))
            for s, f in figures.items()
        },
        "max_abs_diff_between_schemes": max(
            float((curves[("gradient-averaged", n)] - curves[("weight-averaged", n)]).abs().max())
            for n in workers
        ),
    }
    if cross_check_workers:
        fixed = {"lr": lr, "batch_size": batch_size, "seed": seed, "model": "neuron", "data": "step"}
        checks = cross_check(
            out / "cross_check",
            merge(merge(PLAIN_SGD, base or {}), fixed),
            cross_check_workers,
            cross_check_steps,
        )
        results["cross_check"] = {
            "steps": cross_check_steps,
            "tolerance": TOLERANCE,
            "runs": checks,
            "agrees": all(max(c.values()) <= TOLERANCE for c in checks.values()),
        }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    neuron_figures.write_all(curves, results, out)
    return results


def simulate_all(
    workers: tuple[int, ...], lr: float, steps: int, batch_size: int, seed: int, period: int
) -> tuple[dict[tuple[str, int], torch.Tensor], dict[str, dict[str, dict[str, float]]]]:
    """Both schemes at every worker count: ({(scheme, n): mean loss per step}, {scheme: {n: figures}})."""
    curves, figures = {}, {}
    for scheme in SCHEMES:
        for n in workers:
            losses, final = simulate(n, scheme, lr, steps, batch_size, seed, period)
            curves[(scheme, n)] = losses.mean(dim=1)
            figures.setdefault(scheme, {})[str(n)] = curve_figures(losses, final)
    return curves, figures


def print_results(results: dict[str, Any], out: Path) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="single sigmoid neuron: loss curve per worker count")
    for h in ("scheme", "workers", "roughness", "final loss", "decision boundary"):
        table.add_column(h)
    for scheme, per_n in results["schemes"].items():
        for n, f in per_n.items():
            table.add_row(
                scheme, n, f"{f['roughness']:.4f}", f"{f['final_loss']:.4f}", f"{f['decision_boundary']:.3f}"
            )
    Console().print(table)
    print(f"smoother with more workers: {results['smoother_with_more_workers']}")
    check = results.get("cross_check")
    if check:
        worst = max(max(c.values()) for c in check["runs"].values())
        print(
            f"cross-check against real runs ({check['steps']} steps): max abs difference {worst:.2e} "
            f"({'agrees' if check['agrees'] else 'DISAGREES'} within {check['tolerance']:g})"
        )
    print(f"results in {out / 'results.json'}")
    return 0 if not check or check["agrees"] else 1


def _nan_if_none(value: float | None) -> float:
    return float("nan") if value is None else value
