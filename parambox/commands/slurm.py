"""``parambox slurm``: write (and optionally submit) a SLURM batch script that runs ``parambox train``.

    parambox slurm --nodes 2 --tasks-per-node 4 --time 01:00:00 -- --strategy easgd --steps 5000

The script runs ``srun python -m parambox train ...``: every task reads its rank from SLURM and
rendezvouses at the first host of the node list (see README).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from parambox.errors import UserError


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
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: arguments for `parambox train`")


def render(args: argparse.Namespace) -> str:
    if args.nodes < 1 or args.tasks_per_node < 1:
        raise UserError("--nodes and --tasks-per-node must be at least 1")
    train_args = [a for a in args.train_args if a != "--"]
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={args.job_name}",
        f"#SBATCH --nodes={args.nodes}",
        f"#SBATCH --ntasks-per-node={args.tasks_per_node}",
        f"#SBATCH --time={args.time}",
        "#SBATCH --output=%x-%j.out",
    ]
    if args.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={args.cpus_per_task}")
    if args.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={args.gpus_per_node}")
    for opt in ("partition", "account"):
        if getattr(args, opt):
            lines.append(f"#SBATCH --{opt}={getattr(args, opt)}")
    threads = "${SLURM_CPUS_PER_TASK:-1}"
    lines += [
        "set -euo pipefail",
        f"export OMP_NUM_THREADS={threads}",
        f"srun {shlex.quote(sys.executable)} -m parambox train --threads {threads} "
        + " ".join(shlex.quote(a) for a in train_args),
        "",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    text = render(args)
    if args.script or args.submit:
        path = Path(args.script or f"{args.job_name}.sbatch")
        path.write_text(text)
        print(f"wrote {path}")
        if args.submit:
            return subprocess.call(["sbatch", str(path)])
    else:
        print(text, end="")
    return 0
