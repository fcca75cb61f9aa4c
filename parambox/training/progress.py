"""The progress bar on rank 0 (rich), silent when disabled or when output is not a terminal."""

from __future__ import annotations

import sys

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


class Progress:
    def __init__(self, total: int, enabled: bool, start: int = 0):
        self.bar = None
        if enabled and sys.stderr.isatty():
            self.bar = RichProgress(
                TextColumn("[bold]training"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self.task = self.bar.add_task("train", total=total, completed=start, loss=float("nan"))
            self.bar.start()

    def update(self, step: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, loss=loss)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
