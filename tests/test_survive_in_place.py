"""Synchronous runs that survive in place (``on_failure = "shrink"``, issue 18): a worker SIGKILLed or
SIGSTOPped at a known step, the survivors go on as a smaller group over a new process group, and the
weights equal the closed form (the N ranks' mean gradient for K steps, then the survivors'); a stalled
rank fenced out sends nothing that is applied; a death before the group formed ends the run at once
(no gloo hang); nothing is left behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

import parambox
from parambox.runtime.elastic import STORE_ENV, host_store
from tests.conftest import ROOT, final_weights, run_cli, summary
from tests.workloads.constant_gradient import (
    closed_form,
    diloco_after,
    easgd_center_after,
    gradient_of,
    weight_after,
)

W = "tests/workloads/constant_gradient.py"
LR, STEPS, KILLED, AT, BATCH = 0.01, 12, 1, 5, 4
ARGS = [
    *("--model", f"{W}:make_model", "--data", f"{W}:make_data", "--loss", f"{W}:loss"),
    *("--metrics", f"{W}:metrics", "--steps", str(STEPS), "--lr", str(LR), "--momentum", "0"),
    *("--batch-size", str(BATCH), "--eval-every", "0", "--no-progress", "--threads", "1"),
    *("--workers", "3", "--set", "on_failure=shrink"),
]


def _pb_shm() -> set[str]:
    # parambox's segments (pb_<hex>_...); pb_mpi.* directories belong to other sessions' MPI jobs
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("pb_") and "mpi" not in p.name}


def _run(
    tmp_path: Path, strategy: str, fault: str, timeout_s: float, extra: tuple = (), killed: int = KILLED
) -> tuple[Path, float]:
    out = tmp_path / strategy
    before = _pb_shm()
    t0 = time.monotonic()
    run_cli(
        "train", "--strategy", strategy, *ARGS, *extra, "--timeout", str(timeout_s), "--out", str(out),
        env={"PARAMBOX_FAULT": f"{killed}:{AT}:{fault}"},
    )  # fmt: skip
    took = time.monotonic() - t0
    # Nothing of this run left in /dev/shm. A test beside this one (pytest-xdist) holds a box's name
    # only while its workers attach, a second or so: a name left by this run would stay.
    deadline = time.monotonic() + 10
    while not _pb_shm() <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pb_shm() <= before
    return out, took


def _check_closed_form(
    out: Path, expected: float | None = None, kept: int = AT, killed: int = KILLED
) -> None:
    """``kept``: the steps all three ranks' samples count in (a round the survivors repeated without
    the lost rank does not count its part)."""
    weight = final_weights(out)["weight"]
    expected = closed_form(LR, STEPS, [0, 1, 2], killed, AT) if expected is None else expected
    assert (weight - expected).abs().max().item() < 1e-6, (weight, expected)
    assert summary(out)["lost_workers"] == [killed]
    assert summary(out)["restarts"] == 0  # in place: nobody restarted, nothing read from disk
    _check_samples(out, [(kept, [0, 1, 2]), (STEPS - kept, [r for r in (0, 1, 2) if r != killed])])


def _check_samples(out: Path, phases: list[tuple[int, list[int]]]) -> None:
    """The summary's rate counts every member's samples, step by step: the lost rank's before its
    death and a replacement's from its joining (an allreduce at the end saw only the last lives')."""
    s = summary(out)
    trained = sum(n * len(ranks) * BATCH for n, ranks in phases)
    assert s["samples_per_s"] * s["wall_time_s"] == pytest.approx(trained, rel=1e-9), (s, phases)


@pytest.mark.timeout(170)
@pytest.mark.parametrize("strategy", ["allreduce", "weight-avg", "ps-sync", "box-sync"])
def test_a_killed_worker_is_survived_in_place_to_the_closed_form(tmp_path, strategy):
    out, _ = _run(tmp_path, strategy, "kill", timeout_s=30)
    _check_closed_form(out)


@pytest.mark.timeout(170)
@pytest.mark.parametrize(
    "strategy", ["allreduce", *(pytest.param(s, marks=pytest.mark.slow) for s in ("ps-sync", "box-sync"))]
)
def test_rank_0_killed_is_survived_in_place_and_rank_1_writes_the_result(tmp_path, strategy):
    """Rank 0, the leader, SIGKILLed at step AT: ranks 1 and 2 go on over the launcher's store (no
    store lived in rank 0), rank 1 leads from there (ps-sync: it serves) and writes the checkpoint,
    metrics.jsonl and the summary. The weights: 3 ranks' mean gradient for AT steps, then ranks 1
    and 2's; metrics.jsonl goes on after rank 0's lines (the steps it had not flushed are lost with
    it) with a "leader" record, then rank 1's steps from the one the survivors repeated."""
    out, _ = _run(tmp_path, strategy, "kill", timeout_s=30, killed=0)
    _check_closed_form(out, killed=0)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "world" and rows[0]["rank"] == 0
    (at,) = [i for i, r in enumerate(rows) if r["kind"] == "leader"]
    assert rows[at]["rank"] == 1 and rows[at]["lost"] == [0] and rows[at]["step"] == AT + 1, rows[at]
    steps = [r["step"] for r in rows[at:] if r["kind"] == "step"]
    assert steps == list(range(AT + 1, STEPS + 1)), steps  # from the step rank 0 died in
    assert rows[-1]["kind"] == "eval" and rows[-1]["step"] == STEPS


