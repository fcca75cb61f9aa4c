"""A flow-level event simulator of the strategies' steps on a cluster: what ``parambox reproduce``
uses for the claims one machine cannot host (1 to 256 nodes).

Each node runs one worker, or ``workers_per_node`` side by side (simulated as one: :func:`simulate`
says what crosses the link then). A worker computes (its measured step time, optionally with jitter)
and exchanges as its strategy does, one pattern per setup of ``PATTERNS`` (the names of ``bench
cluster``'s setups, plus ``ps-sync``):

- ``allreduce``: gloo's ring (reduce-scatter then all-gather, 2(n-1) rounds of S/n) in buckets that
  start during backward (1 MB first, then 25 MB, as ``strategies/allreduce.py``);
- ``box-sync``: every node pushes its gradient's shards to the nodes holding them in buckets of
  1 MB, each started once backward has finished it (``box-sync.bucket_mb``); a bucket's sums come
  back once every node's push of it has landed (the memory server's gated pulls: the rma box cut
  over every node, ``box/levels.py``), while later buckets still flow out;
- ``box``: one fused push-pull against every shard, no barrier (EASGD, hybrid's group leaders and
  asynchronous DiLoCo every ``period`` steps); Downpour's in buckets of 1 MB, each started once
  backward has finished it (``downpour.bucket_mb``);
- ``allreduce`` with a ``period``: a whole-model allreduce every ``period`` steps (weight-avg, DiLoCo);
- ``ps``: rank 0 gathers every gradient, averages it, broadcasts the weights (ps-sync, SHM-Learn-Dist §6);
- ``wire`` below 1: a compressed collective (``compression=int8 | int4 | topk``, ``strategies/compress.py``):
  each rank's message is that share of the float32 bytes, and gloo's ring all-gather moves n-1 messages
  over each link after n-1 latencies (every rank decodes and sums them; allreduce's compressed
  gradients go once, at the end of backward, not in buckets);
- ``wire`` below 1 on the box: an encoded push (``compression`` of downpour, easgd, asynchronous
  diloco), that share of the float32 bytes out to each shard, which the memory server decodes once all
  of it has landed and then answers in float32: the push, then the pull, one after the other;
- ``low_rank``: PowerSGD of that rank (``compression=powersgd``, ``strategies/powersgd.py``): two ring
  allreduces one after the other, the P's (with the tensors sent whole), then the Q's, their sizes
  PowerSGD's own for the model's ``shapes``, at the end of backward;
- ``overlap``: the exchange runs behind the next steps' compute; the next exchange first waits for it;
- ``share`` below 1: Streaming DiLoCo's fragments, that share of the model an exchange.

The network: every node has one full-duplex link to a non-blocking switch (the emulated cluster's
shape, and a rack's). A message waits the link's latency, then flows over its sender's uplink and its
receiver's downlink; the flows on a link share it max-min fairly (TCP's steady state), recomputed
whenever a flow starts or ends. Payload moves at ``LINK_EFFICIENCY`` of the link rate: what
``bench box --emulate-nodes 2`` measured for the memory server's push and pull over ``tc``'s rate
limit (0.954-0.957 at 1 and 0.1 Gbit/s, with 1.001 wire bytes per payload byte: the bytes counted
here are payload; docs/results/cluster-throughput.md).

The CPU the exchange itself takes (serving threads, summing, encoding, polling) is not simulated: on
a cluster it runs on cores the compute leaves free. Where the workers fill the cores, as on the
emulated cluster, :func:`against_measured` adds it to the compute from the run's own measurement
(each setup's CPU a step less the ceiling's, at the ceiling's share of a core; a collective's only
where it outlasts the worker's wait on the link, except a compressed one's, which encodes before and
decodes after it; an overlapped exchange's on its own path as well).

>>> net = Network.from_gbps(1.0)
>>> r = simulate("ceiling", nodes=4, compute_s=0.05, size_bytes=4e6, net=net)
>>> round(r.step_s, 6), r.link_bytes_per_step
(0.05, 0.0)
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

import simpy

from parambox.errors import UserError
from parambox.perfmodel.compute import ComputeProfile
from parambox.perfmodel.scaling import DEFAULT_WORKER_COUNTS, ScalingCurve
from parambox.perfmodel.topology import Network

LINK_EFFICIENCY = 0.955
FORWARD_SHARE = 1 / 3  # of a step's compute; the rest is backward, where gradients become ready
FIRST_BUCKET, BUCKET = 1 * 2**20, 25 * 2**20
BOX_BUCKET = 1 * 2**20  # downpour.bucket_mb's default


@dataclass(frozen=True)
class Pattern:
    """How a setup's worker exchanges: ``exchange`` every ``period`` steps, behind compute or not."""

    exchange: str  # none | allreduce | box-sync | box | ps
    period: int = 1
    overlap: bool = False
    bucketed: bool = False  # the exchange starts per bucket during backward
    # A compressed collective: each rank's message is this share of the float32 bytes (int8 1/4 plus a
    # float32 scale per 256 elements, int4 1/8 plus the scales, topk at ratio r 2r: an index and a value
    # each), and the messages are all-gathered (strategies/compress.py), not reduced
    wire: float = 1.0
    low_rank: int = 0  # PowerSGD's rank: two allreduces, sized from the model's shapes
    # A "box" exchange on a node of several workers: "cache" (the node's shm box caches the center and
    # syncs it across the link behind the workers: downpour, easgd, eamsgd), "leader" (one exchange a
    # node: hybrid's group leader) or "each" (every worker's own: asynchronous diloco)
    per_node: str = "each"
    # The share of the model an exchange carries: Streaming DiLoCo's fragment, 1/F (every ``period`` =
    # H/F steps one fragment goes; with ``overlap`` its outer step lands when the next one starts)
    share: float = 1.0

    @property
    def compressed(self) -> bool:
        """Its messages are encoded and decoded around the link wait (not reduced within it)."""
        return self.wire < 1 or self.low_rank > 0


