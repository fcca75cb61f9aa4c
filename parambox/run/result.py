"""What a finished run gives back: ``RunResult`` (the summary's fields, and the trained model), the
model rebuilt from a run directory (``parambox.train``'s result, ``parambox export``), and the summary
table the CLI prints."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from parambox.errors import UserError


class RunResult(dict):
    """The run's summary (``summary.json``: a dict, as before) with its fields as attributes, and the
    trained model loaded in this process (``result.model``, from ``checkpoints/last.pt``).

    >>> r = RunResult({"final_test_accuracy": 0.97, "steps": 600}, run_dir=Path("runs/x"))
    >>> r.final_test_accuracy, r["steps"], r.run_dir.name
    (0.97, 600, 'x')
    """

    def __init__(self, summary: dict[str, Any], run_dir: Path, callables: dict[str, Callable] | None = None):
        super().__init__(summary)
        self.run_dir = Path(run_dir)
        self._callables = callables or {}
        self._model = None

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"the run's result has no field {name!r}") from None

    @property
    def model(self):
        """The trained ``nn.Module`` (in eval mode), rebuilt as the run built it, loaded on first use."""
        if self._model is None:
            self._model = load_model(self.run_dir, self._callables, trust=True)  # this run: ours
        return self._model


def load_model(run_dir: str | Path, callables: dict[str, Callable] | None = None, trust: bool = False):
    """The run's model with the weights of ``checkpoints/last.pt``, in eval mode. ``callables``: the
    user's functions in this process (a lambda is fine); else the references ``config.json`` records,
    imported from a run directory this user owns, or with ``trust=True``."""
    run_dir = Path(run_dir)
    model, _ = load_model_and_workload(run_dir, callables, trust="trusted" if trust else "trust=True")
    return model


def load_model_and_workload(
    run_dir: Path, callables: dict[str, Callable] | None = None, trust: str = "trusted"
):
    """``trust``: ``"trusted"`` (the caller checked, as export does), else how to say "trust it"."""
    from parambox.run.plan import load_recorded
    from parambox.run.rundir import check_trust
    from parambox.training import checkpoint
    from parambox.workload import build_workload

    run_dir = Path(run_dir)
    cfg = load_recorded(run_dir)
    check_trust(run_dir, cfg, trust, callables)
    cfg.loader_workers = 0  # a few items at most are read here
    workload = build_workload(cfg, callables)
    model = workload.build_model()
    state = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, KeyError) as e:
        raise UserError(
            f"{run_dir}: the checkpoint does not fit the model: {str(e).splitlines()[0]}"
        ) from None
    return model.eval(), workload


def wait_for_summary(run_dir: Path, since: float, timeout_s: float) -> dict[str, Any]:
    """Rank 0's ``summary.json`` written after ``since`` (Unix time), for the other ranks under an
    external launcher (rank 0 writes it after the last checkpoint, on a file system every rank sees)."""
    import json

    path, deadline = run_dir / "summary.json", time.monotonic() + timeout_s
    while not (path.exists() and path.stat().st_mtime >= since - 1):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 wrote no {path} within {timeout_s:.0f} s")
        time.sleep(0.05)
    return json.loads(path.read_text())


def print_summary(summary: dict, run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="parambox run", show_header=False)
    finals = [k for k in summary if k.startswith("final_test_")]  # loss, accuracy or a user's metrics
    for key in ("strategy", "workers", "model", "data", "steps", *finals, "wall_time_s", "samples_per_s"):
        value = summary.get(key)
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)
    print(f"run directory: {run_dir}")