@pytest.mark.slow  # 3 processes, ~15 s
@pytest.mark.timeout(170)
def test_weight_avg_with_compression_survives_a_kill_in_place(tmp_path):
    """The compressed exchange (int8: a constant gradient's update quantizes exactly) is repeated among the
    survivors as the plain average is, to the same closed form (audit: both survivors died of PeerLost)."""
    out, _ = _run(
        tmp_path, "weight-avg", "kill", timeout_s=30, extra=("--set", "weight-avg.compression=int8")
    )
    _check_closed_form(out)


@pytest.mark.timeout(170)
@pytest.mark.parametrize("strategy", ["allreduce", "ps-sync", "box-sync"])
def test_a_model_with_buffers_survives_a_kill_in_place(tmp_path, strategy):
    """The buffer broadcast (batch norm's statistics, rank 0's every step) runs inside the exchange: a
    peer lost there is survived in place too (before, it ended the rank: a restart of all)."""
    out, _ = _run(tmp_path, strategy, "kill", timeout_s=30, extra=("--model", f"{W}:make_model_with_buffer"))
    _check_closed_form(out)


@pytest.mark.solo  # looks at /tmp
@pytest.mark.timeout(170)
def test_a_killed_rank_and_its_loaders_leave_nothing_in_tmp(tmp_path):
    """The ranks' temporary files live in a directory of the run's, removed at its end: a rank killed
    mid-run and its data-loader processes (user data: two each) used to leave multiprocessing's
    pymp-* folders in /tmp."""

    def ours() -> set[str]:
        return {p.name for p in Path("/tmp").iterdir() if p.name.startswith(("pymp-", "parambox-"))}

    before = ours()
    out, _ = _run(tmp_path, "allreduce", "kill", timeout_s=30)
    _check_closed_form(out)
    assert ours() <= before


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.parametrize("strategy", ["box-sync"])
@pytest.mark.long
def test_under_mpiexec_with_ft_ulfm_a_killed_rank_is_survived_in_place(tmp_path, strategy):
    """The same closed form under ``mpiexec --with-ft ulfm -n 3`` (no local launcher): rank 0 serves the
    regroup store, ULFM tells the survivors who died, and they agree on the new group over MPI. The
    box's exchange (box-sync); a process-group exchange killed under ULFM is
    test_survivors_a_step_apart_go_on_with_the_leaders_state[allreduce-ulfm] (rank 2 killed, the closed
    form, nothing left in its job's TMPDIR), and weight-avg's and allreduce's repeats of their exchange
    are checked under the local launcher (~30 s a run under load)."""
    from parambox.runtime.spawn import find_mpiexec
    from tests.conftest import MPI_ENV

    if find_mpiexec() is None:
        pytest.skip("no mpiexec found")
    out = tmp_path / strategy
    prefix = [find_mpiexec(), "--with-ft", "ulfm", "-n", "3", "--oversubscribe"]
    # The job's temporary directory of its own (short: Open MPI's sockets live there): what the
    # ranks, their loaders and Open MPI make in it must be gone at the end, the killed rank's too.
    scratch = Path(tempfile.mkdtemp(prefix="pbt-", dir="/tmp"))
    try:
        env = {**MPI_ENV, "PARAMBOX_FAULT": f"{KILLED}:{AT}:kill", "TMPDIR": str(scratch)}
        proc = run_cli(
            "train", "--strategy", strategy, *ARGS, "--timeout", "30", "--out", str(out),
            prefix=prefix, env=env, timeout=150,
        )  # fmt: skip
        assert summary(out)["launcher"] == "mpi", proc.stderr[-2000:]
        _check_closed_form(out)
        # torch's compile cache (torchinductor_<user>) stays by design, as it does in /tmp
        left = [str(p.relative_to(scratch)) for p in scratch.rglob("*") if "torchinductor_" not in str(p)]
        assert left == [], left
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.timeout(170)
@pytest.mark.parametrize("compression", ["none", "int8"])
def test_synchronous_diloco_survives_a_kill_mid_round_to_the_closed_form(tmp_path, compression):
    """Rounds of 2 steps; rank 1 dies in step 5, the second step of round 2: the survivors repeat that
    round's exchange among themselves (rank 1's half round is lost), and the outer Nesterov momentum
    goes on: 2 rounds of the 3 ranks' mean pseudo-gradient, then 4 of the survivors'. With int8 the
    repeat sends the survivors' quantized pseudo-gradients again, with their error feedback as it was
    before the failed exchange (a constant block quantizes exactly: the closed form holds)."""
    outer = (
        *("--set", "diloco.inner_steps=2", "--set", "diloco.outer_lr=0.7"),
        *("--set", "diloco.outer_momentum=0.9", "--set", f"diloco.compression={compression}"),
    )
    out, _ = _run(tmp_path, "diloco", "kill", timeout_s=30, extra=outer)
    survivors = [0, 2]
    expected = diloco_after(LR, 2, [(2, [0, 1, 2]), (4, survivors)], outer_lr=0.7, mu=0.9)
    _check_closed_form(out, expected, kept=4)  # rank 1's half of round 3 is lost