_INT8, _INT4 = (1 + 4 / 256) / 4, (1 / 2 + 4 / 256) / 4  # compress.py's bytes per element, over float32's 4
_BF16 = 2 / 4
PATTERNS: dict[str, Pattern] = {
    "ceiling": Pattern("none"),
    "ddp": Pattern("allreduce", bucketed=True),
    "allreduce": Pattern("allreduce", bucketed=True),
    "box-sync": Pattern("box-sync", bucketed=True),
    "downpour": Pattern("box", bucketed=True, per_node="cache"),
    "downpour-overlap": Pattern("box", overlap=True, per_node="cache"),
    "weight-avg": Pattern("allreduce", period=4),
    "post-local-sgd": Pattern("allreduce", period=4),  # torch's PeriodicModelAverager: weight-avg's exchange
    "easgd-tau4": Pattern("box", period=4, per_node="cache"),
    "easgd-tau16": Pattern("box", period=16, per_node="cache"),
    # One worker a node (bench cluster's groups = nodes): each group's allreduce is of one rank, and its
    # leader's exchange is easgd's, every tau = 4 steps
    "hybrid": Pattern("box", period=4, per_node="leader"),
    "eamsgd-tau16": Pattern("box", period=16, per_node="cache"),
    "diloco": Pattern("allreduce", period=16),
    "diloco-overlap": Pattern("allreduce", period=16, overlap=True),
    "diloco-int8": Pattern("allreduce", period=16, wire=_INT8),
    "diloco-int8-overlap": Pattern("allreduce", period=16, overlap=True, wire=_INT8),
    "diloco-int4-overlap": Pattern("allreduce", period=16, overlap=True, wire=_INT4),
    "diloco-bf16-overlap": Pattern("allreduce", period=16, overlap=True, wire=_BF16),
    "diloco-h32-overlap": Pattern("allreduce", period=32, overlap=True),
    "diloco-h32-int8-overlap": Pattern("allreduce", period=32, overlap=True, wire=_INT8),
    "allreduce-topk": Pattern("allreduce", wire=2 * 0.01),
    "allreduce-powersgd": Pattern("allreduce", low_rank=4),
    # Streaming DiLoCo, H 16 in 4 fragments: a quarter of the model every 4 steps, landing 4 steps on
    "diloco-stream": Pattern("allreduce", period=4, overlap=True, share=0.25),
    "diloco-async-stream": Pattern("box", period=4, overlap=True, share=0.25),
    "diloco-async": Pattern("box", period=16),
    "diloco-async-overlap": Pattern("box", period=16, overlap=True),
    # encoded whole after backward, not in buckets
    "downpour-int8": Pattern("box", wire=_INT8, per_node="cache"),
    "easgd-tau4-int8": Pattern("box", period=4, wire=_INT8, per_node="cache"),
    "diloco-async-int8": Pattern("box", period=16, wire=_INT8),
    "ps-sync": Pattern("ps"),
}


