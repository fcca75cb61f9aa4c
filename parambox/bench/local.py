"""``parambox bench local``: Lerat et al.'s study of local parallelism, on this machine.

The same work, a fixed number of training samples of a CNN of the zoo (the benchmark ``cnn`` by
default) on 32x32x3 images (``synthetic32``), in each setup of the study:

=============  ==========================================================================
sequential     1 process, 1 thread: the baseline
threads        1 process, one thread per core (multi-threaded data parallelism in torch)
allreduce      2 processes x 1 thread, data parallel (gradient allreduce)
box-sync       2 processes x 1 thread, gradients averaged through the shared box (if built)
pipeline       the model cut over 2 processes (by measured layer time), 4 micro-batches
pipeline-dp    2 pipelines of 2 stages (4 processes); flagged ``oversubscribed`` below 4 cores
=============  ==========================================================================

Every setup trains with the same global batch (128), so they do the same number of steps. Each is
a ``parambox train`` run in a subprocess; its time is the training time from the run's summary
(start-up and data generation excluded). ``speedups`` are baseline time / setup time, the paper's
metric. Run one benchmark at a time: setups share the machine's cores.

>>> # parambox bench local --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from parambox.errors import UserError
from parambox.runtime import scratch, spawn

GLOBAL_BATCH = 128
DEFAULT_STEPS = 100  # 12,800 samples: about 10 s for the baseline here


def setup_table(cores: int) -> dict[str, dict[str, Any]]:
    """Setup name -> processes, threads per process, and ``parambox train`` flags."""
    half = GLOBAL_BATCH // 2
    return {
        "sequential": {"processes": 1, "threads": 1, "args": ["--strategy", "single"]},
        "threads": {"processes": 1, "threads": cores, "args": ["--strategy", "single"]},
        "allreduce": {"processes": 2, "threads": 1, "args": ["--strategy", "allreduce"], "batch": half},
        "box-sync": {"processes": 2, "threads": 1, "args": ["--strategy", "box-sync"], "batch": half},
        "pipeline": {
            "processes": 2,
            "threads": 1,
            "args": [
                "--strategy",
                "pipeline",
                "--set",
                "pipeline.balance=time",
                "--set",
                "pipeline.num_microbatches=4",
            ],
        },
        "pipeline-dp": {
            "processes": 4,
            "threads": 1,
            "batch": half,
            "args": [
                "--strategy",
                "pipeline-dp",
                "--set",
                "pipeline-dp.num_stages=2",
                "--set",
                "pipeline-dp.balance=time",
                "--set",
                "pipeline-dp.num_microbatches=4",
            ],
        },  # fmt: skip
    }


def _command(spec: dict[str, Any], model: str, data: str, steps: int, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "parambox", "train", *spec["args"],
        "--workers", str(spec["processes"]), "--threads", str(spec["threads"]),
        "--model", model, "--data", data, "--steps", str(steps),
        "--batch-size", str(spec.get("batch", GLOBAL_BATCH)), "--lr", "0.01", "--momentum", "0.9",
        "--eval-every", "0", "--no-progress", "--no-augment", "--out", str(out),
    ]  # fmt: skip


def _bubble_fraction(run_dir: Path) -> dict[str, float]:
    """Mean share of each stage's step spent idle, from rank 0's metrics (pipelines only)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("kind") == "step" and "stage0_bubble_s" in r][1:]  # step 1 warms up
    out = {}
    for s in range(8):
        keys = [f"stage{s}_{k}" for k in ("forward_s", "backward_s", "bubble_s")]
        if not steps or keys[0] not in steps[0]:
            break
        out[f"stage{s}"] = statistics.mean(r[keys[2]] / max(sum(r[k] for k in keys), 1e-12) for r in steps)
    return out


