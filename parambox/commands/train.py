"""``parambox train``: one command for a laptop (local launcher) and for clusters (srun, mpiexec, torchrun)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parambox.config import RunConfig, load_toml, parse_set

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
    "--grad-clip": "grad_clip",
    "--grad-accum": "grad_accum",
    "--precision": "precision",
    "--lr-schedule": "lr_schedule",
    "--warmup-steps": "warmup_steps",
    "--seed": "seed",
    "--out": "out",
    "--checkpoint-every": "checkpoint_every",
    "--checkpoint-interval-s": "checkpoint_interval_s",
    "--resize": "resize",
    "--init-from": "init_from",
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
    p.add_argument(
        "--augment",
        dest="augment",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="train-time augmentation (default: on where the data set has one: CIFAR-10's crops and flips)",
    )
    p.add_argument("--tensorboard", action="store_true", default=None, help="also write TensorBoard events")
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        default=None,
        help="quiet: no progress bar and no summary table (the figures are in OUT/summary.json)",
    )


def config_from_args(args: argparse.Namespace) -> RunConfig:
    from parambox.presets import preset
    from parambox.run.plan import build

    layers = [preset(args.preset) if args.preset else {}]
    if args.config:
        layers.append(load_toml(args.config))
    layers.append({f: getattr(args, f) for f in [*FLAGS.values(), "augment", "tensorboard", "progress"]})
    cluster = {"nodes": args.emulate_nodes, "link_gbps": args.link_gbps}
    layers.append({"cluster": {k: v for k, v in cluster.items() if v is not None}})
    layers.append(parse_set(args.set, args.strategy))
    return build(*layers)


def run(args: argparse.Namespace) -> int:
    from parambox.errors import REQUEUE_EXIT, Preempted
    from parambox.run.execute import RunFailed, launch, prepare
    from parambox.run.plan import CLI
    from parambox.run.worker import run_worker
    from parambox.runtime.world import World

    cfg = config_from_args(args)
    if World.from_env().launcher == "local":  # a rank of our own launcher's, which prepared the run
        return run_worker(cfg, World.from_env(), Path(cfg.out), args.resume)
    plan, run_dir = prepare(cfg, CLI, args.resume)
    if not plan.spawns:  # the only worker, or one rank under torchrun / srun / mpiexec
        return run_worker(plan.cfg, plan.world, run_dir, plan.resume)
    try:
        launch(plan, run_dir)  # rank 0 prints the summary
    except RunFailed as e:
        print(e.line, file=sys.stderr)
        return e.code
    except Preempted:
        print("parambox: stopped for a requeue (SIGUSR1); workers stopped", file=sys.stderr)
        return REQUEUE_EXIT
    except KeyboardInterrupt:
        print("parambox: interrupted; workers stopped", file=sys.stderr)
        return 130
    return 0