@pytest.mark.timeout(170)
def test_synchronous_easgd_survives_a_kill_to_the_closed_form(tmp_path):
    """An exchange every 2 steps; rank 1 dies in step 5, before its exchange: the survivors repeat it
    among themselves, and from then on the center moves by the survivors' elastic sum alone."""
    extra = ("--set", "easgd.sync=true", "--set", "easgd.tau=2", "--set", "easgd.alpha=0.2")
    out, _ = _run(tmp_path, "easgd", "kill", timeout_s=30, extra=extra)
    expected = easgd_center_after(LR, 0.2, 2, STEPS, [0, 1, 2], KILLED, AT)
    _check_closed_form(out, expected, kept=4)  # rank 1's fifth step never reached an exchange


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_the_cli_survives_rank_0_killed_mid_run_on_digits(tmp_path):
    """As a user runs it: ``parambox train --strategy allreduce --workers 3 --set on_failure=shrink``
    with rank 0 SIGKILLed at step 40 of 150 ends with exit 0, a summary naming rank 0 lost and the
    accuracy of a clean run (0.95 on this seed; rank 0's shard goes untrained after step 40)."""
    out = tmp_path / "run"
    proc = run_cli(
        "train", "--strategy", "allreduce", "--workers", "3", "--set", "on_failure=shrink",
        "--data", "digits", "--model", "mlp", "--steps", "150", "--no-progress", "--out", str(out),
        env={"PARAMBOX_FAULT": "0:40:kill"}, fresh=True,
    )  # fmt: skip
    assert proc.returncode == 0 and "lost worker ranks [0]" in proc.stderr, proc.stderr[-2000:]
    s = summary(out)
    assert s["lost_workers"] == [0] and s["steps"] == 150 and s["restarts"] == 0
    assert s["final_test_accuracy"] >= 0.9, s
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["step"] == 150


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_synchronous_easgd_and_diloco_survive_rank_0_killed_to_the_closed_form(tmp_path):
    """The center (easgd) and the outer momentum (diloco) live on every rank: rank 1 leads on with
    its own, and the result is the closed form of ranks 1 and 2 after rank 0's death."""
    extra = ("--set", "easgd.sync=true", "--set", "easgd.tau=2", "--set", "easgd.alpha=0.2")
    out, _ = _run(tmp_path, "easgd", "kill", timeout_s=30, extra=extra, killed=0)
    _check_closed_form(out, easgd_center_after(LR, 0.2, 2, STEPS, [0, 1, 2], 0, AT), kept=4, killed=0)
    outer = ("--set", "diloco.inner_steps=2", "--set", "diloco.outer_lr=0.7")
    out, _ = _run(tmp_path, "diloco", "kill", timeout_s=30, extra=outer, killed=0)
    expected = diloco_after(LR, 2, [(2, [0, 1, 2]), (4, [1, 2])], outer_lr=0.7, mu=0.9)
    _check_closed_form(out, expected, kept=4, killed=0)


