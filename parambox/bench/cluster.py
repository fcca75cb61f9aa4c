"""``parambox bench cluster``: every strategy against torch DDP where communication costs, on an emulated
cluster (``parambox.runtime.cluster``) whose links are rate-limited to each of ``--gbps``.

One worker per node (``--workers-per-node``: more, consecutive ranks per node) x 1 thread trains the
~1M-parameter benchmark CNN of ``bench sync`` (batch 64 per worker, SGD lr 0.01 momentum 0.9) on
fixed random batches, or a zoo model of ``--model`` on fixed batches of ``--data`` (a ``Workbench``:
``--model gpt-25m`` trains the 25M-parameter transformer on ``text``, 8 windows of 128 bytes a
worker; the JSON names the model, its parameters and MB). For each bandwidth, one cluster is built
and one set of worker processes (under mpiexec inside it, since the box spans nodes; across nodes
the rma box serves pushes at its ranks, ``box/server.py``) runs every setup of ``SETUPS`` side by
side: each round, every setup runs the same number of timed steps between two barriers, the order
rotating each round; ratios are medians of the per-round paired ratios. Around each setup's timed
steps every worker reads its node's link counters (L2 bytes sent + received over ``pbnet``), so the
JSON says what each strategy's communication costs in bytes per step, next to the seconds per step
the parambox strategies time per phase.

``ddp_vs_loopback``: DDP's speed on the links against its speed on loopback (the same two processes
in one namespace, a separate run of ``ddp`` and ``ceiling``, before the clusters). Both runs hold the
ceiling, the same processes never communicating, so the figure is (DDP / ceiling on the links) /
(DDP / ceiling on loopback): each factor paired within its run, the drift of a shared machine between
the runs cancelled by the ceiling. ``ddp_vs_loopback_unpaired`` is the plain ratio of the medians.

A setup is one entry of ``SETUPS``: a later strategy is one line (``strategy_setup("diloco", ...)``),
a baseline from outside parambox one function returning ``(step, close)`` (``Setup(what, make=...)``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parambox.bench.rounds import paired_ratio, run_rounds
from parambox.bench.workbench import Workbench
from parambox.bench.workers import close_setups, exit_worker, spawn_workers
from parambox.runtime.heap import keep_freed_memory

LR, MOMENTUM = 0.01, 0.9
# (world, total steps, workbench) -> (step, close)
StepperFactory = Callable[[Any, int, Workbench], tuple[Callable, Callable]]


@dataclass(frozen=True)
class Setup:
    """One contender: a parambox strategy (``strategy``, its ``options``, the ``box`` backend), or a
    baseline from outside parambox built by ``make``. A strategy setup is also a ``parambox train``
    config (``train_config``), so a time-to-accuracy study can run the same contenders."""

    what: str
    strategy: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    box: str = "shm"
    make: StepperFactory | None = None

    @property
    def needs_mpi(self) -> bool:
        return self.box == "rma"  # the box spans nodes: MPI windows

    def train_config(self) -> dict[str, Any]:
        """The RunConfig fields of this setup (``build_config(base, setup.train_config())``)."""
        if self.strategy is None:
            raise ValueError(f"{self.what} is not a parambox strategy")
        return {
            "strategy": self.strategy,
            "options": {self.strategy: dict(self.options)},
            "box": {"backend": self.box},
        }

    def build(self, world, steps: int, bench: Workbench | None = None) -> tuple[Callable, Callable]:
        """(step, close) in this process: the baseline's own, or the strategy built as ``train`` builds it."""
        bench = bench or Workbench()
        if self.make is not None:
            return self.make(world, steps, bench)
        from parambox.box import BoxConfig
        from parambox.strategies import Context, build_strategy
        from parambox.workload.losses import default_loss

        # No memory rank: one worker per node trains in every setup (an asynchronous strategy would
        # otherwise give the last node's rank to holding the box).
        box = BoxConfig(backend=self.box, **({"memory_ranks": 0} if self.box == "rma" else {}))
        ctx = Context(world, bench.build(), _make_sgd, default_loss, steps, 300.0, box=box)
        strategy = build_strategy(self.strategy, ctx, dict(self.options))
        return strategy.step, strategy.close


def _make_sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _ddp(world, steps: int, bench: Workbench):
    """torch DDP (gloo): the reference every synchronous setup is held against."""
    from torch.nn.parallel import DistributedDataParallel

    return _plain(world, steps, bench, wrap=DistributedDataParallel)


