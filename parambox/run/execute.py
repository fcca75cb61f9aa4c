"""A run from a resolved config to its outcome, the same for ``parambox train`` and ``parambox.train``:
the launch checks, the run directory, then either this process trains (one worker, or one rank under
torchrun / srun / mpiexec) or it spawns the local workers, supervises them and reads their outcome."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from parambox.config import RunConfig
from parambox.errors import UserError, warn
from parambox.run import rundir
from parambox.run.plan import Caller, Plan, check_references, prepare_run_dir, resolve
from parambox.run.worker import SYS_PATH_ENV, is_user_error, train_rank
from parambox.training.checkpoint import atomic_write_json

WORKER_MODULE = "parambox.run.worker"  # python -m parambox.run.worker RUN_DIR [--resume]


class RunFailed(Exception):
    """A run that ended badly: ``line`` is the one line to show, ``code`` the exit code (2: the user's)."""

    def __init__(self, line: str, code: int):
        super().__init__(line)
        self.line, self.code = line, code


def prepare(
    cfg: RunConfig, caller: Caller, resume: bool = False, callables: dict[str, Callable] | None = None
) -> tuple[Plan, Path]:
    """The resolved run and its directory: every check that needs no worker has passed (bad input
    raises ``UserError`` here, before any process starts)."""
    plan = resolve(cfg, caller, resume)
    if callables:
        _record_references(plan, callables)
    check_references(plan.cfg, callables)  # a REF that does not import fails here, before any worker starts
    return plan, prepare_run_dir(plan)


def execute(
    cfg: RunConfig,
    caller: Caller,
    resume: bool = False,
    callables: dict[str, Callable] | None = None,
) -> tuple[Plan, dict[str, Any] | None]:
    """Run ``cfg``; the plan and the summary (None on ranks other than 0 when this process trains).
    Bad input raises ``UserError``; a failed run of spawned workers raises ``RunFailed``."""
    plan, run_dir = prepare(cfg, caller, resume, callables)
    try:
        if plan.spawns:
            return plan, launch(plan, run_dir, callables)
        return plan, train_here(plan, run_dir, callables)
    finally:
        rundir.unlock(run_dir)


def _record_references(plan: Plan, callables: dict[str, Callable]) -> None:
    """What config.json records of a user's functions (so workers and ``parambox export`` find them)."""
    from parambox.workload import refs

    for field, fn in callables.items():
        if plan.spawns:
            ref = refs.reference_of(fn, field)  # a UserError when workers could not import it
        else:
            try:
                ref = refs.reference_of(fn, field)
            except UserError:
                ref = refs.in_process_reference(fn)  # fine in this process; config.json says what it was
        setattr(plan.cfg, field, ref)


def train_here(
    plan: Plan, run_dir: Path, callables: dict[str, Callable] | None = None
) -> dict[str, Any] | None:
    """This process is the run's only worker, or one rank under an external launcher."""
    try:
        return train_rank(plan.cfg, plan.world, run_dir, plan.resume, callables)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        if is_user_error(e):
            from parambox.run.worker import failure_line

            raise UserError(failure_line(e).removeprefix("parambox: error: ")) from None
        raise


def launch(plan: Plan, run_dir: Path, callables: dict[str, Callable] | None = None) -> dict[str, Any]:
    """Spawn the run's local processes on the one worker entry, supervise them; the leader's summary.
    The run directory's lock (taken by ``prepare``) is released when it returns."""
    try:
        with _caller_env(callables or {}):
            result = _launch_local(plan, run_dir)
    finally:
        rundir.unlock(run_dir)
    if result.returncode == 130:
        raise KeyboardInterrupt
    for rank, (code, reason) in result.failed.items():
        if reason.startswith("parambox: error: "):  # bad input or a timeout, found by a worker: one line
            raise RunFailed(f"{reason} ({result.who(rank)})", code)
        raise RunFailed(f"parambox: error: {result.who(rank)} failed: {reason} (log: {run_dir / 'logs'})", 1)
    summary_file = run_dir / "summary.json"
    if not summary_file.exists():  # under ULFM mpiexec may end 0 though the rank that writes it died
        raise RunFailed(
            f"parambox: error: the run ended without a result: the rank that writes it (rank 0) died "
            f"(log: {run_dir / 'logs'})",
            1,
        )
    if result.lost or result.restarts:
        mark_lost(run_dir, result.lost, result.restarts, result.earlier_lives_s)
    return json.loads(summary_file.read_text())


def _launch_local(plan: Plan, run_dir: Path):
    from parambox.runtime.launcher import launch_local

    cfg, cls = plan.cfg, plan.strategy_cls
    use_mpi = cls.needs_mpi or cfg.box.needs_mpi
    shrink = _survives_in_place(plan, use_mpi)
    _check_joiners(plan, use_mpi, shrink)
    if cfg.cluster.enabled and cfg.data == "mnist" and cfg.data_path is None:
        from parambox.data.mnist import fetch_mnist

        fetch_mnist()  # here, once: an emulated node has no network to fetch it from
    return launch_local(
        [str(run_dir), *(["--resume"] if plan.resume else [])],
        plan.processes,
        run_dir / "logs",
        cfg.threads,
        use_mpi=use_mpi,
        tolerate_loss=cls.tolerates_worker_loss,
        lose_rank0=cls.tolerates_rank0_loss and not use_mpi,
        start_workers=cfg.start_workers if shrink or cls.tolerates_worker_loss else None,
        module=WORKER_MODULE,
        cluster=cfg.cluster if cfg.cluster.enabled else None,
        max_restarts=cfg.max_restarts,
        warm_spare=cfg.warm_spare,
        resume_argv=[str(run_dir), "--resume"],
        checkpoint=run_dir / "checkpoints" / "last.pt",
        stall_timeout_s=cfg.timeout,
        shrink=shrink,
        mpi_windows=use_mpi and cfg.box.backend == "rma" and cfg.box.server is False,
    )


def _survives_in_place(plan: Plan, use_mpi: bool) -> bool:
    """``on_failure = "shrink"``: checked before any process starts."""
    cfg, cls = plan.cfg, plan.strategy_cls
    if cfg.on_failure != "shrink" or cls.tolerates_worker_loss:
        return False  # asynchronous runs go on without a lost worker anyway
    if not cls.survives_in_place:
        raise UserError(
            f"on_failure=shrink: strategy {cls.name!r} cannot go on as a "
            "smaller group (allreduce, ps-sync, weight-avg, box-sync, synchronous diloco and easgd can); "
            "use restart"
        )
    if getattr(cfg.strategy_options(), "overlap", False):
        raise UserError(
            f"on_failure=shrink: {cls.name}.overlap=true cannot go on as a smaller group (its exchange "
            "runs behind the next steps); use on_failure=restart or overlap=false"
        )
    if use_mpi or cfg.cluster.enabled:
        warn("on_failure=shrink works under the local launcher on one host; a lost worker ends this run")
        return False
    return True


def _check_joiners(plan: Plan, use_mpi: bool, shrink: bool) -> None:
    """``workers = "MIN:MAX"``: workers join a running job under the local launcher on one host; a
    synchronous run takes them in place (``on_failure = "shrink"``). An asynchronous run waits for no
    worker anyway: each of the MAX attaches to the box when it is up."""
    from parambox.training.joining import check_cuts

    cfg, cls = plan.cfg, plan.strategy_cls
    if cfg.start_workers is None or cfg.start_workers == cfg.workers:
        return
    check_cuts(cfg)
    if use_mpi or cfg.cluster.enabled:
        raise UserError(
            f"workers {cfg.start_workers}:{cfg.workers}: workers join a running job under the local "
            "launcher on one host"
        )
    if not cls.tolerates_worker_loss and not shrink:
        raise UserError(
            f"workers {cfg.start_workers}:{cfg.workers}: a synchronous run takes workers that join in "
            "place: add --set on_failure=shrink"
        )


def mark_lost(run_dir: Path, lost: list[int], restarts: int = 0, earlier_lives_s: float = 0.0) -> None:
    """What only the launcher knows, into the leader's summary: ranks lost, restarts made, and the time of
    the lives of the whole group before its last restart (rank 0 measured its last life only): added
    to ``wall_time_s`` and said as ``earlier_lives_s``. ``samples_per_s`` stays the last life's rate."""
    path = run_dir / "summary.json"
    if path.exists():
        summary = json.loads(path.read_text())
        summary["lost_workers"] = sorted(set(summary.get("lost_workers", [])) | set(lost))
        summary["restarts"] = restarts
        if earlier_lives_s:
            summary["earlier_lives_s"] = earlier_lives_s
            summary["wall_time_s"] += earlier_lives_s
        atomic_write_json(path, summary)
    if restarts:
        warn(f"{restarts} restart(s) of workers")
    if lost:
        warn(f"lost worker ranks {lost}; the others finished")


@contextlib.contextmanager
def _caller_env(callables: dict[str, Callable]) -> Iterator[None]:
    """What the workers need of the calling process: its main script (they import it as
    ``__mp_main__`` to find its functions) and its ``sys.path`` additions."""
    from parambox.workload import refs

    env: dict[str, str] = {SYS_PATH_ENV: os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path and any(getattr(fn, "__module__", None) == "__main__" for fn in callables.values()):
        env[refs.MAIN_SCRIPT_ENV] = str(Path(path).resolve())
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
