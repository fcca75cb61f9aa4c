"""The command line: ``parambox train | sweep | bench | reproduce | report | pick | predict | export | slurm |
info``.

Thin by design: each command lives in its own module with ``configure(parser)`` and ``run(args) -> int``.
A ``UserError`` (or pydantic ``ValidationError``) anywhere becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from parambox.errors import (
    REQUEUE_EXIT,
    Preempted,
    RunFailed,
    UserError,
    terminate_as_interrupt,
    validation_message,
)

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("parambox.commands.train", "train a model with any strategy"),
    "sweep": (
        "parambox.commands.sweep",
        "studies of many runs: workers x batch size x learning rate, scaling, time to accuracy",
    ),
    "bench": (
        "parambox.commands.bench",
        "benchmarks measured side by side (sync, box, async, local, cluster, optimizer, api)",
    ),
    "reproduce": (
        "parambox.commands.reproduce",
        "re-measure the seeds' claims: claims.json with verdicts, index.html",
    ),
    "report": ("parambox.commands.report", "plots and tables from run directories"),
    "pick": (
        "parambox.commands.pick",
        "which strategy reaches a target accuracy first with N workers: probes, predictions, ranking",
    ),
    "predict": ("parambox.commands.predict", "analytic scalability model: speedup and n_peak per topology"),
    "export": ("parambox.commands.export", "a run's model as ONNX, checked by onnxruntime"),
    "slurm": ("parambox.commands.slurm", "write (or submit) a SLURM batch script for a training run"),
    "info": (
        "parambox.commands.info",
        "what parambox sees: launcher, world, devices, strategies, models, data",
    ),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line, exit 2
        self.exit(2, f"parambox: error: {message}\n")


DESCRIPTION = (
    "Distributed training with any strategy (synchronous, asynchronous, local SGD, model parallel) over a "
    "shared parameter box or collectives, and the benchmarks that compare them. "
    "`parambox COMMAND --help` says more."
)


def _plain(text: str | None) -> str | None:
    """A command's description (its module's docstring) as ``--help`` prints it: without reST's literal
    markers.

    >>> _plain("``parambox sweep``: the grid (``--study grid``)")
    'parambox sweep: the grid (--study grid)'
    """
    return None if text is None else text.replace("``", "")


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line as its command reads it (argparse's errors: one line, exit 2); nothing runs."""
    parser = _Parser(prog="parambox", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if argv[:1] == [name]:  # only the chosen command's module is imported
            importlib.import_module(module).configure(p)
            p.description = _plain(p.description)
    args = parser.parse_args(argv)
    args._argv = list(argv)  # the local launcher hands the same command to its workers
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if _spawns_local_workers(argv):
        from parambox.runtime import zygote

        zygote.prestart()  # its torch import runs beside ours
    # ``kill`` unwinds as Ctrl-C does: nothing is left behind. From the start: a batch system's SIGUSR1
    # during the imports would otherwise end the process (its default action) without REQUEUE_EXIT; a
    # rank of srun's or mpiexec's keeps it for its loop, which stops with the other ranks.
    rank = argv[:1] == ["train"] and any(v in os.environ for v in _EXTERNAL_RANK_ENV)
    with terminate_as_interrupt(defer_requeue=rank):
        try:
            args = parse(argv)
            return int(importlib.import_module(args._module).run(args) or 0)
        except UserError as e:
            return _fail(str(e))
        except RunFailed as e:  # not the user's input: exit 1
            return _fail(str(e), code=1)
        except Preempted as e:
            where = "" if e.step is None else f" at step {e.step}"
            print(f"parambox: stopped{where} for a requeue (SIGUSR1)", file=sys.stderr)
            return REQUEUE_EXIT
        except KeyboardInterrupt:
            print("parambox: interrupted", file=sys.stderr)
            return 130
        except Exception as e:
            if type(e).__name__ == "ValidationError":  # pydantic, without importing it here
                return _fail(validation_message(e))
            raise


def _spawns_local_workers(argv: list[str]) -> bool:
    """``parambox train`` that will most likely fork workers here: not one worker, not under a
    cluster's launcher, not MPI's or an emulated cluster's (they start their processes themselves)."""
    if argv[:1] != ["train"] or any(v in os.environ for v in _EXTERNAL_RANK_ENV):
        return False
    flags = dict(zip(argv, argv[1:]))
    return flags.get("--workers") != "1" and "--emulate-nodes" not in flags and flags.get("--box") != "rma"


_EXTERNAL_RANK_ENV = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def _fail(message: str, code: int = 2) -> int:
    print(f"parambox: error: {message}", file=sys.stderr)
    if os.environ.get("PARAMBOX_DEBUG"):
        import traceback

        traceback.print_exc()
    return code