@dataclass
class SimResult:
    """One simulated run: a worker's mean step, the cluster's samples/s, the wire bytes per step per
    node (sent + received, as ``bench cluster`` counts them) and node 0's seconds per step by phase."""

    setup: str
    nodes: int
    step_s: float
    samples_per_s: float
    link_bytes_per_step: float
    phases_s: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict:
        return {
            "setup": self.setup,
            "nodes": self.nodes,
            "step_ms": self.step_s * 1e3,
            "samples_per_s": self.samples_per_s,
            "link_mb_per_step": self.link_bytes_per_step / 1e6,
            "phases_ms": {k: v * 1e3 for k, v in self.phases_s.items()},
        }


class _Flow:
    __slots__ = ("src", "dst", "left", "size", "rate", "done")

    def __init__(self, src: int, dst: int, size: float, done: simpy.Event):
        self.src, self.dst, self.left, self.size, self.rate, self.done = src, dst, size, size, 0.0, done


class Fabric:
    """Every node's uplink and downlink, ``rate`` payload bytes/s each way, shared max-min fairly."""

    def __init__(self, env: simpy.Environment, nodes: int, rate: float, latency: float):
        self.env, self.rate, self.latency = env, rate, latency
        self.flows: list[_Flow] = []
        self.wire = [0.0] * nodes  # bytes sent + received per node
        self._stamp, self._generation, self._pending = 0.0, 0, False

    def send(self, src: int, dst: int, nbytes: float) -> simpy.Event:
        """An event that fires when ``nbytes`` have gone from ``src`` to ``dst`` (after the latency)."""
        done = self.env.event()
        if src == dst or nbytes <= 0:
            return done.succeed()
        self.wire[src] += nbytes
        self.wire[dst] += nbytes
        self.env.process(self._start(_Flow(src, dst, float(nbytes), done)))
        return done

    def _start(self, flow: _Flow):
        yield self.env.timeout(self.latency)
        self._drain()
        self.flows.append(flow)
        if not self._pending:  # one rate update per instant, after every flow of that instant started
            self._pending = True
            self.env.timeout(0).callbacks.append(self._update)

    def _drain(self) -> None:
        dt = self.env.now - self._stamp
        if dt > 0:
            for f in self.flows:
                f.left -= f.rate * dt
        self._stamp = self.env.now

    def _update(self, _event=None) -> None:
        self._pending = False
        self._generation += 1
        self._drain()
        finished = [f for f in self.flows if f.left <= 1e-9 * f.size + 1e-6]
        if finished:
            self.flows = [f for f in self.flows if f.left > 1e-9 * f.size + 1e-6]
            for f in finished:
                f.done.succeed()
        if not self.flows:
            return
        self._share()
        generation = self._generation
        wake = self.env.timeout(min(f.left / f.rate for f in self.flows))
        wake.callbacks.append(lambda _e: generation == self._generation and self._update())

    def _share(self) -> None:
        """Max-min fair rates by progressive filling: the links with the smallest fair share fix their
        flows' rates, which leave the other links; repeat."""
        users: dict[tuple[str, int], list[_Flow]] = defaultdict(list)
        for f in self.flows:
            users["up", f.src].append(f)
            users["down", f.dst].append(f)
        capacity = {link: self.rate for link in users}
        count = {link: len(fs) for link, fs in users.items()}
        fixed: set[int] = set()
        while len(fixed) < len(self.flows):
            shares = {link: capacity[link] / count[link] for link in users if count[link] > 0}
            least = min(shares.values())
            for link, share in shares.items():
                if share > least * (1 + 1e-9):
                    continue
                for f in users[link]:
                    if id(f) in fixed:
                        continue
                    fixed.add(id(f))
                    f.rate = least
                    for other in (("up", f.src), ("down", f.dst)):
                        capacity[other] -= least
                        count[other] -= 1


