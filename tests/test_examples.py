"""The examples run as a user runs them, in their quick forms: (a) regression.py, (b) transformer_lm.py
(its test-loss bound), (d) notebook.ipynb executed by nbclient. (c) own_loop.py has its own test."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

EXAMPLES = ROOT / "examples"


def run_example(*args: str, timeout: float) -> subprocess.CompletedProcess:
    from parambox.runtime import zygote

    # parambox.train in the example forks its workers from this session's zygote (no torch import)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **zygote.shared_env())
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_regression_example_learns(tmp_path):
    proc = run_example(
        str(EXAMPLES / "regression.py"), "--quick", "--out", str(tmp_path / "run"), timeout=160
    )
    mse = float(re.search(r"test MSE ([0-9.]+)", proc.stdout).group(1))
    assert mse < 0.5  # predicting the mean scores about 2.0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.long
def test_transformer_lm_example_reaches_its_bound(tmp_path):
    sys.path.insert(0, str(EXAMPLES))
    try:
        from transformer_lm import QUICK_BOUND
    finally:
        sys.path.remove(str(EXAMPLES))
    run_example(str(EXAMPLES / "transformer_lm.py"), "--quick", "--out", str(tmp_path), timeout=290)
    for strategy in ("easgd", "allreduce"):
        s = json.loads((tmp_path / strategy / "summary.json").read_text())
        assert s["final_test_loss"] < QUICK_BOUND, (strategy, s["final_test_loss"])
        weights = json.loads((tmp_path / strategy / "config.json").read_text())
        assert weights["model"].endswith("transformer_lm.py:make_model")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.long
def test_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("PARAMBOX_NOTEBOOK_STEPS", "40")
    monkeypatch.setenv("PARAMBOX_NOTEBOOK_OUT", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    from parambox.runtime import zygote

    for key, value in zygote.shared_env().items():  # the kernel's runs fork from this session's zygote
        monkeypatch.setenv(key, value)
    nb = nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    )
    client.execute()  # raises CellExecutionError on any failing cell
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 2
    assert (tmp_path / "report" / "index.md").exists()