def _run_with_a_replacement(
    out: Path, strategy: str, steps: int, momentum: float, killed: int, slow: int
) -> None:
    """Rank ``killed`` SIGKILLed at step AT with one restart allowed (--max-restarts 1); rank ``slow``
    sleeps 0.2 s a step, so that the replacement has time to start and join."""
    run_cli(
        "train", "--strategy", strategy, *ARGS, "--steps", str(steps), "--timeout", "20",
        "--momentum", str(momentum), "--max-restarts", "1", "--out", str(out),
        env={"PARAMBOX_FAULT": f"{killed}:{AT}:kill,{slow}:0:slow"}, timeout=380,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["allreduce", "ps-sync", "box-sync"])
def test_a_replacement_joins_with_a_live_ranks_state(tmp_path, strategy):
    """--max-restarts: the killed rank's replacement joins at a step boundary, receives the weights and
    the optimizer's momentum from rank 0 over the new group, and trains on the dead rank's slice: the
    weights are those of 3, then 2, then 3 ranks' mean gradients (momentum SGD), and its replica and
    momentum at the end equal the survivors'."""
    out, steps, momentum = tmp_path / "run", 40, 0.5
    _run_with_a_replacement(out, strategy, steps, momentum, killed=KILLED, slow=0)
    times = {r["step"]: r["time"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    # The survivors regrouped at once: the loader processes hold no copy of a worker's connections
    # (with one, rank 0 waited the whole --timeout, 20 s, for a peer that had closed its group).
    assert times[AT + 1] - times[AT] < 5, times
    lines = (out / f"metrics.rank{KILLED}.jsonl").read_text().splitlines()
    joined = [json.loads(x) for x in lines if '"world"' in x][-1]
    at = joined["step"]
    assert joined["life"] == 1 and AT < at < steps
    phases = [(AT, [0, 1, 2]), (at - AT, [0, 2]), (steps - at, [0, 1, 2])]
    expected = weight_after(LR, phases, momentum)
    _check_rejoined(out, expected, at)
    _check_samples(out, phases)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_replacement_of_rank_0_joins_and_rank_1_keeps_leading(tmp_path):
    """--max-restarts with rank 0 killed: rank 1 leads from then on; rank 0's replacement joins as any
    other rank (last in the group, so the leader stays), with rank 1's weights and momentum, and ends
    with rank 2's state; the weights are 3, then 2, then 3 ranks' mean gradients (momentum SGD)."""
    out, steps, momentum = tmp_path / "run", 40, 0.5
    _run_with_a_replacement(out, "allreduce", steps, momentum, killed=0, slow=1)
    lines = (out / "metrics.rank0.jsonl").read_text().splitlines()  # the replacement's: it does not lead
    at = [json.loads(x) for x in lines if '"world"' in x][-1]["step"]
    assert AT < at < steps
    phases = [(AT, [0, 1, 2]), (at - AT, [1, 2]), (steps - at, [0, 1, 2])]
    weight = final_weights(out)["weight"]
    expected = weight_after(LR, phases, momentum)
    assert (weight - expected).abs().max().item() < 1e-4 * max(1.0, abs(expected)), (weight, expected, at)
    states = {
        r: torch.load(next((out / "checkpoints").glob(f"rank{r}-*.pt")), weights_only=True) for r in (0, 2)
    }
    for key in ("replica", "strategy"):
        assert json.dumps(_flat(states[0][key])) == json.dumps(_flat(states[2][key]))
    assert summary(out)["restarts"] == 1 and summary(out)["lost_workers"] == []
    _check_samples(out, phases)  # the leader's count, rank 0's first life included


@pytest.mark.timeout(170)
def test_the_members_go_on_while_a_replacement_loads(tmp_path):
    """A replacement asks to join once its data and model are ready: the members train on meanwhile
    and stall only for the admission itself (before, they stalled from the admission until the
    replacement had built its model and received their state: here 3 s, on MNIST ~0.5 s a fault)."""
    out, steps = tmp_path / "run", 40
    run_cli(
        "train",
        "--strategy",
        "allreduce",
        *ARGS,
        "--model",
        f"{W}:make_model_slow_to_replace",
        "--steps",
        str(steps),
        "--timeout",
        "20",
        "--max-restarts",
        "1",
        "--out",
        str(out),
        env={"PARAMBOX_FAULT": f"{KILLED}:{AT}:kill,0:0:slow"},
    )  # fmt: skip  (rank 0 sleeps 0.2 s a step)
    times = [
        r["time"]
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "step"
    ]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < 2.0, gaps  # a step is 0.2 s; waiting for the replacement's model, >= 3 s
    lines = (out / f"metrics.rank{KILLED}.jsonl").read_text().splitlines()
    at = [json.loads(x) for x in lines if '"world"' in x][-1]["step"]
    assert AT + 10 <= at < steps  # the members trained on for the replacement's 3 s (~15 steps)
    expected = weight_after(LR, [(AT, [0, 1, 2]), (at - AT, [0, 2]), (steps - at, [0, 1, 2])])
    _check_rejoined(out, expected, at)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_diloco_replacement_joins_at_a_rounds_start_with_the_outer_momentum(tmp_path):
    """Synchronous diloco, --max-restarts: the replacement joins at the start of a round and receives
    theta, the outer Nesterov momentum and the inner optimizer from rank 0: rounds of 3, then 2,
    then 3 ranks' mean pseudo-gradient, and its state at the end equals a survivor's."""
    out, steps, h = tmp_path / "run", 40, 2
    run_cli(
        "train", "--strategy", "diloco", *ARGS, "--steps", str(steps), "--timeout", "20",
        "--set", f"diloco.inner_steps={h}", "--max-restarts", "1", "--out", str(out),
        env={"PARAMBOX_FAULT": f"{KILLED}:{AT}:kill,0:0:slow"}, timeout=380,
    )  # fmt: skip
    lines = (out / f"metrics.rank{KILLED}.jsonl").read_text().splitlines()
    at = [json.loads(x) for x in lines if '"world"' in x][-1]["step"]
    assert at % h == 0 and AT < at < steps  # a round's first step
    rounds = [(AT // h, [0, 1, 2]), (at // h - AT // h, [0, 2]), ((steps - at) // h, [0, 1, 2])]
    expected = diloco_after(LR, h, rounds, outer_lr=0.7, mu=0.9)
    _check_rejoined(out, expected, at)


def _run_with_a_joiner(tmp_path: Path, strategy: str, extra: tuple = (), steps: int = 40) -> tuple[Path, int]:
    """``--workers 2:3``: ranks 0 and 1 start the run, rank 2 (3 s slower to build its model) joins it
    at a step boundary; rank 0 sleeps 0.2 s a step. The run's directory and the joiner's first step."""
    out = tmp_path / strategy
    args = [a for a in ARGS if a not in ("--workers", "3")]
    run_cli(
        "train", "--strategy", strategy, *args, "--workers", "2:3", "--model", f"{W}:make_model_late_on_rank_2",
        "--steps", str(steps), "--timeout", "20", *extra, "--out", str(out), env={"PARAMBOX_FAULT": "0:0:slow"},
    )  # fmt: skip
    lines = (out / "metrics.rank2.jsonl").read_text().splitlines()
    at = [json.loads(x) for x in lines if '"world"' in x][-1]["step"]
    assert 5 <= at < steps - 5, at  # it joined mid-run: the others trained ~3 s without it
    return out, at


@pytest.mark.timeout(170)
def test_a_worker_that_joins_allreduce_gets_a_live_ranks_state_and_the_global_batch_is_kept(tmp_path):
    """``--workers 2:3``: the weights are 2 ranks' mean gradient, then 3 ranks' from the step rank 2
    joined (momentum SGD: it received rank 0's momentum); its state at the end equals rank 1's; the
    global batch (4 x 3) was cut over 2, then 3 ranks (keep-global-batch), which metrics.jsonl says."""
    steps, momentum = 40, 0.5
    out, at = _run_with_a_joiner(tmp_path, "allreduce", ("--momentum", str(momentum)), steps)
    phases = [(at, [0, 1]), (steps - at, [0, 1, 2])]
    weight = final_weights(out)["weight"]
    expected = weight_after(LR, phases, momentum)
    assert (weight - expected).abs().max().item() < 1e-6, (weight, expected, at)
    states = {
        r: torch.load(next((out / "checkpoints").glob(f"rank{r}-*.pt")), weights_only=True) for r in (1, 2)
    }
    for key in ("replica", "strategy"):
        assert json.dumps(_flat(states[1][key])) == json.dumps(_flat(states[2][key]))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    (resized,) = [r for r in rows if r["kind"] == "resize"]
    assert resized["step"] == at and resized["workers"] == 3 and resized["members"] == [0, 1, 2]
    assert (resized["rule"], resized["global_batch"]) == ("keep-global-batch", 3 * BATCH)
    s = summary(out)
    assert (s["lost_workers"], s["restarts"]) == ([], 0)
    assert s["samples_per_s"] * s["wall_time_s"] == pytest.approx(steps * 3 * BATCH, rel=1e-9)


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_a_worker_joins_synchronous_easgd_and_diloco_to_the_closed_form(tmp_path):
    """The joiner comes in at a period's start with the center (easgd) or theta and the outer momentum
    (diloco) of a live rank; resize=scale-batch: each worker keeps its batch, the global batch grows."""
    easgd = ("--set", "easgd.sync=true", "--set", "easgd.tau=2", "--set", "easgd.alpha=0.2")
    out, at = _run_with_a_joiner(tmp_path, "easgd", (*easgd, "--set", "resize=scale-batch"), STEPS * 2)
    assert at % 2 == 0
    x, c = {0: 0.0, 1: 0.0}, 0.0
    for step in range(STEPS * 2):
        if step == at:
            x[2] = x[0]  # the leader's replica (the replicas differ: each rank's gradient does)
        for r in x:
            x[r] -= LR * gradient_of(r)
        if (step + 1) % 2 == 0:
            d = {r: x[r] - c for r in x}
            for r in x:
                x[r] -= 0.2 * d[r]
            c += 0.2 * sum(d.values())
    weight = final_weights(out)["weight"]
    assert (weight - c).abs().max().item() < 1e-6, (weight, c, at)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    (resized,) = [r for r in rows if r["kind"] == "resize"]
    assert (resized["rule"], resized["global_batch"]) == ("scale-batch", 3 * BATCH)
    h = 2
    out, at = _run_with_a_joiner(tmp_path, "diloco", ("--set", f"diloco.inner_steps={h}"))
    assert at % h == 0
    rounds = [(at // h, [0, 1]), ((40 - at) // h, [0, 1, 2])]
    expected = diloco_after(LR, h, rounds, outer_lr=0.7, mu=0.9)
    weight = final_weights(out)["weight"]
    assert (weight - expected).abs().max().item() < 1e-6 * max(1.0, abs(expected)), (weight, expected, at)


def _check_rejoined(out: Path, expected: float, at: int) -> None:
    """The weights are ``expected``; the replacement's replica and strategy state at the end are a
    survivor's, exactly; one restart, nobody lost."""
    weight = final_weights(out)["weight"]
    assert (weight - expected).abs().max().item() < 1e-4 * max(1.0, abs(expected)), (weight, expected, at)
    states = {
        r: torch.load(next((out / "checkpoints").glob(f"rank{r}-*.pt")), weights_only=True) for r in (1, 2)
    }
    for key in ("replica", "strategy"):
        assert json.dumps(_flat(states[1][key])) == json.dumps(_flat(states[2][key]))
    assert summary(out)["restarts"] == 1 and summary(out)["lost_workers"] == []


def _flat(obj):
    """Tensors as lists, for an exact comparison of two saved states."""
    if isinstance(obj, dict):
        return {str(k): _flat(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_flat(v) for v in obj]
    return obj.tolist() if isinstance(obj, torch.Tensor) else obj


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.parametrize("strategy", ["allreduce", "box-sync"])
def test_a_stopped_worker_is_fenced_out_and_killed(tmp_path, strategy):
    """SIGSTOP past --timeout: the survivors leave it out and the launcher SIGKILLs it; the weights are
    the closed form, so nothing of it was applied after step AT (box-sync: it may write its slot in
    the box on waking, which the survivors no longer read)."""
    out, _ = _run(tmp_path, strategy, "stop", timeout_s=4)
    _check_closed_form(out)
    stray = [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    assert not stray  # the stopped rank did not outlive the run


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_a_stalled_rank_that_wakes_sends_nothing_into_the_new_group(tmp_path):
    """Without a launcher to kill it: rank 1 stalls past the others' timeout, wakes and sends 1000 into
    its old group; the survivors' sums stay 2 (two ranks of ones) throughout, and rank 1 is fenced."""
    store, address = host_store()
    env = dict(os.environ, **{STORE_ENV: address})
    cmd = [sys.executable, "-m", "tests.elastic_worker"]
    procs = [
        subprocess.Popen([*cmd, str(r), "3", str(tmp_path / f"{r}.json")], env=env, cwd=ROOT)
        for r in range(3)
    ]
    assert [p.wait(timeout=150) for p in procs] == [0, 0, 0]
    records = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert "fenced" in records[1] and records[1]["sums"] == [3.0]
    for r in (0, 2):
        assert records[r]["members"] == [0, 2]
        assert records[r]["sums"][0] == 3.0 and set(records[r]["sums"][1:]) == {2.0}
        assert len(records[r]["sums"]) > 5  # they went on past the moment rank 1 woke
    del store


@pytest.mark.timeout(170)
def test_a_death_before_the_group_formed_ends_the_run_at_once(tmp_path):
    """A rank killed before it joined (gloo#520: a peer that never connects can hang the others): not
    survivable in place, and the launcher, which sees the death, ends the run naming the rank. (Killed
    by the test once named, it sometimes had joined already: its workers fork warm from a zygote.)"""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "parambox", "train", "--strategy", "allreduce", *ARGS,
         "--timeout", "120", "--out", str(tmp_path / "run")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=dict(os.environ, PARAMBOX_FAULT="1:0:kill-join"),
    )  # fmt: skip
    _, err = proc.communicate(timeout=100)
    assert proc.returncode == 1
    assert "worker rank 1 failed: killed by signal SIGKILL" in err
    assert time.monotonic() - t0 < 45  # not the 120 s rendezvous timeout


def test_shrink_is_refused_for_a_strategy_that_cannot_regroup():
    with pytest.raises(parambox.UserError, match="on_failure=shrink: strategy 'pipeline'"):
        parambox.train(strategy="pipeline", workers=2, steps=1, on_failure="shrink", progress=False)
    with pytest.raises(parambox.UserError, match="diloco.overlap=true cannot go on as a smaller group"):
        parambox.train(
            strategy="diloco",
            workers=2,
            steps=1,
            on_failure="shrink",
            progress=False,
            options={"overlap": True},
        )


@pytest.mark.timeout(170)
@pytest.mark.parametrize(
    ("strategy", "launcher"),
    [("allreduce", "local"), ("ps-sync", "local"), pytest.param("allreduce", "ulfm", marks=pytest.mark.slow)],
)
def test_survivors_a_step_apart_go_on_with_the_leaders_state(tmp_path, strategy, launcher):
    """A rank that dies at the very end of an allreduce can leave the survivors a step apart (gloo's
    ring gave rank 0 all it needed; rank 1's last send to the dead rank failed): rank 1 checks in at
    step 6, rank 0 at 7. Rank 1 takes rank 0's weights and momentum (which hold step 6's update,
    made with rank 2's gradient) and skips its own update of step 6: no restart, and the weights are
    3 ranks' mean gradient for 7 steps, then the survivors' (momentum SGD), on both survivors. Under
    the local launcher and under ``mpiexec --with-ft ulfm`` (the members agree on the newer step; the
    job's TMPDIR is left empty, the killed rank's files included).
    ps-sync: the server is a step ahead and rank 1 behind, as for allreduce; but the injected failure
    comes after rank 1 received the step's weights (its parameters are views of the broadcast's
    buffer), so there this checks that the run goes on in place to the closed form, not the transfer
    itself (allreduce's case does: without the catch-up's load, rank 1's weights fall a step behind)."""
    from parambox.runtime.spawn import find_mpiexec
    from tests.conftest import MPI_ENV

    out, momentum, lost_at = tmp_path / "run", 0.5, 7
    env, prefix = {"PARAMBOX_FAULT": f"1:{lost_at - 1}:lose-exchange,2:{lost_at}:kill"}, None
    scratch = None
    if launcher == "ulfm":
        if find_mpiexec() is None:
            pytest.skip("no mpiexec found")
        # The job's temporary directory of its own: what the ranks, their loaders and Open MPI make in
        # it must be gone at the end, the killed rank's too (torch's compile cache stays by design).
        scratch = Path(tempfile.mkdtemp(prefix="pbt-", dir="/tmp"))
        env = {**MPI_ENV, **env, "TMPDIR": str(scratch)}
        prefix = [find_mpiexec(), "--with-ft", "ulfm", "-n", "3", "--oversubscribe"]
    try:
        run_cli(
            "train", "--strategy", strategy, *ARGS, "--timeout", "10", "--momentum", str(momentum),
            "--out", str(out), env=env, prefix=prefix, timeout=150,
        )  # fmt: skip
        if scratch is not None:
            left = [str(p.relative_to(scratch)) for p in scratch.rglob("*") if "torchinductor_" not in str(p)]
            assert left == [], left
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    expected = weight_after(LR, [(lost_at, [0, 1, 2]), (STEPS - lost_at, [0, 1])], momentum)
    weight = final_weights(out)["weight"]
    assert (weight - expected).abs().max().item() < 1e-6, (weight, expected)
    assert summary(out)["lost_workers"] == [2] and summary(out)["restarts"] == 0

    def sums(rank: int) -> list[float]:  # sum(w) before each step: the loss over the rank's gradient
        path = out / ("metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl")
        rows = [json.loads(x) for x in path.read_text().splitlines() if '"step"' in x]
        return [r["loss"] / gradient_of(rank) for r in rows if r.get("kind") == "step"]

    assert len(sums(1)) == STEPS and sums(1) == pytest.approx(sums(0), abs=1e-6)
    replica = torch.load(next((out / "checkpoints").glob("rank1-*.pt")), weights_only=True)["replica"]
    assert (_flat(replica)) and json.dumps(_flat(replica)) == json.dumps(_flat(final_weights(out)))


_FREED = """
import sys, torch, torch.distributed as dist
import parambox.runtime.dist  # what every parambox process imports before its first group
dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", 0, 1, True), rank=0, world_size=1)
group = dist.distributed_c10d._get_default_group()
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch._dynamo, as a strategy's does
dist.destroy_process_group()
print(sys.getrefcount(group) - 1)  # the references left besides `group` itself
"""


@pytest.mark.timeout(120)
def test_a_destroyed_group_is_freed_after_the_first_optimizer():
    """A group made before torch.distributed.nn.functional is imported is bound by its ten default
    arguments (the first optimizer imports it): destroy_process_group then left its sockets open, and a
    peer blocked on a rank that regrouped waited its --timeout (seen under mpiexec: 16 s for the
    step-apart test, 10 s of it that wait). In a fresh interpreter, as a worker under mpiexec starts."""
    out = subprocess.run(
        [sys.executable, "-c", _FREED], capture_output=True, text=True, timeout=100, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "1", out.stdout


@pytest.mark.timeout(170)
@pytest.mark.parametrize("compression", ["int8", "powersgd"])
def test_allreduce_with_compressed_gradients_survives_a_kill_to_the_closed_form(tmp_path, compression):
    """The compressed exchange at the end of backward fails with the rank killed in step 5; the survivors
    repeat it among themselves from the kept message (int8) or round (powersgd: the error feedback and
    Q as before it). A constant-block gradient quantizes exactly, and a one-row weight is rank 1: the
    closed form holds."""
    extra = ("--set", f"allreduce.compression={compression}")
    out, _ = _run(tmp_path, "allreduce", "kill", timeout_s=30, extra=extra)
    _check_closed_form(out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("exchange_bytes", 0) > 0 for r in rows if r["kind"] == "step")  # it was compressed
