"""``parambox.train``: the library's entry, for a user's own model, data, loss and metrics.

The same script runs unchanged as ``python script.py`` (parambox spawns ``workers`` local processes,
which import the script's functions by reference, as multiprocessing's spawn does: keep the call
behind ``if __name__ == "__main__":``), under ``torchrun``, ``srun`` or ``mpiexec`` (the script is each
rank: this process trains its rank and returns), and with ``box="rma"`` locally (workers under
``mpiexec``). With one local worker, or under a launcher, the functions are called in this process,
so any callable works there, a lambda included.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from parambox.errors import UserError
from parambox.run.execute import RunFailed, execute
from parambox.run.plan import API, build
from parambox.run.result import RunResult
from parambox.workload import refs

Function = Callable[..., Any]


def train(
    model: str | Function | None = None,
    data: str | Function | None = None,
    loss: str | Function | None = None,
    metrics: str | Function | None = None,
    strategy: str = "allreduce",
    workers: int | None = None,
    options: dict[str, Any] | None = None,
    *,
    collate: str | Function | None = None,
    resume: bool = False,
    **fields: Any,
) -> RunResult:
    """Train ``model`` on ``data`` with ``strategy`` over ``workers`` processes (default 2; under a
    launcher, the processes it started) and return a :class:`~parambox.run.RunResult`: the run's summary
    (a dict, as ``summary.json``; its fields also as attributes) and ``result.model``, the trained model
    loaded in this process. Under torchrun / srun / mpiexec every rank gets it.

    ``model``: a zero-argument callable returning an ``nn.Module``, a zoo name or a reference
    (``module:function``, ``path/to/file.py:function``); ``data``: a zero-argument callable returning
    ``(train, test)`` Datasets, map-style or ``IterableDataset`` streams (test may be None), a
    registered name or a reference;
    ``loss(model, batch)`` -> scalar tensor (default: cross-entropy of ``model(x)`` against ``y`` for an
    ``(x, y)`` batch); ``metrics(model, batch)`` -> ``dict[str, float]`` averaged over the test set
    (default: the loss, and accuracy for class logits); ``collate(items)`` -> batch (default:
    ``default_collate``); ``options``: the strategy's options (``{"tau": 4}`` for easgd); ``resume``:
    continue the run recorded in ``out`` (only ``steps``, ``workers``, ``timeout`` and logging may change;
    ``resize`` says what becomes of the batch at another worker count); ``init_from``: a new run from
    another run's weights (its directory or a state_dict file);
    ``fields``: any field of the run config, as the CLI flags and TOML spell them (``steps``,
    ``batch_size``, ``lr``, ``out``, ``progress=False`` for no progress bar and no summary table,
    ``target_metric``, ...). A bad value raises ``parambox.UserError`` naming it. The loop's training
    features among them: ``grad_clip`` (the gradient's global L2 norm, None or 0: off), ``grad_accum``
    (micro-batches per optimizer step; ``batch_size`` stays the batch of one step), ``precision``
    (``"fp32"``, ``"bf16"`` autocast, ``"fp16"`` autocast with a loss scaler),
    ``lr_schedule`` (``"constant"``, ``"cosine"``, ``"linear"``) and ``warmup_steps``; a resumed run
    continues the schedule and the scaler exactly.

    >>> import parambox, torch
    >>> def make_model():
    ...     return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    >>> result = parambox.train(model=make_model, data="digits", strategy="single",
    ...                         steps=20, progress=False)  # doctest: +SKIP
    >>> result.final_test_accuracy > 0.5, result.model(torch.zeros(1, 1, 8, 8)).shape  # doctest: +SKIP
    (True, torch.Size([1, 10]))
    """
    if refs.importing_main():
        raise UserError(
            "parambox.train() ran while a worker imported the main script: put the call under "
            '`if __name__ == "__main__":` (the workers import the script to find its functions)'
        )
    given = {"model": model, "data": data, "loss": loss, "metrics": metrics, "collate": collate}
    cfg = _config(strategy, workers, options, given, fields)
    callables = {k: v for k, v in given.items() if callable(v)}
    since = time.time()
    try:
        plan, summary = execute(cfg, API, resume, callables)
    except RunFailed as e:
        message = e.line.removeprefix("parambox: error: ")
        raise (UserError(message) if e.code == 2 else RuntimeError(message)) from None
    run_dir, own = Path(plan.cfg.out), summary is not None
    if summary is None:  # a rank other than 0 under a launcher: rank 0 writes the summary
        from parambox.run.result import wait_for_summary

        summary = wait_for_summary(run_dir, since, plan.cfg.timeout)
    if plan.cfg.progress and own and not plan.spawns:  # spawned: rank 0 printed it
        from parambox.run.result import print_summary

        print_summary(summary, run_dir)
    return RunResult(summary, run_dir, callables)


def _config(
    strategy: str,
    workers: int | None,
    options: dict[str, Any] | None,
    given: dict[str, Any],
    fields: dict[str, Any],
):
    layer: dict[str, Any] = {"strategy": strategy, "workers": workers, **fields}
    for field, value in given.items():
        if isinstance(value, str):
            layer[field] = value
        elif value is not None and not callable(value):
            raise UserError(
                f"{field}: expected a function, a name or a reference, got {type(value).__name__}"
            )
        elif value is not None:
            layer[field] = refs.in_process_reference(value)  # replaced by the reference in execute
    if options:
        if not isinstance(options, dict):
            raise UserError(f"options: expected a dict of {strategy}'s options, got {type(options).__name__}")
        layer["options"] = {strategy: dict(options)}
    return build(layer)
