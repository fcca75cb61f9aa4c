"""A restart by torchrun's elastic agent (``torchrun --nnodes MIN:MAX``): the workers continue the run
from its last checkpoint at the new size, with no ``--resume`` on the command line.

The agent restarts every worker with the same command line when a worker fails (then its
``TORCHELASTIC_RESTART_COUNT`` goes up) and when nodes join or leave (then the count stays: membership
changes are not retries). A life is a restart of the run in its directory when the count is above 0, or
when the directory's ``logs/torchelastic.json`` names this job (torchrun's run id, ``--rdzv-id``, which
torchrun asks to be the job's own; ``--standalone`` draws one) with the store of another life: each
rendezvous round serves its workers a store of its own, and the record keeps the first life's, so the
ranks of one life, which read the record while their siblings write it, agree. With c10d's default id
``none`` (every such job's) or the store the agents share across rounds (torch's default), only the
count tells a restart. A new torchrun job with another id pointed at a used directory is refused as
before; one with the same ``--rdzv-id`` continues the run, as a requeued job does.

>>> job({"TORCHELASTIC_RUN_ID": "j1", "TORCHELASTIC_RESTART_COUNT": "1", "MASTER_ADDR": "h",
...      "MASTER_PORT": "29500"})
{'run_id': 'j1', 'store': 'h:29500'}
>>> job({"RANK": "0"}) is None
True
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from parambox.training.checkpoint import atomic_write_json

RECORD = Path("logs") / "torchelastic.json"
DEFAULT_RUN_ID = "none"  # torchrun's --rdzv-id when none is given: shared by unrelated jobs


def job(env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """This worker's torchrun job (None outside torchrun's elastic agent)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env or "TORCHELASTIC_RESTART_COUNT" not in env:
        return None
    return {
        "run_id": env["TORCHELASTIC_RUN_ID"],
        "store": f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}",
    }


def restart_count(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    count = env.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
    return int(count) if count.isdigit() else 0


def is_restart(run_dir: Path, env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a worker that torchrun's agent restarted in the run ``run_dir`` holds."""
    current = job(env)
    if current is None:
        return False
    if restart_count(env) > 0:
        return True
    try:
        recorded = json.loads((run_dir / RECORD).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(recorded, dict) or recorded.get("run_id") != current["run_id"]:
        return False
    return current["run_id"] != DEFAULT_RUN_ID and recorded.get("store") != current["store"]


def record(run_dir: Path, env: Mapping[str, str] | None = None) -> None:
    """The job this life belongs to and the first life's store, for a later life to recognise itself (a
    no-op outside torchrun's agent; a record of this job stays as it is)."""
    current = job(env)
    if current is None:
        return
    try:
        recorded = json.loads((run_dir / RECORD).read_text())
    except (OSError, ValueError):
        recorded = None
    if not isinstance(recorded, dict) or recorded.get("run_id") != current["run_id"]:
        atomic_write_json(run_dir / RECORD, current)
