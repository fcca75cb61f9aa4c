"""What sweeps and studies share: launching ``parambox train`` runs (resumably) and reading loss curves.

Each run is a plain ``python -m parambox train ... --out DIR`` subprocess, exactly what a user would
type, so a sweep measures the same thing as a hand-made run, start-up excluded (run times come from
the run's own ``metrics.jsonl``). A directory holding ``summary.json`` is a finished run and is never
run again; any other directory is an unfinished one and is cleared and run from the start, so every
loss-vs-time curve of a sweep comes from one uninterrupted process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parambox.config import RunConfig, build_config
from parambox.errors import UserError, terminate_as_interrupt
from parambox.runtime import spawn, zygote

# Fields a sweep sets on every run; a finished run directory must agree on them to be reused.
CHECKED_FIELDS = ("strategy", "workers", "model", "data", "batch_size", "lr", "steps", "seed", "momentum")


@dataclass
class PlannedRun:
    """One training run of a sweep: its directory name and its full config (a dict RunConfig accepts)."""

    name: str
    config: dict[str, Any]


@dataclass
class Outcome:
    name: str
    run_dir: Path
    launched: bool  # False: a finished run from an earlier invocation was reused
    error: str | None = None  # last line of stderr when the run failed


def validate(config: dict[str, Any]) -> RunConfig:
    """A planned run's config as RunConfig, so bad values fail before anything is launched."""
    return build_config(config)


def train_args(config: dict[str, Any], run_dir: Path) -> list[str]:
    """``train`` arguments reproducing ``config``: every field as ``--set key=value`` (TOML values)."""
    args = ["train", "--out", str(run_dir), "--no-progress"]
    for key, value in config.items():
        if key in ("out", "progress") or value is None:
            continue
        if key == "options":
            for table, opts in value.items():
                args += [f"--set={table}.{k}={_toml(v)}" for k, v in opts.items()]
        elif isinstance(value, dict):  # the [box] table
            args += [f"--set={key}.{k}={_toml(v)}" for k, v in value.items() if v is not None]
        else:
            args.append(f"--set={key}={_toml(value)}")
    return args


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def is_finished(run_dir: Path) -> bool:
    return (run_dir / "summary.json").exists()


def check_reusable(run_dir: Path, config: dict[str, Any]) -> None:
    """A finished run may stand for a planned one only if it was made with the same settings."""
    done = json.loads((run_dir / "summary.json").read_text()).get("config", {})
    for key in CHECKED_FIELDS:
        if key in config and key in done and done[key] != config[key]:
            raise UserError(
                f"{run_dir} holds a finished run with {key}={done[key]!r}, this sweep wants "
                f"{config[key]!r}; use another --out"
            )


def ensure_runs(
    planned: list[PlannedRun], runs_dir: Path, timeout_s: float, echo: bool = True
) -> list[Outcome]:
    """Run every planned run that is not finished yet, one after the other (the machine is shared)."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    todo = [p for p in planned if not is_finished(runs_dir / p.name)]
    for p in planned:
        if p not in todo:
            check_reusable(runs_dir / p.name, p.config)
    if echo and len(todo) < len(planned):
        print(f"resuming: {len(planned) - len(todo)} finished run(s) reused, {len(todo)} to run")
    outcomes = []
    with terminate_as_interrupt():
        for p in planned:
            outcomes.append(_ensure_one(p, runs_dir, todo, timeout_s, echo))
    return outcomes


def _ensure_one(
    p: PlannedRun, runs_dir: Path, todo: list[PlannedRun], timeout_s: float, echo: bool
) -> Outcome:
    run_dir = runs_dir / p.name
    if p not in todo:
        return Outcome(p.name, run_dir, launched=False)
    if echo:
        print(f"[{todo.index(p) + 1}/{len(todo)}] {p.name}", flush=True)
    outcome = launch_run(p, run_dir, timeout_s)
    if echo and outcome.error:
        print(f"  failed: {outcome.error}", flush=True)
    return outcome


def launch_run(p: PlannedRun, run_dir: Path, timeout_s: float) -> Outcome:
    """One ``parambox train`` subprocess; its output goes to ``run_dir/train.log``."""
    if run_dir.exists():  # unfinished: start over, so the loss curve's clock is one process's
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "parambox", *train_args(p.config, run_dir)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **zygote.shared_env())  # workers forked warm
    with open(run_dir / "train.log", "w") as log:
        # A session of its own, so a timeout or Ctrl-C stops the run's workers too, not just the launcher.
        proc = spawn.start(cmd, env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout_s)
        except BaseException as e:
            spawn.stop([proc])
            if isinstance(e, subprocess.TimeoutExpired):
                return Outcome(p.name, run_dir, True, f"ran past --run-timeout {timeout_s:.0f} s")
            raise
    if code == 0 and is_finished(run_dir):
        return Outcome(p.name, run_dir, True)
    return Outcome(p.name, run_dir, True, _last_error(run_dir / "train.log", code))


def clock_lead(run_dir: Path) -> float:
    """Seconds by which the first rank to start training started before rank 0 (0 when none did).

    Every rank's metrics clock starts at its own training start, and its first ``world`` record holds
    that moment as ``epoch`` (Unix time). Asynchronous ranks do not wait for each other: where rank 0
    set up last, the others trained before its clock began, and a time to target on rank 0's clock
    leaves that out. (The ranks' wall clocks: one host here; NTP-synchronised on a cluster.)

    0 for a run whose strategy steps in lockstep (``Strategy.lockstep``, read from its config.json): a
    rank that started first only waited in its first collective for rank 0 (ps-sync's rank 0 sets up
    its server 1.7 s after its workers on the emulated cluster: pick's validation counted that wait
    as training, and measured ps-sync 2.3x slower than its steps)."""
    if _lockstep(run_dir):
        return 0.0
    starts: dict[str, float] = {}
    for path in run_dir.glob("metrics*.jsonl"):
        with open(path, errors="replace") as f:
            try:
                first = json.loads(f.readline())
            except json.JSONDecodeError:
                continue
        if first.get("kind") == "world" and isinstance(first.get("epoch"), int | float):
            starts[path.name] = float(first["epoch"])
    if "metrics.jsonl" not in starts:
        return 0.0
    return max(0.0, starts["metrics.jsonl"] - min(starts.values()))


def _lockstep(run_dir: Path) -> bool:
    """Whether the run's strategy steps in lockstep; False when its config is missing or unreadable."""
    from parambox.strategies import strategy_class

    try:
        config = json.loads((run_dir / "config.json").read_text())
        name = config["strategy"]
        return strategy_class(name, config.get("options", {}).get(name, {})).lockstep
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return False


def _last_error(log: Path, code: int) -> str:
    """A failed run's reason: the last line of its log that names an error (the CLI's own prefix off:
    the study prints it after its own ``failed:``)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [f"exit code {code}"])[-1].strip().removeprefix("parambox: error: ")[:300]


# Per data set: (samples per run, loss threshold). 24,576 = 2^13 * 3 divides every global batch of
# 16..512 x 1..8 workers (the report chose 307,200 for CIFAR-10 the same way); the CIFAR-10 threshold
# is the report's 1.8, the others sit where a run has clearly learnt (digits: ~95 % train accuracy).
DATASET_DEFAULTS: dict[str, tuple[int, float]] = {
    "digits": (24_576, 0.3),
    "synthetic": (24_576, 0.3),
    "step": (24_576, 0.3),
    "mnist": (307_200, 0.3),
    "cifar10": (307_200, 1.8),
}
FALLBACK_DEFAULTS = (24_576, 0.5)
