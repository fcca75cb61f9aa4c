"""``parambox export RUN_DIR --onnx FILE``: a run's model as ONNX, checked by onnxruntime against torch."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from parambox.errors import UserError


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="a finished run (config.json, checkpoints/last.pt)"
    )
    p.add_argument("--onnx", type=Path, required=True, metavar="FILE", help="the ONNX file to write")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the onnxruntime comparison")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--trust",
        action="store_true",
        help="import the code a run directory you do not own names in its config.json (a run directory is code)",
    )


def run(args: argparse.Namespace) -> int:
    from parambox.run.export import export_onnx

    if not args.run_dir.is_dir():
        raise UserError(f"run directory {args.run_dir} does not exist")
    result = export_onnx(args.run_dir, args.onnx, args.check, args.trust)
    if args.json:
        print(json.dumps(result))
    else:
        check = f"; onnxruntime vs torch: max |diff| {result['max_abs_diff']:.2e}" if args.check else ""
        extra = (
            f"; with its weights in {result['files'][1]}, which must travel with it"
            if len(result["files"]) > 1
            else ""
        )
        print(f"wrote {result['onnx']} ({result['model']}, input {result['input_shape']}{check}{extra})")
    return 0
