"""``parambox slurm --requeue``: the script's text, its signal handling run by bash against a stand-in
srun, the ranks' SIGUSR1 path under srun's environment, and (where SLURM runs) a job whose one-minute
time limit ends it three times over before it finishes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from parambox.errors import REQUEUE_EXIT
from tests.conftest import NO_SLURM, ROOT, final_weights, max_abs_diff, run_cli, slurm_running, summary

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
while :; do sleep 0.05; done
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code, requeued", [(REQUEUE_EXIT, True), (130, False)])
def test_batch_shell_passes_the_signal_on_and_requeues_only_a_run_that_asked(tmp_path, code, requeued):
    """bash runs the script against a stand-in srun (exits ``code`` on SIGUSR1) and scontrol: SLURM's
    signal to the shell reaches the step, and only exit 75 requeues the job."""
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


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_srun_ranks_checkpoint_on_sigusr1_exit_75_and_resume(tmp_path):
    """What srun passes on: SIGUSR1 to every task. Both ranks leave at the same step boundary with a
    checkpoint and exit 75; ``--resume`` continues from that step to the end."""
    out = tmp_path / "run"
    ranks = _srun_ranks(str(50000 + os.getpid() % 10000), "--steps", "60", "--out", str(out), slow=True)
    try:
        deadline = time.monotonic() + 120
        metrics = out / "metrics.jsonl"
        while '"kind": "step"' not in (metrics.read_text() if metrics.exists() else ""):
            assert time.monotonic() < deadline and all(p.poll() is None for p in ranks)
            time.sleep(0.2)  # a step logged: the loop (and its signal handlers) is running
        time.sleep(1)
        for p in ranks:
            p.send_signal(signal.SIGUSR1)
        errs = [p.communicate(timeout=60)[1] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [REQUEUE_EXIT, REQUEUE_EXIT], errs
    stopped = int(errs[0].split("stopped at step ")[1].split()[0])
    assert 0 < stopped < 60 and "stopped at step" not in errs[1]  # rank 0 says it, once
    assert not (out / "summary.json").exists()
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["step"] == stopped
    ranks = _srun_ranks(str(60000 + os.getpid() % 10000), "--steps", "60", "--out", str(out), "--resume")
    errs = [p.communicate(timeout=120)[1] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], errs
    assert summary(out)["steps"] == 60


# --- the real SLURM: a one-minute time limit, three requeues --------------------------------------


def scontrol_job(job_id: str) -> dict[str, str]:
    """``scontrol show job``'s fields (empty once the controller forgot the job)."""
    proc = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    return dict(f.split("=", 1) for f in proc.stdout.split() if "=" in f) if proc.returncode == 0 else {}


def drive(job_id: str, deadline_s: float) -> dict[str, str]:
    """Poll the job until it ends. SLURM holds a requeued job for cred_expire + 1 s (121 s by default: an
    old credential may not start it again); the test lets it start at once (``StartTime=now``)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        job = scontrol_job(job_id)
        if job.get("JobState") in (
            "COMPLETED",
            "FAILED",
            "TIMEOUT",
            "CANCELLED",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
        ):
            return job
        if job.get("JobState") == "PENDING" and job.get("Reason") == "BeginTime":
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=False)
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not end in {deadline_s:.0f} s: {scontrol_job(job_id)}")


STEPS = "520"  # about 0.2 s a step (PARAMBOX_FAULT slow): more than three one-minute starts hold


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not slurm_running(), reason=NO_SLURM)
def test_a_one_minute_job_requeued_three_times_ends_at_the_uninterrupted_runs_accuracy(tmp_path):
    out, job = tmp_path / "run", tmp_path / "job.sbatch"
    run_cli(
        *("slurm", "--time", "1", "--requeue", "--signal-before", "30", "--job-name", "pbrequeue"),
        *("--script", str(job), "--", *TRAIN, "--steps", STEPS, "--out", str(out)),
    )
    started = time.monotonic()
    env = dict(os.environ, PARAMBOX_FAULT="0:0:slow", PYTHONPATH=str(ROOT))  # the pace, not the maths
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(job)], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    job_id = submitted.stdout.strip().split(";")[0]
    assert submitted.returncode == 0 and job_id, submitted.stderr
    try:
        reference = tmp_path / "reference"  # the uninterrupted run, meanwhile
        run_cli(
            "train",
            *TRAIN,
            "--workers",
            "2",
            "--steps",
            STEPS,
            "--threads",
            "1",
            "--out",
            str(reference),
            fresh=True,
        )
        ended = drive(job_id, deadline_s=480)
    finally:
        subprocess.run(["scancel", job_id], check=False)
    wall = time.monotonic() - started
    log = (tmp_path / f"pbrequeue-{job_id}.out").read_text()
    assert ended["JobState"] == "COMPLETED", log
    assert int(ended["Restarts"]) >= 3 and log.count("requeueing job") == int(ended["Restarts"]), log
    assert summary(out)["steps"] == int(STEPS)
    assert summary(out)["final_test_accuracy"] == pytest.approx(
        summary(reference)["final_test_accuracy"], abs=1e-6
    )
    assert max_abs_diff(final_weights(out), final_weights(reference)) <= 1e-5
    print(
        f"requeues {ended['Restarts']}, wall {wall:.0f} s, accuracy {summary(out)['final_test_accuracy']:.4f}"
    )