def _plain(world, steps: int, bench: Workbench, wrap: Callable = lambda m: m):
    """The same model and optimizer, never communicating (``wrap``: DDP's model around it)."""
    model = bench.build()
    opt = _make_sgd(model.parameters())
    forward = wrap(model)

    def step(batch, i):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(forward(x), y).backward()
        opt.step()

    return step, lambda: None


def _post_local_sgd(world, steps: int, bench: Workbench):
    from parambox.bench.peers import post_local_sgd_stepper

    return post_local_sgd_stepper(bench.build(), _make_sgd, period=4)


def strategy_setup(name: str, box: str = "shm", what: str = "", **options: Any) -> Setup:
    """Strategy ``name`` with these options over this box backend."""
    text = ", ".join(f"{k} {v}" for k, v in options.items())
    return Setup(what or f"parambox {name}" + (f" ({text})" if text else ""), name, options, box)


SETUPS: dict[str, Setup] = {
    "ddp": Setup("torch DistributedDataParallel (gloo)", make=_ddp),
    "allreduce": strategy_setup("allreduce"),
    "allreduce-powersgd": strategy_setup(
        "allreduce",
        what="parambox allreduce, its gradients PowerSGD rank 4 (error feedback)",
        compression="powersgd",
    ),
    "allreduce-topk": strategy_setup(
        "allreduce",
        what="parambox allreduce, the top 1 % of its gradients' entries a step (error feedback)",
        compression="topk",
    ),
    "box-sync": strategy_setup("box-sync", box="rma", what="parambox box-sync over the rma box"),
    "weight-avg": strategy_setup("weight-avg", period=4),
    "easgd-tau4": strategy_setup("easgd", box="rma", tau=4),
    "easgd-tau16": strategy_setup("easgd", box="rma", tau=16),
    "easgd-tau4-int8": strategy_setup(
        "easgd",
        box="rma",
        what="parambox easgd (tau 4), its elastic pushes int8 with error feedback (the memory server decodes them)",
        tau=4,
        compression="int8",
    ),
    "eamsgd-tau16": strategy_setup("eamsgd", box="rma", tau=16),
    "downpour": strategy_setup("downpour", box="rma"),
    "downpour-overlap": strategy_setup(
        "downpour",
        box="rma",
        what="parambox downpour, its push and fetch behind the next step (overlap)",
        overlap=True,
    ),
    "downpour-int8": strategy_setup(
        "downpour",
        box="rma",
        what="parambox downpour, its pushes int8 with error feedback (the memory server decodes them)",
        compression="int8",
    ),
    "post-local-sgd": Setup(
        "torch PostLocalSGDOptimizer (period 4: weight-avg's peer)", make=_post_local_sgd
    ),
    "diloco": strategy_setup("diloco", inner_steps=16),
    "diloco-int8": strategy_setup(
        "diloco",
        what="parambox diloco, its outer gradients int8 with error feedback (inner_steps 16)",
        inner_steps=16,
        compression="int8",
    ),
    "diloco-int8-overlap": strategy_setup(
        "diloco",
        what="parambox diloco, int8 outer gradients, each round's exchange behind the next round "
        "(Streaming DiLoCo's overlap and quantization, inner_steps 16)",
        inner_steps=16,
        compression="int8",
        overlap=True,
    ),
    "diloco-int4-overlap": strategy_setup(
        "diloco",
        what="parambox diloco, int4 outer gradients (error feedback: MuLoCo's and SparseLoCo's 4 bits), each "
        "round's exchange behind the next round (inner_steps 16)",
        inner_steps=16,
        compression="int4",
        overlap=True,
    ),
    "diloco-bf16-overlap": strategy_setup(
        "diloco",
        what="parambox diloco, bf16 outer gradients (error feedback), each round's exchange behind the next "
        "round (inner_steps 16)",
        inner_steps=16,
        compression="bf16",
        overlap=True,
    ),
    "diloco-async": strategy_setup(
        "diloco",
        box="rma",
        what="parambox diloco, asynchronous over the rma box (Delayed Nesterov, DyLU, inner_steps 16)",
        inner_steps=16,
        asynchronous=True,
    ),
    "diloco-async-int8": strategy_setup(
        "diloco",
        box="rma",
        what="parambox diloco, asynchronous, its pseudo-gradients int8 with error feedback (the memory server "
        "decodes them before its outer step; inner_steps 16)",
        inner_steps=16,
        asynchronous=True,
        compression="int8",
    ),
    "diloco-overlap": strategy_setup(
        "diloco",
        what="parambox diloco, each round's allreduce behind the next round (overlap, inner_steps 16)",
        inner_steps=16,
        overlap=True,
    ),
    "diloco-h32-overlap": strategy_setup(
        "diloco",
        what="parambox diloco, rounds of 32 inner steps, each round's allreduce behind the next round "
        "(time it with --steps 32: a whole round a timed round)",
        inner_steps=32,
        overlap=True,
    ),
    "diloco-h32-int8-overlap": strategy_setup(
        "diloco",
        what="parambox diloco, rounds of 32 inner steps, int8 outer gradients, each round's exchange behind "
        "the next round (time it with --steps 32)",
        inner_steps=32,
        compression="int8",
        overlap=True,
    ),
    "diloco-async-overlap": strategy_setup(
        "diloco",
        box="rma",
        what="parambox diloco, asynchronous, each push-pull behind the next round (overlap, inner_steps 16)",
        inner_steps=16,
        asynchronous=True,
        overlap=True,
    ),
    "diloco-stream": strategy_setup(
        "diloco",
        what="parambox Streaming DiLoCo: inner_steps 16 in 4 fragments, a quarter of the model every 4 steps, "
        "each landing 4 steps on (fragment_sync_delay 4, alpha 0.5)",
        inner_steps=16,
        fragments=4,
        fragment_sync_delay=4,
        fragment_update_alpha=0.5,
    ),
    "diloco-async-stream": strategy_setup(
        "diloco",
        box="rma",
        what="parambox Streaming DiLoCo, asynchronous over the rma box: 4 fragments of inner_steps 16, each "
        "push and pull behind the next 4 steps",
        inner_steps=16,
        asynchronous=True,
        fragments=4,
        fragment_sync_delay=4,
        fragment_update_alpha=0.5,
    ),
    "hybrid": strategy_setup(
        "hybrid", box="rma", what="parambox hybrid (groups = nodes: with 1 worker per node, EASGD tau 4)"
    ),
    "ceiling": Setup("the same processes, never communicating", make=_plain),
}
REFERENCES = ("ddp", "ceiling", "post-local-sgd")  # not parambox's: not candidates for best_setup
LOOPBACK_SETUPS = ["ddp", "ceiling"]


