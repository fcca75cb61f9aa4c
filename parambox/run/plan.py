"""What a run is before any process starts: its config resolved once, the checks a launch needs, and
its run directory. Both entry points (``parambox train`` and ``parambox.train``) come through here, and
every message speaks the caller's language (flags for the CLI, keyword arguments for the library)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from parambox.config import RunConfig, build_config
from parambox.errors import UserError, validation_message, warn
from parambox.run import rundir
from parambox.runtime.world import World, check_gpus, under_external_launcher
from parambox.training.checkpoint import atomic_write_json, remove_interrupted_writes


@dataclass(frozen=True)
class Caller:
    """Who started the run, so that a message names what that caller typed: ``--out DIR`` on the
    command line, ``out=...`` in a script.

    >>> Caller("cli").field("out"), Caller("api").field("out")
    ('--out OUT', 'out=...')
    """

    kind: Literal["cli", "api"]

    def field(self, name: str) -> str:
        if self.kind == "cli":
            return f"--{name.replace('_', '-')}" + ("" if name == "resume" else " " + name.upper())
        return "resume=True" if name == "resume" else f"{name}=..."

    def given(self, name: str, value: Any) -> str:
        """A field as this caller gave it: ``--lr 0.1`` or ``lr=0.1``."""
        if self.kind == "cli":
            return f"--{name.replace('_', '-')} {value}"
        return f"{name}={value!r}"


CLI, API = Caller("cli"), Caller("api")


def build(*layers: dict[str, Any]) -> RunConfig:
    """The run's config from layers (preset < file < flags or keywords < ``--set``): the one place a
    pydantic error becomes a ``UserError`` naming the field."""
    try:
        return build_config(*layers)
    except UserError:
        raise
    except Exception as e:
        if type(e).__name__ == "ValidationError":
            raise UserError(validation_message(e)) from None
        raise


def load_recorded(run_dir: Path) -> RunConfig:
    """The config a run directory recorded (``config.json``), as a ``UserError`` when it is unreadable."""
    path = run_dir / "config.json"
    try:
        return RunConfig(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise UserError(f"{run_dir} is not a run directory: {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
        raise UserError(f"{path} is not a run's config (garbled JSON: {str(e).splitlines()[0]})") from None
    except Exception as e:
        if type(e).__name__ == "ValidationError":
            raise UserError(f"{path} is not a run's config: {validation_message(e)}") from None
        raise


@dataclass
class Plan:
    """A resolved run: its config, the strategy class that will really run, this process's world."""

    cfg: RunConfig
    strategy_cls: type
    world: World
    caller: Caller
    resume: bool = False
    restarted: bool = False  # torchrun's elastic agent restarted this worker (``run/elastic.py``)

    @property
    def processes(self) -> int:
        """The run's processes: its workers, plus the rma box's spare and memory ranks."""
        return (
            self.cfg.workers + (self.cfg.box.spare_ranks or 0) + self.strategy_cls.memory_ranks(self.cfg.box)
        )

    @property
    def external(self) -> bool:
        return under_external_launcher()

    @property
    def spawns(self) -> bool:
        """Whether this process starts worker processes (else it trains itself)."""
        return not self.external and (self.processes > 1 or self.cfg.cluster.enabled)


