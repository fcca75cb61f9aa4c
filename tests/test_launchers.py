"""Tier (c): the same `parambox train` under torchrun, mpiexec (and srun where SLURM runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from parambox.runtime.spawn import find_mpiexec
from tests.conftest import MPI_ENV, NO_SLURM, final_weights, max_abs_diff, run_cli, slurm_running, summary

ARGS = ["train", "--model", "mlp", "--steps", "30", "--no-progress", "--threads", "1", "--eval-every", "0"]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "run"
    run_cli(*ARGS, "--out", str(out), fresh=True)  # the local launcher as a user runs it
    return out


def _same_run(out, local_run, launcher):
    assert summary(out)["launcher"] == launcher
    assert summary(out)["workers"] == 2
    assert (summary(out)["device"], summary(out)["backend"]) == (
        "cpu",
        "gloo",
    )  # (nccl: scripts/gpu_check.py)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in local_run.iterdir())
    assert max_abs_diff(final_weights(out), final_weights(local_run)) <= 1e-6


@pytest.mark.timeout(120)
def test_torchrun(tmp_path, local_run):
    out = tmp_path / "run"
    logs = str(tmp_path / "torchrun")  # not a torchelastic_* folder left in /tmp
    run_cli(
        *ARGS,
        "--out",
        str(out),
        prefix=["torchrun", "--standalone", "--log-dir", logs, "--nproc-per-node", "2", "-m"],
    )
    _same_run(out, local_run, "torchrun")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_mpiexec(tmp_path, local_run):
    out = tmp_path / "run"
    run_cli(*ARGS, "--out", str(out), prefix=[find_mpiexec() or "mpiexec", "-n", "2"], env=MPI_ENV)
    _same_run(out, local_run, "mpi")


@pytest.mark.timeout(150)
@pytest.mark.skipif(not slurm_running(), reason=NO_SLURM)
def test_srun(tmp_path, local_run):
    out = tmp_path / "run"
    run_cli(*ARGS, "--out", str(out), prefix=["srun", "-n", "2", "--overlap"], timeout=140)
    _same_run(out, local_run, "slurm")


def test_open_mpi_options_go_only_to_the_mpiexec_that_takes_them(tmp_path, monkeypatch, capsys):
    """--with-ft ulfm (Open MPI 5), --oversubscribe and --bind-to (Open MPI) are not MPICH's options, nor
    Open MPI 4's --with-ft: a cluster's own mpiexec gets only what it takes."""
    import stat
    import subprocess

    from parambox.runtime import spawn

    def fake(version: str) -> str:
        path = tmp_path / f"mpiexec-{len(list(tmp_path.iterdir()))}"
        path.write_text(
            f'#!/bin/sh\nif [ "$1" = --version ]; then echo "{version}"; exit 0; fi\n'
            f'printf "%s " "$@" > {path}.argv\n'
        )
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
        return str(path)

    seen = {}
    for name, version in (
        ("ompi5", "mpiexec (Open MPI) 5.0.11"),
        ("ompi4", "mpiexec (OpenRTE) 4.1.6"),
        ("mpich", "HYDRA build details:\n    Version: 4.2.0"),
    ):
        mpiexec = fake(version)
        monkeypatch.setattr(spawn, "find_mpiexec", lambda m=mpiexec: m)
        proc = spawn.start_mpi(["prog"], 2, {}, fault_tolerant=True, stdout=subprocess.DEVNULL)
        proc.wait()
        spawn.release_mpi(proc)
        seen[name] = Path(f"{mpiexec}.argv").read_text().split()
    assert seen["ompi5"] == ["--with-ft", "ulfm", "-n", "2", "--oversubscribe", "--bind-to", "none", "prog"]
    assert seen["ompi4"] == ["-n", "2", "--oversubscribe", "--bind-to", "none", "prog"]
    assert seen["mpich"] == ["-n", "2", "prog"]
    assert capsys.readouterr().err.count("no ULFM (--with-ft ulfm), so a rank that dies ends the job") == 2


def test_a_process_that_ran_mpi_alone_leaves_no_session_directory(tmp_path):
    """An Open MPI 5 singleton's Finalize empties its session directory and leaves it
    (``<TMPDIR>/ompi.<host>.<uid>/jf.<n>/<job>``): one more each run of a process that used the rma
    box alone. parambox removes its own at exit; another job's, not empty, is left alone."""
    import os
    import subprocess
    import sys

    other = tmp_path / f"ompi.host.{os.getuid()}" / "jf.0" / "123"
    (other / "0").mkdir(parents=True)  # a live job's, made before: not this process's to remove
    code = "import parambox.box.rma\nfrom mpi4py import MPI\nassert MPI.COMM_WORLD.Get_size() == 1"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    subprocess.run([sys.executable, "-c", code], env={**env, "TMPDIR": str(tmp_path)}, check=True, timeout=60)
    jobs = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("ompi.*/jf.*/*"))
    assert jobs == [f"ompi.host.{os.getuid()}/jf.0/123"], jobs
    assert (other / "0").is_dir()


def test_a_process_that_ran_mpi_alone_still_starts_mpi_jobs_whose_ranks_have_a_transport():
    """``before_import`` gives a process that no launcher started the "self" transport alone; an
    mpiexec it starts later must not hand that to its ranks (they could not reach each other: a
    pytest process that had imported the box ran test_quorum_server's job into MPI_Init's abort)."""
    from parambox.runtime import mpi, spawn

    env: dict[str, str] = {}
    mpi.before_import(env)
    assert env == {"OMPI_MCA_btl": "self", mpi.ALONE_ENV: "1"}
    child = spawn.mpi_env(env)
    assert "OMPI_MCA_btl" not in child and mpi.ALONE_ENV not in child
    chosen = {"OMPI_MCA_btl": "self,tcp"}  # a user's own choice is kept, here and in the child
    mpi.before_import(chosen)
    assert chosen == {"OMPI_MCA_btl": "self,tcp"} and spawn.mpi_env(chosen)["OMPI_MCA_btl"] == "self,tcp"