class _Cluster:
    """The simulated run: the fabric, the collectives' rendezvous, each node's step clock."""

    def __init__(self, nodes: int, net: Network, seed: int, jitter: float, workers_per_node: int = 1):
        self.env = simpy.Environment()
        self.n = nodes
        self.ranks = nodes * workers_per_node  # a collective's ring runs over every worker
        self.syncing = [False] * nodes  # a node cache's sync of the center in flight
        self.pushes = [0] * nodes  # exchanges made into a node's cache
        self.fabric = Fabric(self.env, nodes, net.bandwidth * LINK_EFFICIENCY, net.latency)
        self.rng, self.jitter = random.Random(seed), jitter
        self._events: dict[tuple, simpy.Event] = {}
        self.counts: dict[tuple, int] = defaultdict(int)

    def event(self, key: tuple) -> simpy.Event:
        if key not in self._events:
            self._events[key] = self.env.event()
        return self._events[key]

    def compute(self, seconds: float) -> simpy.Event:
        if self.jitter > 0:  # lognormal with mean 1
            seconds *= math.exp(self.rng.gauss(0.0, self.jitter) - self.jitter**2 / 2)
        return self.env.timeout(seconds)

    def gate(self, key: tuple, delay: float = 0.0) -> simpy.Event:
        """Fires ``delay`` after every node has arrived."""
        self.counts[key] += 1
        event = self.event(("gate", key))
        if self.counts[key] == self.n:
            self.env.timeout(delay).callbacks.append(lambda _e: event.succeed())
        return event

    def ring_allreduce(self, me: int, tag: tuple, nbytes: float):
        """Node ``me``'s part of a ring allreduce of ``nbytes``: once every node has arrived (a round
        needs its neighbours), 2(n-1) rounds of S/n to the next node, as one flow of 2(n-1)/n S over
        that link after 2(n-1) latencies. Exact where nothing else shares the links; with other traffic
        the ring's share of a link is one flow's. With several workers a node the ring runs over all
        R of them, node by node: 2(R-1) rounds of S/R, one hop of each round crossing each node's
        link, the hops inside a node at memory speed (free here)."""
        n, r = self.n, self.ranks
        if n == 1:
            return
        yield self.gate(("ring", tag))
        yield self.env.timeout((2 * (r - 1) - 1) * self.fabric.latency)  # the send waits the last one
        sent = self.fabric.send(me, (me + 1) % n, 2 * (r - 1) / r * nbytes)
        sent.callbacks.append(lambda _e: self.event(("ring in", tag, (me + 1) % n)).succeed())
        yield self.env.all_of([sent, self.event(("ring in", tag, me))])

    def ring_allgather(self, me: int, tag: tuple, nbytes: float):
        """Node ``me``'s part of a ring all-gather of one ``nbytes`` message a worker (gloo's): R-1
        rounds of one message to the next worker, as one flow of (R-1) messages over the node's link
        after R-1 latencies (R workers; one a node: R = n)."""
        n, r = self.n, self.ranks
        if n == 1:
            return
        yield self.gate(("gather", tag))
        yield self.env.timeout((r - 2) * self.fabric.latency)
        sent = self.fabric.send(me, (me + 1) % n, (r - 1) * nbytes)
        sent.callbacks.append(lambda _e: self.event(("gather in", tag, (me + 1) % n)).succeed())
        yield self.env.all_of([sent, self.event(("gather in", tag, me))])

    def collective(self, me: int, tag: tuple, nbytes: float, wire: float):
        """An allreduce of ``nbytes``, or, compressed (``wire`` < 1), the all-gather of the messages."""
        if wire < 1:
            yield from self.ring_allgather(me, tag, wire * nbytes)
        else:
            yield from self.ring_allreduce(me, tag, nbytes)

    def push_pull(self, me: int, nbytes: float, barrier: tuple | None = None, wire: float = 1.0):
        """Every shard's piece to its node and the new values back: fused (the server returns each
        piece as it adds it), or push, ``barrier``, pull (box-sync); ``wire`` below 1: an encoded push of
        that share of the bytes, decoded once landed, then the float32 answer."""
        others = [j for j in range(self.n) if j != me]
        piece = nbytes / self.n
        if wire < 1:
            yield self.env.all_of([self.fabric.send(me, j, wire * piece) for j in others])
            yield self.env.all_of([self.fabric.send(j, me, piece) for j in others])
            return
        if barrier is None:
            yield self.env.all_of(
                [self.fabric.send(me, j, piece) for j in others]
                + [self.fabric.send(j, me, piece) for j in others]
            )
            return
        yield self.env.all_of([self.fabric.send(me, j, piece) for j in others])
        yield self.gate(barrier, self.fabric.latency)  # the barrier: one message
        yield self.env.all_of([self.fabric.send(j, me, piece) for j in others])