# -- the worker --------------------------------------------------------------------------------------


def _link_meter() -> Callable[[], float] | None:
    """Bytes over this process's node link so far (sent + received), or None off an emulated node."""
    from parambox.runtime.cluster import link_bytes

    try:
        link_bytes()
    except (OSError, RuntimeError):
        return None
    return lambda: float(sum(link_bytes()))


def worker(setups: list[str], rounds: int, steps: int, warmup: int, bench: Workbench, out: Path) -> None:
    from parambox.runtime.dist import destroy_distributed, init_distributed
    from parambox.runtime.world import World

    torch.set_num_threads(1)
    keep_freed_memory()
    world = World.from_env()
    init_distributed(world, 300.0)  # gloo; the rendezvous over MPI when mpiexec started us
    try:
        total = warmup + rounds * steps
        steppers = {name: SETUPS[name].build(world, total, bench) for name in setups}
        meter = _link_meter()
        step_of = {name: setup[0] for name, setup in steppers.items()}
        samples = world.world_size * bench.batch
        batches = bench.batches(world.rank)
        result = run_rounds(step_of, batches, rounds, steps, warmup, samples, dist.barrier, meter)
        close_setups(steppers)
        link = _gather_means(result.metered, setups) if meter else None
        mine = {name: _comm_per_step(result.outputs[name][warmup:]) for name in setups}
        cpu_ms = {  # CPU per timed step, the medians over rounds: the process's, its main thread's, the machine's
            name: [
                1e3 * statistics.median(c[name]) for c in (result.cpu, result.cpu_main, result.cpu_machine)
            ]
            for name in setups
        }
        mine = {name: {"comm": mine[name], "cpu_ms": cpu_ms[name]} for name in setups}
        comm: list[Any] = [None] * world.world_size  # every rank's: a rank far from the counters waits longer
        dist.all_gather_object(comm, mine)
        if world.rank == 0:
            comm = {name: [c[name] for c in comm] for name in setups}
            out.write_text(json.dumps({"per_round": result.per_round, "link_bytes": link, "comm": comm}))
    finally:
        destroy_distributed()


