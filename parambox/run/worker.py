"""One rank's training, and the worker entry every local run spawns:
``python -m parambox.run.worker RUN_DIR [--resume] [--spare]``.

The entry reads ``RUN_DIR/config.json`` (written by ``parambox train`` or ``parambox.train``), so no user
flag is parsed twice; a user's functions arrive as the references the config records, the launching
script's by ``PARAMBOX_MAIN_SCRIPT``, and the caller's ``sys.path`` additions by ``PARAMBOX_SYS_PATH``
(see :mod:`parambox.workload.refs`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from parambox.errors import REQUEUE_EXIT, CommTimeout, Preempted, UserError, validation_message
from parambox.runtime.world import World

SYS_PATH_ENV = "PARAMBOX_SYS_PATH"  # the caller's sys.path entries a worker lacks, os.pathsep-joined


def train_rank(
    cfg, world: World, run_dir: Path, resume: bool, callables: dict[str, Callable] | None = None
) -> dict[str, Any] | None:
    """Train this rank; the summary on rank 0. Any failure is first written to ``logs/rank{r}.err``
    (one line, then the traceback) and raised again."""
    from parambox.training.loop import train

    (run_dir / "logs" / f"rank{world.rank}.err").unlink(missing_ok=True)  # an earlier life's cause
    try:
        try:
            summary = train(cfg, world, run_dir, resume, callables)
        except SystemExit as e:  # parambox never exits inside train(): a user's function did
            from parambox.workload.refs import exit_site, raised

            raise UserError(
                f"{exit_site(e)} {raised(e)} during the run: a user's function must return or raise"
            ) from e
        if summary is not None:
            check_converged(cfg, run_dir, summary)
        return summary
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        write_failure(e, world, run_dir)
        raise


def check_converged(cfg, run_dir: Path, summary: dict[str, Any]) -> None:
    """Rank 0 after its last step: the run's last checkpoint is that step, unless its weights were not
    finite (the loop writes no checkpoint of such weights). A diverged run is a failure naming the last
    good checkpoint; its ``summary.json`` says it, and the rank files no checkpoint commits go."""
    from parambox.strategies import strategy_class
    from parambox.training import checkpoint

    ckpt_dir = run_dir / "checkpoints"
    good = checkpoint.committed_step(ckpt_dir)
    if good == summary["steps"]:
        return
    summary.update(diverged=True, last_good_step=good)
    checkpoint.atomic_write_json(run_dir / "summary.json", summary)
    if not strategy_class(cfg.strategy, cfg.strategy_options()).tolerates_worker_loss:
        checkpoint.prune_rank_states(ckpt_dir, good)  # asynchronous ranks keep their own newest
    where = (
        f"the last good checkpoint is step {good} ({ckpt_dir / 'last.pt'}); --resume continues from it"
        if good is not None
        else "no checkpoint was written before"
    )
    raise UserError(
        f"the run diverged: its weights are not finite at step {summary['steps']}; {where} "
        "(lower the learning rate, or check the data and loss for NaN)"
    )


def failure_line(e: BaseException) -> str:
    """The one line that names a failure: the user's error or a timeout as ``parambox: error: ...``."""
    if isinstance(e, UserError | CommTimeout):
        return f"parambox: error: {e}"
    if type(e).__name__ == "ValidationError":
        return f"parambox: error: {validation_message(e)}"
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def is_user_error(e: BaseException) -> bool:
    return isinstance(e, UserError) or type(e).__name__ == "ValidationError"


def write_failure(e: BaseException, world: World, run_dir: Path) -> None:
    """``logs/rank{r}.err``: the line the launcher quotes, then the traceback."""
    logs = Path(os.environ.get("PARAMBOX_LOG_DIR") or run_dir / "logs")
    with contextlib.suppress(OSError):
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"rank{world.rank}.err").write_text(failure_line(e) + "\n\n" + traceback.format_exc())
    if os.environ.get("PARAMBOX_DEBUG"):
        traceback.print_exc()


def run_worker(cfg, world: World, run_dir: Path, resume: bool) -> int:
    """A spawned (or externally launched CLI) rank: train, print the summary on rank 0, exit code."""
    from parambox.run import rundir
    from parambox.run.result import print_summary
    from parambox.runtime import spawn
    from parambox.runtime.mpi import exit_now

    spawn.name_this_process(spawn.rank_name(world.rank))  # ps shows parambox-r3
    try:
        summary = train_rank(cfg, world, run_dir, resume)
    except KeyboardInterrupt as e:
        if world.world_size == 1:
            raise
        # stopped (Ctrl-C, or the launcher ending a straggler), its checkpoint saved: no traceback
        code = 130
        if isinstance(e, Preempted):  # SIGUSR1: every rank exits "requeue me", rank 0 says where
            code = REQUEUE_EXIT
            if world.rank == 0:
                where = "before its first step" if e.step is None else f"at step {e.step}"
                print(f"parambox: stopped {where} for a requeue (SIGUSR1)", file=sys.stderr)
    except SystemExit:
        raise
    except BaseException as e:
        code = 2 if is_user_error(e) else 1
        ours = world.launcher == "local" or "PARAMBOX_LOG_DIR" in os.environ  # also our mpiexec's ranks
        if not ours:  # our launcher quotes the .err file itself: one line in all
            line = failure_line(e)
            print(line if world.world_size == 1 else f"[rank {world.rank}] {line}", file=sys.stderr)
    else:
        if summary is not None and cfg.progress:  # --no-progress / progress=False: quiet
            print_summary(summary, run_dir)
        code = 0
    finally:
        rundir.unlock(run_dir)  # the only worker's: prepared (and locked) in this process
    if world.world_size > 1:
        exit_now(code)
    return code


def main(argv: list[str] | None = None) -> int:
    from parambox.run.plan import load_recorded
    from parambox.runtime.control import SPARE_FLAG, take_console

    take_console()  # rank 0: Python's output to the console, C++'s through the launcher's pipe
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m parambox.run.worker RUN_DIR [--resume] [--spare]", file=sys.stderr)
        return 2
    _extend_sys_path()
    run_dir, resume = Path(argv[0]), "--resume" in argv[1:]
    try:
        cfg = load_recorded(run_dir)
    except Exception as e:
        write_failure(e, World.from_env(), run_dir)
        return 2 if is_user_error(e) else 1
    if SPARE_FLAG in argv[1:] and not _become_a_replacement(cfg):
        return 0  # the run ended without needing this spare
    return run_worker(cfg, World.from_env(), run_dir, resume)


def _extend_sys_path() -> None:
    """The caller's ``sys.path.insert(...)`` additions, so its imports work in the workers too."""
    for entry in reversed(os.environ.get(SYS_PATH_ENV, "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(1, entry)


def _become_a_replacement(cfg) -> bool:
    """A spare (see ``parambox.runtime.launcher``): warm up, then wait for the launcher to say which
    rank this process replaces. False when the launcher closed the pipe without a word."""
    import parambox.training.loop  # noqa: F401  (torch, the strategies: the bulk of a start-up)
    from parambox.runtime.control import SPARE_ENV

    with contextlib.suppress(
        Exception, SystemExit
    ):  # warm the data's imports and files; errors show in the real run
        from parambox.workload import build_workload

        build_workload(cfg)
    line = sys.stdin.readline()
    if not line.strip():
        return False
    env = {**json.loads(line), SPARE_ENV: "1"}  # it attaches to the run's boxes by name
    os.environ.clear()
    os.environ.update(env)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
