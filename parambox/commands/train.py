"""``parambox train``: one command for a laptop (local launcher) and for clusters (srun, mpiexec, torchrun)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from parambox.config import RunConfig, build_config, load_toml, parse_set
from parambox.errors import CommTimeout, UserError, warn
from parambox.runtime.mpi import exit_now, srun_without_mpi
from parambox.runtime.world import World, under_external_launcher
from parambox.strategies import strategy_class
from parambox.training.checkpoint import atomic_write_json

if TYPE_CHECKING:
    from parambox.runtime.supervisor import LaunchResult

WORKER_MODULE = "parambox.api.worker"  # python -m parambox.api.worker RUN_DIR [--resume]

FLAGS = {  # flag -> config field; each flag's type and range come from RunConfig
    "--strategy": "strategy",
    "--workers": "workers",
    "--model": "model",
    "--data": "data",
    "--loss": "loss",
    "--metrics": "metrics",
    "--collate": "collate",
    "--loader-workers": "loader_workers",
    "--data-path": "data_path",
    "--steps": "steps",
    "--batch-size": "batch_size",
    "--lr": "lr",
    "--optimizer": "optimizer",
    "--momentum": "momentum",
    "--weight-decay": "weight_decay",
    "--seed": "seed",
    "--out": "out",
    "--checkpoint-every": "checkpoint_every",
    "--eval-every": "eval_every",
    "--timeout": "timeout",
    "--max-restarts": "max_restarts",
    "--threads": "threads",
    "--box": "box",
}


def configure(p: argparse.ArgumentParser) -> None:
    for flag, field in FLAGS.items():
        info = RunConfig.model_fields[field]
        text = f"{info.description or field} (default: {info.default})"
        if field == "box":
            text = "the box's backend, shm or rma (default: shm); its options: --set box.KEY=VALUE"
        p.add_argument(flag, dest=field, default=None, metavar=field.upper(), help=text)
    p.add_argument("--preset", default=None, help="start from a named preset (see `parambox info`)")
    p.add_argument(
        "--config", default=None, help="TOML file; tables named after strategies hold their options"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any field, e.g. --set easgd.tau=4 (repeatable)",
    )
    p.add_argument(
        "--emulate-nodes",
        type=int,
        default=None,
        metavar="N",
        help="run the workers on N emulated nodes (network namespaces; needs root), consecutive ranks per node",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        metavar="G",
        help="rate-limit each emulated node's link to G Gbit/s (default: unshaped)",
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--augment", dest="augment", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--tensorboard", action="store_true", default=None, help="also write TensorBoard events")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    from parambox.presets import preset

    layers = [preset(args.preset) if args.preset else {}]
    if args.config:
        layers.append(load_toml(args.config))
    layers.append({f: getattr(args, f) for f in [*FLAGS.values(), "augment", "tensorboard", "progress"]})
    cluster = {"nodes": args.emulate_nodes, "link_gbps": args.link_gbps}
    layers.append({"cluster": {k: v for k, v in cluster.items() if v is not None}})
    layers.append(parse_set(args.set))
    return build_config(*layers)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    world = World.from_env()
    if world.launcher == "local":  # spawned by our own launcher, which prepared the run directory
        return run_worker(cfg, world, Path(cfg.out), args.resume)
    cls = strategy_class(cfg.strategy, cfg.strategy_options())
    if cls.max_workers == 1 and "workers" not in cfg.model_fields_set:
        cfg.workers = 1  # `--strategy single` needs no `--workers 1`
    if under_external_launcher():
        if cfg.cluster.enabled and "PARAMBOX_NUM_NODES" not in os.environ:  # not one of our nodes' ranks
            raise UserError(
                f"--emulate-nodes is for the local launcher; under {world.launcher} it places the workers"
            )
        if cfg.box.needs_mpi and srun_without_mpi():  # before MPI starts: it would leave files behind
            if world.rank == 0:
                print(f"parambox: error: {srun_without_mpi()}", file=sys.stderr)
            return 2
        cfg.out = cfg.out or external_run_dir(cfg)
        if "--workers" in args._argv and processes(cfg) != world.world_size and world.rank == 0:
            warn(f"--workers {cfg.workers} ignored: the launcher started {world.world_size} processes")
    elif cfg.cluster.enabled:
        from parambox.runtime.cluster import check_environment

        check_environment()  # not root, or no ip/tc: one line before anything is written
    if not under_external_launcher():
        cls.check_workers(cfg.workers)  # before any process starts
    check_references(cfg)  # a REF that does not import fails here, before any worker starts
    run_dir = prepare_run_dir(cfg, args.resume)
    if (processes(cfg) == 1 and not cfg.cluster.enabled) or under_external_launcher():
        return run_worker(cfg, world, run_dir, args.resume)
    return launch(cfg, args, run_dir)


def processes(cfg: RunConfig) -> int:
    """The run's processes: its workers, plus the rma box's memory ranks."""
    return cfg.workers + strategy_class(cfg.strategy, cfg.strategy_options()).extra_ranks(cfg.box)


def external_run_dir(cfg: RunConfig) -> str:
    """A run directory every rank agrees on without talking: named after the launcher's job id."""
    env = os.environ
    job = (
        (env.get("SLURM_JOB_ID") and f"{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', 0)}")
        or env.get("TORCHELASTIC_RUN_ID")
        or env.get("PMIX_NAMESPACE")
        or env.get("OMPI_MCA_orte_ess_jobid")
    )
    if not job:
        raise UserError("under this launcher, give --out DIR (a path every rank can write)")
    return f"runs/{cfg.strategy}-{job.replace('/', '_').replace('@', '_')}"


