"""``parambox.train``: the library's entry, for a user's own model, data, loss and metrics.

The same script runs unchanged as ``python script.py`` (parambox spawns ``workers`` local processes,
which import the script's functions by reference, as multiprocessing's spawn does: keep the call
behind ``if __name__ == "__main__":``), under ``torchrun``, ``srun`` or ``mpiexec`` (the script is each
rank: this process trains its rank and returns), and with ``box="rma"`` locally (workers under
``mpiexec``). With one local worker, or under a launcher, the functions are called in this process,
so any callable works there, a lambda included.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from parambox.errors import UserError, validation_message, warn
from parambox.runtime.world import World, under_external_launcher
from parambox.workload import refs

Function = Callable[..., Any]


def train(
    model: str | Function | None = None,
    data: str | Function | None = None,
    loss: str | Function | None = None,
    metrics: str | Function | None = None,
    strategy: str = "allreduce",
    workers: int = 2,
    options: dict[str, Any] | None = None,
    *,
    collate: str | Function | None = None,
    resume: bool = False,
    **fields: Any,
) -> dict[str, Any] | None:
    """Train ``model`` on ``data`` with ``strategy`` over ``workers`` processes; the run's summary
    (``summary.json``) on rank 0, None on the other ranks.

    ``model``: a zero-argument callable returning an ``nn.Module``, a zoo name or a reference
    (``module:function``, ``path/to/file.py:function``); ``data``: a zero-argument callable returning
    ``(train, test)`` map-style Datasets (test may be None), a registered name or a reference;
    ``loss(model, batch)`` -> scalar tensor (default: cross-entropy of ``model(x)`` against ``y``);
    ``metrics(model, batch)`` -> ``dict[str, float]`` averaged over the test set (default: the loss,
    and accuracy for class logits); ``collate(items)`` -> batch (default: ``default_collate``);
    ``options``: the strategy's options (``{"tau": 4}`` for easgd); ``fields``: any field of the run
    config, as the CLI flags and TOML spell them (``steps``, ``batch_size``, ``lr``, ``out``, ...).
    A bad value raises ``parambox.UserError`` naming it.

    >>> import parambox, torch
    >>> def make_model():
    ...     return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    >>> summary = parambox.train(model=make_model, data="digits", strategy="single", workers=1,
    ...                          steps=20, progress=False)  # doctest: +SKIP
    >>> summary["final_test_accuracy"] > 0.5  # doctest: +SKIP
    True
    """
    if refs.importing_main():
        raise UserError(
            "parambox.train() ran while a worker imported the main script: put the call under "
            '`if __name__ == "__main__":` (the workers import the script to find its functions)'
        )
    given = {"model": model, "data": data, "loss": loss, "metrics": metrics, "collate": collate}
    cfg = _config(strategy, workers, options, given, fields)
    world = World.from_env()
    external = under_external_launcher()
    from parambox.commands.train import check_references, prepare_run_dir, processes

    spawns = not external and (processes(cfg) > 1 or cfg.cluster.enabled)  # processes: + memory ranks
    callables = {k: v for k, v in given.items() if callable(v)}
    for field, fn in callables.items():  # what config.json records (so `parambox export` finds the model)
        ref = refs.reference_of(fn, field) if spawns else _reference_or_note(fn, field)
        setattr(cfg, field, ref)
    if external:
        cfg.out = cfg.out or _external_run_dir(cfg)
        if cfg.workers not in (2, world.world_size) and world.rank == 0:  # 2: the default, not a choice
            warn(f"workers={cfg.workers} ignored: the launcher started {world.world_size} processes")
    elif cfg.cluster.enabled:
        from parambox.runtime.cluster import check_environment

        check_environment()  # not root, or no ip/tc: one line before anything is written
    check_references(cfg, callables)  # references given as strings import here, before any worker starts
    run_dir = prepare_run_dir(cfg, resume)
    if spawns:
        return _launch(cfg, run_dir, resume, callables)
    return _run_here(cfg, world, run_dir, resume, callables)


def _config(
    strategy: str, workers: int, options: dict[str, Any] | None, given: dict[str, Any], fields: dict[str, Any]
):
    from parambox.config import build_config

    layer: dict[str, Any] = {"strategy": strategy, "workers": workers, **fields}
    for field, value in given.items():
        if isinstance(value, str):
            layer[field] = value
        elif value is not None and not callable(value):
            raise UserError(
                f"{field}: expected a function, a name or a reference, got {type(value).__name__}"
            )
        elif value is not None:
            layer[field] = refs.in_process_reference(value)  # replaced by the reference below
    if options:
        if not isinstance(options, dict):
            raise UserError(f"options: expected a dict of {strategy}'s options, got {type(options).__name__}")
        layer["options"] = {strategy: dict(options)}
    try:
        return build_config(layer)
    except Exception as e:
        if type(e).__name__ == "ValidationError":
            raise UserError(validation_message(e)) from None
        raise


def _reference_or_note(fn: Function, field: str) -> str:
    try:
        return refs.reference_of(fn, field)
    except UserError:
        return refs.in_process_reference(fn)  # fine in this process; config.json says what it was


def _external_run_dir(cfg) -> str:
    from parambox.commands.train import external_run_dir

    try:
        return external_run_dir(cfg)
    except UserError:
        raise UserError("under this launcher, give out=DIR (a path every rank can write)") from None


def _run_here(cfg, world: World, run_dir: Path, resume: bool, callables: dict[str, Function]):
    """This process is the run's only worker, or one rank under torchrun / srun / mpiexec."""
    from parambox.commands.train import print_summary, report_failure
    from parambox.training.loop import train as train_rank

    try:
        summary = train_rank(cfg, world, run_dir, resume, callables)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        report_failure(e, world, run_dir, echo=False)  # the traceback goes to logs/rank{r}.err
        if isinstance(e, UserError):
            raise UserError(str(e)) from None  # one line; the traceback is in the log
        if type(e).__name__ == "ValidationError":
            raise UserError(validation_message(e)) from None
        raise
    if summary is not None and cfg.progress:
        print_summary(summary, run_dir)
    return summary


