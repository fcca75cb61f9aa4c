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
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from parambox.errors import UserError, warn

EXAMPLE_ITEMS = 4
TOLERANCE = 1e-4


LABEL_KEYS = ("label", "labels", "y", "target", "targets")  # a dict batch's keys that are no input


def check_trust(run_dir: Path, cfg: Any, trust: bool) -> None:
    """A run directory that names code (``module:function``) is code: say what will be imported, and
    import it only from a directory this user owns, or with ``trust`` (the rule of
    :func:`parambox.run.rundir.check_trust`, which resume and ``load_model`` follow too)."""
    from parambox.run import rundir

    refs = rundir.check_trust(run_dir, cfg, "trusted" if trust else "--trust")
    if refs:
        warn(f"export imports and runs {', '.join(refs)}, named in {run_dir / 'config.json'}")


def export_onnx(run_dir: Path, onnx_file: Path, check: bool = True, trust: bool = False) -> dict[str, Any]:
    """Write ``onnx_file`` (one file; a model over protobuf's 2 GB limit also writes ``FILE.data``,
    named in the result); returns what was written and, with ``check``, onnxruntime's largest absolute
    difference from torch on the example input and one more row (the dynamic batch axis)."""
    from parambox.run.plan import load_recorded
    from parambox.run.result import load_model_and_workload

    check_trust(run_dir, load_recorded(run_dir), trust)
    model, workload = load_model_and_workload(run_dir)
    inputs = example_inputs(workload)
    files = _export(model, inputs, onnx_file)
    first = next(iter(inputs.values()))
    result: dict[str, Any] = {
        "onnx": str(onnx_file),
        "files": [str(f) for f in files],
        "model": workload_model_name(run_dir),
        "inputs": list(inputs),
        "input_shape": list(first.shape),
    }
    if check:
        result["max_abs_diff"] = check_onnx(model, inputs, onnx_file)
        if result["max_abs_diff"] > TOLERANCE:
            raise UserError(
                f"{onnx_file}: onnxruntime differs from torch by {result['max_abs_diff']:.2e} (> {TOLERANCE})"
            )
    return result


def workload_model_name(run_dir: Path) -> str:
    return json.loads((run_dir / "config.json").read_text()).get("model", "?")


def example_inputs(workload) -> dict[str, torch.Tensor]:
    """The model's inputs for the first items of the run's test set (else its training set), by name:
    ``x`` for a tensor or ``(inputs, target)`` batch; a dict batch's tensors but its labels, passed to
    the model as keyword arguments."""
    data = workload.data
    if data.has_test:
        batch = next(iter(data.test_batches()))
    else:
        batch = data.batch_source(EXAMPLE_ITEMS, 0, 1, 0, False).batch(0)
    if isinstance(batch, dict):
        inputs = {k: v[:EXAMPLE_ITEMS] for k, v in batch.items() if k not in LABEL_KEYS}
        bad = [k for k, v in inputs.items() if not isinstance(v, torch.Tensor)]
        if bad or not inputs:
            raise UserError(
                f"export passes a dict batch's entries but {', '.join(LABEL_KEYS)} to the model as "
                f"keyword arguments; {', '.join(bad) or 'none'} of this run's are tensors"
            )
        return inputs
    x = batch[0] if isinstance(batch, tuple | list) else batch
    if not isinstance(x, torch.Tensor):
        raise UserError(
            "export needs batches that are a tensor, (inputs, target) with a tensor of inputs, or a dict "
            f"of tensors; this run's inputs are a {type(x).__name__}"
        )
    return {"x": x[:EXAMPLE_ITEMS]}


def _cause(e: Exception) -> str:
    """The exporter's error in one line: its exception summary where it gives one (its first line says
    only which step failed), without the terminal's colour codes.

    >>> _cause(RuntimeError("Failed to export. \\x1b[96mStep 1/3\\x1b[0m\\n## Exception summary\\n\\n"
    ...                     "<class 'RuntimeError'>: a and b must have same reduction dim"))
    'RuntimeError: a and b must have same reduction dim'
    """
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    text = text.split("## Exception summary", 1)[-1]
    first = (text.strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r"^<class '(?:\w+\.)*(\w+)'>", r"\1", first)


def _call(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    if list(inputs) == ["x"]:
        return model(inputs["x"])
    return model(**inputs)


def _export(model: torch.nn.Module, inputs: dict[str, torch.Tensor], onnx_file: Path) -> list[Path]:
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
            positional = list(inputs) == ["x"]
            args, kwargs = ((inputs["x"],), None) if positional else ((), dict(inputs))
            shapes = ({0: "batch"},) if positional else {k: {0: "batch"} for k in inputs}
            big = sum(p.numel() * p.element_size() for p in model.parameters()) > 2**31 - 2**26
            torch.onnx.export(
                model,
                args,
                str(onnx_file),
                kwargs=kwargs,
                dynamo=True,
                dynamic_shapes=shapes,
                external_data=big,  # one file unless protobuf's 2 GB limit forces a FILE.data beside it
            )
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"torch.onnx.export cannot export this model: {_cause(e)[:300]}") from e
    finally:
        logger.setLevel(level)
    data = onnx_file.with_name(onnx_file.name + ".data")
    return [onnx_file, data] if data.exists() else [onnx_file]


def check_onnx(model: torch.nn.Module, inputs: dict[str, torch.Tensor], onnx_file: Path) -> float:
    """Largest absolute difference between onnxruntime and torch, on ``inputs`` plus one row."""
    try:
        import onnxruntime
    except ImportError:
        raise UserError('checking the export needs onnxruntime: pip install "parambox[onnx]"') from None
    inputs = {k: torch.cat([v, v[:1]]) for k, v in inputs.items()}  # a batch size the export never saw
    session = onnxruntime.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    feed = (
        dict(zip(names, (v.numpy() for v in inputs.values())))
        if list(inputs) == ["x"]
        else {n: inputs[n].numpy() for n in names}
    )
    got = session.run(None, feed)[0]
    with torch.no_grad():
        expected = _call(model, inputs)
    return float((torch.from_numpy(got) - expected).abs().max())
