"""``parambox slurm --requeue``: the script's text, its signal handling run by bash against a stand-in
srun, the ranks' SIGUSR1 path under srun's environment, and (where SLURM runs) a job whose one-minute
time limit ends it three times over before it finishes."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from parambox.errors import REQUEUE_EXIT, UserError
from parambox.runtime.spawn import find_mpiexec
from tests.conftest import (
    MPI_ENV,
    NO_SLURM,
    ROOT,
    final_weights,
    max_abs_diff,
    run_cli,
    slurm_running,
    summary,
)

TRAIN = ["--strategy", "allreduce", "--model", "mlp", "--no-progress", "--eval-every", "0"]


def script(*flags: str, train: tuple[str, ...] = ("--strategy", "allreduce", "--out", "runs/x")) -> str:
    return run_cli("slurm", *flags, "--", *train).stdout


def test_requeue_script_asks_for_the_signal_and_requeues_on_the_runs_exit_code():
    text = script("--time", "00:10:00", "--requeue", "--signal-before", "120")
    lines = text.splitlines()
    for line in ("#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert line in lines
    assert lines.index("#SBATCH --open-mode=append") < lines.index("set -euo pipefail")  # headers first
    assert "trap '" in text and 'kill -USR1 "$step"' in text and "' USR1" in text
    assert f"if (( code == {REQUEUE_EXIT} )); then" in lines and '  scontrol requeue "$SLURM_JOB_ID"' in lines
    assert (
        "out=runs/x" in lines and 'if [[ -e "$out/checkpoints/last.pt" ]]; then resume=--resume; fi' in lines
    )
    assert [line for line in lines if line.startswith("srun ")][0].endswith("--out runs/x $resume &")
    plain = script("--time", "00:10:00")
    assert "--signal" not in plain and "scontrol" not in plain and "trap" not in plain


def test_requeue_script_names_a_run_directory_after_the_job_when_none_is_given():
    text = script("--requeue", train=("--strategy", "easgd"))
    assert 'out=runs/easgd-"$SLURM_JOB_ID"' in text  # one directory for every start of the job
    assert '--out "$out" $resume &' in text


def test_requeue_script_of_the_rma_box_passes_the_signal_to_mpiexec():
    text = script("--requeue", train=("--strategy", "easgd", "--box", "rma", "--out", "r"))
    launch = [line for line in text.splitlines() if line.startswith('"$mpiexec"')][0]
    assert (
        launch.endswith("--out r $resume &") and '-n "$SLURM_NTASKS"' in launch
    )  # the new allocation's size
    assert "trap 'rm -rf \"$private\"' EXIT" in text and 'kill -USR1 "$step"' in text


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--time", "1", "--signal-before", "60"], "must be longer than --signal-before 60 s"),
        (["--time", "UNLIMITED"], "must be longer than"),
        (["--time", "1:2:3:4"], "not a SLURM time"),
        (["--signal-before", "0"], "give at least 1 second"),
    ],
)
def test_requeue_refuses_a_signal_the_time_limit_leaves_no_room_for(flags, message):
    proc = run_cli("slurm", "--requeue", *flags, "--", "--strategy", "single", check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


FAKE_SRUN = """#!/bin/bash
echo "$*" >> "$FAKE_LOG"
trap 'echo got-usr1 >> "$FAKE_LOG"; exit $FAKE_CODE' USR1
echo started >> "$FAKE_LOG"
for _ in $(seq 600); do sleep 0.05; done  # 30 s at most: a lost signal fails the test, not hangs it
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code, requeued", [(REQUEUE_EXIT, True), (128 + signal.SIGUSR1, True), (130, False)])
def test_batch_shell_passes_the_signal_on_and_requeues_only_a_run_that_asked(tmp_path, code, requeued):
    """bash runs the script against a stand-in srun (exits ``code`` on SIGUSR1) and scontrol: SLURM's
    signal to the shell reaches the step, and exit 75 requeues the job, or 138: the signal killed the
    run's processes while they started, before their handler (SLURM signals up to a minute early: a
    one-minute job failed so once, without a requeue). Exit 130 (the run was interrupted) does not."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho "scontrol $*" >> "$FAKE_LOG"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "last.pt").write_bytes(b"")  # a start after a requeue
    job = tmp_path / "job.sbatch"
    job.write_text(script("--requeue", train=("--strategy", "allreduce", "--out", str(out))))
    log = tmp_path / "log"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(log), FAKE_CODE=str(code))
    env |= {"SLURM_JOB_ID": "41", "SLURM_NTASKS": "2", "SLURM_RESTART_COUNT": "1"}
    shell = subprocess.Popen(
        ["bash", str(job)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 30
    while "started" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    shell.send_signal(signal.SIGUSR1)  # SLURM's --signal=B:USR1@S: the batch shell only
    stdout, _ = shell.communicate(timeout=30)
    calls = log.read_text().splitlines()
    assert calls[0].endswith(f"--out {out} --resume"), calls  # resumes: the run directory holds last.pt
    assert "got-usr1" in calls  # passed on to the step
    assert shell.returncode == code, stdout
    assert ("scontrol requeue 41" in calls) is requeued, calls
    assert "start 1, 2 tasks, resuming" in stdout


SRUN_ENV = {
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_NODES": "1",
}
SRUN_ENV |= {"SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2"}


def _srun_ranks(job_id: str, *args: str, slow: bool = False) -> list[subprocess.Popen]:
    """Two ``parambox train`` tasks as srun starts them: each reads its rank from SLURM's variables."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI", "PARAMBOX_FAULT"))
    }
    env |= SRUN_ENV | {"SLURM_JOB_ID": job_id, "PYTHONUNBUFFERED": "1"}
    env |= {"PARAMBOX_FAULT": "0:0:slow"} if slow else {}  # 0.2 s a step: time to be signalled mid-run
    cmd = [sys.executable, "-m", "parambox", "train", *TRAIN, "--threads", "1", *args]
    return [
        subprocess.Popen(
            cmd,
            env=env | {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]


def _catches_usr1(pid: int) -> bool:
    """The process has its SIGUSR1 handler (``SigCgt`` in /proc): parambox's, set as its CLI starts."""
    try:
        caught = int(Path(f"/proc/{pid}/status").read_text().split("SigCgt:")[1].split()[0], 16)
    except (OSError, IndexError):
        return False
    return bool(caught & (1 << (signal.SIGUSR1 - 1)))


def _signal_and_wait(ranks: list[subprocess.Popen], ready) -> list[str]:
    """SIGUSR1 to every rank once ``ready()``; their stderr once they exit."""
    try:
        deadline = time.monotonic() + 120
        while not ready():
            if time.monotonic() > deadline or any(p.poll() is not None for p in ranks):
                for p in ranks:
                    p.kill()
                pytest.fail(
                    f"a rank left before it was signalled: {[p.communicate()[1][-3000:] for p in ranks]}"
                )
            time.sleep(0.1)
        for p in ranks:
            p.send_signal(signal.SIGUSR1)
        return [p.communicate(timeout=120)[1] for p in ranks]
    finally:
        for p in ranks:
            p.kill()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_srun_ranks_checkpoint_on_sigusr1_at_the_same_step_and_exit_75(tmp_path):
    """What srun passes on: SIGUSR1 to every task. Heard while the ranks start (a rank that left then
    would strand the others in their first collective), they stop at their first step boundary
    together; heard mid-run, at the next one. Each time both leave a checkpoint and exit 75, and rank 0
    says where it stopped."""
    out, job = tmp_path / "run", 50000 + os.getpid() % 10000
    ranks = _srun_ranks(str(job), "--steps", "60", "--out", str(out))
    errs = _signal_and_wait(ranks, lambda: all(_catches_usr1(p.pid) for p in ranks))
    assert [p.returncode for p in ranks] == [REQUEUE_EXIT, REQUEUE_EXIT], errs
    assert "stopped at step 1 for a requeue" in errs[0] and "stopped" not in errs[1], errs
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["step"] == 1

    metrics = out / "metrics.jsonl"
    ranks = _srun_ranks(str(job + 1), "--steps", "60", "--out", str(out), "--resume", slow=True)
    errs = _signal_and_wait(ranks, lambda: metrics.read_text().count('"kind": "step"') >= 2)
    assert [p.returncode for p in ranks] == [REQUEUE_EXIT, REQUEUE_EXIT], errs
    stopped = int(errs[0].split("stopped at step ")[1].split()[0])
    assert (
        2 < stopped < 60 and torch.load(out / "checkpoints" / "last.pt", weights_only=True)["step"] == stopped
    )
    assert not (out / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.long
def test_mpiexec_passes_sigusr1_on_and_the_memory_rank_stops_too(tmp_path):
    """The script's mpiexec variant (the rma box): mpiexec passes SIGUSR1 on; the worker checkpoints at
    its next step boundary, the memory rank (serving the box, with no step to stop at) leaves once the
    worker has, and mpiexec exits 75."""
    out = tmp_path / "run"
    cmd = [
        find_mpiexec() or "mpiexec",
        "--with-ft",
        "ulfm",
        "-n",
        "2",
        sys.executable,
        "-m",
        "parambox",
        "train",
    ]
    cmd += [
        *TRAIN,
        "--strategy",
        "easgd",
        "--box",
        "rma",
        "--steps",
        "1000",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    env = dict(os.environ, **MPI_ENV, PARAMBOX_FAULT="0:0:slow")
    mpiexec = subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    (err,) = _signal_and_wait(
        [mpiexec], lambda: '"kind": "step"' in (metrics.read_text() if metrics.exists() else "")
    )
    assert mpiexec.returncode == REQUEUE_EXIT, err
    stopped = int(err.split("stopped at step ")[1].split()[0])
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["step"] == stopped > 0


# --- the real SLURM: a one-minute time limit, three requeues --------------------------------------
#
# SLURM looks at its jobs every 30 s and signals one once its end is within S + 30 s: with a one-minute
# limit and S = 30, at its first look after the start, so no start trains more than 30 s (python's
# start-up takes 5-25 s of them here, with the machine's load). The run is long (STEPS_OPEN: no three
# starts finish it) until the third requeue; then the test shortens it (`steps` may change on a resume)
# so that the fourth start finishes it, and the uninterrupted run of the same steps is the reference.

STEPS_OPEN = 100_000


def scontrol_job(job_id: str) -> dict[str, str]:
    """``scontrol show job``'s fields (empty once the controller forgot the job)."""
    proc = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    return dict(f.split("=", 1) for f in proc.stdout.split() if "=" in f) if proc.returncode == 0 else {}


ENDED = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


def drive(job_id: str, deadline_s: float, on_requeue=lambda restarts: None) -> dict[str, str]:
    """Poll the job until it ends; ``on_requeue(restarts)`` once each requeue, before the next start.
    SLURM holds a requeued job for cred_expire + 1 s (121 s by default), so that the credential it revoked
    cannot start it; the test lets it start sooner (``StartTime=now``), but 3 s after the requeue: in the
    revocation's second the start is refused ("Job credential revoked")."""
    deadline, held_since, seen = time.monotonic() + deadline_s, None, 0
    while time.monotonic() < deadline:
        job = scontrol_job(job_id)
        if job.get("JobState") in ENDED:
            return job
        if job.get("JobState") == "PENDING" and job.get("Reason") == "BeginTime":
            if int(job["Restarts"]) > seen:
                seen = int(job["Restarts"])
                on_requeue(seen)
            held_since = held_since or time.monotonic()
            if time.monotonic() - held_since >= 3:
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=False)
        else:
            held_since = None
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not end in {deadline_s:.0f} s: {scontrol_job(job_id)}")


def submit(tmp_path: Path, out: Path, tasks: int, limit: str, steps: int) -> tuple[str, Path]:
    """``parambox slurm --requeue`` of a paced run (0.2 s a step: PARAMBOX_FAULT slow, the pace and not
    the maths) whose steps come from a TOML file the test may rewrite; the job id and that file."""
    toml, job = tmp_path / f"run{tasks}.toml", tmp_path / f"job{tasks}.sbatch"
    toml.write_text(f"steps = {steps}\n")
    flags = ["--time", limit, "--requeue", "--signal-before", "30", "--tasks-per-node", str(tasks)]
    run_cli(
        "slurm",
        *flags,
        "--job-name",
        "pbrequeue",
        "--script",
        str(job),
        "--",
        *TRAIN,
        "--config",
        str(toml),
        "--out",
        str(out),
    )
    env = dict(os.environ, PARAMBOX_FAULT="0:0:slow", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        ["sbatch", "--parsable", str(job)], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0], toml


def checkpoint_step(out: Path) -> int:
    return torch.load(out / "checkpoints" / "last.pt", weights_only=True)["step"]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(not slurm_running(), reason=NO_SLURM)
@pytest.mark.long
def test_a_one_minute_job_requeued_three_times_ends_at_the_uninterrupted_runs_accuracy(tmp_path):
    out, started, final = tmp_path / "run", time.monotonic(), {}
    job_id, toml = submit(tmp_path, out, tasks=2, limit="1", steps=STEPS_OPEN)

    def on_requeue(restarts: int) -> None:
        if restarts == 3:  # the fourth start finishes the run
            final["steps"] = checkpoint_step(out) + 10
            toml.write_text(f"steps = {final['steps']}\n")

    try:
        ended = drive(job_id, deadline_s=360, on_requeue=on_requeue)
    finally:
        subprocess.run(["scancel", job_id], check=False)
    wall = time.monotonic() - started
    log = (tmp_path / f"pbrequeue-{job_id}.out").read_text()
    assert ended["JobState"] == "COMPLETED", log
    assert int(ended["Restarts"]) == log.count("requeueing job") >= 3, log
    assert log.count("stopped at step") >= 2, log  # starts that trained, then checkpointed on the signal
    assert summary(out)["steps"] == final["steps"] > 10  # resumed from a checkpoint of the third start
    reference = tmp_path / "reference"  # the uninterrupted run
    run_cli(
        "train",
        *TRAIN,
        "--workers",
        "2",
        "--steps",
        str(final["steps"]),
        "--threads",
        "1",
        "--out",
        str(reference),
        fresh=True,
    )
    accuracy = summary(out)["final_test_accuracy"]
    assert accuracy == pytest.approx(summary(reference)["final_test_accuracy"], abs=1e-6)
    assert max_abs_diff(final_weights(out), final_weights(reference)) <= 1e-5
    print(
        f"\n{ended['Restarts']} requeues, {final['steps']} steps, {wall:.0f} s, test accuracy {accuracy:.4f}"
    )


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(not slurm_running(), reason=NO_SLURM)
@pytest.mark.long
def test_a_requeued_job_resumes_on_the_task_count_of_its_new_allocation(tmp_path):
    """A job requeued at 2 tasks comes back on an allocation of 1 (a new submission of the same script
    for the same run directory: this SLURM cannot change a pending job's tasks per node)."""
    out = tmp_path / "run"
    first, _ = submit(tmp_path, out, tasks=2, limit="1", steps=STEPS_OPEN)

    def on_requeue(restarts: int) -> None:
        if (out / "checkpoints" / "last.pt").exists() and checkpoint_step(out) > 0:
            subprocess.run(["scancel", first], check=False)  # it trained, checkpointed and was requeued

    try:
        drive(first, deadline_s=180, on_requeue=on_requeue)
    finally:
        subprocess.run(["scancel", first], check=False)
    steps = checkpoint_step(out) + 10
    second, _ = submit(tmp_path, out, tasks=1, limit="1", steps=steps)
    try:
        ended = drive(second, deadline_s=180)
    finally:
        subprocess.run(["scancel", second], check=False)
    log = (tmp_path / f"pbrequeue-{second}.out").read_text()
    assert ended["JobState"] == "COMPLETED" and "1 tasks, resuming" in log, log
    assert summary(out)["steps"] == steps and summary(out)["workers"] == 1
    reference = tmp_path / "reference"  # uninterrupted, at 2 workers: the global batch is the same
    run_cli(
        "train",
        *TRAIN,
        "--workers",
        "2",
        "--steps",
        str(steps),
        "--threads",
        "1",
        "--out",
        str(reference),
        fresh=True,
    )
    assert max_abs_diff(final_weights(out), final_weights(reference)) <= 1e-5


def test_a_resume_with_the_first_starts_flags_continues_an_rma_run(tmp_path):
    """Every start of a requeued job passes the same flags: ``--box rma`` must not differ from the
    recorded box, whose memory ranks the plan filled in."""
    from parambox.commands.train import config_from_args, configure
    from parambox.run.plan import CLI, continue_recorded
    from parambox.training.checkpoint import atomic_write_json

    parser = argparse.ArgumentParser()
    configure(parser)
    given = config_from_args(
        parser.parse_args(["--strategy", "easgd", "--box", "rma", "--out", str(tmp_path)])
    )
    recorded = given.model_copy(update={"box": given.box.model_copy(update={"memory_ranks": 1})})
    atomic_write_json(tmp_path / "config.json", recorded.model_dump())
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"")
    assert continue_recorded(given, CLI).box.memory_ranks == 1
    shm = config_from_args(parser.parse_args(["--strategy", "easgd", "--box", "shm", "--out", str(tmp_path)]))
    with pytest.raises(UserError, match="differs from the recorded"):
        continue_recorded(shm, CLI)
