"""``parambox export RUN_DIR --onnx FILE``: zoo and user models round-trip through onnxruntime (<= 1e-4)."""

from __future__ import annotations

import json

import pytest
import torch

import parambox
from tests.conftest import run_cli
from tests.workloads import user_regression

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

QUICK = {"strategy": "single", "workers": 1, "steps": 5, "eval_every": 0, "progress": False, "threads": 1}


def onnx_matches_torch(run_dir, onnx_file, x: torch.Tensor) -> float:
    """onnxruntime's output against the checkpoint's weights in the run's own model, on ``x``."""
    from parambox.config import RunConfig
    from parambox.workload import build_workload

    cfg = RunConfig(**json.loads((run_dir / "config.json").read_text()))
    model = build_workload(cfg).build_model()
    model.load_state_dict(torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"])
    model.eval()
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    return float((torch.from_numpy(got) - model(x).detach()).abs().max())


@pytest.mark.timeout(170)
@pytest.mark.parametrize("workload", ["zoo", "user"])
def test_export_round_trips_through_onnxruntime(workload, tmp_path):
    run_dir, onnx_file = tmp_path / "run", tmp_path / "model.onnx"
    if workload == "zoo":
        parambox.train(model="lenet", data="digits", out=str(run_dir), **QUICK)
        x = torch.randn(7, 1, 8, 8)
    else:
        fns = {
            "model": user_regression.make_model,
            "data": user_regression.make_data,
            "loss": user_regression.mse,
        }
        parambox.train(**fns, out=str(run_dir), **QUICK)
        x = torch.randn(7, 4)
    proc = run_cli("export", str(run_dir), "--onnx", str(onnx_file), "--json")
    result = json.loads(proc.stdout)
    assert result["max_abs_diff"] <= 1e-4
    assert onnx_matches_torch(run_dir, onnx_file, x) <= 1e-4  # a batch size the export never saw


def test_export_of_an_in_process_model_is_one_line(tmp_path):
    parambox.train(model=lambda: user_regression.Net(), data=user_regression.make_data, loss=user_regression.mse,
                   out=str(tmp_path / "run"), **QUICK)  # fmt: skip
    proc = run_cli("export", str(tmp_path / "run"), "--onnx", str(tmp_path / "m.onnx"), check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "was a function of the process that started the run" in proc.stderr


@pytest.mark.timeout(170)
def test_export_of_dict_batches_takes_named_inputs_in_one_file(tmp_path):
    fns = {
        "model": user_regression.make_named_model,
        "data": user_regression.make_dict_items,
        "loss": user_regression.named_inputs_loss,
    }
    run_dir, onnx_file = tmp_path / "run", tmp_path / "named.onnx"
    parambox.train(**fns, out=str(run_dir), **QUICK)
    result = json.loads(run_cli("export", str(run_dir), "--onnx", str(onnx_file), "--json").stdout)
    assert result["inputs"] == ["features", "scale"] and result["max_abs_diff"] <= 1e-4
    assert result["files"] == [str(onnx_file)] and list(tmp_path.glob("*.data")) == []  # one file
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    assert sorted(i.name for i in session.get_inputs()) == ["features", "scale"]