def _gather_means(metered: dict[str, list[float]], setups: list[str]) -> dict[str, list[float]]:
    """Every rank's mean link bytes per step, per setup (tensors, not pickled objects)."""
    mine = torch.tensor([statistics.mean(metered[s]) for s in setups], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return {s: [t[i].item() for t in every] for i, s in enumerate(setups)}


def _comm_per_step(outputs: list[Any]) -> dict[str, float] | None:
    """Seconds per timed step in each communication phase a parambox strategy reported (None for DDP)."""
    comms = [getattr(o, "comm", None) for o in outputs]
    if not comms or any(c is None for c in comms):
        return None
    phases = sorted({p for c in comms for p in c})
    return {p: sum(c.get(p, 0.0) for c in comms) / len(comms) for p in phases}


# -- the driver --------------------------------------------------------------------------------------


def run_bench_cluster(
    nodes: int = 2,
    gbps: tuple[float, ...] = (1.0, 0.1),
    rounds: int | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    setups: list[str] | None = None,
    quick: bool = False,
    workers_per_node: int = 1,
    model: str = "cnn",
    data: str | None = None,
    batch_size: int | None = None,
) -> dict:
    """Loopback reference first, then one cluster per bandwidth; returns the JSON object."""
    from parambox.errors import UserError
    from parambox.runtime.cluster import EmulatedCluster, check_environment

    # 16 steps a round: a whole number of exchanges for weight-avg (4) and easgd tau 4 and 16.
    default = (1, 2, 1) if quick else (3, 16, 4)
    rounds, steps, warmup = rounds or default[0], steps or default[1], warmup or default[2]
    setups = setups or list(SETUPS)
    unknown = [s for s in setups if s not in SETUPS]
    if unknown or nodes < 2 or not gbps or min(gbps) <= 0 or workers_per_node < 1:
        raise UserError(
            f"bench cluster: setups from {', '.join(SETUPS)}; --nodes >= 2; --gbps positive; "
            "--workers-per-node >= 1"
        )
    workers = nodes * workers_per_node
    bench = Workbench.of(model, data, batch_size)
    size = bench.size()  # a model that does not fit its data fails here, before any cluster is built
    check_environment()
    args = [str(rounds), str(steps), str(warmup), *bench.args()]
    loopback = spawn_workers(__name__, [",".join(LOOPBACK_SETUPS), *args], workers)
    result: dict[str, Any] = {
        "nodes": nodes,
        "workers": workers,
        "workers_per_node": workers_per_node,
        "threads_per_worker": 1,
        "batch_per_worker": bench.batch,
        "model": bench.model,
        "data": bench.data or "random CIFAR-size images",
        **size,
        "optimizer": f"sgd lr {LR} momentum {MOMENTUM}",
        "rounds": rounds,
        "steps_per_round": steps,
        "warmup_steps": warmup,
        "setups": {name: _describe(SETUPS[name]) for name in setups},
        "loopback": _medians(loopback["per_round"]),
        "by_gbps": {},
    }
    for g in gbps:
        load0 = os.getloadavg()[0]
        with EmulatedCluster(nodes, g) as cluster:
            data = spawn_workers(
                __name__,
                [",".join(setups), *args],
                workers,
                cluster,
                mpi=any(SETUPS[s].needs_mpi for s in setups),
            )
            setup_s = cluster.setup_s
        entry = summarize(data, loopback["per_round"])
        entry.update(link_gbps=g, cluster_setup_s=setup_s, load_average_1m=[load0, os.getloadavg()[0]])
        entry["simulated"] = _simulated(
            entry, nodes, g, bench.batch, 4.0 * size["parameters"], model_shapes(bench), workers_per_node
        )
        result["by_gbps"][f"{g:g}"] = entry
    return result


def _simulated(
    entry: dict[str, Any],
    nodes: int,
    gbps: float,
    batch: int,
    size_bytes: float,
    shapes: list[tuple[int, ...]],
    workers_per_node: int = 1,
) -> dict[str, dict[str, float]]:
    """Each setup of one rate's ``entry`` beside the event simulator's step for it on these links,
    without and with the exchange's measured CPU on the workers' cores (``perfmodel/simulate.py``)."""
    from parambox.perfmodel.simulate import against_measured
    from parambox.perfmodel.topology import Network

    net = Network.from_gbps(gbps, 10.0)
    return against_measured(
        entry["samples_per_s"],
        nodes,
        batch,
        size_bytes,
        net,
        cpu_ms_of(entry),
        shapes,
        workers_per_node,
    )


def cpu_ms_of(entry: dict[str, Any]) -> dict[str, float]:
    """Each setup's CPU a step a worker (all threads; the mean over ranks) of one rate's entry."""
    comm = entry.get("comm") or {}
    return {
        s: statistics.mean(c["cpu_ms_per_step_per_rank"])
        for s, c in comm.items()
        if c.get("cpu_ms_per_step_per_rank")
    }


def cnn_bytes() -> float:
    """The gradient bytes of the benchmark CNN."""
    return 4.0 * Workbench().size()["parameters"]


def model_shapes(bench: Workbench | None = None) -> list[tuple[int, ...]]:
    """The parameter shapes of ``bench``'s model (default: the benchmark CNN)."""
    return [tuple(p.shape) for p in (bench or Workbench()).build().parameters()]


def _describe(setup: Setup) -> dict[str, Any]:
    if setup.strategy is None:
        return {"what": setup.what}
    return {"what": setup.what, "strategy": setup.strategy, "options": setup.options, "box": setup.box}


def _medians(per_round: dict[str, list[float]]) -> dict[str, Any]:
    return {
        "samples_per_s": {k: statistics.median(v) for k, v in per_round.items()},
        "per_round_samples_per_s": per_round,
    }


def summarize(data: dict, loopback: dict[str, list[float]]) -> dict[str, Any]:
    """One bandwidth's figures from the workers' per-round samples/s, link bytes and comm times."""
    per_round = data["per_round"]
    names = list(per_round)
    out: dict[str, Any] = _medians(per_round)

    def ratios(ref: str) -> dict[str, float]:
        return {n: paired_ratio(per_round[n], per_round[ref]) for n in names if n != ref and ref in per_round}

    out["ratio_vs_ddp"], out["ratio_vs_ceiling"] = ratios("ddp"), ratios("ceiling")
    if {"weight-avg", "post-local-sgd"} <= set(per_round):
        out["ratio_weight_avg_vs_post_local_sgd"] = paired_ratio(
            per_round["weight-avg"], per_round["post-local-sgd"]
        )
    if {"ddp", "ceiling"} <= set(per_round) and {"ddp", "ceiling"} <= set(loopback):
        on_link = paired_ratio(per_round["ddp"], per_round["ceiling"])
        out["ddp_vs_loopback"] = on_link / paired_ratio(loopback["ddp"], loopback["ceiling"])
        out["ddp_vs_loopback_unpaired"] = statistics.median(per_round["ddp"]) / statistics.median(
            loopback["ddp"]
        )
    candidates = [n for n in names if n not in REFERENCES]
    if candidates and "ddp" in per_round:
        best = max(candidates, key=lambda n: out["ratio_vs_ddp"][n])
        out.update(best_setup=best, best_vs_ddp=out["ratio_vs_ddp"][best])
        out["best_vs_ceiling"] = out["ratio_vs_ceiling"].get(best)
    out["comm"] = {
        n: {
            "link_bytes_per_step": None
            if data["link_bytes"] is None
            else statistics.mean(data["link_bytes"][n]),
            "link_bytes_per_step_per_node": None if data["link_bytes"] is None else data["link_bytes"][n],
            **_comm_summary([c["comm"] for c in data["comm"][n]]),
            # CPU ms a step per rank: the whole process, its main thread (the rest: gloo's, a box's server)
            "cpu_ms_per_step_per_rank": [c["cpu_ms"][0] for c in data["comm"][n]],
            "main_thread_cpu_ms_per_step_per_rank": [c["cpu_ms"][1] for c in data["comm"][n]],
            # the whole machine's, every process and the kernel's (rank 0's view: one machine here)
            "machine_cpu_ms_per_step": data["comm"][n][0]["cpu_ms"][2],
        }
        for n in names
    }
    return out


def _comm_summary(per_rank: list[dict[str, float] | None]) -> dict[str, Any]:
    """Seconds per step in communication: the mean over ranks per phase, and each rank's total."""
    if any(c is None for c in per_rank):
        return {"comm_s_per_step": None, "comm_s_per_step_by_phase": None, "comm_s_per_step_per_rank": None}
    phases = sorted({p for c in per_rank for p in c})
    by_phase = {p: statistics.mean(c.get(p, 0.0) for c in per_rank) for p in phases}
    return {
        "comm_s_per_step": sum(by_phase.values()),
        "comm_s_per_step_by_phase": by_phase,
        "comm_s_per_step_per_rank": [sum(c.values()) for c in per_rank],
    }


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        bench = Workbench.from_args(*sys.argv[6:9])
        worker(
            sys.argv[2].split(","),
            int(sys.argv[3]),
            int(sys.argv[4]),
            int(sys.argv[5]),
            bench,
            Path(sys.argv[9]),
        )
        exit_worker()  # gloo's threads may abort in C++ destructors at a normal exit
