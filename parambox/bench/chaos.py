"""``parambox bench chaos``: an asynchronous run that keeps losing workers, against the same run without faults.

Runs of ``parambox train --strategy easgd --workers 3`` (digits, LeNet; ``--quick``: the MLP and
fewer steps), one after the other, as a user starts them:

- ``clean``: no fault;
- ``chaos``: ``--max-restarts`` high, and a kill loop that SIGKILLs a random worker process every
  ``kill_every_s`` seconds while at least two train (any rank, rank 0 included; not one within a
  few steps of its end), each replaced by the launcher from its warm spare (``warm_spare=true``: a
  worker process that has already imported torch and loaded the data): the replacement attaches to the box, pulls the
  center and carries on with the steps its predecessor had not done, while the others never stop;
- ``chaos_without_spare`` (not in ``--quick``): the same with ``warm_spare=false`` (the default),
  every replacement a new interpreter.

Reported: each run's training time, whole-command time, samples/s (every worker's samples over the
training time) and final test accuracy; the chaos runs' kills, restarts and lost workers; and the
throughput retained, ``chaos samples/s / clean samples/s`` (torchft reports 97.7 % in its CPU chaos
run, with per-step recovery inside live processes; here a replacement is another process, so each
kill still costs a worker its steps since its last push and the replacement's set-up).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from parambox.runtime import spawn, zygote

WORKERS = 3
# The clean run trains ~40 s here, so a kill every 5 s hits it ~8 times: a run under steady failures,
# not one whose every worker is killed as soon as its replacement starts.
FULL = {"model": "lenet", "steps": 10000, "kill_every_s": 5.0, "max_kills": 1000}
# The quick form's MLP trains a few seconds: with 400 steps a loaded machine's workers sometimes
# finished before the first kill could find two of them training.
QUICK = {"model": "mlp", "steps": 3000, "kill_every_s": 1.0, "max_kills": 2}
RETRY_S = 0.2
SPARE_STEPS = 20  # a worker this close to its target is not killed: its replacement would only finish


def run_bench_chaos(
    steps: int | None = None, quick: bool = False, kill_every_s: float | None = None, seed: int = 0
) -> dict[str, Any]:
    setup = dict(QUICK if quick else FULL)
    setup["steps"] = steps or setup["steps"]
    setup["kill_every_s"] = kill_every_s or setup["kill_every_s"]
    args = ["train", "--strategy", "easgd", "--workers", str(WORKERS), "--model", setup["model"]]
    args += ["--steps", str(setup["steps"]), "--eval-every", "0", "--no-progress"]
    with tempfile.TemporaryDirectory() as tmp:
        clean = _run(args, Path(tmp) / "clean")
        kill = {
            "kill_every_s": setup["kill_every_s"],
            "max_kills": setup["max_kills"],
            "steps": setup["steps"],
        }
        spare_args = [*args, "--max-restarts", "1000", "--set", "warm_spare=true"]
        chaos = _run(spare_args, Path(tmp) / "chaos", rng=random.Random(seed), **kill)
        cold = None
        if not quick:  # the same kills, every replacement a new interpreter (no warm spare)
            cold_args = [*args, "--max-restarts", "1000", "--set", "warm_spare=false"]
            cold = _run(cold_args, Path(tmp) / "cold", rng=random.Random(seed), **kill)
    return {
        "strategy": "easgd",
        "workers": WORKERS,
        **setup,
        "clean": clean,
        "chaos": chaos,
        "throughput_retained": chaos["samples_per_s"] / max(clean["samples_per_s"], 1e-9),
        "command_time_ratio": clean["command_s"] / max(chaos["command_s"], 1e-9),
        "chaos_without_spare": cold,
        "throughput_retained_without_spare": cold
        and cold["samples_per_s"] / max(clean["samples_per_s"], 1e-9),
    }


def _run(
    args: list[str],
    out: Path,
    kill_every_s: float | None = None,
    max_kills: int = 0,
    steps: int = 0,
    rng: random.Random | None = None,
) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "parambox", *args, "--out", str(out)]
    log = out.parent / f"{out.name}.log"
    t0 = time.monotonic()
    with open(log, "wb") as sink:
        # The workers fork from this process's zygote (started once, not in every run's launcher);
        # _kill_one finds them below this process.
        env = {**os.environ, **zygote.shared_env()}
        launcher = spawn.start(cmd, env, stdout=sink, stderr=subprocess.STDOUT)
        kills = []
        try:
            next_kill = t0 + (kill_every_s or 0)
            while launcher.poll() is None:
                time.sleep(0.1)
                if kill_every_s and len(kills) < max_kills and time.monotonic() >= next_kill:
                    victim = _kill_one(out, steps, rng)
                    if victim is None:  # nobody training yet (or all near their end): look again soon
                        next_kill = time.monotonic() + RETRY_S
                    else:
                        kills.append({"t": round(time.monotonic() - t0, 2), "rank": victim})
                        next_kill += kill_every_s
        finally:
            spawn.stop([launcher])
    command_s = time.monotonic() - t0
    if launcher.returncode != 0 or not (out / "summary.json").exists():
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the {out.name} run exited {launcher.returncode}:\n{tail}")
    s = json.loads((out / "summary.json").read_text())
    result = {
        "command_s": command_s,
        "wall_time_s": s["wall_time_s"],
        "samples_per_s": s["samples_per_s"],
        "final_test_accuracy": s["final_test_accuracy"],
        "worker_steps": s["worker_steps"],
    }
    if kill_every_s:
        result.update(
            kills=len(kills), kill_log=kills, restarts=s["restarts"], lost_workers=s["lost_workers"]
        )
    return result


def _kill_one(out: Path, steps: int, rng: random.Random) -> int | None:
    """SIGKILL one random worker that is training (it has logged steps in this life, and is not about
    to finish: a replacement still starting up is spared), while at least two are; returns its rank.
    The workers are below this process: under the run's launcher, or under this process's zygote."""
    workers = {}
    for child in psutil.Process().children(recursive=True):
        try:
            rank = _rank_of(child)
            born = child.create_time()
        except (psutil.Error, ValueError):
            continue
        logged, step = _last_step(out, rank)
        if rank >= 0 and logged > born and 0 < step < steps - SPARE_STEPS:
            workers[rank] = child
    if len(workers) < 2:  # the last one training finishes in peace: failures hit a run, not its tail end
        return None
    rank = rng.choice(sorted(workers))
    try:
        workers[rank].send_signal(signal.SIGKILL)
    except psutil.Error:
        return None
    return rank


def _rank_of(child: psutil.Process) -> int:
    """The rank a worker process runs: its name (``parambox-r3``), or, for a warm spare that has
    not taken one yet, the metrics file it has open."""
    rank = spawn.rank_of(child)
    if rank is not None:
        return rank
    for f in child.open_files():
        name = Path(f.path).name
        if name == "metrics.jsonl":
            return 0
        if name.startswith("metrics.rank") and name.endswith(".jsonl"):
            return int(name[len("metrics.rank") : -len(".jsonl")])
    return -1


def _last_step(out: Path, rank: int) -> tuple[float, int]:
    """(when, which) the last step this rank logged (every life of a rank appends to one file)."""
    path = out / ("metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl")
    try:
        with open(path, "rb") as f:
            logged = os.fstat(f.fileno()).st_mtime
            f.seek(max(0, f.seek(0, 2) - 4096))
            lines = f.read().splitlines()
    except OSError:
        return 0.0, 0
    for line in reversed(lines):
        try:
            return logged, int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return logged, 0