def check_references(cfg: RunConfig, given: dict | None = None) -> None:
    """Import every ``module:function`` / ``file.py:function`` the run names (but the functions
    ``given`` in-process); a ``UserError`` naming the first that cannot be imported or is not callable."""
    from parambox.workload import CALLABLE_FIELDS, resolve_callables
    from parambox.workload.refs import absolute, is_reference

    resolve_callables(cfg, given)
    for field in CALLABLE_FIELDS:  # file.py:function recorded with its absolute path
        value = getattr(cfg, field)
        if isinstance(value, str) and is_reference(value) and field not in (given or {}):
            setattr(cfg, field, absolute(value))


def prepare_run_dir(cfg: RunConfig, resume: bool) -> Path:
    if cfg.out is None:
        if resume:
            raise UserError("--resume needs --out DIR: the run directory to continue")
        cfg.out = f"runs/{cfg.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.out).resolve()
    cfg.out = str(run_dir)
    if resume:
        if not (run_dir / "checkpoints" / "last.pt").exists():
            raise UserError(f"--resume: {run_dir / 'checkpoints' / 'last.pt'} does not exist")
    elif (run_dir / "summary.json").exists() or (run_dir / "checkpoints").exists():
        raise UserError(f"run directory {run_dir} already holds a run; use --resume or another --out")
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)  # per-rank error files land here
        (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2))
    except OSError as e:
        raise UserError(f"--out {run_dir}: cannot write the run directory there ({e.strerror})") from None
    return run_dir


def launch(cfg: RunConfig, args: argparse.Namespace, run_dir: Path) -> int:
    result = launch_workers(cfg, run_dir, args.resume)
    if result.returncode == 130:
        print("parambox: interrupted; workers stopped", file=sys.stderr)
        return 130
    for rank, (code, reason) in result.failed.items():
        if reason.startswith("parambox: error: "):  # bad input or a timeout, found by a worker: one line
            print(f"{reason} (worker rank {rank})", file=sys.stderr)
            return code
        print(
            f"parambox: error: worker rank {rank} failed: {reason} (log: {run_dir / 'logs'})", file=sys.stderr
        )
        return 1
    if result.returncode == 0 and not (run_dir / "summary.json").exists():
        # Under mpiexec --with-ft ulfm the job may end 0 though rank 0, which writes the result, died.
        print(
            f"parambox: error: the run ended without a result: rank 0 died (log: {run_dir / 'logs'})",
            file=sys.stderr,
        )
        return 1
    if result.lost or result.restarts:
        mark_lost(run_dir, result.lost, result.restarts)
    return result.returncode