def resolve(cfg: RunConfig, caller: Caller, resume: bool = False) -> Plan:
    """The strategy's facts applied to the config, and every check that needs no process: a worker
    count the strategy cannot take is refused here, not seconds later in the workers."""
    from parambox.strategies import strategy_class

    recorded_workers = None
    restarted = not resume and under_external_launcher() and _elastic_restart(cfg, caller)
    resume = resume or (restarted and _has_checkpoint(cfg))
    if resume:
        cfg = continue_recorded(cfg, caller)
        recorded_workers = load_recorded(Path(cfg.out)).workers
    check_seed(cfg, caller)
    check_variables()
    options = cfg.strategy_options()
    cls = strategy_class(cfg.strategy, options)
    if recorded_workers not in (None, cfg.workers) and not under_external_launcher():
        cls.check_resize(recorded_workers, cfg.workers, options)
    if cfg.init_from and not resume:
        cfg.init_from = check_init_from(cfg.init_from, caller)
    if cls.max_workers == 1 and "workers" not in cfg.model_fields_set:
        cfg.workers = 1  # `--strategy single` needs no `--workers 1`
    if cfg.box.spare_ranks and not cls.takes_spare_ranks:
        raise UserError(
            f"box.spare_ranks: strategy {cls.name!r} has no worker a spare could replace alone (the "
            "asynchronous strategies over --box rma do: downpour, dynsgd, easgd, eamsgd, asynchronous diloco)"
        )
    if cfg.box.backend == "rma" and cfg.box.memory_ranks is None:  # decided once, recorded for the workers
        ranks = cls.memory_ranks(cfg.box, emulated_nodes=cfg.cluster.enabled)
        cfg.box = cfg.box.model_copy(update={"memory_ranks": ranks})
    if cfg.box.spare_ranks and cfg.box.memory_ranks == 0:
        raise UserError(
            "box.spare_ranks needs box.memory_ranks >= 1: a worker that holds part of the box takes it "
            "with it, and no spare can bring it back"
        )
    plan = Plan(cfg, cls, World.from_env(), caller, resume, restarted)
    check_fault_ranks(plan)
    if plan.external:
        _check_external(plan)
        check_gpus(plan.world.local_world_size)
    else:
        cls.check_workers(cfg.workers, options)
        check_gpus(plan.processes)  # an emulated cluster's nodes share this machine's GPUs
        if cfg.cluster.enabled:
            from parambox.runtime.cluster import check_environment

            check_environment()  # not root, or no ip/tc: one line before anything is written
    return plan


def _elastic_restart(cfg: RunConfig, caller: Caller) -> bool:
    """Whether torchrun's agent restarted this worker in the run it names; then ``cfg.out`` is set."""
    from parambox.run import elastic
    from parambox.runtime.dist import check_store

    out = (cfg.out or external_run_dir(cfg, caller)) if elastic.job() is not None else cfg.out
    if out is None or not elastic.is_restart(Path(out).resolve()):
        return False
    check_store(World.from_env().world_size)
    cfg.out = out
    return True


def _has_checkpoint(cfg: RunConfig) -> bool:
    return (Path(cfg.out).resolve() / "checkpoints" / "last.pt").exists()


def check_init_from(source: str, caller: Caller) -> str:
    """``init_from`` as an absolute path every worker finds; a ``UserError`` when it names nothing."""
    path = Path(source).expanduser().resolve()
    weights = path / "checkpoints" / "last.pt" if path.is_dir() else path
    if not weights.is_file():
        raise UserError(f"{caller.given('init_from', source)}: {weights} does not exist")
    return str(path)


# The seed is mixed into torch generators' seeds (seed * 1000 + rank + 1 per rank, and the data's
# (seed * 7919 + step) * 65537 + rank for augmentation), which torch takes below 2**64.
MAX_SEED = 2**32 - 1


def check_seed(cfg: RunConfig, caller: Caller) -> None:
    if cfg.seed > MAX_SEED:
        raise UserError(f"config field 'seed': {caller.given('seed', cfg.seed)} is more than 2**32 - 1")


def check_variables() -> None:
    """The environment variables a run reads, checked before any process starts: a bad one is one
    line here, not a worker's traceback (or silently nothing, for a fault of an unknown kind)."""
    from parambox.runtime.control import JOIN_FROM_ENV, LIFE_ENV
    from parambox.training.faults import FaultPlan

    env = os.environ
    threads = env.get("PARAMBOX_THREADS", "").strip()
    if threads and not (threads.isdigit() and int(threads) > 0):
        raise UserError(f"PARAMBOX_THREADS={env['PARAMBOX_THREADS']!r}: expected a positive integer")
    for name in (LIFE_ENV, JOIN_FROM_ENV):
        if env.get(name, "").strip() and not env[name].strip().isdigit():
            raise UserError(f"{name}={env[name]!r}: expected a count (it is the launcher's; unset it)")
    for entry in env.get("PARAMBOX_STRATEGIES", "").split(";"):  # what register() hands the workers
        name, _, ref = entry.partition("=")
        module, _, attr = ref.partition(":")
        if entry.strip() and not (name and module and attr):
            raise UserError(
                f"PARAMBOX_STRATEGIES={env['PARAMBOX_STRATEGIES']!r}: expected name=module:Class entries "
                "joined by ';' (parambox.strategies.register writes it)"
            )
    spec = env.get("PARAMBOX_FAULT")
    if spec:
        try:
            plan = FaultPlan.parse(spec)
        except ValueError as e:
            detail = str(e) if "PARAMBOX_FAULT" in str(e) else "expected RANK:STEP:KIND[,...]"
            raise UserError(f"PARAMBOX_FAULT={spec!r}: {detail.removeprefix('PARAMBOX_FAULT ')}") from None
        unknown = [k for _, _, k in plan.faults if k.split("=")[0] not in FAULT_KINDS]
        if unknown:
            raise UserError(
                f"PARAMBOX_FAULT={spec!r}: no fault {unknown[0]!r} (choose from {', '.join(FAULT_KINDS)})"
            )


