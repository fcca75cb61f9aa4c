"""Shared fixtures: run the CLI as a user would, and kill any orphaned worker after each test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_osc": "^ucx",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}


def slurm_running() -> bool:
    """A SLURM whose controller answers (``../shared/tools/slurm-up.sh`` starts one); installed but
    stopped counts as none."""
    import shutil

    if not all(shutil.which(t) for t in ("srun", "sbatch", "scontrol")):
        return False
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return ping.returncode == 0 and "UP" in ping.stdout


NO_SLURM = "no SLURM controller here (../shared/tools/slurm-up.sh starts one)"


@pytest.fixture(autouse=True)
def _kill_orphans():
    """Like hivemind's conftest: a failed multi-process test must not leave workers behind."""
    yield
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def run_cli(
    *args: str,
    timeout: float = 170,
    env: dict | None = None,
    prefix: list[str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``python -m parambox ARGS`` in a subprocess (optionally under a launcher given as ``prefix``)."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [*(prefix or []), sys.executable, "-m", "parambox", *args]
    if prefix and prefix[-1] == "-m":  # torchrun takes the module itself
        cmd = [*prefix, "parambox", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
