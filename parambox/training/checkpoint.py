"""Atomic checkpoints and resume.

``DIR/checkpoints/last.pt`` is the commit point: a dict with ``"model"`` (the run's model as one
state_dict with the usual names), ``"step"``, ``"world_size"``, ``"config"``, ``"data"`` (where the
sample stream stands: samples consumed, the global batch) and rank 0's own resume state. Every other rank's state (its replica, optimizer, RNG) goes to
``rank{r}-step{N}.pt`` first, so ``last.pt`` never points at state that is not on disk. In a
synchronous run every rank saves the same step and ``last.pt`` commits it; in an asynchronous run
each rank saves at its own pace (its own step), replaces only its own older file, and resumes from
its own newest one.

A resume at another worker count (:func:`load_resume`): ranks the old run had keep their own state;
a rank new to the run is a *joiner* (its state is ``None``: the loop starts it from ``last.pt``'s
model and rank 0's state, as the strategy says); the files of ranks the new run lacks are discarded.
Everything loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
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
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if no_space_left(e):  # torch's says "enforce fail at inline_container.cc", the cause unsaid
            kept = "; the previous one is kept" if path.exists() else ""
            raise UserError(f"no space left on device writing {path}{kept}") from None
        raise


def no_space_left(e: BaseException) -> bool:
    """Whether ``e`` is, or was raised while handling, a full disk (``ENOSPC``; torch.save keeps the
    writer's ``OSError`` only as the context of its own ``RuntimeError``)."""
    seen: BaseException | None = e
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def remove_interrupted_writes(run_dir: Path) -> list[Path]:
    """Remove the temporary files of :func:`atomic_write` calls a kill interrupted (``.NAME.*.tmp`` in
    the run directory and its checkpoints); call it only while no process writes there (the run
    directory's lock held, before any worker starts). The files removed."""
    removed = []
    for folder in (run_dir, run_dir / "checkpoints"):
        for path in folder.glob(".*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return removed


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``path``, atomically."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON in ``path``, atomically (``summary.json``), readable as any file the
    user creates (the umask decides)."""
    umask = os.umask(0o022)
    os.umask(umask)
    text = json.dumps(finite_json(obj), indent=2, allow_nan=False)
    atomic_write(path, lambda f: f.write(text.encode()), mode=0o666 & ~umask)


def finite_json(obj: Any) -> Any:
    """``obj`` with every NaN and infinity as None: JSON has no bare ``NaN`` (a diverged run's losses).

    >>> finite_json({"loss": float("nan"), "xs": [1.0, float("inf")]})
    {'loss': None, 'xs': [1.0, None]}
    """
    if isinstance(obj, float):
        return obj if obj - obj == 0 else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_json(v) for v in obj]
    return obj


def committed_step(ckpt_dir: Path) -> int | None:
    """The step ``last.pt`` commits, None without one; reads the step only (the tensors are mapped)."""
    try:
        last = torch.load(ckpt_dir / "last.pt", weights_only=True, map_location="cpu", mmap=True)
    except FileNotFoundError:
        return None
    except Exception as e:
        raise UserError(
            f"checkpoint {ckpt_dir / 'last.pt'} is unreadable: {str(e).splitlines()[0][:200]}"
        ) from None
    return int(last["step"]) if isinstance(last, dict) and "step" in last else None


def prune_rank_states(ckpt_dir: Path, keep_step: int | None) -> None:
    """Remove every rank's state at a step other than ``keep_step`` (synchronous runs: what no
    ``last.pt`` commits, as after a divergence, where the commit stopped)."""
    for old in ckpt_dir.glob("rank*-step*.pt"):
        m = re.fullmatch(r"rank\d+-step(\d+)\.pt", old.name)
        if m and int(m.group(1)) != keep_step:
            old.unlink(missing_ok=True)


def rank_state(replica: dict, strategy_state: dict, loop_state: dict | None = None) -> dict[str, Any]:
    """One rank's resume state: its replica, its strategy's state, the loop's (the lr schedule, the
    loss scaler) and its RNG."""
    state = {"replica": replica, "strategy": strategy_state, "torch_rng": torch.get_rng_state()}
    if loop_state:
        state["loop"] = loop_state
    return state


def save_rank_state(ckpt_dir: Path, rank: int, step: int, state: dict[str, Any], prune: bool = False) -> None:
    """``rank{r}-step{N}.pt``; ``prune``: then remove this rank's own older states (asynchronous runs,
    where each rank checkpoints at its own pace and no ``last.pt`` says which step is current)."""
    atomic_save(state, ckpt_dir / f"rank{rank}-step{step}.pt")
    if prune:
        for old, old_step in rank_states(ckpt_dir, rank):
            if old_step != step:
                old.unlink(missing_ok=True)


def drop_rank_states(ckpt_dir: Path, rank: int) -> None:
    """Remove every state file of ``rank``."""
    for path, _ in rank_states(ckpt_dir, rank):
        path.unlink(missing_ok=True)


def rank_states(ckpt_dir: Path, rank: int) -> list[tuple[Path, int]]:
    """This rank's state files with their steps, newest first."""
    found = []
    for path in ckpt_dir.glob(f"rank{rank}-step*.pt"):
        m = re.fullmatch(rf"rank{rank}-step(\d+)\.pt", path.name)
        if m:
            found.append((path, int(m.group(1))))
    return sorted(found, key=lambda f: -f[1])


