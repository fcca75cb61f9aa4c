"""A finished run's model as an ONNX file (HP-DLF's model format), checked against torch by onnxruntime.

The model is rebuilt as the run built it (the zoo's builder, or the user's factory named by the
reference in the run's ``config.json``), its weights are the run's result (``checkpoints/last.pt``),
and the example input is the first items of the run's own test set (its training set without one).
The batch axis is dynamic. ``torch.onnx.export`` (the torch.export-based exporter) needs ``onnx`` and
``onnxscript``; the check needs ``onnxruntime`` (``pip install "parambox[onnx]"``).

>>> # export_onnx(Path("runs/first"), Path("lenet.onnx"))  ->  {"max_abs_diff": 3e-08, ...}
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from parambox.errors import UserError, warn
from parambox.training import checkpoint
from parambox.workload.workload import build_workload

EXAMPLE_ITEMS = 4
TOLERANCE = 1e-4


def check_trust(run_dir: Path, cfg: Any, trust: bool) -> None:
    """A run directory that names code (``module:function``) is code: say what will be imported, and
    import it only from a directory this user owns, or with ``trust``."""
    from parambox.workload import CALLABLE_FIELDS

    refs = [f"{f}={getattr(cfg, f)}" for f in CALLABLE_FIELDS if ":" in str(getattr(cfg, f) or "")]
    if not refs:
        return
    owner = run_dir.stat().st_uid
    if owner != os.geteuid() and not trust:
        raise UserError(
            f"{run_dir} belongs to uid {owner}, not you, and its config.json names code to import "
            f"({', '.join(refs)}): pass --trust to run it"
        )
    warn(f"export imports and runs {', '.join(refs)}, named in {run_dir / 'config.json'}")


def export_onnx(run_dir: Path, onnx_file: Path, check: bool = True, trust: bool = False) -> dict[str, Any]:
    """Write ``onnx_file``; returns what was written and, with ``check``, onnxruntime's largest
    absolute difference from torch on the example input and one more row (the dynamic batch axis)."""
    from parambox.config import RunConfig

    config_file = run_dir / "config.json"
    if not config_file.is_file():
        raise UserError(f"{run_dir} is not a run directory: {config_file} does not exist")
    try:
        cfg = RunConfig(**json.loads(config_file.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
        raise UserError(f"{config_file} is not a run's config (garbled JSON: {e})") from None
    except ValueError as e:  # pydantic: a field that is not a RunConfig's
        raise UserError(f"{config_file} is not a run's config: {str(e).splitlines()[0]}") from None
    check_trust(run_dir, cfg, trust)
    cfg.loader_workers = 0  # a few items, read here
    workload = build_workload(cfg)
    model = workload.build_model()
    state = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, KeyError) as e:
        raise UserError(
            f"{run_dir}: the checkpoint does not fit the model: {str(e).splitlines()[0]}"
        ) from None
    model.eval()
    x = example_input(workload)
    _export(model, x, onnx_file)
    result: dict[str, Any] = {"onnx": str(onnx_file), "model": cfg.model, "input_shape": list(x.shape)}
    if check:
        result["max_abs_diff"] = check_onnx(model, x, onnx_file)
        if result["max_abs_diff"] > TOLERANCE:
            raise UserError(
                f"{onnx_file}: onnxruntime differs from torch by {result['max_abs_diff']:.2e} (> {TOLERANCE})"
            )
    return result


def example_input(workload) -> torch.Tensor:
    """The model input of the first items of the run's test set (else its training set)."""
    data = workload.data
    if data.has_test:
        batch = next(iter(data.test_batches()))
    else:
        batch = data.batch_source(EXAMPLE_ITEMS, 0, 1, 0, False).batch(0)
    x = batch[0] if isinstance(batch, tuple | list) else batch
    if not isinstance(x, torch.Tensor):
        raise UserError(
            "export needs batches that are a tensor or (inputs, target) with a tensor of inputs; "
            f"this run's inputs are a {type(x).__name__}"
        )
    return x[:EXAMPLE_ITEMS]


def _export(model: torch.nn.Module, x: torch.Tensor, onnx_file: Path) -> None:
    try:
        import onnxscript  # noqa: F401  (torch.onnx.export's exporter needs it)
    except ImportError:
        raise UserError('ONNX export needs onnx and onnxscript: pip install "parambox[onnx]"') from None
    onnx_file.parent.mkdir(parents=True, exist_ok=True)
    quiet = io.StringIO()
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the exporter's progress and registry chatter
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(quiet):
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (x,), str(onnx_file), dynamo=True, dynamic_shapes=({0: "batch"},))
    except UserError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"torch.onnx.export cannot export this model: {first[:300]}") from e
    finally:
        logger.setLevel(level)


def check_onnx(model: torch.nn.Module, x: torch.Tensor, onnx_file: Path) -> float:
    """Largest absolute difference between onnxruntime and torch, on ``x`` plus one row."""
    try:
        import onnxruntime
    except ImportError:
        raise UserError('checking the export needs onnxruntime: pip install "parambox[onnx]"') from None
    x = torch.cat([x, x[:1]])  # a batch size the export never saw: the batch axis is dynamic
    session = onnxruntime.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        expected = model(x)
    return float((torch.from_numpy(got) - expected).abs().max())
