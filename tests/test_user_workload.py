"""A user's model, data and loss, run as a user runs them: ``python script.py`` (parambox.train spawning
its workers), the same script under torchrun, and ``parambox train --model file.py:fn`` for every
strategy; bad input answered in one line, exit 2, within seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from parambox.runtime.spawn import find_mpiexec
from parambox.strategies import STRATEGIES
from tests.conftest import MPI_ENV, ROOT, final_weights, max_abs_diff, run_cli, summary
from tests.workloads import user_regression

SCRIPT = user_regression.__file__
REFS = ["--model", f"{SCRIPT}:make_model", "--data", f"{SCRIPT}:make_data", "--loss", f"{SCRIPT}:mse"]
QUICK = ["--no-progress", "--eval-every", "0", "--threads", "1"]
FAST_TIER = ("allreduce", "easgd")  # one synchronous, one over the box; the others in the full suite


def run_script(
    *args: str, prefix: list[str] | None = None, timeout: float = 150, env: dict | None = None
) -> None:
    cmd = [*(prefix or [sys.executable]), SCRIPT, *args]
    from parambox.runtime import zygote

    shared = zygote.shared_env()  # the script's workers fork from this session's zygote
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), **shared, **(env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


# -- Must show: numerics of a user's model, as a script and under torchrun -----------------------------


@pytest.fixture(scope="module", params=["plain", pytest.param("tied", marks=pytest.mark.slow)])
def single_2b(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    run_script("single", "1", "32", str(out), *(["tied"] if request.param == "tied" else []))
    return request.param, final_weights(out)


@pytest.mark.timeout(170)
def test_script_allreduce_equals_single_at_double_batch(single_2b, tmp_path):
    kind, expected = single_2b
    run_script("allreduce", "2", "16", str(tmp_path / "run"), *(["tied"] if kind == "tied" else []))
    got = final_weights(tmp_path / "run")
    assert max_abs_diff(got, expected) <= 1e-5
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"].startswith(SCRIPT)
    if kind == "tied":  # still one tensor under two names
        assert max_abs_diff({"w": got["emb.weight"]}, {"w": got["out.weight"]}) == 0


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_script_under_torchrun_equals_single(single_2b, tmp_path):
    kind, expected = single_2b
    if kind == "tied":  # the launcher is not the tied weights' concern: the same workers train it
        pytest.skip("the tied model is covered by the script run (allreduce over 2 workers)")
    prefix = ["torchrun", "--standalone", "--log-dir", str(tmp_path / "torchrun"), "--nproc-per-node", "2"]
    run_script(
        "allreduce", "2", "16", str(tmp_path / "run"), *(["tied"] if kind == "tied" else []), prefix=prefix
    )
    assert summary(tmp_path / "run")["launcher"] == "torchrun"
    assert max_abs_diff(final_weights(tmp_path / "run"), expected) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.parametrize("how", ["mpiexec", "rma-box"])
def test_script_under_mpiexec_and_with_the_rma_box(how, single_2b, tmp_path):
    """``mpiexec -n 2 python script.py``: each rank trains in-process; ``box="rma"`` from a plain
    ``python script.py``: parambox starts the workers under mpiexec itself (box-sync goes through the box)."""
    kind, expected = single_2b
    if kind == "tied":
        pytest.skip("the tied model is covered by the script run (allreduce over 2 workers)")
    if how == "mpiexec":
        prefix = [find_mpiexec() or "mpiexec", "-n", "2", sys.executable]
        run_script("allreduce", "2", "16", str(tmp_path / "run"), prefix=prefix, env=MPI_ENV)
        assert summary(tmp_path / "run")["launcher"] == "mpi"
    else:
        run_script("box-sync", "2", "16", str(tmp_path / "run"), "rma", env=MPI_ENV)
    assert max_abs_diff(final_weights(tmp_path / "run"), expected) <= 1e-5


# -- every strategy runs a user's non-Sequential model with a custom loss --------------------------------


def strategy_args(name: str) -> tuple[int, list[str]]:
    workers = {"single": 1, "pipeline-dp": 4}.get(name, 2)
    extra = [f'--set={name}.split_at=["head"]'] if name.startswith("pipeline") else []
    return workers, extra


@pytest.mark.timeout(170)
@pytest.mark.parametrize(
    "name", [n if n in FAST_TIER else pytest.param(n, marks=pytest.mark.slow) for n in sorted(STRATEGIES)]
)
def test_every_strategy_trains_a_users_workload(name, tmp_path):
    workers, extra = strategy_args(name)
    out = tmp_path / "run"
    run_cli(
        "train", "--strategy", name, "--workers", str(workers), *REFS, "--metrics",
        f"{SCRIPT}:regression_metrics", "--steps", "6", "--batch-size", "16", "--lr", "0.02",
        "--out", str(out), *extra, *QUICK, env=MPI_ENV,
    )  # fmt: skip
    s = summary(out)
    assert s["steps"] >= 6 and s["final_test_loss"] < 10 and "final_test_mse" in s
    assert "final_test_accuracy" not in s  # a regression: no meaningless accuracy


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_module_reference_from_the_current_directory(tmp_path):
    """``module:function`` imports from the directory parambox runs in, as ``python -c`` would."""
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "parambox", "train", "--strategy", "easgd", "--model",
           "user_regression:make_model", "--data", "user_regression:make_data", "--loss", "user_regression:mse",
           "--steps", "10", "--batch-size", "16", "--out", str(out), *QUICK]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=110, env=env, cwd=ROOT / "tests" / "workloads"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert summary(out)["model"] == "user_regression:make_model"
    report = run_cli("report", str(out), "--out", str(tmp_path / "report"))  # copes with a regression run
    assert report.returncode == 0 and (tmp_path / "report" / "index.md").exists()


# -- bad input: one line, exit 2, within seconds, from the CLI ---------------------------------------------


CLI_BAD = [
    (["--model", "no_such_module_xyz:make"], "model 'no_such_module_xyz:make': no module named", 1),
    (["--loss", f"{SCRIPT}:VOCAB"], "is a int, not callable", 1),
    (["--model", f"{SCRIPT}:model_raises"], "model factory model_raises raised RuntimeError", 2),
    (["--model", f"{SCRIPT}:model_wrong_type"], "model factory model_wrong_type returned a str", 2),
    (["--loss", f"{SCRIPT}:loss_vector"], "loss loss_vector returned a tensor of shape (16, 1)", 2),
    (["--loss", f"{SCRIPT}:loss_nan"], "loss loss_nan is nan on the first step", 1),
    (["--data", f"{SCRIPT}:data_ragged"], "data data_ragged: items cannot be batched", 2),
    (["--batch-size", "200"], "batch_size 200 x 2 data-parallel workers = 400 is more than the 256", 2),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "change,message,workers",
    [  # the errors found by spawned workers (but the first): the full suite
        pytest.param(*c, marks=[pytest.mark.slow] if c[2] > 1 and i != 2 else [], id=c[0][0][2:] + str(i))
        for i, c in enumerate(CLI_BAD)
    ],
)
def test_bad_input_from_the_cli(change, message, workers, tmp_path):
    t0 = time.monotonic()
    args = [*REFS, "--batch-size", "16", "--steps", "3", "--workers", str(workers), *change]
    proc = run_cli("train", *args, "--out", str(tmp_path / "r"), *QUICK, check=False, timeout=80)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 60
