"""A lost box rebuilt from the workers' replicas (issue 50).

Across nodes the rma box lives in its memory ranks' own memory (or in the workers'): a rank that dies
takes its part of the center with it, and the MPI job restarts whole (``--max-restarts``). What the
center had become since the last checkpoint is not gone with it: each surviving worker holds a
replica, the center as it last pulled it plus its own updates since. So a worker that learns the box
is lost (``BoxLost``) saves its own state at the step it reached (:func:`save`), marked *salvaged*;
rank 0 of the restarted job puts back, instead of the checkpoint's center, the mean of the replicas
saved at that loss (:func:`rebuild`), and the strategy's other state in the box (Adagrad's sums,
DiLoCo's outer momentum) from the last checkpoint. Each salvaged worker then starts from that center,
as a replacement does, and goes on at its own step: none of its steps is done twice or lost.

What is lost, and stated in the warning the restart prints: the center's updates since each worker's
last pull, of which the mean keeps each worker's own share (1/N of the sum a shared center holds);
the box's other state since the last checkpoint; and the replica of a worker that died with the box,
which continues from its own last checkpoint.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from parambox.errors import warn
from parambox.numerics import is_finite
from parambox.strategies.asynchronous import SALVAGED
from parambox.training import checkpoint


def save(run: Any, step: int | None, loop_state: dict[str, Any]) -> None:
    """This worker's state after ``step`` steps, kept for the restart that rebuilds the box; nothing for a
    strategy whose center cannot be rebuilt from replicas, a memory rank, a rank that never started, or
    a worker halted on non-finite values (its replica would poison the mean)."""
    strategy = run.strategy
    if step is None or not getattr(strategy, "rebuilds_center", False) or getattr(strategy, "serves", False):
        return
    if strategy.halted or not is_finite(strategy.x):
        return
    state = checkpoint.rank_state(strategy.model.state_dict(), strategy.salvage_state(step), loop_state)
    try:
        checkpoint.save_rank_state(run.run_dir / "checkpoints", run.world.rank, step, state, prune=True)
    except Exception as e:  # the run fails on the lost box anyway: say only why this replica is not kept
        warn(f"rank {run.world.rank}: its replica could not be kept for the restart: {e}")


def salvaged(ckpt_dir: Path, committed_box: int) -> tuple[list[int], list[int], list[dict[str, Any]]]:
    """The ranks, steps and states the workers kept when the latest box was lost, if that box is the one
    ``last.pt`` was committed from (``committed_box``, when its center went in) or a later one; empty
    lists otherwise (the replicas of an older box went into a center since checkpointed)."""
    found: list[tuple[int, int, dict[str, Any]]] = []
    for path in ckpt_dir.glob("rank*-step*.pt"):
        with contextlib.suppress(Exception):  # (a file that is not a rank's state is not a replica)
            # mapped, not read: every resume of rank 0 looks, and only a flag is wanted of most files
            state = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
            if state["strategy"].get(SALVAGED) and state["strategy"]["box"] >= committed_box:
                rank, step = (int(s) for s in path.stem.removeprefix("rank").split("-step"))
                found.append((rank, step, state))
    if not found:
        return [], [], []
    latest = max(state["strategy"]["box"] for _, _, state in found)
    found = sorted((f for f in found if f[2]["strategy"]["box"] == latest), key=lambda f: f[0])
    return [f[0] for f in found], [f[1] for f in found], [f[2] for f in found]


def rebuild(run: Any, resumed: checkpoint.Resumed) -> None:
    """Rank 0 of a restarted asynchronous run: where the workers saved replicas at a loss of the box,
    its resume state puts back their mean as the center (and rank 0 continues from its own replica,
    where it saved one), and ``summary.json`` says so (``rebuilt_box``). Changes ``resumed`` in place."""
    strategy = run.strategy
    if run.world.rank != 0 or not getattr(strategy, "rebuilds_center", False) or resumed.state is None:
        return
    last = resumed.rank0
    ranks, steps, states = salvaged(run.run_dir / "checkpoints", int(last["strategy"].get("box", 0)))
    if not ranks:
        return
    if 0 in ranks:  # rank 0's own replica, with what the box held of the strategy from the checkpoint
        own = states[ranks.index(0)]
        kept = {k: last["strategy"][k] for k in strategy.box_state_keys if k in last["strategy"]}
        resumed.state = {**own, "strategy": {**own["strategy"], **kept}}
        resumed.step = steps[ranks.index(0)]
    strategy.rebuilt = {"ranks": ranks, "steps": steps, "checkpoint_step": resumed.last_step}  # summary.json
    center = strategy.rebuilt_center([s["replica"] for s in states])
    resumed.state = {**resumed.state, "strategy": {**resumed.state["strategy"], "center": center}}
    warn(
        f"box {strategy.box_name!r} rebuilt from the replicas that ranks {', '.join(map(str, ranks))} kept "
        f"when it was lost, at their steps {', '.join(map(str, steps))} (the last checkpoint: step "
        f"{resumed.last_step}): their mean is the center, and each goes on at its own step; what the box "
        "held beyond the center comes from the checkpoint"
    )
