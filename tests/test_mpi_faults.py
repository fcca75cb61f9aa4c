"""Tier (c): the rma box across ranks that die, on MPI's own fault tolerance (ULFM), and MPI's files.

The box lives on a memory rank that trains nothing (``box.memory_ranks``, default 1 for the
asynchronous strategies), so a dead worker takes no part of it; ``mpiexec --with-ft ulfm`` keeps the
job alive and tells the memory rank, which marks the worker lost. Every file Open MPI makes goes to
a private directory that a reaper removes, also after a SIGKILL of the launcher (issue 13).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from parambox.runtime.spawn import find_mpiexec
from tests.conftest import MPI_ENV, NO_SLURM, ROOT, run_cli, slurm_running, summary
from tests.test_restarts import start

FAST = ["--model", "mlp", "--eval-every", "0", "--no-progress", "--threads", "1"]
SHM = Path("/dev/shm")


@pytest.fixture
def mpi_dir(monkeypatch):
    """A folder of this test's own in /dev/shm that its MPI jobs make their private folders in
    (``PARAMBOX_MPI_DIR``): what they leave is judged there, whatever tests beside it do."""
    parent = Path(tempfile.mkdtemp(prefix="pbtest-", dir=SHM))
    monkeypatch.setenv("PARAMBOX_MPI_DIR", str(parent))
    yield parent
    shutil.rmtree(parent, ignore_errors=True)


def _private_dirs(parent: Path = SHM) -> set[str]:
    return {p.name for p in parent.glob("pb_mpi.*")}


def _await_metrics(launcher, out: Path, seconds: float = 90) -> None:
    """Until the run's first metrics; if none come, the run is stopped (SIGINT: it cleans up) first,
    so that a failed test leaves no 100000-step run behind."""
    deadline = time.monotonic() + seconds
    while not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").stat().st_size == 0:
        if time.monotonic() > deadline or launcher.poll() is not None:
            launcher.send_signal(signal.SIGINT)
            launcher.communicate(timeout=30)
            pytest.fail(f"the run wrote no metrics within {seconds:.0f} s (exit {launcher.returncode})")
        time.sleep(0.2)


# (Before the solo tests, which then run one after another under one hold of the exclusive lock.)
def test_slurm_script_for_the_rma_box_runs_mpiexec_inside_the_allocation():
    text = run_cli("slurm", "--", "--strategy", "easgd", "--box", "rma").stdout
    assert '"$mpiexec" --with-ft ulfm -n "$SLURM_NTASKS"' in text and "srun" not in text
    assert "pb_mpi.XXXXXX" in text and "trap 'rm -rf \"$private\"' EXIT" in text
    assert "\nsrun " in run_cli("slurm", "--", "--strategy", "easgd").stdout  # shm or collectives: srun


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rma_box_locally_survives_a_killed_worker(tmp_path):
    """The issue's Must show: `--box rma --workers 3` with rank 1 killed half way (the issue's run: at
    step 300 of 600; here 150 of 300, which reaches 0.967 as 600 steps reach 0.972, in 0.4 of the time)."""
    out = tmp_path / "run"
    args = [
        "train",
        "--strategy",
        "easgd",
        "--box",
        "rma",
        "--workers",
        "3",
        "--steps",
        "300",
        "--out",
        str(out),
        "--no-progress",
    ]
    run_cli(*args, env={**MPI_ENV, "PARAMBOX_FAULT": "1:150:kill"}, timeout=230)
    s = summary(out)
    assert (s["lost_workers"], s["memory_ranks"], s["workers"]) == ([1], 1, 3)
    assert s["worker_steps"] == [300, 150, 300]
    assert s["final_test_accuracy"] >= 0.93, s["final_test_accuracy"]


@pytest.mark.solo  # failure detection under load: the server variant hung once beside other tests
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("server", [False, True], ids=["windows", "server"])
def test_rma_box_under_mpiexec_with_ft_ulfm(tmp_path, server):
    """The issue's Must show: `mpiexec --with-ft ulfm -n 3 ... --box rma`, rank 1 killed half way (2
    workers and the memory rank; the issue's run: at step 300 of 600, here 150 of 300); with MPI's
    windows and with the memory server (issue 17)."""
    out = tmp_path / "run"
    prefix = [find_mpiexec() or "mpiexec", "--with-ft", "ulfm", "-n", "3", "--oversubscribe"]
    args = [
        "train",
        "--strategy",
        "easgd",
        "--box",
        "rma",
        "--steps",
        "300",
        "--out",
        str(out),
        "--no-progress",
    ]
    args += ["--set", f"box.server={str(server).lower()}"]
    proc = run_cli(*args, prefix=prefix, env={**MPI_ENV, "PARAMBOX_FAULT": "1:150:kill"}, timeout=230)
    s = summary(out)
    assert (s["lost_workers"], s["worker_steps"], s["launcher"]) == ([1], [300, 150], "mpi")
    assert s["final_test_accuracy"] >= 0.93, s["final_test_accuracy"]
    assert "worker rank 1 is lost" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.long
def test_open_mpi_files_live_in_a_private_directory_that_goes(tmp_path, mpi_dir):
    """While the job runs its shared-memory files are in /dev/shm/pb_mpi.* (here in the test's own
    PARAMBOX_MPI_DIR in /dev/shm); when it ends they are gone."""
    before = _private_dirs(mpi_dir)
    out = tmp_path / "run"
    launcher = start(
        "train", "--strategy", "easgd", "--box", "rma", "--steps", "100000", *FAST, "--out", str(out)
    )
    deadline = time.monotonic() + 90
    while not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").stat().st_size == 0:
        assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()[1][-2000:]
        time.sleep(0.2)
    ranks = [
        p
        for p in psutil.Process(launcher.pid).children(recursive=True)
        if "parambox" in " ".join(p.cmdline())
    ]
    maps = "".join(Path(f"/proc/{p.pid}/maps").read_text() for p in ranks).splitlines()
    mapped = {line.split()[-1] for line in maps if "sm_segment" in line}
    private = _private_dirs(mpi_dir) - before
    assert (
        len(private) == 1
        and mapped
        and all(m.startswith(f"{mpi_dir}/{next(iter(private))}/") for m in mapped)
    )
    launcher.send_signal(signal.SIGINT)
    launcher.communicate(timeout=30)
    assert _private_dirs(mpi_dir) - before == set()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "server", [pytest.param(False, marks=pytest.mark.long), True], ids=["windows", "server"]
)
def test_sigkilled_launcher_under_mpi_leaves_no_rank_and_no_file(tmp_path, server, mpi_dir):
    before, tmp_before = _private_dirs(mpi_dir), set(Path("/tmp").iterdir())
    out = tmp_path / "run"
    box = ["--box", "rma", "--set", f"box.server={str(server).lower()}"]
    launcher = start("train", "--strategy", "easgd", *box, "--steps", "100000", *FAST, "--out", str(out))
    _await_metrics(launcher, out)
    job = psutil.Process(launcher.pid).children(recursive=True)
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait(10)
    _, alive = psutil.wait_procs(job, timeout=15)
    assert not alive, alive
    deadline = time.monotonic() + 10
    while _private_dirs(mpi_dir) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _private_dirs(mpi_dir) - before == set()
    # What this job left in /tmp; a name that ends in another process's pid is a test's beside it.
    pids = {str(launcher.pid)} | {str(proc.pid) for proc in job}
    new = {p for p in set(Path("/tmp").iterdir()) - tmp_before if "pb" in p.name or "ompi" in p.name}
    assert not {p for p in new if not p.suffix[1:].isdigit() or p.suffix[1:] in pids}


@pytest.mark.solo  # looks at /dev/shm or /tmp
@pytest.mark.timeout(60)
def test_srun_with_the_rma_box_says_so_in_one_line(tmp_path):
    """srun here starts singletons (its PMIx cannot wire this Open MPI up): one line, exit 2, and MPI
    is never initialised (it would leave a 16 MiB segment in /dev/shm)."""
    srun = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}
    srun |= {"SLURM_JOB_ID": "7", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "1"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    before = {p.name for p in SHM.iterdir()}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "parambox",
            "train",
            "--strategy",
            "easgd",
            "--box",
            "rma",
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=50,
        env={**env, **srun},
        cwd=ROOT,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "parambox slurm" in lines[0] and "mpiexec --with-ft ulfm" in lines[0], (
        proc.stderr
    )
    assert not any(n.startswith("sm_segment") for n in {p.name for p in SHM.iterdir()} - before)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not slurm_running(), reason=NO_SLURM)
@pytest.mark.long
def test_slurm_submit_with_the_rma_box_runs_to_the_end(tmp_path, mpi_dir):
    """The issue's Must show: `parambox slurm --submit -- --strategy easgd --box rma` on the one-node SLURM
    (its job script makes its private folder in the PARAMBOX_MPI_DIR it inherits)."""
    before = _private_dirs(mpi_dir)
    out = tmp_path / "run"
    args = ["slurm", "--submit", "--wait", "--script", str(tmp_path / "job.sbatch"), "--"]
    args += ["--strategy", "easgd", "--box", "rma", "--steps", "60", *FAST, "--out", str(out)]
    run_cli(*args, timeout=290)
    s = summary(out)
    assert s["launcher"] == "mpi" and s["worker_steps"] == [60] and s["memory_ranks"] == 1
    assert _private_dirs(mpi_dir) - before == set()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_user_error_under_mpi_leaves_nothing(tmp_path, mpi_dir):
    """Every rank fails with the same bad input: one line, exit 2, and Open MPI's files are gone."""
    before = _private_dirs(mpi_dir)
    proc = run_cli(
        "train", "--strategy", "hogwild", "--box", "rma", *FAST, "--out", str(tmp_path / "r"), check=False
    )
    assert proc.returncode == 2 and "use --box shm" in proc.stderr and "Traceback" not in proc.stderr
    assert _private_dirs(mpi_dir) - before == set()
