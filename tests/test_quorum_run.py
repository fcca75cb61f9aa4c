"""``diloco`` with a quorum over the shm box, 4 workers, one of them 5x slower (issue 51, item 3's Must show).

Two runs side by side, at the same time on the same machine: quorum 3 of 4 with rank 3 slowed by the
``slow`` fault (0.2 s a step on top of the paced loss's 0.04 s and the step's own ~0.01 s: 5x), and the same run without the fault.
The fast workers' steps per second in the first over the second is the quorum's point: a slow worker does
not hold the others up (a push gets the center back at once). Each step is paced by a sleep, as a worker
on its own accelerator, so that 8 workers on this machine's 2 cores measure the rule, not the contention.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import run_cli, summary

SLOW_RANK, STEPS = 3, 400
ARGS = ["train", "--preset", "digits-diloco-async", "--workers", "4", "--steps", str(STEPS)]
ARGS += ["--set", "diloco.quorum=3", "--set", "diloco.termination=fastest"]  # a quorum's own outer_lr, 0.35
ARGS += ["--loss", "tests.workloads.paced:loss", "--eval-every", "0", "--no-progress", "--threads", "1"]


def steps_per_s(run_dir: Path, rank: int) -> float:
    """Rank ``rank``'s steps over the time of its last one, from its metrics."""
    name = "metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"
    rows = [json.loads(line) for line in (run_dir / name).read_text().splitlines()]
    last = [r for r in rows if r.get("kind") == "step"][-1]
    return last["step"] / last["time"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.long
def test_a_worker_5x_slower_does_not_hold_the_others_up(tmp_path):
    runs = {"slow": {"PARAMBOX_FAULT": f"{SLOW_RANK}:0:slow"}, "even": {}}
    with ThreadPoolExecutor(2) as pool:
        done = {
            name: pool.submit(run_cli, *ARGS, "--out", str(tmp_path / name), env=env, fresh=True, timeout=280)
            for name, env in runs.items()
        }
        for job in done.values():
            job.result()
    fast = [r for r in range(4) if r != SLOW_RANK]
    speed = {name: sum(steps_per_s(tmp_path / name, r) for r in fast) / len(fast) for name in runs}
    ratio = speed["slow"] / speed["even"]
    slowed = steps_per_s(tmp_path / "slow", SLOW_RANK) / speed["slow"]
    accuracy = summary(tmp_path / "slow")["final_test_accuracy"]
    print(
        f"fast workers' steps/s, a 5x slower worker / none: {ratio:.3f} (it at {slowed:.2f}); accuracy {accuracy:.3f}"
    )
    assert slowed < 0.25, "the slow worker was not 5x slower"
    assert ratio >= 0.85, ratio  # measured 0.99-1.01 (the Must show: >= 0.9); a margin for the loaded suite
    assert accuracy >= 0.85, accuracy  # measured 0.93-0.94


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_dead_worker_does_not_stop_the_steps(tmp_path):
    """Quorum 4 of 4, rank 1 killed at step 60: the quorum counts the workers still in the run, so the
    other three go on taking outer steps (the pending step's counters in the checkpoint say how many)."""
    import torch

    out = tmp_path / "run"
    args = ["train", "--preset", "digits-diloco-async", "--model", "mlp", "--workers", "4", "--steps", "200"]
    args += [
        "--set",
        "diloco.quorum=4",
        "--set",
        "diloco.outer_lr=0.35",
        "--eval-every",
        "0",
        "--no-progress",
    ]
    run_cli(*args, "--threads", "1", "--out", str(out), env={"PARAMBOX_FAULT": "1:60:kill"})
    s = summary(out)
    assert s["lost_workers"] == [1] and s["worker_steps"] == [200, 60, 200, 200]
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["rank0"]["strategy"]
    steps, joined_by_rank1 = state["quorum"][0], state["quorum"][4 + 1]
    assert steps >= joined_by_rank1 + 10, state["quorum"]  # 20 rounds each after the kill
    assert s["final_test_accuracy"] >= 0.8, s["final_test_accuracy"]