def save_last(
    ckpt_dir: Path,
    step: int,
    model_state: dict,
    config: dict,
    world_size: int,
    state: dict,
    prune_others: bool = True,
    data: dict | None = None,
) -> None:
    """The commit point. ``prune_others`` (synchronous runs): every rank's state at another step is
    garbage now. Asynchronous ranks checkpoint at their own pace: their files are theirs to replace.
    ``data``: where the sample stream stands at ``step`` (``GlobalBatchSampler.state``)."""
    last = {"model": model_state, "step": step, "world_size": world_size, "config": config, "rank0": state}
    if data is not None:
        last["data"] = data
    atomic_save(last, ckpt_dir / "last.pt")
    if prune_others:
        for old in ckpt_dir.glob("rank*-step*.pt"):
            if not old.name.endswith(f"-step{step}.pt"):
                old.unlink(missing_ok=True)


def load(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise UserError(f"checkpoint {path} does not exist") from None
    except Exception as e:
        raise UserError(f"checkpoint {path} is unreadable: {str(e).splitlines()[0][:200]}") from None


@dataclass
class Resumed:
    """What a rank resumes from. ``state``: its own resume state, or rank 0's where a synchronous rank
    of the old run has none; None for a *joiner* (a rank the old run did not have) and an asynchronous
    rank that never checkpointed. ``rank0``: rank 0's state, what a joiner starts from."""

    step: int
    state: dict[str, Any] | None
    world_size: int  # the old run's processes
    model: dict[str, Any]  # last.pt's weights: the run's result at ``last_step``
    last_step: int  # the step last.pt commits (an asynchronous rank's own may differ)
    rank0: dict[str, Any] = field(default_factory=dict)
    data: dict[str, int] | None = None  # GlobalBatchSampler.state at last_step; None in older checkpoints
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def joiner(self) -> bool:
        return self.state is None


def read_last(ckpt_dir: Path) -> dict[str, Any]:
    """``last.pt``, checked to be a parambox checkpoint."""
    last = load(ckpt_dir / "last.pt")
    if not isinstance(last, dict) or "step" not in last or "model" not in last:
        raise UserError(f"checkpoint {ckpt_dir / 'last.pt'} is not a parambox checkpoint")
    return last


def load_resume(ckpt_dir: Path, rank: int, world_size: int, own_pace: bool = False) -> Resumed:
    """This rank's resume from the run's last checkpoint, at any ``world_size``. ``own_pace``
    (asynchronous runs): each rank other than 0 from its own newest state, at its own step. A rank
    beyond the old run's is a joiner; rank 0 of a smaller run discards the dropped ranks' files."""
    last = read_last(ckpt_dir)
    step, old_size = int(last["step"]), int(last.get("world_size") or world_size)
    resumed = Resumed(
        step, None, old_size, last["model"], step, last["rank0"], last.get("data"), last.get("config") or {}
    )
    if rank == 0:
        if old_size > world_size:
            for r in range(world_size, old_size):
                for path, _ in rank_states(ckpt_dir, r):
                    path.unlink(missing_ok=True)
        resumed.state = last["rank0"]
        return resumed
    if rank >= old_size:
        return resumed  # a joiner
    if not own_pace:
        own = ckpt_dir / f"rank{rank}-step{step}.pt"
        # A stopped run (Ctrl-C) saves each rank where it stopped, which for a rank a step apart from
        # rank 0 is not rank 0's step: it then continues from rank 0's state (a synchronous replica).
        resumed.state = load(own) if own.exists() else last["rank0"]
        return resumed
    states = rank_states(ckpt_dir, rank)
    if states:
        path, resumed.step = states[0]
        resumed.state = load(path)
    return resumed


def init_weights(source: str) -> dict[str, Any]:
    """The weights ``init_from`` names: a run directory (its ``checkpoints/last.pt``), a ``last.pt``
    (its ``"model"``) or a plain state_dict ``.pt`` file."""
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "checkpoints" / "last.pt"
    obj = load(path)
    if isinstance(obj, dict) and "model" in obj and "step" in obj:
        obj = obj["model"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"init_from {source}: {path} holds no state_dict (a dict of tensors)")
    return obj


def load_init_weights(model: torch.nn.Module, source: str) -> None:
    """``model``'s weights from ``source`` (:func:`init_weights`); a ``UserError`` naming the keys or
    shapes that do not match the run's model."""
    weights, own = init_weights(source), model.state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    shapes = sorted(k for k in set(own) & set(weights) if own[k].shape != weights[k].shape)
    problems = [
        f"{what} {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
        for what, keys in (("missing", missing), ("unexpected", unexpected), ("other shapes:", shapes))
        if keys
    ]
    if problems:
        raise UserError(f"init_from {source}: its weights do not fit the run's model ({'; '.join(problems)})")
    model.load_state_dict(weights)
