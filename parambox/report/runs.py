"""Reading run directories: ``summary.json`` plus ``metrics.jsonl`` (step and eval records) -> :class:`Run`.

Every problem with a user's files becomes a one-line ``UserError`` naming the file (and line). A truncated
last line of metrics.jsonl (a run killed mid-write) is skipped with a warning, not an error.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from parambox.errors import UserError
from parambox.numerics import is_finite

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


@dataclass
class Run:
    """One training run: its summary and its records, in file order.

    >>> r = Run(Path("runs/a"), {"strategy": "allreduce", "workers": 2},
    ...         [{"kind": "step", "step": 1, "time": 0.1, "loss": 2.3, "comm": {"allreduce": 0.004}}])
    >>> r.label, r.series("loss"), r.mean_comm_ms()
    ('allreduce x2', ([0.1], [2.3]), {'allreduce': 4.0})
    """

    path: Path
    summary: dict
    steps: list[dict]
    evals: list[dict] = field(default_factory=list)
    label: str = ""

    def __post_init__(self):
        if not self.label:
            strategy, workers = self.summary.get("strategy"), self.summary.get("workers")
            self.label = f"{strategy} x{workers}" if strategy and workers else self.path.name

    def series(self, y: str, x: str = "time", kind: str = "step") -> tuple[list[float], list[float]]:
        """(xs, ys) of the records of ``kind`` that have both keys, e.g. ``series("test_accuracy", "step", "eval")``."""
        records = self.steps if kind == "step" else self.evals
        pts = [(r[x], r[y]) for r in records if x in r and y in r and r[y] is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    def comm_phases(self) -> list[str]:
        """Phase names in the order they first appear."""
        phases: dict[str, None] = {}
        for r in self.steps:
            phases.update(dict.fromkeys(r.get("comm") or {}))
        return list(phases)

    def comm_series_ms(self, phase: str) -> tuple[list[float], list[float]]:
        pts = [(r["step"], r["comm"][phase] * 1e3) for r in self.steps if phase in (r.get("comm") or {})]
        return [p[0] for p in pts], [p[1] for p in pts]

    def mean_comm_ms(self) -> dict[str, float]:
        """Mean communication time per step record, per phase (records without the phase count as 0)."""
        n = max(len(self.steps), 1)
        return {
            ph: sum((r.get("comm") or {}).get(ph, 0.0) for r in self.steps) * 1e3 / n
            for ph in self.comm_phases()
        }

    @property
    def target_metric(self) -> str:
        """The run's target metric (``target_metric``: ``accuracy`` unless the user named another)."""
        return (self.summary.get("config") or {}).get("target_metric") or "accuracy"

    def final(self, key: str) -> float | None:
        """From summary.json, else from the last eval (or step) record that has ``key``."""
        if self.summary.get(f"final_{key}") is not None:
            return self.summary[f"final_{key}"]
        for r in reversed(self.evals if key.startswith("test_") else self.steps):
            if r.get(key) is not None:
                return r[key]
        return None

    def info(self, key: str):
        """A summary field with fallbacks from the records for the ones a crashed run may lack."""
        if self.summary.get(key) is not None:
            return self.summary[key]
        if key == "steps" and self.steps:
            return self.steps[-1]["step"]
        if key == "wall_time_s":
            times = [r["time"] for r in self.steps + self.evals]
            return max(times) if times else None
        if key == "samples_per_s":
            rates = [r["samples_per_s"] for r in self.steps if is_finite(r.get("samples_per_s"))]
            return sum(rates) / len(rates) if rates else None
        return None


def load_run(path: str | Path) -> Run:
    """Read one run directory; bad or missing files raise ``UserError`` naming the file."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"run directory {path} does not exist or is not a directory")
    steps, evals = _read_metrics(path / METRICS_FILE)
    if not steps and not evals:
        raise UserError(f"{path / METRICS_FILE}: no step or eval records")
    return Run(path, _read_summary(path / SUMMARY_FILE), steps, evals)


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Read several runs; labels that would collide get the directory name appended."""
    runs = [load_run(p) for p in paths]
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in runs:
        if seen[r.label] > 1:
            r.label = f"{r.label} ({r.path.name})"
    return runs


def _read_summary(file: Path) -> dict:
    if not file.exists():
        print(
            f"parambox report: warning: {file} missing (unfinished run?); using the metrics only",
            file=sys.stderr,
        )
        return {}
    try:
        summary = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{file}: cannot read ({e})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{file}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(summary, dict):
        raise UserError(f"{file}: expected a JSON object")
    return summary


def _read_metrics(file: Path) -> tuple[list[dict], list[dict]]:
    try:
        lines = file.read_text().splitlines()
    except FileNotFoundError:
        raise UserError(f"{file}: missing (is {file.parent} a parambox run directory?)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{file}: cannot read ({e})") from None
    steps, evals = [], []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _parse_line(file, lineno, line, last=lineno == len(lines))
        if record is None:
            continue
        kind = record.get("kind")
        if kind == "step":
            _require(file, lineno, record, ("step", "time"))
            steps.append(record)
        elif kind == "eval":
            _require(file, lineno, record, ("step", "time"))
            evals.append(record)
    return steps, evals


def _parse_line(file: Path, lineno: int, line: str, last: bool) -> dict | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        if last:  # a run killed while writing leaves half a line: keep what came before
            print(f"parambox report: warning: {file}:{lineno}: truncated last line skipped", file=sys.stderr)
            return None
        raise UserError(f"{file}:{lineno}: not valid JSON") from None
    if not isinstance(record, dict):
        raise UserError(f"{file}:{lineno}: expected a JSON object per line")
    return record


def _require(file: Path, lineno: int, record: dict, keys: tuple[str, ...]) -> None:
    for k in keys:
        if not is_finite(record.get(k)):
            raise UserError(f"{file}:{lineno}: {record['kind']} record needs a number {k!r}")