def run_setup(name: str, spec: dict, model: str, data: str, steps: int, tmp: Path, timeout_s: float) -> dict:
    """One ``parambox train`` run; its training time and throughput, or the error that stopped it."""
    out = tmp / f"{name}-{len(list(tmp.iterdir()))}"
    cmd = _command(spec, model, data, steps, out)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = spawn.start(cmd, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    finally:
        spawn.stop([proc])
    if proc.returncode != 0:
        lines = (stderr or stdout).strip().splitlines() or ["(no output)"]
        return {"error": lines[-1][:300]}
    summary = json.loads((out / "summary.json").read_text())
    result = {"time_s": summary["wall_time_s"], "samples_per_s": summary["samples_per_s"]}
    if "pipeline" in summary:
        result["split_points"] = summary["pipeline"]["split_points"]
        result["bubble_fraction"] = _bubble_fraction(out)
    return result


def run_bench_local(
    rounds: int = 1,
    steps: int | None = None,
    model: str = "cnn",
    data: str = "synthetic32",
    setups: list[str] | None = None,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Time every setup ``rounds`` times (order rotating each round) and return times and speedups."""
    from parambox.strategies import STRATEGIES

    cores = os.cpu_count() or 1
    steps = steps or DEFAULT_STEPS
    table = setup_table(cores)
    requested = setups or list(table)
    unknown = [n for n in requested if n not in table]
    if unknown:
        raise UserError(f"bench local: unknown setups {unknown}; choose from {', '.join(table)}")
    strategy = {n: table[n]["args"][1] for n in requested}
    skipped = {
        n: f"strategy {strategy[n]!r} is not in this build"
        for n in requested
        if strategy[n] not in STRATEGIES
    }
    names = [n for n in requested if n not in skipped]
    times: dict[str, list[float]] = {n: [] for n in names}
    results: dict[str, dict[str, Any]] = {}
    with scratch.folder(scratch.BENCH) as tmp:
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                res = run_setup(name, table[name], model, data, steps, Path(tmp), timeout_s)
                results[name] = {**results.get(name, {}), **res}
                if "time_s" in res:
                    times[name].append(res["time_s"])
    return summarize(table, names, times, results, skipped, model, data, steps, rounds, cores)


def summarize(table, names, times, results, skipped, model, data, steps, rounds, cores) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": model,
        "data": data,
        "samples": steps * GLOBAL_BATCH,
        "global_batch": GLOBAL_BATCH,
        "steps": steps,
        "rounds": rounds,
        "cores": cores,
        "setups": {},
    }
    for name in names:
        spec, res = table[name], dict(results.get(name, {}))
        entry = {"processes": spec["processes"], "threads_per_process": spec["threads"]}
        entry["oversubscribed"] = spec["processes"] * spec["threads"] > cores
        if times[name]:
            res["time_s"] = statistics.median(times[name])
            res["samples_per_s"] = steps * GLOBAL_BATCH / res["time_s"]
        out["setups"][name] = {**entry, **res}
    base = out["setups"].get("sequential", {}).get("time_s")
    out["speedups"] = {
        name: base / s["time_s"] for name, s in out["setups"].items() if base and s.get("time_s")
    }
    if skipped:
        out["skipped"] = skipped
    return out


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"parambox bench local: {result['model']}, {result['samples']:,} samples of {result['data']}, "
        f"{result['cores']} cores"
    )
    table = Table(title=title)
    for col in ("setup", "processes x threads", "time (s)", "samples/s", "speedup", "note"):
        table.add_column(col, justify="left" if col in ("setup", "note") else "right")
    for name, s in result["setups"].items():
        note = "oversubscribed" if s["oversubscribed"] else ""
        if "bubble_fraction" in s:
            bubbles = ", ".join(f"{k} {v:.0%}" for k, v in s["bubble_fraction"].items())
            note = "; ".join(filter(None, [note, f"cut {s['split_points']}, idle {bubbles}"]))
        if "error" in s:
            note = f"failed: {s['error']}"
        speedup = result["speedups"].get(name)
        table.add_row(
            name,
            f"{s['processes']} x {s['threads_per_process']}",
            f"{s['time_s']:.2f}" if "time_s" in s else "-",
            f"{s['samples_per_s']:,.0f}" if "samples_per_s" in s else "-",
            f"{speedup:.2f}" if speedup else "-",
            note,
        )
    for name, why in result.get("skipped", {}).items():
        table.add_row(name, "-", "-", "-", "-", f"skipped: {why}")
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parambox.bench.local", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--model", default="cnn", help="a model of the zoo taking 32x32x3 images (default: cnn)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"steps at global batch {GLOBAL_BATCH}")
    p.add_argument("--rounds", type=int, default=1, help="repeat each setup, order rotating; medians")
    p.add_argument("--setups", default=None, help="comma-separated subset of the setups")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds must be at least 1")
    setups = args.setups.split(",") if args.setups else None
    result = run_bench_local(rounds=args.rounds, steps=args.steps, model=args.model, setups=setups)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
