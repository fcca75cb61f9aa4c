"""Tier (c): an asynchronous run SIGKILLed whole after some checkpoints, then ``--resume``d: exit 0, every
step done, the accuracy of an uninterrupted run (issue 13). Ranks checkpoint at their own pace; each
restores its own last state, rank 0 the center too. (allreduce's bit-exact resume: test_resume.py.)"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from parambox.training.checkpoint import load_resume, save_last, save_rank_state
from tests.conftest import run_cli, summary
from tests.test_restarts import start


def test_each_rank_keeps_and_resumes_from_its_own_last_state(tmp_path):
    """Rank 1 lags: it saved step 100 when rank 0 commits step 200. The commit must not delete rank 1's
    state (it did: then resume looked for rank1-step200.pt, failed, and the run hung)."""
    save_rank_state(tmp_path, 1, 100, {"who": 1}, prune=True)
    save_rank_state(tmp_path, 2, 250, {"who": 2}, prune=True)  # rank 2 runs ahead
    save_last(tmp_path, 200, {}, {}, 3, {"who": 0}, prune_others=False)
    assert _own(load_resume(tmp_path, 0, 3, own_pace=True)) == (200, {"who": 0})
    assert _own(load_resume(tmp_path, 1, 3, own_pace=True)) == (100, {"who": 1})
    assert _own(load_resume(tmp_path, 2, 3, own_pace=True)) == (250, {"who": 2})
    save_rank_state(tmp_path, 1, 300, {"who": 1}, prune=True)  # replaces rank 1's own older state only
    assert sorted(p.name for p in tmp_path.glob("rank*.pt")) == ["rank1-step300.pt", "rank2-step250.pt"]
    assert load_resume(tmp_path, 3 - 1, 3, own_pace=True).step == 250


def test_a_resume_at_another_size_keeps_old_ranks_discards_dropped_and_makes_joiners(tmp_path):
    """3 -> 4 workers: rank 3 is a joiner (no state: it starts from the center at rank 0's step);
    then 3 -> 2: rank 0 discards rank 2's files (its progress not pushed is lost, as documented)."""
    save_rank_state(tmp_path, 1, 100, {"who": 1}, prune=True)
    save_rank_state(tmp_path, 2, 250, {"who": 2}, prune=True)
    save_last(tmp_path, 200, {"w": 1}, {}, 3, {"who": 0}, prune_others=False)
    joiner = load_resume(tmp_path, 3, 4, own_pace=True)
    assert joiner.joiner and joiner.step == 200 and joiner.rank0 == {"who": 0} and joiner.world_size == 3
    assert _own(load_resume(tmp_path, 2, 4, own_pace=True)) == (250, {"who": 2})
    assert _own(load_resume(tmp_path, 0, 2, own_pace=True)) == (200, {"who": 0})
    assert sorted(p.name for p in tmp_path.glob("rank*.pt")) == ["rank1-step100.pt"]


def _own(resumed) -> tuple:
    return resumed.step, resumed.state


def _checkpointed(out, rank: int, at_least: int) -> bool:
    ckpts = out / "checkpoints"
    if not (ckpts / "last.pt").exists():
        return False
    steps = [
        int(m.group(1)) for p in ckpts.glob(f"rank{rank}-step*.pt") if (m := re.search(r"step(\d+)", p.name))
    ]
    return bool(steps) and max(steps) >= at_least


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "strategy,extra",
    [
        ("easgd", []),
        ("downpour", []),
        ("hogwild", ["--preset", "digits-hogwild"]),
        ("dogwild", ["--preset", "digits-dogwild"]),
        ("downpour", ["rank 1 never checkpointed"]),
    ],
)
def test_sigkill_everything_then_resume(tmp_path, strategy, extra):
    """``rank 1 never checkpointed``: its state files gone, rank 1 starts again from the center at
    last.pt's step, and its count of steps in the box from there too (it was 0: worker_steps fell a
    whole resume short)."""
    lose_own = extra == ["rank 1 never checkpointed"]
    extra = [] if lose_own else extra
    out = tmp_path / "run"
    args = [
        "train",
        "--strategy",
        strategy,
        *extra,
        "--checkpoint-every",
        "100",
        "--no-progress",
        "--out",
        str(out),
    ]
    launcher = start(*args, shared_zygote=True)
    deadline = time.monotonic() + 200
    while not _checkpointed(out, 1, 200):
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's group; its workers die with it
    launcher.wait(10)
    assert not (out / "summary.json").exists()
    if lose_own:
        for own in (out / "checkpoints").glob("rank1-step*.pt"):
            own.unlink()
    run_cli(*args, "--resume")
    s = summary(out)
    assert s["worker_steps"] == [600, 600] and s["lost_workers"] == []
    assert s["final_test_accuracy"] >= 0.93, s["final_test_accuracy"]
