"""``parambox report RUN_DIR... --out REPORT_DIR``: plots and tables from run directories."""

from __future__ import annotations

import argparse
from pathlib import Path

from parambox.errors import UserError
from parambox.report import load_runs, write_report


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories to report on"
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for the figures and index.md/html")
    parser.add_argument("--title", default="parambox report", help="the page's title")
    parser.add_argument(
        "--smooth",
        type=float,
        default=0.0,
        help="EMA weight of the past for loss curves, 0..0.999 (default 0: raw)",
    )


def run(args: argparse.Namespace) -> int:
    if not 0.0 <= args.smooth < 1.0:
        raise UserError(f"--smooth must be within 0..0.999, got {args.smooth}")
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out} exists and is not a directory")
    runs = load_runs(args.run_dirs)
    index = write_report(runs, args.out, args.title, args.smooth)
    print(f"wrote {index} ({len(runs)} run(s)) and {index.with_suffix('.html').name}")
    return 0
