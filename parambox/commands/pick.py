"""``parambox pick``: which strategy reaches --target first with --workers N, predicted from
short probes of every applicable strategy on this launcher (or emulated cluster), ranked with reasons.

The target is a test metric and its value: ``--target perplexity=8`` (lower is better: the text set's
perplexity and bits_per_byte, any loss), ``--target accuracy=0.95`` or ``--target-accuracy 0.95`` (higher is
better), ``--target wer<=0.2`` for a metric of your own that falls.
A reference run (allreduce) trains until its test metric reaches the target; every other strategy
of the registry that accepts N workers is probed for a few dozen steps (its presets' options), and each
strategy whose exchange takes a compression once more per encoding of --compression (default none,int8:
allreduce, weight-avg, synchronous easgd and diloco; across nodes the asynchronous forms' pushes too;
rows such as "allreduce compression=int8"). Each
prediction is samples to target / samples per second: the samples from how fast the probe's test loss
fell against the reference's (convergence per sample, with a band), the rate from the probe's time
per step (compute and communication). The top --confirm K predictions (default 5) are then trained
to the target and put first in the order they reached it. --validate trains every ranked candidate
to the target (--validate K: the top K and K others at random) and scores the predictions: Kendall's
tau between predicted and measured order, the top pick's hit, the median prediction error per
strategy and family; each validated setup runs --validate-runs R times (default 3), its median the
measurement. With more workers than this machine's cores, the probes run as many workers as there
are cores and the model scales their communication to N; the race is then left out ("race" in
pick.json says so) and --validate refused: both would train N. --seeds N repeats it all with N
seeds. The runs live in --out (reference/, probes/, confirm/, validation/; seed-K/ each with several
seeds) beside pick.json.
pick.json holds the ranking so far after every run ("partial": true, the candidates not yet probed
under "unmeasured"), so a pick stopped by Ctrl-C has an answer. --budget 10m bounds the whole pick: the
reference first, then one probe per strategy, then their other options, then the race and validation;
when the budget runs out, the run under way is stopped (its candidate unmeasured), and pick exits 0 with
the ranking of what it measured.

    parambox pick --workers 2 --target-accuracy 0.95 --validate all --seeds 3 --json
    parambox pick --workers 2 --target-accuracy 0.95 --emulate-nodes 2 --link-gbps 0.1 --validate 3
    parambox pick --workers 2 --target-accuracy 0.9 --target-metric acc --metrics mymod:metrics
    parambox pick --workers 2 --target perplexity=20 --model gpt --data text --steps 400
    parambox pick --workers 2 --target perplexity=20 --model gpt --data text --budget 10m
    parambox pick --workers 8 --target-accuracy 0.95 --compression none,int8,int4,topk,powersgd
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from parambox.errors import UserError

RUN_FLAGS = ("model", "data", "loss", "metrics", "collate", "data_path", "batch_size", "lr", "optimizer")
RUN_FLAGS += ("momentum", "steps", "seed", "threads", "box")
# --quick's sizes; the rest are PickSettings' defaults.
QUICK = {"probe_fraction": 1.0, "eval_every": 2, "confirm": 2, "validate_runs": 1}
BARE = "bare"  # --validate with no value: all (under --quick, the top pick and one other)


def configure(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    a = p.add_argument
    a("--workers", type=int, required=True, help="the worker count to choose a strategy for")
    a(
        "--target",
        metavar="METRIC=VALUE",
        help="the test metric to reach: perplexity=8, bits_per_byte=2.5, accuracy=0.95 (its direction known), "
        "or METRIC<=VALUE / METRIC>=VALUE for a metric of your own",
    )
    a("--target-accuracy", type=float, help="test accuracy to reach, within (0, 1] (--target accuracy=VALUE)")
    a("--strategies", help="comma list: consider only these (default: every registered strategy)")
    a(
        "--validate",
        nargs="?",
        const=BARE,
        metavar="all|K",
        help="train every ranked candidate and allreduce to the target (all, the default), or the top K "
        "and K others at random",
    )
    a(
        "--confirm",
        type=int,
        metavar="K",
        help="train the top K predictions to the target and rank them by their measured time first "
        "(default 5; 0: the prediction alone)",
    )
    a(
        "--validate-runs",
        type=int,
        metavar="R",
        help="runs to the target per validated setup; its measured time is their median (default 3; "
        "--quick: 1)",
    )
    a(
        "--compression",
        metavar="LIST",
        help="comma list of the encodings to try on the exchanges that take one (allreduce, weight-avg, "
        "synchronous easgd and diloco; across nodes the asynchronous forms' pushes too), each a candidate of "
        "its own: none (float32), bf16, int8, int4, int2, "
        "sign, topk, powersgd (default none,int8; none: float32 only)",
    )
    a("--seeds", type=int, default=1, help="repeat probes and validations with N seeds (default 1)")
    a(
        "--budget",
        metavar="DURATION",
        help="the whole pick's time limit (10m, 90s, 1h30m): it ends then with the ranking of what it "
        "measured, the rest listed as unmeasured; pick.json holds the ranking so far at every moment",
    )
    a(
        "--target-metric",
        help="the evaluations' metric --target-accuracy applies to (test_NAME; default accuracy)",
    )
    a("--json", action="store_true", help="print one JSON object on stdout (progress on stderr)")
    a("--out", type=Path, help="directory for pick.json and the runs (default picks/pick-TIME)")
    a(
        "--quick",
        action="store_true",
        help="for tests: evaluations every 2 steps, one run per validated setup; a bare --validate "
        "validates the top pick and one other",
    )
    a("--probe-steps", type=int, help="steps of each probe (default: the reference's to the target)")
    a("--probe-fraction", type=float, help="a probe's steps as a fraction of the reference's (default 1)")
    a("--eval-every", type=int, help="steps between evaluations of every run (default 4)")
    a("--run-timeout", type=float, default=900.0, help="seconds a run to the target may take (default 900)")
    a("--probe-timeout", type=float, default=180.0, help="seconds a probe may take (default 180)")
    a("--emulate-nodes", type=int, metavar="N", help="every run on N emulated nodes (needs root)")
    a("--link-gbps", type=float, metavar="G", help="the emulated nodes' links in Gbit/s")
    a("--preset", default="digits-allreduce", help="the workload's base config (default digits-allreduce)")
    for field in RUN_FLAGS:
        a(f"--{field.replace('_', '-')}", dest=field, default=None, help="as for parambox train")
    a("--set", action="append", default=[], metavar="KEY=VALUE", help="override any run field, as for train")


def settings_from_args(args: argparse.Namespace):
    from parambox.config import build_config, merge, parse_set
    from parambox.presets import preset
    from parambox.studies.pick import PickSettings
    from parambox.studies.pick.budget import parse_duration
    from parambox.studies.pick.candidates import DEFAULT_COMPRESSIONS, parse_compressions

    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    goal = target_of(args)
    if args.seeds < 1:
        raise UserError(f"--seeds must be >= 1, got {args.seeds}")
    budget_s = None if args.budget is None else parse_duration(args.budget)
    compressions = DEFAULT_COMPRESSIONS if args.compression is None else parse_compressions(args.compression)
    if budget_s is not None and args.seeds > 1:
        raise UserError("--budget bounds one seed's pick: drop --seeds or --budget")
    num_validated = _num_validated(args.validate, args.quick)
    if args.confirm is not None and args.confirm < 0:
        raise UserError(f"--confirm must be >= 0, got {args.confirm}")
    sizes = {"probe_fraction": args.probe_fraction, "eval_every": args.eval_every}
    for key, value in {**sizes, "probe_steps": args.probe_steps}.items():
        if value is not None and not value > 0:
            raise UserError(f"--{key.replace('_', '-')} must be > 0, got {value}")
    for flag, value in (("--run-timeout", args.run_timeout), ("--probe-timeout", args.probe_timeout)):
        if not value > 0:
            raise UserError(f"{flag} must be > 0, got {value}")
    flags = {f: getattr(args, f) for f in RUN_FLAGS if getattr(args, f) is not None}
    cluster = {"nodes": args.emulate_nodes, "link_gbps": args.link_gbps}
    flags["cluster"] = {k: v for k, v in cluster.items() if v is not None}
    overrides = parse_set(args.set)
    fixed = {f for f in flags if f != "cluster"} | {
        k for k in overrides if k not in ("options", "box", "cluster")
    }
    base = merge(merge(preset(args.preset), flags), overrides)
    base = build_config(base).model_dump(exclude_defaults=False)  # flags' types and ranges, once
    if args.validate_runs is not None and args.validate_runs < 1:
        raise UserError(f"--validate-runs must be >= 1, got {args.validate_runs}")
    sizes["confirm"], sizes["validate_runs"] = args.confirm, args.validate_runs
    given = {k: v for k, v in sizes.items() if v is not None}
    sizes = {**(QUICK if args.quick else {}), **given}  # unset: PickSettings' defaults
    eval_every = sizes.get("eval_every", PickSettings.eval_every)
    if args.probe_steps is not None and eval_every > args.probe_steps // 2:
        raise UserError("--eval-every must leave at least two evaluations in a probe (<= --probe-steps / 2)")
    only = [x.strip() for x in args.strategies.split(",") if x.strip()] if args.strategies else None
    if only:
        from parambox.studies.pick.candidates import registry_candidates

        registry_candidates(args.workers, only)  # unknown names: one line, before anything is written
    out = args.out or Path(f"picks/pick-{time.strftime('%Y%m%d-%H%M%S')}")
    return PickSettings(
        workers=args.workers,
        target=goal.value,
        base=base,
        out=out,
        strategies=only,
        validate=args.validate is not None,
        run_timeout_s=args.run_timeout,
        probe_timeout_s=args.probe_timeout,
        fixed=fixed,
        probe_steps=args.probe_steps,
        num_validated=num_validated,
        seeds=args.seeds,
        target_metric=goal.metric,
        lower_is_better=goal.lower_is_better,
        budget_s=budget_s,
        compressions=tuple(compressions),
        **sizes,
    )


def target_of(args: argparse.Namespace):
    """The target of --target METRIC=VALUE, or of --target-accuracy (with --target-metric's name)."""
    from parambox.workload.targets import Target

    if (args.target is None) == (args.target_accuracy is None):
        raise UserError("give the target to reach: --target METRIC=VALUE (or --target-accuracy VALUE)")
    if args.target is not None:
        if args.target_metric is not None:
            raise UserError("--target names its metric: drop --target-metric")
        return Target.parse(args.target)
    if not 0 < args.target_accuracy <= 1:
        raise UserError(f"--target-accuracy must be within (0, 1], got {args.target_accuracy}")
    metric = args.target_metric or "accuracy"
    if not metric.replace("_", "").isalnum():
        raise UserError(f"--target-metric must be a metric's name (letters, digits, _), got {metric!r}")
    return Target(metric.removeprefix("test_"), args.target_accuracy)


def _num_validated(value: str | None, quick: bool) -> int | None:
    """--validate's K (None: every candidate); a bare --validate under --quick is K = 1."""
    if value in (None, "all", BARE):
        return 1 if quick and value == BARE else None
    try:
        k = int(value)
    except ValueError:
        raise UserError(f"--validate takes all or a count K >= 1, got {value!r}") from None
    if k < 1:
        raise UserError(f"--validate takes all or a count K >= 1, got {value!r}")
    return k


def run(args: argparse.Namespace) -> int:
    from parambox.config import build_config
    from parambox.run.plan import check_references
    from parambox.studies.pick import run_pick_seeds
    from parambox.studies.pick.budget import write_json

    s = settings_from_args(args)
    cfg = build_config(s.base)
    if cfg.cluster.enabled:
        from parambox.runtime.cluster import check_environment

        check_environment()  # not root, or no ip/tc: one line before anything runs
    check_references(cfg)  # a --model/--data/--loss REF that does not import: one line, now
    s.base = cfg.model_dump()  # references made absolute: the runs start in their own directories
    try:
        s.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {s.out}: cannot create ({e.strerror})") from None

    def say(text: str) -> None:
        print(f"parambox pick: {text}", file=sys.stderr if args.json else sys.stdout, flush=True)

    try:
        result = run_pick_seeds(s, say)
    except KeyboardInterrupt:
        so_far = _ranked_so_far(s.out / "pick.json")
        if so_far:
            say(f"interrupted: the ranking of the {so_far} measured so far is in {s.out / 'pick.json'}")
        raise
    write_json(s.out / "pick.json", result)
    if args.json:
        print(json.dumps(result, indent=2, allow_nan=False))
    else:
        print_result(result)
        print(f"details: {s.out / 'pick.json'}")
    return 0


def _ranked_so_far(path: Path) -> int:
    """How many candidates the partial ``pick.json`` at ``path`` ranks (0: none, or no file)."""
    try:
        return len(json.loads(path.read_text()).get("ranking", []))
    except (OSError, ValueError):
        return 0


def _target_text(result: dict) -> str:
    t = result.get("target") or {"metric": "accuracy", "value": result["target_accuracy"]}
    return f"{t['metric']} {'<=' if t.get('lower_is_better') else '>='} {t['value']:g}"


def print_result(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    def sec(x) -> str:
        return "-" if x is None else f"{x:.1f}"

    table = Table(
        title=f"time to test {_target_text(result)} with {result['workers']} workers "
        f"(probed with {result['probe_workers']})"
    )
    # A setup's options (compression=int8) wrap onto lines of their own, never cut off.
    widest = max((len(w) for r in result["ranking"] for w in r["setup"].split()), default=5)
    for h in ("#", "setup", "predicted s", "band s", "x ref. samples", "ms/step", "comm ms", "confirmed s"):
        setup = h == "setup"
        table.add_column(
            h, overflow="fold" if setup else "ellipsis", min_width=min(widest, 32) if setup else None
        )
    for r in result["ranking"]:
        conv = r["convergence_vs_reference"]
        table.add_row(
            str(r["rank"]),
            r["setup"],
            sec(r["predicted_s"]),
            f"{sec(r['predicted_low_s'])}-{sec(r['predicted_high_s'])}",
            "-" if not conv else f"{1 / conv:.2f}",
            f"{r['step_ms']:.1f}",
            f"{r['comm_ms']:.1f}",
            sec(r.get("confirmed_s")) if r.get("confirm_run_dir") or r.get("confirmed_s") else "",
        )
    console = Console()
    if not console.is_terminal:  # a log or a pipe: no screen to fit, the table at its own width (no cut)
        console = Console(width=120)
    console.print(table)
    for r in result["ranking"]:
        print(f"{r['rank']}. {r['setup']}: {r['reason']}")
    for x in result["excluded"]:
        print(f"excluded: {x['setup']}: {x['reason']}")
    budget = result.get("budget") or {}
    if budget.get("spent"):
        print(f"the budget of {budget['seconds']:g} s ran out in {budget['spent_in']}: a partial ranking")
    for x in result.get("unmeasured", []):
        print(f"not measured: {x['setup']}")
    if result.get("race"):
        print(f"note: {result['race']}")
    if not result["confident"]:
        print("note: the top pick's band overlaps the runner-up's: the two are too close to call from probes")
    v = result.get("validation")
    if v:
        for label, t in v.get("measured_s", {}).items():
            print(f"measured: {label}: {sec(t)} s" + ("" if t is not None else " (did not reach the target)"))
        for key in (
            "top_pick_vs_best_measured",
            "predicted_top_pick_vs_best_measured",
            "top_pick_vs_allreduce",
            "rank_correlation",
            "top1_hit_rate",
        ):
            if key in v:
                print(f"{key}: {'-' if v[key] is None else format(v[key], '.2f')}")
        if v.get("measurement_spread") is not None:
            print(
                f"measured: each the median of {v['validate_runs']} runs, which spread by "
                f"{v['measurement_spread']:.0%} of it (median over setups)"
            )
        for family, err in v.get("prediction_error_by_family", {}).items():
            print(f"median prediction error, {family}: {'-' if err is None else format(err, '.0%')}")
