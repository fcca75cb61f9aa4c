"""``parambox bench sync | box | async | local | cluster | optimizer | api | chaos | defaults | sandblaster``: benchmarks that print
ratios measured side by side.

Each prints a JSON object with ``--json`` (and nothing else on stdout), or a table otherwise.
Run one benchmark at a time: they share the machine's cores.
"""

from __future__ import annotations

import argparse
import inspect
import json

from parambox.bench import BENCHES, benchmark
from parambox.errors import UserError


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "which", choices=sorted(BENCHES), help="; ".join(f"{k}: {v[2]}" for k, v in BENCHES.items())
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--rounds", type=int, default=None, help="alternating rounds (sync, async, sandblaster, chaos)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per setup and round (sync, async, sandblaster, cluster); steps per run (chaos, "
        "defaults: instead of the default run's)",
    )
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    workload = p.add_argument_group("the workload (bench cluster, bench defaults)")
    workload.add_argument(
        "--model",
        default=None,
        help="zoo model (cluster default: the benchmark CNN; gpt, gpt-6m, gpt-25m: the transformer on text)",
    )
    workload.add_argument(
        "--data", default=None, help="registered data set (default: the model's own, else random images)"
    )
    workload.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="bench cluster: samples per worker and step (default 64; 8 windows of 128 bytes for gpt)",
    )
    cluster = p.add_argument_group("bench cluster (an emulated cluster: needs root)")
    cluster.add_argument("--nodes", type=int, default=None, help="emulated nodes (default 2)")
    cluster.add_argument("--gbps", default=None, help="link rates in Gbit/s, comma list (default 1,0.1)")
    cluster.add_argument(
        "--workers-per-node", type=int, default=None, help="workers on each emulated node (default 1)"
    )
    cluster.add_argument(
        "--setups", default=None, help="comma list of setups (cluster, sync, chaos; default: all)"
    )
    chaos = p.add_argument_group("bench chaos")
    chaos.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="the runs' --timeout in seconds (default 3): a stopped rank's stall costs about this",
    )
    chaos.add_argument(
        "--faults",
        default=None,
        help="the fault loop's kinds in turn, a comma list of kill, stop (default both)",
    )
    chaos.add_argument(
        "--hit-ranks",
        default=None,
        help="the ranks the fault loop may hit, a comma list (default any, 0 and easgd-rma's memory rank 3 too)",
    )
    defaults = p.add_argument_group("bench defaults (each strategy's default run over seeds)")
    defaults.add_argument("--seeds", default=None, help="seeds, a range or a list: 0-9 (default), 0,3,5")
    defaults.add_argument("--strategies", default=None, help="comma list of strategies (default: all)")
    defaults.add_argument(
        "--compression",
        default=None,
        help="comma list of encodings (none, bf16, int8, int4, int2, sign, topk, powersgd): each strategy "
        "whose exchange takes one, once per encoding it accepts (default strategies: those)",
    )
    link = p.add_argument_group("bench box across an emulated link (needs root)")
    link.add_argument("--emulate-nodes", type=int, default=None, help="bench box: 2 nodes, one link each")
    link.add_argument("--link-gbps", type=float, default=None, help="bench box: the link rate (default 1)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short form for tests (cluster, chaos, defaults, sandblaster): checks, no figures",
    )


def run(args: argparse.Namespace) -> int:
    bench = benchmark(args.which)
    kwargs = {k: v for k, v in (("rounds", args.rounds), ("steps", args.steps)) if v is not None}
    if any(v < 1 for v in kwargs.values()):
        raise UserError("--rounds and --steps must be at least 1")
    kwargs.update(_cluster_options(args))
    kwargs.update(_workload_options(args))
    kwargs.update(_defaults_options(args))
    kwargs.update(_link_options(args))
    if args.timeout is not None:
        if args.which != "chaos":
            raise UserError("--timeout applies to bench chaos only")
        if args.timeout <= 0:
            raise UserError(f"--timeout must be positive, got {args.timeout}")
        kwargs["timeout"] = args.timeout
    kwargs.update(_chaos_options(args))
    if args.quick:
        if "quick" not in inspect.signature(bench).parameters:
            raise UserError(f"bench {args.which} has no --quick form")
        kwargs["quick"] = True
    result = bench(**kwargs)
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    else:
        _print_table(args.which, result)
    return 0


