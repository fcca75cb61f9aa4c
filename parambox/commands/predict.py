"""``parambox predict``: speedup, efficiency and n_peak per topology, as a table, JSON and a plot.

Defaults: global batch 1024 (so every n up to 1024 gets at least one sample: the strong-scaling curve is
defined on the whole grid), 10 Gbit/s links with 10 us latency, 4 servers / box shards, overlap 0, T_comp
measured here with 1 thread (the fastest of 5 passes) over the local batch sizes the grid needs (powers of two up to 256, linear above).

``--nodes N`` ranks parambox's setups for a cluster of N nodes (one worker each, or ``--workers-per-node W``)
at the given links (``--bandwidth-gbps``): every setup of ``--simulate`` (default all) simulated at n = N and
ranked by samples/s, on the model given (a zoo name or your own factory, with ``--data``):
``perfmodel/ranking.py``.

``--simulate allreduce,ps-sync`` adds curves from ``perfmodel/simulate.py`` (named ``sim:SETUP``): each
point a flow-level simulation of the setup's steps on n nodes with the same T_comp and network, where
the analytic model has one formula per topology (bucketed allreduce behind backward, contention
shared max-min fairly, ps-sync's gather at one link).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from parambox.errors import UserError
from parambox.perfmodel import measure
from parambox.perfmodel.compute import (
    ComputeProfile,
    batch_sizes_to_measure,
    parse_comp_table,
)
from parambox.perfmodel.output import plot_speedup, print_report
from parambox.perfmodel.ranking import rank_setups
from parambox.perfmodel.sample import Sample, build_measured_model
from parambox.perfmodel.scaling import DEFAULT_WORKER_COUNTS, ScalingCurve, local_batches, predict_curve
from parambox.perfmodel.simulate import PATTERNS, SIMULATED_MAX_NODES, simulate_curve
from parambox.perfmodel.topology import Network, parse_topologies
from parambox.workload import refs


def configure(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--model",
        default="alexnet",
        help="model whose size and step time to use: a zoo name or your factory, file.py:fn or module:fn "
        "(default alexnet)",
    )
    a(
        "--data",
        help="registered data set whose items the timed steps feed the model (shape, dtype: the text set's "
        "token ids); default: the one a zoo model is meant for (gpt: text), else --input-shape",
    )
    a("--data-path", type=Path, help="the data set's files (as parambox train --data-path)")
    a(
        "--input-shape",
        help="without --data: float samples of this shape, e.g. C,H,W (default 3,32,32: cifar10)",
    )
    a("--num-classes", type=int, help="without --data: the number of classes (default 10)")
    a("--parameters", type=int, help="override the parameter count (S = 4 bytes x this)")
    a("--topology", default="all", help="ring, tree, ps, ps-sharded, box: one, a comma list or all")
    a("--bandwidth-gbps", type=float, help="link bandwidth in Gbit/s (default 10)")
    a("--latency-us", type=float, help="per-message latency in microseconds (default 10)")
    a("--measure-bandwidth", action="store_true", help="measure bandwidth and latency: gloo on loopback")
    a("--servers", type=int, default=4, help="k servers for ps-sharded, k box shards (default 4)")
    a("--box-bandwidth-gbps", type=float, help="the box's aggregate bandwidth (default servers x bandwidth)")
    a("--overlap", type=float, default=0.0, help="fraction of T_comm hidden behind compute, 0..1 (default 0)")
    a("--global-batch", type=int, default=1024, help="global batch for strong scaling (default 1024)")
    a(
        "--scaling",
        choices=["strong", "weak", "both"],
        default="strong",
        help="strong: --global-batch cut over the workers; weak: --local-batch a worker (default strong)",
    )
    a("--local-batch", type=int, default=64, help="per-worker batch for weak scaling (default 64)")
    a("--comp-ms", type=float, help="give T_comp: milliseconds per sample (linear, no small-batch penalty)")
    a("--comp-table", help="give T_comp: BATCH:MS per step, e.g. 1:2.5,16:9,64:30 (log-log interpolated)")
    a("--threads", type=int, default=1, help="torch threads when measuring T_comp (default 1)")
    a("--repeats", type=int, default=5, help="timed passes over the batch sizes (fastest counts; default 5)")
    a("--max-measure-batch", type=int, default=256, help="largest batch to time; linear above (default 256)")
    a("--max-workers", type=int, default=1024, help="largest n of the grid 1, 2, 4, ... (default 1024)")
    a(
        "--simulate",
        help="also simulate these setups (comma list: allreduce, ps-sync, box-sync, downpour, diloco, ...; "
        "a flow-level event simulation of each step, n <= 256): curves named sim:SETUP",
    )
    a(
        "--nodes",
        type=int,
        metavar="N",
        help="rank the simulated setups (--simulate, default all) for N nodes by samples per second at n = N",
    )
    a(
        "--workers-per-node",
        type=int,
        default=1,
        metavar="W",
        help="with --nodes: W workers on each node (its GPUs), exchanging as the strategies do with "
        "several a node (box-sync's node sum, the node cache, hybrid's groups; default 1)",
    )
    a("--validate", action="store_true", help="measure 1 and 2 workers here and compare with ring")
    a("--validate-batch", type=int, help="global batch of the validation (default min(global batch, 64))")
    a("--emulate-nodes", type=int, help="--validate on 2 emulated nodes (network namespaces; needs root)")
    a("--link-gbps", type=float, help="the emulated nodes' link rate in Gbit/s (also the default bandwidth)")
    a("--json", action="store_true", help="print one JSON object on stdout and nothing else")
    a("--out", type=Path, help="write predict.json and predict.png into this directory")


def _check(args: argparse.Namespace) -> None:
    if args.comp_ms is not None and args.comp_table:
        raise UserError("give either --comp-ms or --comp-table, not both")
    if args.measure_bandwidth and (args.bandwidth_gbps is not None or args.latency_us is not None):
        raise UserError(
            "--measure-bandwidth measures bandwidth and latency: drop --bandwidth-gbps/--latency-us"
        )
    if args.emulate_nodes is not None or args.link_gbps is not None:
        if not args.validate or args.emulate_nodes != 2 or not (args.link_gbps or 0) > 0:
            raise UserError(
                "--emulate-nodes 2 --link-gbps G go with --validate (it measures 1 and 2 workers)"
            )
        if args.measure_bandwidth:
            raise UserError("--measure-bandwidth probes loopback; with --emulate-nodes the link's rate is BW")
    if not 0.0 <= args.overlap <= 1.0:
        raise UserError(f"--overlap must be within 0..1, got {args.overlap}")
    if args.nodes is not None and not 1 <= args.nodes <= SIMULATED_MAX_NODES:
        raise UserError(
            f"--nodes must be within 1..{SIMULATED_MAX_NODES} (the simulator's), got {args.nodes}"
        )
    if args.workers_per_node < 1 or (args.workers_per_node > 1 and args.nodes is None):
        raise UserError(f"--workers-per-node W (>= 1) goes with --nodes N, got {args.workers_per_node}")
    if args.workers_per_node > 1 and "ps-sync" in _simulated(args):
        raise UserError(
            "--simulate ps-sync is simulated with one worker a node only: drop it or --workers-per-node"
        )
    _simulated(args)  # names checked before anything is measured
    for name in ("global_batch", "local_batch", "threads", "repeats", "max_measure_batch", "max_workers"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"--input-shape {text!r}: expected integers like 3,32,32") from None
    if not shape or min(shape) < 1:
        raise UserError(f"--input-shape {text!r}: every dimension must be >= 1")
    return shape


def sample_of(args: argparse.Namespace) -> tuple[Sample, str | None]:
    """The kind of item the timed steps feed the model, and the data set it was read from (None: given)."""
    from parambox.data import load_dataset
    from parambox.models.registry import data_for

    data = args.data
    if data is None and not refs.is_reference(args.model) and args.input_shape is None:
        data = data_for(args.model)
    if data is None:
        if args.data_path is not None:
            raise UserError("--data-path goes with --data")
        return Sample(
            parse_shape(args.input_shape or "3,32,32"), 10 if args.num_classes is None else args.num_classes
        ), None
    if args.input_shape is not None or args.num_classes is not None:
        raise UserError(
            f"--data {data} gives the samples' shape and classes: drop --input-shape/--num-classes"
        )
    if refs.is_reference(data):
        raise UserError(
            f"--data {data}: predict reads a registered data set; for your own, give --input-shape and --num-classes"
        )
    return Sample.of_dataset(load_dataset(data, args.data_path, 0)), data


def _try_step(args: argparse.Namespace, build, sample: Sample, data: str | None) -> None:
    """One training step of the model on two items of ``sample``'s kind, or a ``UserError`` saying what
    the model was fed."""
    try:
        sample.loss(build(), sample.batch(2)).backward()
    except UserError:
        raise
    except Exception as e:
        fed = f"data {data}'s items" if data else f"float items of shape {sample.shape}"
        raise UserError(
            f"--model {args.model} on {fed} ({sample.dtype}, {sample.num_classes} classes) {refs.raised(e)}: "
            "give the data set it reads with --data, or --input-shape/--num-classes"
        ) from None


def _builder(args: argparse.Namespace, sample: Sample):
    return functools.partial(build_measured_model, args.model, sample)


def _network(args: argparse.Namespace, size_bytes: float) -> tuple[Network, str]:
    if args.measure_bandwidth:
        _say(args, "measuring loopback bandwidth and latency (gloo allreduce, 2 processes)")
        bw, lat = measure.measure_loopback(size_bytes, threads=args.threads)
        return Network(bw, lat, args.servers, _box(args)), "measured (gloo allreduce, 2 processes, loopback)"
    gbps = args.bandwidth_gbps if args.bandwidth_gbps is not None else (args.link_gbps or 10.0)
    lat = 10.0 if args.latency_us is None else args.latency_us
    return Network.from_gbps(gbps, lat, args.servers, args.box_bandwidth_gbps), "given"


def _box(args: argparse.Namespace) -> float | None:
    return None if args.box_bandwidth_gbps is None else args.box_bandwidth_gbps * 1e9 / 8


def _compute(
    args, build, sample: Sample, batches: dict[str, int], validate_batch: int | None
) -> ComputeProfile:
    if args.comp_ms is not None:
        return ComputeProfile.per_sample(args.comp_ms)
    if args.comp_table:
        return parse_comp_table(args.comp_table)
    needed = [
        b for scaling, batch in batches.items() for b in local_batches(batch, scaling == "weak", _grid(args))
    ]
    if validate_batch:
        needed += [validate_batch, validate_batch / 2]
    sizes = batch_sizes_to_measure(needed, args.max_measure_batch)
    _say(args, f"measuring T_comp of {args.model} at batch sizes {sizes} ({args.threads} thread(s))")
    if args.parameters:  # the model was not built for its size: fail here, not inside the worker
        build()
    return measure.measure_compute(args.model, sample, sizes, args.threads, args.repeats)


def _simulated(args: argparse.Namespace) -> list[str]:
    """The setups to simulate: --simulate's, or all of them (``all``) but the no-communication ceiling and
    torch's own DDP and PostLocalSGD (baselines, not setups of parambox's)."""
    if args.simulate == "all":
        return _every_setup(args)
    if not args.simulate:
        return []
    names = list(dict.fromkeys(t.strip() for t in args.simulate.split(",") if t.strip()))
    bad = [t for t in names if t not in PATTERNS]
    if bad or not names:
        raise UserError(f"--simulate {args.simulate!r}: choose from {', '.join(PATTERNS)}")
    shaped = [t for t in names if PATTERNS[t].low_rank]
    if shaped and args.parameters:
        raise UserError(
            f"--simulate {shaped[0]} sizes PowerSGD's messages from the model's parameter shapes, which "
            "--parameters overrides: drop --parameters"
        )
    return names


def _every_setup(args: argparse.Namespace) -> list[str]:
    """Every setup of parambox's (not bench cluster's references: the ceiling, torch's DDP and
    PostLocalSGD); not the low-rank ones where --parameters hides the shapes."""
    from parambox.bench.cluster import REFERENCES

    return [
        p
        for p in PATTERNS
        if p not in REFERENCES
        and not (args.parameters and PATTERNS[p].low_rank)
        and not (args.workers_per_node > 1 and PATTERNS[p].exchange == "ps")  # one worker a node only
    ]


def _grid(args: argparse.Namespace) -> list[int]:
    return [n for n in DEFAULT_WORKER_COUNTS if n <= args.max_workers] or [1]


def _say(args: argparse.Namespace, text: str) -> None:
    print(f"parambox predict: {text}", file=sys.stderr if args.json else sys.stdout, flush=True)


def run(args: argparse.Namespace) -> int:
    _check(args)
    sample, data = sample_of(args)
    topologies = parse_topologies(args.topology)
    build = _builder(args, sample)
    parameters = args.parameters or sum(p.numel() for p in build().parameters())
    if parameters < 1:
        raise UserError(f"--parameters must be >= 1, got {parameters}")
    size_bytes = 4.0 * parameters
    shapes = None if args.parameters else [tuple(p.shape) for p in build().parameters()]
    batches = {"strong": args.global_batch, "weak": args.local_batch}
    batches = {k: v for k, v in batches.items() if args.scaling in (k, "both")}
    validate_batch = (args.validate_batch or min(args.global_batch, 64)) if args.validate else None
    if validate_batch is not None and validate_batch < 2:
        raise UserError(f"--validate-batch must be >= 2 (two workers), got {validate_batch}")
    if validate_batch is not None or (args.comp_ms is None and not args.comp_table):
        _try_step(args, build, sample, data)  # here, in one line, not as a measuring process's traceback
    net, source = _network(args, size_bytes)
    compute = _compute(args, build, sample, batches, validate_batch)
    curves = {
        scaling: [
            predict_curve(t, compute, size_bytes, net, batch, scaling == "weak", args.overlap, _grid(args))
            for t in topologies
        ]
        for scaling, batch in batches.items()
    }
    for setup in _simulated(args):
        _say(args, f"simulating {setup} at n = 1..{min(_grid(args)[-1], SIMULATED_MAX_NODES)}")
        for scaling, batch in batches.items():
            curve = simulate_curve(
                setup, compute, size_bytes, net, batch, scaling == "weak", _grid(args), shapes=shapes
            )
            curve.topology = f"sim:{setup}"
            curves[scaling].append(curve)
    result = result_json(args, sample, data, parameters, net, source, compute, curves, batches)
    if args.nodes is not None:
        result["setups"] = _rank_setups(args, compute, size_bytes, net, batches, shapes)
    if validate_batch is not None:
        _say(args, f"validating: 1 and 2 processes x {args.threads} thread(s), global batch {validate_batch}")
        v = _validate(args, sample, validate_batch, compute, size_bytes)
        result["validation"] = v.as_json()
        result["validation_max_rel_error"] = v.max_rel_error
        result["validation_bandwidth_gbps"] = v.bandwidth * 8 / 1e9
    _emit(args, result, curves)
    return 0


def _rank_setups(
    args, compute: ComputeProfile, size_bytes: float, net: Network, batches: dict, shapes: list | None
) -> dict:
    """--nodes N: every setup of --simulate (default all) simulated at n = N alone, ranked."""
    scaling = "strong" if "strong" in batches else "weak"
    setups = _simulated(args) or _every_setup(args)
    w = args.workers_per_node
    each = f", {w} workers each" if w > 1 else ""
    _say(args, f"ranking {len(setups)} setups on {args.nodes} nodes{each} (simulated)")
    curves = []
    for setup in setups:
        c = simulate_curve(
            setup,
            compute,
            size_bytes,
            net,
            batches[scaling],
            scaling == "weak",
            [args.nodes],
            shapes=shapes,
            workers_per_node=w,
        )
        c.topology = f"sim:{setup}"
        curves.append(c)
    rows = rank_setups(curves, args.nodes, batches[scaling], scaling == "weak", w)
    return {"nodes": args.nodes, "workers_per_node": w, "scaling": scaling, "ranking": rows}


def _validate(
    args, sample: Sample, batch: int, compute: ComputeProfile, size_bytes: float
) -> measure.Validation:
    """``measure.validate`` on loopback, or on an emulated cluster of 2 nodes that lives as long as it."""
    run = functools.partial(
        measure.validate,
        args.model,
        sample,
        batch,
        compute,
        size_bytes,
        args.overlap,
        args.threads,
    )
    if args.emulate_nodes is None:
        return run()
    from parambox.runtime.cluster import EmulatedCluster

    _say(args, f"on 2 emulated nodes, {args.link_gbps:g} Gbit/s links")
    with EmulatedCluster(2, args.link_gbps) as cluster:
        return run(cluster=cluster)


def result_json(
    args, sample: Sample, data, parameters, net: Network, source, compute, curves, batches
) -> dict:
    """The JSON object ``--json`` prints: inputs, per-scaling per-topology curves, n_peak per topology."""
    result = {
        "model": args.model,
        "data": data,
        "input_shape": list(sample.shape),
        "input_dtype": sample.dtype,
        "num_classes": sample.num_classes,
        "parameters": parameters,
        "message_bytes": 4 * parameters,
        "network": {
            "bandwidth_gbps": net.bandwidth * 8 / 1e9,
            "latency_us": net.latency * 1e6,
            "servers": net.servers,
            "box_bandwidth_gbps": net.box_bw * 8 / 1e9,
            "source": source,
        },
        "overlap": args.overlap,
        "compute": compute.as_json(),
        "n": _grid(args),
    }
    for scaling, cs in curves.items():
        result[scaling] = {"batch": batches[scaling], "topologies": {c.topology: c.as_json() for c in cs}}
    main = curves["strong" if "strong" in curves else "weak"]
    result["n_peak"] = {c.topology: c.n_peak for c in main}
    result["still_growing"] = {c.topology: c.still_growing for c in main}
    result["n_efficient"] = {c.topology: c.n_efficient for c in main}
    return result


def _emit(args, result: dict, curves: dict[str, list[ScalingCurve]]) -> None:
    text = json.dumps(result, indent=2, allow_nan=False)
    if args.out:
        try:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "predict.json").write_text(text + "\n")
        except OSError as e:
            raise UserError(f"--out {args.out}: cannot write ({e.strerror})") from None
        title = f"{args.model}: S = {result['message_bytes'] / 1e6:.1f} MB, {_net_label(result)}"
        batches = {scaling: result[scaling]["batch"] for scaling in curves}
        plot_speedup(curves, batches, title, args.out / "predict.png")
    if args.json:
        print(text)
    else:
        print_report(result, curves)
        if args.out:
            print(f"wrote {args.out / 'predict.json'} and {args.out / 'predict.png'}")


def _net_label(result: dict) -> str:
    net = result["network"]
    lat = net["latency_us"]
    return f"{net['bandwidth_gbps']:.3g} Gbit/s, {lat:.3g} us latency"
