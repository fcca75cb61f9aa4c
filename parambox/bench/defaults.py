"""``parambox bench defaults``: does every strategy's default run train?

Runs ``parambox train --strategy X --seed S`` (the default digits run, nothing else given) for each
strategy and seed, one after the other as a user would, and reports each strategy's test accuracy
over the seeds: min, max and every value, and the seeds below the target (0.95). A strategy that needs
its own optimizer, rate or batch brings it (``Strategy.default_optimizer``, ``default_run``,
``default_options``): this is the check that it does.

``--quick`` (the suite's form): diloco (it brings its own optimizer), one seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from parambox.errors import UserError
from parambox.runtime import scratch, spawn

TARGET = 0.95
QUICK = {"strategies": ["diloco"], "seeds": [0]}  # the one that must bring its own optimizer
RUN_TIMEOUT_S = 600.0


def run_bench_defaults(
    strategies: list[str] | None = None, seeds: list[int] | None = None, quick: bool = False
) -> dict[str, Any]:
    from parambox.strategies import STRATEGIES

    strategies = strategies or (QUICK["strategies"] if quick else list(STRATEGIES))
    seeds = seeds if seeds is not None else (QUICK["seeds"] if quick else list(range(10)))
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise UserError(f"unknown strategy {unknown[0]!r}; choose from {', '.join(sorted(STRATEGIES))}")
    out: dict[str, Any] = {"target": TARGET, "seeds": seeds, "strategies": {}}
    with scratch.folder(scratch.BENCH) as tmp:
        for name in strategies:
            runs = {seed: _train(name, seed, Path(tmp) / f"{name}-{seed}") for seed in seeds}
            out["strategies"][name] = _summarise(runs)
    return out


def _train(strategy: str, seed: int, run_dir: Path) -> dict[str, Any]:
    """One default run as a user types it; its final test accuracy (None if it failed) and time."""
    cmd = [sys.executable, "-m", "parambox", "train", "--strategy", strategy, "--seed", str(seed)]
    cmd += ["--out", str(run_dir), "--no-progress"]
    t0 = time.perf_counter()
    from parambox.runtime import zygote

    env = {**os.environ, **zygote.shared_env()}  # its workers fork from this process's zygote, as pick's
    proc = spawn.start(cmd, env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        spawn.stop([proc])  # the launcher's session: its workers go with it
        return {"accuracy": None, "seconds": RUN_TIMEOUT_S, "error": "timed out"}
    seconds = time.perf_counter() - t0
    summary = run_dir / "summary.json"
    if proc.returncode != 0 or not summary.exists():
        lines = stderr.strip().splitlines() or [f"exit {proc.returncode}"]
        return {"accuracy": None, "seconds": seconds, "error": lines[-1]}
    accuracy = json.loads(summary.read_text()).get("final_test_accuracy")
    return {"accuracy": accuracy, "seconds": seconds}


def _summarise(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    accs = {s: r["accuracy"] for s, r in runs.items()}
    done = [a for a in accs.values() if a is not None]
    return {
        "min": min(done) if done else None,
        "max": max(done) if done else None,
        "accuracy": {str(s): a for s, a in accs.items()},
        "below_target": [s for s, a in accs.items() if a is None or a < TARGET],
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