def check_fault_ranks(plan: Plan) -> None:
    """A fault aimed at a rank the run does not have would silently inject nothing."""
    from parambox.training.faults import FaultPlan

    ranks = plan.world.world_size if plan.external else plan.processes
    spec = os.environ.get("PARAMBOX_FAULT")
    beyond = [r for r, _, _ in FaultPlan.parse(spec).faults if r >= ranks]
    if beyond:
        raise UserError(f"PARAMBOX_FAULT={spec!r}: no rank {beyond[0]} in this run of {ranks} rank(s)")


# The kinds of fault parambox.training.faults injects (its docstring says what each does)
FAULT_KINDS = (
    "kill",
    "nan",
    "slow",
    "hang",
    "stop",
    "partition",
    "lose-exchange",
    "kill-resume",
    "kill-join",
)


# What a resume may change: how long it runs, how it waits, what it logs, and how many workers it has
# (``resize`` says what becomes of the batch then). Everything else is the run's.
RESUMABLE = frozenset(
    {
        "steps",
        "out",
        "timeout",
        "progress",
        "tensorboard",
        "log_every",
        "eval_every",
        "checkpoint_every",
        "checkpoint_interval_s",
        "workers",
        "resize",
        "max_restarts",
        "warm_spare",
        "on_failure",
        "threads",
        "loader_workers",
    }
)


def no_checkpoint(caller: Caller, last: Path) -> UserError:
    """A resume with nothing to resume from: a run that stopped before its first checkpoint says how
    to checkpoint sooner."""
    every, interval = (
        ("--checkpoint-every", "--checkpoint-interval-s")
        if caller.kind == "cli"
        else ("checkpoint_every", "checkpoint_interval_s")
    )
    return UserError(
        f"{caller.field('resume')}: {last} does not exist: no checkpoint was written (the run stopped "
        f"before its first: {interval} sets the seconds between them, 600 by default; {every} counts steps)"
    )


def continue_recorded(cfg: RunConfig, caller: Caller) -> RunConfig:
    """A resume continues the run its directory recorded: a given field that would change the training
    is refused; the ones in ``RESUMABLE`` may change."""
    if cfg.out is None:
        raise UserError(f"{caller.field('resume')} needs {caller.field('out')}: the run directory")
    last = Path(cfg.out).resolve() / "checkpoints" / "last.pt"
    if not last.exists():
        raise no_checkpoint(caller, last)
    recorded = load_recorded(Path(cfg.out))
    rundir.check_trust(Path(cfg.out).resolve(), recorded, None)
    changed = [
        f
        for f in sorted(cfg.model_fields_set - RESUMABLE)
        if _differs(_as_recorded(f, getattr(cfg, f)), getattr(recorded, f))
    ]
    if changed:
        f = changed[0]
        raise UserError(
            f"{caller.field('resume')} continues the recorded run: {caller.given(f, getattr(cfg, f))} "
            f"differs from the recorded {getattr(recorded, f)!r} "
            f"(it may change only {', '.join(sorted(RESUMABLE - {'out'}))})"
        )
    return recorded.model_copy(update={f: getattr(cfg, f) for f in cfg.model_fields_set & RESUMABLE})


def _as_recorded(field: str, value: Any) -> Any:
    """A given ``file.py:function`` as the run recorded it: its path absolute (the same file, named
    from the directory the run was started in, resumes it)."""
    from parambox.workload import CALLABLE_FIELDS
    from parambox.workload.refs import absolute, is_reference

    if field in CALLABLE_FIELDS and isinstance(value, str) and is_reference(value):
        return absolute(value)
    return value