def simulate(
    setup: str | Pattern,
    nodes: int,
    compute_s: float,
    size_bytes: float,
    net: Network,
    batch: int = 64,
    steps: int | None = None,
    jitter: float = 0.0,
    seed: int = 0,
    average_bytes_per_s: float = 5e9,
    exchange_cpu_s: float = 0.0,
    shapes: list[tuple[int, ...]] | None = None,
    workers_per_node: int = 1,
) -> SimResult:
    """``setup`` (a key of ``PATTERNS``, or a ``Pattern``) on ``nodes`` nodes, each step ``compute_s`` of compute on
    ``batch`` samples and ``size_bytes`` of gradient or weights; measured over ``steps`` steps after one
    exchange period of warm-up (default 4 periods, at least 8 steps). ``average_bytes_per_s``: how fast
    ps-sync's server sums the gathered gradients (its ``average`` phase). ``exchange_cpu_s``: the seconds
    of a core an overlapped exchange waits for besides its links (its CPU on cores the compute fills).
    ``shapes``: the model's parameter shapes, which a ``low_rank`` pattern's message sizes come from.

    ``workers_per_node`` (w): a node's w workers compute side by side and step together, so a node is
    simulated as one, with its exchange as the strategy makes it across the link (``bench cluster
    --workers-per-node``): a collective's ring over all ``nodes * w`` workers; box-sync's two levels
    (the node's sum, pushed by its leader after backward, ``box/levels.py``); hybrid's group leader;
    through a node cache (``per_node="cache"``: ``box/node_cache.py``) the workers' exchanges end in
    the node's shm box and never wait on the link, and a sync of the center (float32, one fused
    push-pull) starts whenever an exchange finds none in flight; every worker its own push-pull
    (``per_node="each"``). Traffic inside a node is at memory speed: free here (its CPU is
    ``against_measured``'s). Through a cache the worker that syncs waits for it while its node-mates go
    on: they drift apart and come to share the syncs, and the step is the slowest worker's, over a
    longer run (64 steps) to let them settle. ``bench cluster``'s barrier at the end of each timed
    round (16 steps) brings them back in step, which this does not simulate."""
    if isinstance(setup, Pattern):
        pattern, setup = setup, f"{setup.exchange} every {setup.period}"
    elif setup in PATTERNS:
        pattern = PATTERNS[setup]
    else:
        raise UserError(f"simulate: setup {setup!r}; choose from {', '.join(PATTERNS)}")
    if nodes < 1 or not compute_s > 0 or size_bytes < 0 or jitter < 0 or workers_per_node < 1:
        raise UserError(
            "simulate: nodes >= 1, compute_s > 0, size_bytes >= 0, jitter >= 0, workers_per_node >= 1"
        )
    w = workers_per_node
    if w > 1 and pattern.exchange == "ps":
        raise UserError(f"simulate: {setup} is simulated with one worker a node only")
    pattern = _with_workers(pattern, w)
    cached = w > 1 and pattern.exchange == "box" and pattern.per_node == "cache"
    crossing = (
        size_bytes * pattern.share * (w if pattern.exchange == "box" and pattern.per_node == "each" else 1)
    )
    rounds = low_rank_bytes(setup, pattern.low_rank, shapes) if pattern.low_rank else ()
    warm = pattern.period
    # through a cache the workers drift apart (the one that syncs waits): a longer run settles it
    steps = steps or (max(64, 16 * pattern.period) if cached else max(8, 4 * pattern.period))
    run = _Cluster(nodes, net, seed, jitter, w)
    clocks: list[list[float]] = [[] for _ in range(nodes)]
    phases: dict[str, list[float]] = defaultdict(list)

    def worker(me: int):
        env, background = run.env, None
        for k in range(warm + steps):
            t0 = env.now
            exchanging = (k + 1) % pattern.period == 0 and nodes > 1 and pattern.exchange != "none"
            if pattern.bucketed and exchanging:
                yield from _bucketed_step(run, pattern, me, k, compute_s, size_bytes)
            else:
                yield run.compute(compute_s)
            t1 = env.now
            if exchanging and not pattern.bucketed:
                if pattern.overlap:
                    if background is not None:
                        yield background
                    background = env.process(
                        _exchange(run, pattern, me, k, crossing, average_bytes_per_s, exchange_cpu_s, rounds)
                    )
                else:
                    timed = yield env.process(
                        _exchange(run, pattern, me, k, crossing, average_bytes_per_s, rounds=rounds)
                    )
                    if me == 0 and k >= warm:
                        for name, s in (timed or {}).items():
                            phases[name].append(s)
            if me == 0 and k >= warm:
                phases["compute"].append(t1 - t0)
                phases["exchange"].append(env.now - t1)
            clocks[me].append(env.now)

    def cached_worker(me: int, j: int):
        """Worker ``j`` of node ``me`` through its node's cache: every ``w``-th exchange of the node
        syncs it, inline, unless a sync is under way (``NodeCachedBox.sync(wait=False)``)."""
        env, clock = run.env, clocks[me * w + j]
        for k in range(warm + steps):
            t0 = env.now
            yield run.compute(compute_s)
            t1 = env.now
            if (k + 1) % pattern.period == 0 and nodes > 1:
                run.pushes[me] += 1
                if run.pushes[me] % w == 0 and not run.syncing[me]:
                    run.syncing[me] = True
                    yield from run.push_pull(me, size_bytes)
                    run.syncing[me] = False
            if me == 0 and j == 0 and k >= warm:
                phases["compute"].append(t1 - t0)
                phases["exchange"].append(env.now - t1)
            clock.append(env.now)

    if cached:
        clocks = [[] for _ in range(nodes * w)]
        for i in range(nodes * w):
            run.env.process(cached_worker(i // w, i % w))
    else:
        for i in range(nodes):
            run.env.process(worker(i))
    run.env.run()
    per_worker = [(c[-1] - c[warm - 1]) / steps for c in clocks]
    # through a cache the slowest worker's (a node's workers differ: the one that syncs waits, and
    # bench cluster's rounds end with a barrier)
    step_s = max(per_worker) if cached else statistics.mean(per_worker)
    per_step = {name: sum(v) / steps for name, v in phases.items()}
    wire = statistics.mean(run.fabric.wire) / (warm + steps)
    return SimResult(setup, nodes, step_s, nodes * w * batch / step_s, wire, per_step)


def _with_workers(pattern: Pattern, w: int) -> Pattern:
    """What crosses the link with ``w`` workers a node (:func:`simulate`): box-sync's node sum goes once
    backward is done, a node cache syncs float32 in one piece."""
    if w > 1 and pattern.exchange == "box-sync":
        return dataclasses.replace(pattern, bucketed=False)
    if w > 1 and pattern.exchange == "box" and pattern.per_node == "cache":
        return dataclasses.replace(pattern, bucketed=False, overlap=False, wire=1.0)
    return pattern


def low_rank_bytes(setup: str, rank: int, shapes: list[tuple[int, ...]] | None) -> tuple[float, float]:
    """The bytes of a PowerSGD round's two allreduces for a model of these parameter ``shapes``."""
    from parambox.strategies.powersgd import round_elements

    if not shapes:
        raise UserError(f"simulate: {setup} sizes its messages from the model's parameter shapes; none given")
    first, second = round_elements(shapes, rank, tail=len(shapes))
    return 4.0 * first, 4.0 * second


def _bucketed_step(run: _Cluster, pattern: Pattern, me: int, k: int, compute_s: float, size_bytes: float):
    """Forward, then backward with each bucket's exchange started once its gradients are ready: an
    allreduce once the previous bucket's is done too (gloo runs one at a time), a box push-pull at
    once (box-sync's pull of a bucket once every node has pushed it); the step ends with the last
    bucket's exchange."""
    env = run.env
    yield run.compute(compute_s * FORWARD_SHARE)
    backward = compute_s * (1 - FORWARD_SHARE)
    start = env.now
    box = pattern.exchange in ("box", "box-sync")
    sizes, left = [], size_bytes
    while left > 0:
        sizes.append(min(left, BOX_BUCKET if box else FIRST_BUCKET if not sizes else BUCKET))
        left -= sizes[-1]

    def exchange(b: int, nbytes: float, ready: float):
        wait = start + backward * ready / size_bytes - env.now
        if wait > 0:
            yield env.timeout(wait)
        if box:
            gate = ("box-sync", k, b) if pattern.exchange == "box-sync" else None
            yield from run.push_pull(me, nbytes, barrier=gate)
        else:
            yield from run.ring_allreduce(me, ("bucket", k, b), nbytes)

    def buckets():
        ready = 0.0
        for b, nbytes in enumerate(sizes):
            ready += nbytes
            yield from exchange(b, nbytes, ready)

    if box:
        ready = [sum(sizes[: b + 1]) for b in range(len(sizes))]
        comm = env.all_of([env.process(exchange(b, n, r)) for b, (n, r) in enumerate(zip(sizes, ready))])
    else:
        comm = env.process(buckets())
    yield run.compute(backward)
    yield comm


def _exchange(
    run: _Cluster,
    pattern: Pattern,
    me: int,
    k: int,
    size_bytes: float,
    average_bps: float,
    cpu_s: float = 0.0,
    rounds: tuple[float, ...] = (),
):
    """One exchange of ``pattern`` at step ``k``, then ``cpu_s`` of the CPU it waits for; returns node
    0's phase times for ps-sync. ``rounds``: a low-rank pattern's allreduces, their bytes."""
    if cpu_s > 0:
        yield run.env.timeout(cpu_s)
    if pattern.low_rank:
        for i, nbytes in enumerate(rounds):
            yield from run.ring_allreduce(me, ("low rank", k, i), nbytes)
    elif pattern.exchange == "allreduce":
        yield from run.collective(me, ("allreduce", k), size_bytes, pattern.wire)
    elif pattern.exchange == "box-sync":
        yield from run.push_pull(me, size_bytes, barrier=("box-sync", k))
    elif pattern.exchange == "box":
        yield from run.push_pull(me, size_bytes, wire=pattern.wire)
    elif pattern.exchange == "ps":
        return (yield from _parameter_server(run, me, k, size_bytes, average_bps))
    return None


def _parameter_server(run: _Cluster, me: int, k: int, size_bytes: float, average_bps: float):
    """ps-sync's step: gather at node 0 (timed there from its own gradient to the last arrival),
    average, broadcast (node 0 sends every copy; each node goes on once its copy arrived)."""
    env, gathered = run.env, run.event(("gathered", k))
    if me != 0:
        run.fabric.send(me, 0, size_bytes).callbacks.append(lambda _e: _arrive(run, k, gathered))
        yield run.event(("weights", k, me))
        return None
    t0 = env.now
    _arrive(run, k, gathered)
    yield gathered
    t1 = env.now
    yield env.timeout(run.n * size_bytes / average_bps)
    t2 = env.now
    copies = []
    for j in range(1, run.n):
        copies.append(run.fabric.send(0, j, size_bytes))
        copies[-1].callbacks.append(lambda _e, j=j: run.event(("weights", k, j)).succeed())
    yield env.all_of(copies)
    return {"gather": t1 - t0, "average": t2 - t1, "broadcast": env.now - t2}


def _arrive(run: _Cluster, k: int, gathered: simpy.Event) -> None:
    run.counts["gather", k] += 1
    if run.counts["gather", k] == run.n:
        gathered.succeed()


SIMULATED_MAX_NODES = 256


def against_measured(
    samples_per_s: dict[str, float],
    nodes: int,
    batch: int,
    size_bytes: float,
    net: Network,
    cpu_ms: dict[str, float] | None = None,
    shapes: list[tuple[int, ...]] | None = None,
    workers_per_node: int = 1,
) -> dict[str, dict[str, float]]:
    """``bench cluster``'s view of one link rate (``workers_per_node`` a node): each setup's measured ms per
    step beside its simulation, given that run's own compute time (its ``ceiling`` setup: the same
    processes never communicating, on the same cores). ``error`` = simulated / measured - 1: a setup
    far below 0 runs slower than its pattern over the links allows.

    ``cpu_ms`` (each setup's CPU a step a worker, all its threads, the ceiling's included): the
    exchange's own CPU (``exchange_cpu_ms``: the setup's less the ceiling's) taken from the compute's
    cores, which the workers fill here, at the ceiling's share of a core (its CPU / its wall time);
    ``error_with_cpu`` is the simulation with it (``shapes``: the model's parameter shapes, for a
    low-rank setup's messages). Where it runs decides what it costs:

    - a collective's (gloo's ring: reducing, copying, sending) runs inside the collective, which every
      rank waits on: it first fills the time the worker waits on the link, so the step is about the longer
      of the links-alone step and the compute plus that CPU (allreduce, ddp, weight-avg, diloco); so
      does box-sync's in two levels (several workers a node: the node's sum and its leader's push and
      pull run after backward, while every worker of the node waits);
    - a compressed collective's (encoding the message before the all-gather, decoding every rank's
      after it; PowerSGD's products and orthogonalization between and around its two allreduces) lies
      before and after the link wait, not within it: the step grows by all of it;
    - the box's (the memory server summing and serving the other workers' pushes and pulls, whenever
      they come) runs while this worker computes where the exchange is in buckets during backward
      (downpour, box-sync): the compute grows by all of it; where it is periodic (easgd, asynchronous
      diloco: every ``period`` steps, the workers in step), the others' requests come while this worker
      waits on its own exchange: it first fills that wait, as a collective's does (not where its pushes
      are encoded: the encoding lies on the step's path);
    - an overlapped exchange's (downpour with ``overlap``: the push-pull in a thread behind the next
      step) lies on both of the step's paths at once: it takes the core from the compute, and the
      exchange's bytes wait for the CPU that moves and serves them, so the exchange grows by it too
      (by ``period`` steps' worth). A sequential step has one path, and counts it once."""
    if "ceiling" not in samples_per_s:
        return {}
    w = workers_per_node
    compute_s = nodes * w * batch / samples_per_s["ceiling"]
    cpu = cpu_ms if cpu_ms and cpu_ms.get("ceiling", 0) > 0 else None
    share = cpu["ceiling"] / 1e3 / compute_s if cpu else 1.0
    out = {}
    for setup, rate in samples_per_s.items():
        if setup == "ceiling" or setup not in PATTERNS or not rate > 0:
            continue
        if w > 1 and PATTERNS[setup].exchange == "ps":
            continue
        measured = nodes * w * batch / rate
        sim = simulate(
            setup,
            nodes,
            compute_s,
            size_bytes,
            net,
            batch=batch,
            shapes=shapes,
            workers_per_node=w,
        ).step_s
        out[setup] = {
            "compute_ms": compute_s * 1e3,
            "measured_ms": measured * 1e3,
            "simulated_ms": sim * 1e3,
            "error": sim / measured - 1,
        }
        if cpu and cpu.get(setup):
            extra = max(0.0, cpu[setup] - cpu["ceiling"]) / 1e3
            taken = extra / share  # compute seconds a step that CPU takes at the ceiling's share
            pattern = _with_workers(PATTERNS[setup], w)
            if _cpu_within_wait(pattern):
                taken = max(0.0, taken - (sim - compute_s))
            behind = taken * pattern.period if pattern.overlap else 0.0  # on the exchange's path too
            with_cpu = simulate(
                setup,
                nodes,
                compute_s + taken,
                size_bytes,
                net,
                batch=batch,
                exchange_cpu_s=behind,
                shapes=shapes,
                workers_per_node=w,
            ).step_s
            out[setup].update(
                exchange_cpu_ms=extra * 1e3,
                simulated_with_cpu_ms=with_cpu * 1e3,
                error_with_cpu=with_cpu / measured - 1,
            )
    return out


def _cpu_within_wait(pattern: Pattern) -> bool:
    """The exchange's CPU first fills the worker's wait on the link (``against_measured``'s rules)."""
    if pattern.exchange in ("allreduce", "ps") or (pattern.exchange == "box-sync" and not pattern.bucketed):
        return not pattern.compressed
    return pattern.exchange == "box" and pattern.period > 1 and not pattern.overlap and not pattern.compressed


def simulate_curve(
    setup: str,
    compute: ComputeProfile,
    size_bytes: float,
    net: Network,
    batch: int,
    weak: bool = False,
    worker_counts: list[int] = DEFAULT_WORKER_COUNTS,
    jitter: float = 0.0,
    shapes: list[tuple[int, ...]] | None = None,
    workers_per_node: int = 1,
) -> ScalingCurve:
    """``predict_curve``'s curve for ``setup``, each point simulated (n <= ``SIMULATED_MAX_NODES``):
    strong scaling splits the global ``batch`` over the n nodes' workers (``workers_per_node`` each),
    weak keeps ``batch`` per worker."""
    t_iter, t_comp, t_comm = [], [], []
    for n in worker_counts:
        local = batch if weak else batch / (n * workers_per_node)
        if local < 1 or n > SIMULATED_MAX_NODES:
            t_iter.append(None), t_comp.append(None), t_comm.append(None)
            continue
        tc = compute.time_s(local)
        step = simulate(
            setup,
            n,
            tc,
            size_bytes,
            net,
            batch=max(1, round(local)),
            jitter=jitter,
            shapes=shapes,
            workers_per_node=workers_per_node,
        ).step_s
        t_iter.append(step)
        t_comp.append(tc)
        t_comm.append(max(0.0, step - tc))
    return ScalingCurve(setup, list(worker_counts), t_iter, t_comp, t_comm, compute.time_s(batch), weak)
