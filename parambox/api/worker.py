"""The worker entry every local run spawns: ``python -m parambox.api.worker RUN_DIR [--resume]``.

It reads ``RUN_DIR/config.json`` (written by ``parambox train`` or ``parambox.train``), so no user flag
is parsed twice; a user's functions arrive as the references the config records, the launching
script's by ``PARAMBOX_MAIN_SCRIPT`` (see :mod:`parambox.workload.refs`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from parambox.commands.train import report_failure, run_worker
from parambox.config import RunConfig
from parambox.runtime.world import World


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m parambox.api.worker RUN_DIR [--resume]", file=sys.stderr)
        return 2
    run_dir, resume = Path(argv[0]), "--resume" in argv[1:]
    world = World.from_env()
    try:
        cfg = RunConfig(**json.loads((run_dir / "config.json").read_text()))
    except Exception as e:
        return report_failure(e, world, run_dir)
    return run_worker(cfg, world, run_dir, resume)


if __name__ == "__main__":
    raise SystemExit(main())
