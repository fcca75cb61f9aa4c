"""Atomic checkpoints and resume.

``DIR/checkpoints/last.pt`` is the commit point: a dict with ``"model"`` (the run's model as one
state_dict with the usual names), ``"step"``, ``"world_size"``, ``"config"`` and rank 0's own
resume state. Every other rank's state (its replica, optimizer, RNG) goes to
``rank{r}-step{N}.pt`` first, so ``last.pt`` never points at state that is not on disk.
Everything loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from parambox.errors import UserError


def atomic_write(path: Path, write: Callable[[BinaryIO], object], mode: int | None = None) -> None:
    """The one atomic writer: ``write(f)`` into a temporary file in the same folder, fsync, rename, fsync
    the folder. A crash leaves the old file or the new one, never half of one. The file is the owner's
    alone (0600) unless ``mode`` says otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``path``, atomically."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON in ``path``, atomically (``summary.json``), readable as any file the
    user creates (the umask decides)."""
    umask = os.umask(0o022)
    os.umask(umask)
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2).encode()), mode=0o666 & ~umask)


def rank_state(replica: dict, strategy_state: dict) -> dict[str, Any]:
    return {"replica": replica, "strategy": strategy_state, "torch_rng": torch.get_rng_state()}


def save_rank_state(ckpt_dir: Path, rank: int, step: int, state: dict[str, Any]) -> None:
    atomic_save(state, ckpt_dir / f"rank{rank}-step{step}.pt")


def save_last(
    ckpt_dir: Path, step: int, model_state: dict, config: dict, world_size: int, state: dict
) -> None:
    atomic_save(
        {"model": model_state, "step": step, "world_size": world_size, "config": config, "rank0": state},
        ckpt_dir / "last.pt",
    )
    for old in ckpt_dir.glob("rank*-step*.pt"):  # states older than the commit point are garbage now
        if not old.name.endswith(f"-step{step}.pt"):
            old.unlink(missing_ok=True)


def load(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise UserError(f"checkpoint {path} does not exist") from None
    except Exception as e:
        raise UserError(f"checkpoint {path} is unreadable: {str(e).splitlines()[0][:200]}") from None


def load_resume(ckpt_dir: Path, rank: int, world_size: int) -> tuple[int, dict[str, Any]]:
    """(step, this rank's state) from the run's last checkpoint."""
    last = load(ckpt_dir / "last.pt")
    if not isinstance(last, dict) or "step" not in last or "model" not in last:
        raise UserError(f"checkpoint {ckpt_dir / 'last.pt'} is not a parambox checkpoint")
    if last.get("world_size") != world_size:
        raise UserError(
            f"checkpoint {ckpt_dir / 'last.pt'} was written by {last.get('world_size')} workers, "
            f"this run has {world_size}"
        )
    step = int(last["step"])
    state = last["rank0"] if rank == 0 else load(ckpt_dir / f"rank{rank}-step{step}.pt")
    return step, state
