"""The worker entry every local run spawns: ``python -m parambox.api.worker RUN_DIR [--resume] [--spare]``.

It reads ``RUN_DIR/config.json`` (written by ``parambox train`` or ``parambox.train``), so no user flag
is parsed twice; a user's functions arrive as the references the config records, the launching
script's by ``PARAMBOX_MAIN_SCRIPT`` (see :mod:`parambox.workload.refs`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from parambox.commands.train import report_failure, run_worker
from parambox.config import RunConfig
from parambox.runtime.control import SPARE_FLAG, reopen_box_fds
from parambox.runtime.world import World


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m parambox.api.worker RUN_DIR [--resume] [--spare]", file=sys.stderr)
        return 2
    run_dir, resume = Path(argv[0]), "--resume" in argv[1:]
    try:
        cfg = RunConfig(**json.loads((run_dir / "config.json").read_text()))
    except Exception as e:
        return report_failure(e, World.from_env(), run_dir)
    if SPARE_FLAG in argv[1:] and not _become_a_replacement(cfg):
        return 0  # the run ended without needing this spare
    return run_worker(cfg, World.from_env(), run_dir, resume)


def _become_a_replacement(cfg: RunConfig) -> bool:
    """A spare (see ``parambox.runtime.launcher``): warm up, then wait for the launcher to say which
    rank this process replaces. False when the launcher closed the pipe without a word."""
    import parambox.training.loop  # noqa: F401  (torch, the strategies: the bulk of a start-up)

    with contextlib.suppress(Exception):  # warm the data's imports and files; errors show in the real run
        from parambox.workload import build_workload

        build_workload(cfg)
    line = sys.stdin.readline()
    if not line.strip():
        return False
    env = reopen_box_fds(json.loads(line), owner=os.getppid())
    os.environ.clear()
    os.environ.update(env)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
