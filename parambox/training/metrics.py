"""Per-step metrics to ``metrics.jsonl`` (the leader: rank 0, or the oldest survivor of a run that survives
in place; ``metrics.rank{r}.jsonl`` elsewhere), optional TensorBoard."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psutil

from parambox.training.checkpoint import finite_json

# Step records reach the file every FLUSH_EVERY steps or FLUSH_S seconds, whichever comes first (an
# eval record at once): a run of 1.75 s steps (sandblaster on the zoo's gpt) showed nothing for 90 s.
FLUSH_EVERY, FLUSH_S = 50, 10.0


class MetricsLogger:
    """Appends one JSON object per line: ``{"kind": "step" | "eval", "step", "time", ...}``."""

    def __init__(self, run_dir: Path, rank: int, tensorboard: bool = False, leads: bool | None = None):
        self.run_dir, self.leads = run_dir, rank == 0 if leads is None else leads
        name = "metrics.jsonl" if self.leads else f"metrics.rank{rank}.jsonl"
        self.file = open(run_dir / name, "a", buffering=1 << 16)  # noqa: SIM115  (closed in close())
        self.run_file = None  # metrics.jsonl besides, once this rank took over the lead (lead())
        self.pending = 0
        self.start = time.perf_counter()
        self.flushed_at = self.start
        self.epoch = time.time()  # the same moment in Unix time: the ranks' clocks line up by it
        self.process = psutil.Process()
        self.process.cpu_percent()  # the first call only starts the measurement
        self.tb = None
        if tensorboard and rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def lead(self, record: dict[str, Any]) -> None:
        """This rank comes to lead (the leader died): from now on it writes ``metrics.jsonl`` too (its
        own file goes on: each rank's progress stays in one file), where ``record`` says so first (a
        leader never hands the role back: nothing to undo)."""
        self.run_file = open(self.run_dir / "metrics.jsonl", "a", buffering=1 << 16)  # noqa: SIM115
        self.leads = True
        self.write(record)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def write(self, record: dict[str, Any]) -> None:
        record.setdefault("time", round(self.elapsed(), 6))
        # JSON has no NaN: a diverged step's loss is null, as in summary.json
        line = json.dumps(finite_json(record), allow_nan=False) + "\n"
        self.file.write(line)
        if self.run_file is not None:
            self.run_file.write(line)
        self.pending += 1
        if (
            self.pending >= FLUSH_EVERY
            or record["kind"] != "step"
            or time.perf_counter() - self.flushed_at >= FLUSH_S
        ):
            self.flush()
        if self.tb is not None:
            self._to_tensorboard(record)

    def resources(self) -> dict[str, float]:
        return {"cpu_percent": self.process.cpu_percent(), "rss_mb": self.process.memory_info().rss / 2**20}

    def _to_tensorboard(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key in ("kind", "step"):
                continue
            if isinstance(value, dict):
                for sub, v in value.items():
                    self.tb.add_scalar(f"{key}/{sub}", v, step)
            elif isinstance(value, int | float):
                self.tb.add_scalar(f"{record['kind']}/{key}", value, step)

    def flush(self) -> None:
        self.file.flush()
        if self.run_file is not None:
            self.run_file.flush()
        self.pending, self.flushed_at = 0, time.perf_counter()

    def close(self) -> None:
        self.flush()
        self.file.close()
        if self.run_file is not None:
            self.run_file.close()
        if self.tb is not None:
            self.tb.close()