def launch_workers(cfg: RunConfig, run_dir: Path, resume: bool) -> LaunchResult:
    """Start the run's local processes on the one worker entry (``python -m parambox.api.worker
    RUN_DIR``, which reads ``config.json``) and supervise them: the CLI's and ``parambox.train``'s."""
    from parambox.runtime.launcher import launch_local

    cls = strategy_class(cfg.strategy, cfg.strategy_options())  # the class that will really run
    use_mpi = cls.needs_mpi or cfg.box.needs_mpi
    if use_mpi and cfg.max_restarts:
        warn("--max-restarts is ignored under MPI (one job): a dead rank is lost, the others carry on")
    return launch_local(
        [str(run_dir), *(["--resume"] if resume else [])],
        processes(cfg),
        run_dir / "logs",
        cfg.threads,
        use_mpi=use_mpi,
        tolerate_loss=cls.tolerates_worker_loss,
        module=WORKER_MODULE,
        cluster=cfg.cluster if cfg.cluster.enabled else None,
        max_restarts=0 if use_mpi else cfg.max_restarts,
        warm_spare=cfg.warm_spare,
        resume_argv=[str(run_dir), "--resume"],
        checkpoint=run_dir / "checkpoints" / "last.pt",
    )


def mark_lost(run_dir: Path, lost: list[int], restarts: int = 0) -> None:
    """What only the launcher knows, into rank 0's summary: ranks lost, and restarts made."""
    path = run_dir / "summary.json"
    if path.exists():
        summary = json.loads(path.read_text())
        summary["lost_workers"] = sorted(set(summary.get("lost_workers", [])) | set(lost))
        summary["restarts"] = restarts
        atomic_write_json(path, summary)
    if restarts:
        warn(f"{restarts} restart(s) of workers")
    if lost:
        warn(f"lost worker ranks {lost}; the others finished")


def run_worker(cfg: RunConfig, world: World, run_dir: Path, resume: bool) -> int:
    from parambox.training.loop import train

    try:
        summary = train(cfg, world, run_dir, resume)
    except BaseException as e:
        code = report_failure(e, world, run_dir)
    else:
        if summary is not None and cfg.progress:  # --no-progress / progress=False: quiet
            print_summary(summary, run_dir)
        code = 0
    if world.world_size > 1:
        exit_now(code)
    return code


def report_failure(e: BaseException, world: World, run_dir: Path, echo: bool = True) -> int:
    """One line on stderr and in logs/rank{r}.err (the launcher quotes it); the traceback goes to the log.
    ``echo=False``: the log alone (the library API raises the error instead)."""
    if isinstance(e, KeyboardInterrupt | SystemExit):
        raise e
    user = isinstance(e, UserError) or type(e).__name__ == "ValidationError"
    if user or isinstance(e, CommTimeout):
        line = f"parambox: error: {e}"
    else:
        line = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    logs = Path(os.environ.get("PARAMBOX_LOG_DIR") or run_dir / "logs")
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"rank{world.rank}.err").write_text(line + "\n\n" + traceback.format_exc())
    ours = world.launcher == "local" or "PARAMBOX_LOG_DIR" in os.environ  # also our mpiexec's ranks
    if echo and not ours:  # our launcher quotes the .err file itself: one line in all
        print(line if world.world_size == 1 else f"[rank {world.rank}] {line}", file=sys.stderr)
    if os.environ.get("PARAMBOX_DEBUG"):
        traceback.print_exc()
    return 2 if user else 1


def print_summary(summary: dict, run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="parambox run", show_header=False)
    finals = [k for k in summary if k.startswith("final_test_")]  # loss, accuracy or a user's metrics
    for key in ("strategy", "workers", "model", "data", "steps", *finals, "wall_time_s", "samples_per_s"):
        value = summary.get(key)
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)
    print(f"run directory: {run_dir}")
