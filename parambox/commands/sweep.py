"""``parambox sweep``: the hyper-parameter grid of SHM-Learn-Dist §5, and the studies built on it.

``parambox sweep`` (``--study grid``, the default) trains every combination of ``--workers`` x
``--batch-size`` x ``--lr`` (x ``--strategy``), one run after the other, each seeing the same number of
samples: a run does ``steps = samples // (workers * batch_size)`` steps (``--samples``; or ``--steps``,
the steps of the run with the smallest global batch, so ``samples = steps * min(workers * batch)``).
Each run is scored as in the report: runs whose minimum training loss (a moving mean over 1/20 of
the run, so one lucky batch does not count) stays above ``--loss-threshold`` are out; of the rest,
the one with the smallest area under its loss-vs-time curve (loss x seconds, start-up excluded) wins,
per worker count. A run is *diverged* when its loss became non-finite or blew up (above 2x its initial
value, the first step's loss); a run that never reached the threshold is *above_threshold*, noted
"no progress" when its final loss is above 90 % of its initial loss (stuck, e.g. dead ReLUs).

Writes ``OUT/results.json`` (every run's figures and ``winners``), ``table.md`` (Table 5.1, also
printed), ``heatmap_workers{N}.png`` (Figs. 5.5-5.8), ``areas_workers{N}.png`` (Figs. 5.1-5.4) and
``loss_workers{N}.png``; the runs themselves live in ``OUT/runs/``. Running the same command again
with the same ``--out`` reuses finished runs and redoes unfinished ones.

``--study neuron`` is the single-neuron study (§3; preset ``neuron-study``): a sigmoid neuron learning
the step function, 2/4/8/16 workers simulated in one process, gradient- and weight-averaged; writes
``loss_curves.png`` (Fig. 2.1), ``smoothness.png`` and ``results.json``, after checking the simulation
against real runs at 2 and 4 workers (``--cross-check-steps``; ``--no-cross-check`` skips them).
``--study scaling`` is the scaling study (§6; preset ``scaling-study``, ps-sync): 1..N workers per
``--strategy``, loss and accuracy against time, gather/average/broadcast time per worker count and
time to ``--target-accuracy``. ``--study time-to-accuracy`` (preset ``time-to-accuracy``: LeNet on
MNIST, 2 workers; ``--workers N`` for N) trains every strategy setup of ``bench cluster``
(``--setups``) with each of ``--seeds`` (default 0,1,2) on one emulated node a worker at each of
``--gbps`` (default 1,0.1; needs root; ``loopback``: this machine's processes, no cluster) and
reports the median training seconds to ``--target-accuracy`` (default 0.98; or ``--target perplexity=12``, a
metric in its own units and direction) per setup, and the best
setup against ``allreduce``; ``--quick`` is a short form on digits (target 0.8, 1 seed, 1 Gbit/s).
See ``parambox.studies.neuron``, ``parambox.studies.scaling`` and ``parambox.studies.accuracy``.

    parambox sweep --workers 1,2 --batch-size 16,32,64 --lr 0.05,0.1,0.2 --out sweeps/digits
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from parambox.config import merge, parse_set
from parambox.errors import UserError, warn
from parambox.numerics import is_finite
from parambox.presets import preset

STUDIES = ("grid", "neuron", "scaling", "time-to-accuracy")
CROSS_CHECK_STEPS = 1000


def configure(p: argparse.ArgumentParser) -> None:
    p.description = __doc__  # `parambox sweep --help` explains the metric, the files and the studies
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument(
        "--study",
        choices=STUDIES,
        default="grid",
        help="grid (default), neuron (§3), scaling (§6), time-to-accuracy (issue 11)",
    )
    p.add_argument("--preset", help="base run config (default: digits-sweep, neuron-study or scaling-study)")
    p.add_argument("--strategy", help="comma list of strategies (default: the preset's)")
    p.add_argument(
        "--workers",
        help="comma list (grid default 1,2; neuron 2,4,8,16; scaling 1,2); time-to-accuracy: one count",
    )
    p.add_argument("--batch-size", help="comma list of per-worker batch sizes (grid default 16,32,64)")
    p.add_argument("--lr", help="comma list of learning rates (grid default 0.05,0.1,0.2)")
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--samples", type=int, help="samples every run sees (default per data set: 24,576 on digits)"
    )
    size.add_argument(
        "--steps", type=int, help="steps of the run with the smallest global batch (neuron: per worker)"
    )
    p.add_argument(
        "--loss-threshold", type=float, help="grid: min loss a run must reach (default per data set)"
    )
    p.add_argument("--target-accuracy", type=float, help="scaling: test accuracy for time-to-accuracy (0..1)")
    p.add_argument(
        "--model", help="every run's model: a zoo name, or a factory (module:function, file.py:function)"
    )
    p.add_argument(
        "--data", help="every run's data set: a registered one, or a factory returning (train, test)"
    )
    p.add_argument("--data-path", help="where the data set's files are (CIFAR-10, your own text)")
    p.add_argument("--seed", type=int, help="every run's seed (the studies take --seeds)")
    p.add_argument("--momentum", type=float, help="every run's SGD momentum")
    p.add_argument(
        "--emulate-nodes", type=int, metavar="N", help="every run on N emulated nodes (needs root)"
    )
    p.add_argument("--link-gbps", type=float, metavar="G", help="the emulated nodes' links in Gbit/s")
    tta = p.add_argument_group("--study time-to-accuracy")
    tta.add_argument("--setups", help="comma list of bench cluster setups (default: every strategy setup)")
    tta.add_argument(
        "--gbps", help="comma list of link rates in Gbit/s, or loopback (no cluster, no root; default 1,0.1)"
    )
    tta.add_argument("--seeds", help="comma list of seeds (default 0,1,2)")
    tta.add_argument("--quick", action="store_true", help="short form: digits, target 0.8, 1 seed, 1 Gbit/s")
    tta.add_argument(
        "--target",
        metavar="METRIC=VALUE",
        help="the test metric to reach: perplexity=12, bits_per_byte=3 (lower is better), accuracy=0.98, or "
        "METRIC<=VALUE / METRIC>=VALUE for your own (default: --target-accuracy's)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any run field")
    p.add_argument("--out", type=Path, help="output directory (default sweeps/STUDY-TIME); rerun to resume")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one training run may take")
    p.add_argument(
        "--no-cross-check", dest="cross_check", action="store_false", help="neuron: skip real runs"
    )
    p.add_argument(
        "--cross-check-steps", type=int, default=CROSS_CHECK_STEPS, help="neuron: steps of each real run"
    )


def run(args: argparse.Namespace) -> int:
    args.out = args.out or Path(f"sweeps/{args.study}-{time.strftime('%Y%m%d-%H%M%S')}")
    for flag, value in (("--samples", args.samples), ("--steps", args.steps)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    if args.study != "neuron" and (not args.cross_check or args.cross_check_steps != CROSS_CHECK_STEPS):
        warn("--no-cross-check and --cross-check-steps apply to --study neuron only")
    if args.study != "time-to-accuracy" and (
        args.setups or args.gbps or args.seeds or args.quick or args.target
    ):
        raise UserError(
            "--setups, --gbps, --seeds, --quick and --target apply to --study time-to-accuracy only"
        )
    if args.study == "neuron":
        return run_neuron(args)
    if args.study == "scaling":
        return run_scaling(args)
    if args.study == "time-to-accuracy":
        return run_time_to_accuracy(args)
    if args.target_accuracy is not None:
        raise UserError("--target-accuracy applies to --study scaling; a grid uses --loss-threshold")
    return run_grid(args)


def run_grid(args: argparse.Namespace) -> int:
    """``parambox sweep`` (``--study grid``)."""
    from parambox.studies.grid import print_winners, run_sweep

    base = base_config(args, "digits-sweep")
    t0 = time.perf_counter()
    results = run_sweep(
        args.out,
        base,
        workers=parse_list(args.workers or "1,2", int, "--workers"),
        batch_sizes=parse_list(args.batch_size or "16,32,64", int, "--batch-size"),
        lrs=parse_list(args.lr or "0.05,0.1,0.2", float, "--lr"),
        strategies=parse_list(args.strategy, str, "--strategy") if args.strategy else None,
        samples=args.samples,
        steps=args.steps,
        loss_threshold=args.loss_threshold,
        run_timeout_s=args.run_timeout,
    )
    print_winners(results)
    print(f"sweep took {time.perf_counter() - t0:.0f} s; results in {args.out / 'results.json'}")
    return 0


def run_neuron(args: argparse.Namespace) -> int:
    """``parambox sweep --study neuron``: the study from the ``neuron-study`` preset and the flags."""
    from parambox.studies.neuron import print_results, run_neuron_study
    from parambox.studies.runs import validate

    cfg = validate(base_config(args, "neuron-study"))
    if cfg.momentum != 0 or cfg.optimizer != "sgd" or cfg.model != "neuron" or cfg.data != "step":
        raise UserError("the neuron study simulates plain SGD (momentum 0) of model 'neuron' on data 'step'")
    if args.strategy or args.samples or args.loss_threshold is not None or args.target_accuracy is not None:
        raise UserError(
            "--strategy, --samples, --loss-threshold and --target-accuracy do not apply to --study neuron"
        )
    lrs = parse_list(args.lr, float, "--lr") if args.lr else [cfg.lr]
    batches = parse_list(args.batch_size, int, "--batch-size") if args.batch_size else [cfg.batch_size]
    if len(lrs) > 1 or len(batches) > 1:
        raise UserError("--study neuron takes one --lr and one --batch-size")
    if args.cross_check_steps < 1:
        raise UserError(f"--cross-check-steps must be at least 1, got {args.cross_check_steps}")
    base = cfg.model_dump(exclude={"out", "strategy", "workers", "steps"})
    results = run_neuron_study(
        args.out,
        workers=tuple(parse_list(args.workers or "2,4,8,16", int, "--workers")),
        lr=lrs[0],
        steps=args.steps or cfg.steps,
        batch_size=batches[0],
        seed=cfg.seed,
        period=cfg.strategy_options("weight-avg").period,
        cross_check_workers=(2, 4) if args.cross_check else (),
        cross_check_steps=args.cross_check_steps,
        base=base,
    )
    return print_results(results, Path(args.out))


def run_scaling(args: argparse.Namespace) -> int:
    """``parambox sweep --study scaling``."""
    from parambox.studies.scaling import print_summary, run_scaling_study

    base = base_config(args, "scaling-study")
    for flag, key, kind in (("--lr", "lr", float), ("--batch-size", "batch_size", int)):
        text = getattr(args, key)
        if text:
            values = parse_list(text, kind, flag)
            if len(values) > 1:
                raise UserError(f"--study scaling takes one {flag} (a grid is --study grid)")
            base[key] = values[0]
    if args.loss_threshold is not None:
        raise UserError("--loss-threshold applies to --study grid; the scaling study uses --target-accuracy")
    if args.target_accuracy is not None and not 0 < args.target_accuracy <= 1:
        raise UserError(f"--target-accuracy must be within (0, 1], got {args.target_accuracy}")
    workers = parse_list(args.workers or "1,2", int, "--workers")
    samples = args.steps * min(workers) * base.get("batch_size", 32) if args.steps else args.samples
    results = run_scaling_study(
        args.out,
        base,
        parse_list(args.strategy, str, "--strategy") if args.strategy else None,
        workers,
        samples,
        args.target_accuracy,
        args.run_timeout,
    )
    print_summary(results)
    print(f"results in {Path(args.out) / 'results.json'}")
    return 0 if all(r["status"] == "ok" for r in results["runs"]) else 1


QUICK_TTA = {"data": "digits", "steps": 200, "eval_every": 20}


def run_time_to_accuracy(args: argparse.Namespace) -> int:
    """``parambox sweep --study time-to-accuracy``."""
    from parambox.studies.accuracy import run_time_to_accuracy as study
    from parambox.studies.accuracy import table_markdown

    if args.emulate_nodes is not None or args.link_gbps is not None:
        raise UserError("--study time-to-accuracy builds its own cluster: use --gbps, not --link-gbps")
    if args.strategy or args.loss_threshold is not None:
        raise UserError("--study time-to-accuracy takes --setups (not --strategy/--loss-threshold)")
    base = base_config(args, "time-to-accuracy", QUICK_TTA if args.quick else None)  # the user's flags win
    for flag, key, kind in (
        ("--workers", "workers", int),
        ("--lr", "lr", float),
        ("--batch-size", "batch_size", int),
    ):
        text = getattr(args, key)
        if text:
            values = parse_list(text, kind, flag)
            if len(values) > 1:
                raise UserError(f"--study time-to-accuracy takes one {flag}")
            base[key] = values[0]
    if base.get("workers", 2) < 2:
        raise UserError("--study time-to-accuracy compares exchanges: --workers must be at least 2")
    if args.steps:
        base["steps"] = args.steps
    if args.target is not None and args.target_accuracy is not None:
        raise UserError("give one of --target METRIC=VALUE and --target-accuracy")
    target = args.target_accuracy if args.target_accuracy is not None else (0.8 if args.quick else 0.98)
    if not 0 < target <= 1:
        raise UserError(f"--target-accuracy must be within (0, 1], got {target}")
    if args.target is not None:
        from parambox.workload.targets import Target

        target = Target.parse(args.target)
    quick_setups = "allreduce,weight-avg" if args.quick else None
    setups = args.setups or quick_setups
    results = study(
        args.out,
        base,
        setups=parse_list(setups, str, "--setups") if setups else None,
        gbps=parse_gbps(args.gbps or ("1" if args.quick else "1,0.1")),
        seeds=parse_seeds(args.seeds or ("0" if args.quick else "0,1,2")),
        target=target,
        nodes=base.get("workers", 2),
        run_timeout_s=args.run_timeout,
    )
    print(table_markdown(results))
    print(f"results in {Path(args.out) / 'results.json'}")
    return 0


# -- helpers of the three studies ------------------------------------------------------------------


def parse_list(text: str, kind: type, flag: str) -> list:
    """``"16,32"`` -> ``[16, 32]``; positive numbers only, no repeats; UserError naming the flag."""
    try:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected a comma-separated list of {kind.__name__}") from None
    if not values:
        raise UserError(f"{flag}: empty list")
    if kind is not str and any(not (is_finite(v) and v > 0) for v in values):
        raise UserError(f"{flag} {text!r}: every value must be positive")
    if len(set(values)) != len(values):
        raise UserError(f"{flag} {text!r}: a value is repeated")
    return values


def parse_gbps(text: str) -> list[float | None]:
    """``"1,0.1"`` -> ``[1.0, 0.1]``; ``loopback`` -> None (the runs on this machine, no emulated cluster).

    >>> parse_gbps("loopback,0.1")
    [None, 0.1]
    """
    names = [v.strip() for v in text.split(",") if v.strip()]
    rates = [v for v in names if v != "loopback"]
    if len(names) - len(rates) > 1:
        raise UserError(f"--gbps {text!r}: a value is repeated")
    values = iter(parse_list(",".join(rates), float, "--gbps") if rates else [])
    return [None if v == "loopback" else next(values) for v in names] or parse_list("", float, "--gbps")


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``: non-negative integers, no repeats."""
    try:
        seeds = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--seeds {text!r}: expected a comma-separated list of integers") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds {text!r}: non-negative integers, none repeated")
    return seeds


def base_config(args: argparse.Namespace, default_preset: str, extra: dict | None = None) -> dict[str, Any]:
    """The preset (``--preset`` or the study's own; ``extra`` over it) with ``--model --data ...`` and ``--set``
    applied."""
    flags = {k: getattr(args, k) for k in ("model", "data", "data_path", "seed", "momentum")}
    cluster = {"nodes": args.emulate_nodes, "link_gbps": args.link_gbps}
    flags["cluster"] = {k: v for k, v in cluster.items() if v is not None} or None
    return merge(
        merge(
            merge(preset(args.preset or default_preset), extra or {}),
            {k: v for k, v in flags.items() if v is not None},
        ),
        parse_set(args.set),
    )
