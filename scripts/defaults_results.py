"""docs/results/<name>.json from the JSON of ``parambox bench defaults --json``, for the documentation's results pages.

``parambox bench defaults --model gpt --json > defaults-gpt.json && python scripts/defaults_results.py
defaults-gpt.json defaults-gpt``: a table of each strategy's test figure over the seeds (min, max, the seeds
short of the target, the seconds the runs took), in the figure's own direction (a perplexity is lower-is-
better: "short of" is above it); then ``python scripts/gen_docs.py`` renders the page. ``--command`` records
the command that measured it (default: the LeNet form, or the model's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch

import parambox

ROOT = Path(__file__).resolve().parents[1]


def _num(x) -> str:
    return "failed" if x is None else f"{x:.1f}" if abs(x) >= 10 else f"{x:.3f}"


def rows(bench: dict) -> list[list[str]]:
    """One row per strategy: min, max, the seeds short of the target (or the first error), seconds."""
    out = []
    for name, r in bench["strategies"].items():
        errors = r.get("errors") or {}
        short = ", ".join(str(s) for s in r["below_target"]) or "-"
        if errors:
            short += f" ({next(iter(errors.values()))})"
        out.append([name, _num(r["min"]), _num(r["max"]), short, f"{r['seconds']:.0f}"])
    return out


def results(bench: dict, command: str) -> dict:
    """The results page's JSON (title, intro, tables) for one ``bench defaults`` run."""
    metric = bench.get("metric", "accuracy")
    lower = bench.get("lower_is_better", False)
    workload = (
        f"{bench['model']} on {bench['data']}" if "model" in bench else "the default run (LeNet on digits)"
    )
    steps = f"{bench['steps']} steps" if "steps" in bench else "the default run's steps"
    direction = "at most" if lower else "at least"
    encodings = any("compression=" in name for name in bench["strategies"])
    what = "Each encoding on each strategy that takes one" if encodings else "Every strategy"
    return {
        "title": f"{what}: {workload}" if encodings else f"{what}'s default run: {workload}",
        "intro": (
            f"parambox bench defaults: each strategy's default run (parambox train --strategy X --seed S with "
            f"nothing else given) of {workload}, {steps}, seed{'s' if len(bench['seeds']) > 1 else ''} "
            f"{', '.join(map(str, bench['seeds']))}. The table gives the test {metric} each run ends at and the "
            f"seeds short of the target ({direction} {bench['target']:g}"
            + ("; lower is better" if lower else "")
            + "); seconds are the runs' wall time, one after the other."
            + (
                " A row 'S compression=M' is that default run with --set S.compression=M (bench defaults "
                "--compression): each encoding a strategy's options accept."
                if encodings
                else ""
            )
        ),
        "tables": [
            {
                "caption": f"Test {metric} over the seeds (target: {direction} {bench['target']:g})",
                "command": command,
                "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}; torch {torch.__version__}",
                "version": f"parambox {getattr(parambox, '__version__', '')}".strip(),
                "columns": ["strategy", "min", "max", "seeds short of the target", "seconds"],
                "key": "strategy",
                "rows": rows(bench),
            }
        ],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench_json", type=Path, help="the output of parambox bench defaults --json")
    p.add_argument("name", help="the page's name: docs/results/NAME.json")
    p.add_argument("--command", help="the command that measured it")
    args = p.parse_args(argv)
    bench = json.loads(args.bench_json.read_text())
    command = args.command or "parambox bench defaults " + (
        f"--model {bench['model']} --data {bench['data']} --json" if "model" in bench else "--json"
    )
    path = ROOT / "docs" / "results" / f"{args.name}.json"
    path.write_text(json.dumps(results(bench, command), indent=1) + "\n")
    print(f"wrote {path}; now python scripts/gen_docs.py")


if __name__ == "__main__":
    main()