def _differs(given: Any, recorded: Any) -> bool:
    """A given value that changes the recorded one; of a table (the box) only the keys given count: the
    plan fills the others (``--box rma`` records its memory ranks), and the same flags must resume."""
    if isinstance(given, BaseModel) and type(given) is type(recorded):
        return any(getattr(given, k) != getattr(recorded, k) for k in given.model_fields_set)
    return given != recorded


def _check_external(plan: Plan) -> None:
    from parambox.runtime.mpi import srun_without_mpi

    cfg, world = plan.cfg, plan.world
    if cfg.cluster.enabled and "PARAMBOX_NUM_NODES" not in os.environ:  # not one of our nodes' ranks
        raise UserError(
            f"{plan.caller.field('emulate_nodes')} is for the local launcher; under {world.launcher} it "
            "places the workers"
        )
    if cfg.box.needs_mpi and srun_without_mpi():  # before MPI starts: it would leave files behind
        raise UserError(srun_without_mpi())
    cfg.out = cfg.out or external_run_dir(cfg, plan.caller)
    if plan.resume:  # the recorded count is the last life's: this life has what the launcher started
        cfg.workers = world.world_size - (plan.processes - cfg.workers)
    elif "workers" in cfg.model_fields_set and plan.processes != world.world_size and world.rank == 0:
        warn(
            f"{plan.caller.given('workers', cfg.workers)} ignored: the launcher started {world.world_size} processes"
        )


def external_run_dir(cfg: RunConfig, caller: Caller = CLI) -> str:
    """A run directory every rank agrees on without talking: named after the launcher's job id."""
    env = os.environ
    job = (
        (env.get("SLURM_JOB_ID") and f"{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', 0)}")
        or env.get("TORCHELASTIC_RUN_ID")
        or env.get("PMIX_NAMESPACE")
        or env.get("OMPI_MCA_orte_ess_jobid")
    )
    if not job:
        raise UserError(f"under this launcher, give {caller.field('out')} (a path every rank can write)")
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


def prepare_run_dir(plan: Plan) -> Path:
    """The run directory, made and holding ``config.json`` (a resume keeps the recorded one)."""
    cfg, caller = plan.cfg, plan.caller
    if cfg.out is None:
        if plan.resume:
            raise UserError(f"{caller.field('resume')} needs {caller.field('out')}: the run directory")
        cfg.out = f"runs/{cfg.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.out).resolve()
    cfg.out = str(run_dir)
    if not plan.external:  # under torchrun / srun / mpiexec every rank prepares the same directory
        try:
            rundir.lock(run_dir, caller.field("out"))
        except OSError as e:
            raise _unwritable(run_dir, caller, e) from None
    try:
        if not plan.external:  # locked: no writer of an earlier life is left
            remove_interrupted_writes(run_dir)
        _check_and_record(plan, run_dir)
    except BaseException:
        rundir.unlock(run_dir)
        raise
    return run_dir


def _check_and_record(plan: Plan, run_dir: Path) -> None:
    cfg, caller = plan.cfg, plan.caller
    if plan.resume:
        if not (run_dir / "checkpoints" / "last.pt").exists():
            raise no_checkpoint(caller, run_dir / "checkpoints" / "last.pt")
    elif plan.restarted:  # restarted before the first checkpoint: the run starts again
        if plan.world.is_main:
            print(f"parambox: restarting {run_dir} from step 0 (no checkpoint yet)", flush=True)
    elif (run_dir / "summary.json").exists() or (run_dir / "checkpoints").exists():
        raise UserError(
            f"run directory {run_dir} already holds a run; pass {caller.field('resume')} to continue it, "
            f"or another {caller.field('out')}"
        )
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)  # per-rank error files land here
        atomic_write_json(run_dir / "config.json", cfg.model_dump())
        if plan.external:
            from parambox.run import elastic

            elastic.record(run_dir)  # the next life of a torchrun job knows it is one
    except OSError as e:
        raise _unwritable(run_dir, caller, e) from None


def _unwritable(run_dir: Path, caller: Caller, e: OSError) -> UserError:
    return UserError(
        f"{caller.field('out').split()[0]} {run_dir}: cannot write the run directory there ({e.strerror})"
    )
