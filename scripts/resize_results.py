"""docs/results/resize.json from the run directories of scripts/resize_check.sh.

``python scripts/resize_results.py runs/resize-check``: for each strategy the test accuracy after the
resume at 3 workers, the resize record of its summary, the wall time of the two parts, the uninterrupted
2-worker run's accuracy and time, and the largest weight difference between the two runs' final models;
a strategy that refuses the resize gets its one-line message. Then ``python scripts/gen_docs.py`` renders
the page.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

import parambox

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = [
    "strategy",
    "accuracy 2 -> 3 workers",
    "accuracy uninterrupted (2 workers)",
    "weights at step 600: max |w - w uninterrupted| (relative)",
    "resize",
    "wall s: 300 + 300 steps / 600 steps",
]


def summary(path: Path) -> dict | None:
    p = path / "summary.json"
    return json.loads(p.read_text()) if p.exists() else None


def weight_difference(a: Path, b: Path) -> tuple[float, float] | None:
    """The largest absolute difference between the models of two runs' ``last.pt``, and the norm of the
    difference over the norm of the second's weights."""
    pa, pb = a / "checkpoints" / "last.pt", b / "checkpoints" / "last.pt"
    if not (pa.exists() and pb.exists()):
        return None
    ma = torch.load(pa, map_location="cpu", weights_only=False)["model"]
    mb = torch.load(pb, map_location="cpu", weights_only=False)["model"]
    d = {k: ma[k].double() - mb[k].double() for k in ma}
    norm = sum(float(mb[k].double().square().sum()) for k in mb) ** 0.5
    return max(float(v.abs().max()) for v in d.values()), sum(
        float(v.square().sum()) for v in d.values()
    ) ** 0.5 / norm


def times(out: Path, strategy: str) -> list[float | None]:
    p = out / f"{strategy}.time"
    if not p.exists():
        return [None, None, None]
    t = [float(v) for v in p.read_text().split()]
    return [t[1] - t[0], t[3] - t[2], t[5] - t[4]]


def last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()] if log.exists() else []
    return lines[-1].removeprefix("parambox: error: ").strip() if lines else "no log"


def row(out: Path, strategy: str) -> list:
    part1, resized, full = summary(out / strategy), summary(out / strategy), summary(out / f"{strategy}-full")
    t1, t2, tf = times(out, strategy)
    if part1 is None:
        return [strategy, "not run", "-", "-", last_line(out / f"{strategy}.part1.log"), "-"]
    if resized is None or resized["steps"] != 600 or resized.get("resize") is None:
        return [strategy, "refused", "-", "-", last_line(out / f"{strategy}.part2.log"), "-"]
    r = resized["resize"]
    record = (
        f"step {r['step']}: {r['from_workers']} -> {r['to_workers']} workers, {r['rule']}, global batch "
        f"{r['from_global_batch']} -> {r['global_batch']}, rank 0's slice {r['batch_size']}"
    )
    diff = weight_difference(out / strategy, out / f"{strategy}-full")
    first = weight_difference(out / f"{strategy}-step301", out / f"{strategy}-full301")
    wall = f"{t1:.0f} + {t2:.0f} / {tf:.0f}" if None not in (t1, t2, tf) else "-"
    return [
        strategy,
        round(resized["final_test_accuracy"], 4),
        round(full["final_test_accuracy"], 4) if full else "failed",
        (f"{diff[0]:.1e} ({diff[1]:.0e})" if diff is not None else "-")
        + (f"; one step after the resize {first[0]:.1e} ({first[1]:.0e})" if first is not None else ""),
        record,
        wall,
    ]


def notes(rows: list[list]) -> str:
    resized = [r[1] for r in rows if isinstance(r[1], float)]
    lowest = f"{min(resized):.4f}" if resized else "-"
    asynchronous = ("downpour", "easgd", "eamsgd", "dynsgd", "hogwild", "dogwild")
    gaps = [abs(r[1] - r[2]) for r in rows if r[0] in asynchronous and isinstance(r[2], float)]
    spread = f"{max(gaps):.3f}" if gaps else "-"
    return (
        f"Every strategy that takes the resize ends at test accuracy {lowest} or above after it. "
        "allreduce, ps-sync and box-sync apply one mean gradient a step: one step after the resize their "
        "weights differ from the uninterrupted run's by float32 rounding (the mean is summed over three "
        "slices instead of two), which 300 more steps of SGD with momentum grow to the difference at step "
        "600. weight-avg (period 1) averages weights after each rank's own step, and each rank keeps its "
        "own momentum buffer; the joiner takes rank 0's, so the mean of the three buffers, by which the "
        "averaged weights move, is not the mean of the two: its weights leave the uninterrupted run's at "
        "the resize, by more than rounding, and its accuracy does not. DiLoCo's ranks train apart for 20 "
        "inner steps a round, so a third rank changes its trajectory. The asynchronous rules' (downpour, "
        "easgd, eamsgd, dynsgd, hogwild, dogwild) interleaving is the machine's, so no two of their runs "
        f"share weights; their resized and uninterrupted runs end {spread} apart in accuracy or less. "
        "`single` runs one process; the others refuse in one line, before any process starts."
    )


def commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()


def main(out: Path) -> None:
    from parambox.strategies import STRATEGIES

    rows = [row(out, s) for s in STRATEGIES if (out / f"{s}.part1.log").exists()]
    data = {
        "title": "Resume at another worker count: every strategy, 2 -> 3 workers",
        "intro": (
            "Each strategy at its defaults on lenet and digits trains 300 steps on 2 workers, then "
            "`--resume --workers 3` continues it to step 600, against the uninterrupted 600-step run on 2 "
            "workers. scripts/resize_check.sh runs them at seed 0, one torch thread a worker; the resize is "
            "keep-global-batch, the default: the global batch of 64 stays, cut 22, 21, 21, each rank's loss "
            "weighted by its slice. The weight difference is between the two runs' final models (`last.pt`: the "
            "weights, or an asynchronous run's center)."
        ),
        "tables": [
            {
                "caption": "Final test accuracy after the resize and without it",
                "command": "bash scripts/resize_check.sh runs/rc && python scripts/resize_results.py runs/rc",
                "machine": f"a 2-core shared Linux VM, {platform.machine()}; torch {torch.__version__} CPU (gloo)",
                "version": f"parambox {getattr(parambox, '__version__', '')}".strip(),
                "recorded_in": commit(),
                "columns": COLUMNS,
                "key": "strategy",
                "rows": rows,
                "notes": notes(rows),
            }
        ],
    }
    path = ROOT / "docs" / "results" / "resize.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
