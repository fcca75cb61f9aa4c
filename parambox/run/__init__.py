"""A run's orchestration under both entry points: ``parambox train`` (``commands/train.py``) and
``parambox.train`` (``api/train.py``) build a config, then call :func:`execute`.

- ``plan``: the config resolved once (the strategy's facts applied, the recorded config on a resume),
  every check that needs no process, the run directory; messages in the caller's language.
- ``execute``: train here (one worker, or one rank under an external launcher) or spawn the local
  workers, supervise them and read their outcome.
- ``worker``: one rank's training, and the entry every spawned worker runs
  (``python -m parambox.run.worker RUN_DIR``).
- ``result``: what a finished run gives back (``RunResult``, the model rebuilt from a run directory).
- ``export``: a finished run's model as ONNX.
- ``rundir``: a run directory's lock (held by the run that owns it) and the trust rule for the code
  its config names (resume, export, ``load_model``).
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module: resolved on first use, so that ``python -m parambox.run.worker`` imports the worker
# module once (as __main__), and ``import parambox.run`` stays light.
_LAZY = {
    "RunFailed": "execute",
    "execute": "execute",
    "API": "plan",
    "CLI": "plan",
    "Caller": "plan",
    "build": "plan",
    "RunResult": "result",
    "load_model": "result",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'parambox.run' has no attribute {name!r}")
    return getattr(importlib.import_module(f"parambox.run.{_LAZY[name]}"), name)