def _cluster_options(args: argparse.Namespace) -> dict:
    names = ("nodes", "gbps", "setups", "workers_per_node")
    given = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.which in ("sync", "chaos") and set(given) == {"setups"}:
        pass  # bench sync and chaos pick setups too
    elif given and args.which != "cluster":
        raise UserError(f"--{'/--'.join(given)} apply to bench cluster only")
    if "gbps" in given:
        try:
            given["gbps"] = tuple(float(g) for g in given["gbps"].split(","))
        except ValueError:
            raise UserError(f"--gbps {args.gbps!r}: expected numbers like 1,0.1") from None
    if "setups" in given:
        given["setups"] = [s.strip() for s in given["setups"].split(",") if s.strip()]
    return given


def _workload_options(args: argparse.Namespace) -> dict:
    given = {k: getattr(args, k) for k in ("model", "data", "batch_size") if getattr(args, k) is not None}
    if given and args.which not in ("cluster", "defaults"):
        raise UserError(
            f"--{'/--'.join(k.replace('_', '-') for k in given)} apply to bench cluster and defaults only"
        )
    if "batch_size" in given and args.which != "cluster":
        raise UserError("--batch-size applies to bench cluster only")
    if given.get("batch_size", 1) < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    return given


def _defaults_options(args: argparse.Namespace) -> dict:
    given = {
        k: getattr(args, k) for k in ("seeds", "strategies", "compression") if getattr(args, k) is not None
    }
    if given and args.which != "defaults":
        raise UserError(
            f"--{'/--'.join(given)} {'applies' if len(given) == 1 else 'apply'} to bench defaults only"
        )
    if "seeds" in given:
        from parambox.bench.defaults import parse_seeds

        given["seeds"] = parse_seeds(given["seeds"])
    if "strategies" in given:
        given["strategies"] = [s.strip() for s in given["strategies"].split(",") if s.strip()]
    if "compression" in given:
        from parambox.studies.pick.candidates import parse_compressions

        given["compressions"] = parse_compressions(given.pop("compression"))
    return given


def _chaos_options(args: argparse.Namespace) -> dict:
    given = {k: getattr(args, k) for k in ("faults", "hit_ranks") if getattr(args, k) is not None}
    if given and args.which != "chaos":
        flags = "/".join(f"--{k.replace('_', '-')}" for k in given)
        raise UserError(f"{flags} {'applies' if len(given) == 1 else 'apply'} to bench chaos only")
    out: dict = {}
    if "faults" in given:
        out["kinds"] = [k.strip() for k in given["faults"].split(",") if k.strip()]
    if "hit_ranks" in given:
        try:
            out["hit_ranks"] = [int(r) for r in given["hit_ranks"].split(",") if r.strip()]
        except ValueError:
            raise UserError(
                f"--hit-ranks {given['hit_ranks']!r}: a comma list of ranks, like 0 or 0,2"
            ) from None
    return out


def _link_options(args: argparse.Namespace) -> dict:
    given = {k: getattr(args, k) for k in ("emulate_nodes", "link_gbps") if getattr(args, k) is not None}
    if given and args.which != "box":
        raise UserError("--emulate-nodes and --link-gbps apply to bench box only")
    if "link_gbps" in given and "emulate_nodes" not in given:
        raise UserError("--link-gbps needs --emulate-nodes")
    return given


def _print_table(name: str, result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"parambox bench {name}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    if name == "defaults":
        return _print_defaults(result)
    for key, value in _flatten(result):
        table.add_row(key, f"{value:,.3f}" if isinstance(value, float) else str(value))
    Console().print(table)


def _flatten(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        elif not isinstance(v, list):
            yield f"{prefix}{k}", v


def _print_defaults(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    metric = result.get("metric", "accuracy")
    title = f"parambox bench defaults (test {metric}; target {result['target']}"
    on = f" {result['model']} on {result['data']}" if "model" in result else ""
    table = Table(title=title + (", lower is better" if result.get("lower_is_better") else "") + ")" + on)
    for col in ("strategy", "min", "max", "below target (seeds)"):
        table.add_column(col)
    for name, r in result["strategies"].items():
        low = ", ".join(str(s) for s in r["below_target"]) or "-"
        table.add_row(name, *(f"{r[k]:.3f}" if r[k] is not None else "failed" for k in ("min", "max")), low)
    Console().print(table)
