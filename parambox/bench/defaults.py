"""``parambox bench defaults``: does every strategy's default run train?

Runs ``parambox train --strategy X --seed S`` (the default digits run, nothing else given) for each
strategy and seed, one after the other as a user would, and reports each strategy's test accuracy
over the seeds: min, max and every value, and the seeds below the target (0.95). A strategy that needs
its own optimizer, rate or batch brings it (``Strategy.default_optimizer``, ``default_run``,
``default_options``): this is the check that it does.

``--model`` / ``--data``: the same default runs of another workload (``--model gpt``: on ``text``,
the model's own data set). On a sequence data set the figure is the test perplexity, lower is
better, and the target is the perplexity of the training bytes' own frequencies
(``unigram_perplexity``: 26.3 on CPython 3.11's standard library, 4.7 bits a byte): a run above it
has learnt nothing of the context.

``--compression int8,topk,...``: each strategy whose exchange takes ``compression`` once per encoding it
accepts (``--set STRATEGY.compression=MODE`` on its default run; rows such as ``diloco compression=int8``),
as pick varies its candidates: does each encoding train at the strategy's defaults?

``--quick`` (the suite's form): diloco (it brings its own optimizer), one seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parambox.errors import UserError
from parambox.runtime import scratch, spawn
from parambox.workload.targets import Target, lower_is_better

TARGET = 0.95
QUICK = {"strategies": ["diloco"], "seeds": [0]}  # the one that must bring its own optimizer
RUN_TIMEOUT_S = 600.0


def run_bench_defaults(
    strategies: list[str] | None = None,
    seeds: list[int] | None = None,
    quick: bool = False,
    model: str | None = None,
    data: str | None = None,
    steps: int | None = None,
    compressions: list[str] | None = None,
) -> dict[str, Any]:
    """Each strategy's default run per seed (``steps``: that many steps instead of the default run's;
    ``compressions``: each strategy whose exchange takes one, once per encoding it accepts)."""
    from parambox.strategies import STRATEGIES

    compressing = compressions is not None
    default = [s for s in STRATEGIES if _has_compression(s)] if compressing else list(STRATEGIES)
    strategies = strategies or (QUICK["strategies"] if quick else default)
    seeds = seeds if seeds is not None else (QUICK["seeds"] if quick else list(range(10)))
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise UserError(f"unknown strategy {unknown[0]!r}; choose from {', '.join(sorted(STRATEGIES))}")
    rows = _rows(strategies, compressions) if compressing else [(s, s, []) for s in strategies]
    goal = Goal.of(model, data)
    out: dict[str, Any] = {**goal.describe(), "seeds": seeds, "strategies": {}}
    if steps is not None:
        out["steps"] = steps
    extra = ["--steps", str(steps)] if steps is not None else []
    with scratch.folder(scratch.BENCH) as tmp:
        for label, name, flags in rows:
            folder = label.replace(" ", "-").replace("=", "-")
            runs = {
                seed: _train(name, seed, Path(tmp) / f"{folder}-{seed}", goal, [*flags, *extra])
                for seed in seeds
            }
            out["strategies"][label] = _summarise(runs, goal)
    return out


def _has_compression(strategy: str) -> bool:
    from parambox.strategies import strategy_class

    return "compression" in strategy_class(strategy).Options.model_fields


def _rows(strategies: list[str], modes: list[str]) -> list[tuple[str, str, list[str]]]:
    """(row label, strategy, its extra flags): each strategy that takes ``compression`` once per mode its
    options accept (``none``: as it is), the others as they are."""
    from parambox.strategies import accepts

    rows = []
    for name in strategies:
        if not _has_compression(name):
            rows.append((name, name, []))
            continue
        for mode in modes:
            if mode == "none":
                rows.append((name, name, []))
            elif accepts(name, {"compression": mode}):
                rows.append((f"{name} compression={mode}", name, ["--set", f"{name}.compression={mode}"]))
    return rows


@dataclass(frozen=True)
class Goal:
    """The workload of the default runs (``model``/``data`` None: the default run's) and what each
    must reach: test ``metric`` at least ``target`` (at most, where ``lower_is_better``)."""

    model: str | None = None
    data: str | None = None
    metric: str = "accuracy"
    target: float = TARGET
    lower_is_better: bool = False

    @classmethod
    def of(cls, model: str | None, data: str | None) -> Goal:
        from parambox.data import load_dataset
        from parambox.models.registry import MODELS, data_for, import_builders

        import_builders()  # the zoo registers itself on import: with --data given, nothing else imports it
        data = data or (data_for(model) if model else None)
        if model is not None and model not in MODELS and ":" not in model:
            raise UserError(f"unknown model {model!r}; choose from {', '.join(sorted(MODELS))}")
        if data is None:
            return cls(model)
        ds = load_dataset(data)
        if not ds.sequence:
            return cls(model, data)
        return cls(
            model, data, "perplexity", round(unigram_perplexity(ds.train_y), 1), lower_is_better("perplexity")
        )

    def flags(self) -> list[str]:
        return [
            f for name in ("model", "data") if getattr(self, name) for f in (f"--{name}", getattr(self, name))
        ]

    def reached(self, value: float | None) -> bool:
        return Target(self.metric, self.target, self.lower_is_better).reached(value)

    def describe(self) -> dict[str, Any]:
        what = {"target": self.target}
        if self.model or self.data:
            what.update(model=self.model or "lenet", data=self.data or "digits", metric=self.metric)
            what["lower_is_better"] = self.lower_is_better
        return what


def unigram_perplexity(targets: Any) -> float:
    """The perplexity of a model that knows only how often each token occurs in ``targets``.

    >>> import torch
    >>> round(unigram_perplexity(torch.tensor([0, 0, 1, 1])), 6)
    2.0
    """
    import torch

    counts = torch.bincount(targets.flatten().long()).double()
    p = counts[counts > 0] / counts.sum()
    return float(torch.exp(-(p * p.log()).sum()))


def _train(strategy: str, seed: int, run_dir: Path, goal: Goal, extra: list[str]) -> dict[str, Any]:
    """One default run as a user types it; its final test figure (None if it failed) and time."""
    cmd = [sys.executable, "-m", "parambox", "train", "--strategy", strategy, "--seed", str(seed)]
    cmd += [*goal.flags(), *extra, "--out", str(run_dir), "--no-progress"]
    t0 = time.perf_counter()
    from parambox.runtime import zygote

    env = {**os.environ, **zygote.shared_env()}  # its workers fork from this process's zygote, as pick's
    proc = spawn.start(cmd, env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        spawn.stop([proc])  # the launcher's session: its workers go with it
        return {"value": None, "seconds": RUN_TIMEOUT_S, "error": "timed out"}
    seconds = time.perf_counter() - t0
    summary = run_dir / "summary.json"
    if proc.returncode != 0 or not summary.exists():
        lines = stderr.strip().splitlines() or [f"exit {proc.returncode}"]
        return {"value": None, "seconds": seconds, "error": lines[-1]}
    value = json.loads(summary.read_text()).get(f"final_test_{goal.metric}")
    return {"value": value, "seconds": seconds}


def _summarise(runs: dict[int, dict[str, Any]], goal: Goal) -> dict[str, Any]:
    values = {s: r["value"] for s, r in runs.items()}
    done = [a for a in values.values() if a is not None]
    return {
        "min": min(done) if done else None,
        "max": max(done) if done else None,
        goal.metric: {str(s): a for s, a in values.items()},
        # "below": short of the target, whichever way the metric improves
        "below_target": [s for s, a in values.items() if not goal.reached(a)],
        "errors": {str(s): r["error"] for s, r in runs.items() if "error" in r},
        "seconds": round(sum(r["seconds"] for r in runs.values()), 1),
    }


def parse_seeds(text: str) -> list[int]:
    """``"0-9"`` -> 0..9; ``"0,3,5"`` -> [0, 3, 5].

    >>> parse_seeds("0-2"), parse_seeds("4,1")
    ([0, 1, 2], [4, 1])
    """
    seeds: list[int] = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            seeds += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    except ValueError:
        raise UserError(f"--seeds {text!r}: expected a range like 0-9 or a list like 0,3,5") from None
    if not seeds or min(seeds) < 0:
        raise UserError(f"--seeds {text!r}: expected seeds >= 0, e.g. 0-9")
    return seeds