def _launch(cfg, run_dir: Path, resume: bool, callables: dict[str, Function]) -> dict[str, Any]:
    """Spawn the local workers on the one worker entry and wait; rank 0's summary."""
    from parambox.commands.train import launch_workers, mark_lost

    with _main_script_env(callables):
        result = launch_workers(cfg, run_dir, resume)
    if result.returncode == 130:
        raise KeyboardInterrupt
    for rank, (_code, reason) in result.failed.items():
        if reason.startswith("parambox: error: "):  # the user's error, found by a worker
            raise UserError(f"{reason.removeprefix('parambox: error: ')} (worker rank {rank})")
        raise RuntimeError(f"worker rank {rank} failed: {reason} (log: {run_dir / 'logs'})")
    if not (run_dir / "summary.json").exists():  # under ULFM mpiexec may end 0 though rank 0 died
        raise RuntimeError(f"the run ended without a result: rank 0 died (log: {run_dir / 'logs'})")
    if result.lost or result.restarts:
        mark_lost(run_dir, result.lost, result.restarts)
    return json.loads((run_dir / "summary.json").read_text())


@contextlib.contextmanager
def _main_script_env(callables: dict[str, Function]) -> Iterator[None]:
    """Name the launching script to the workers (they import it as ``__mp_main__``)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    uses_main = any(getattr(fn, "__module__", None) == "__main__" for fn in callables.values())
    if not (uses_main and path):
        yield
        return
    old = os.environ.get(refs.MAIN_SCRIPT_ENV)
    os.environ[refs.MAIN_SCRIPT_ENV] = str(Path(path).resolve())
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(refs.MAIN_SCRIPT_ENV, None)
        else:
            os.environ[refs.MAIN_SCRIPT_ENV] = old
