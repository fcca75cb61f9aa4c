"""Tier (c): the same `parambox train` under torchrun, mpiexec (and srun where SLURM runs)."""

from __future__ import annotations

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
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in local_run.iterdir())
    assert max_abs_diff(final_weights(out), final_weights(local_run)) <= 1e-6


@pytest.mark.timeout(120)
def test_torchrun(tmp_path, local_run):
    out = tmp_path / "run"
    run_cli(*ARGS, "--out", str(out), prefix=["torchrun", "--standalone", "--nproc-per-node", "2", "-m"])
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
