"""The mean of every worker's vector, per step, through the box: one level or two (ShmCaffe).

One level: every worker pushes ``v / n`` into the step's sum in the box (across nodes: the rma box's
memory server adds it), all meet at the box's barrier, and each pulls the mean: two vectors cross a
worker's link per step, whatever the number of workers.

Two levels (``two_level``: the rma box across nodes with several workers per node): the workers of a
node push into a sum in the node's shm box (memory speed); after the node's barrier its leader
(local rank 0) alone pushes that node sum into the cross-node box, meets the other leaders at its
barrier, pulls the mean and writes it into the node's box; after a second node barrier every worker
reads the mean there. A node's link carries two vectors per step whether it runs one worker or eight.

Sums rotate over three areas: step t sums into area t % 3, and after step t's barrier each rank
zeroes its own part of area t + 2 (= t - 1: everyone read it before step t's barrier; nobody pushes
into it before step t + 1's).

Where the cross-node box is sharded over several ranks, the vector is dealt out over all of them in
blocks of up to ``BLOCK`` elements (each to the shard with the fewest so far; with ``bounds``, no
block crosses a parameter's start unless both sides are small): each rank then sends and receives
the same bytes, both directions of every link carry the exchange at once, as in a ring allreduce,
and so does any stretch of the vector, such as the buckets backward finishes last. Laid end to end,
one area would sit on one rank, its link busy one way while the other way idles (box-sync ran at
0.60x allreduce at 0.1 Gbit/s that way); cut in halves, the half that backward finishes last went to
one rank's shard alone, and the whole step waited for it to cross the link twice.

With the memory server (``box/server.py``, the rma box's default across nodes) there is no barrier:
each worker pushes every block under the block's key and at once asks for its sum with a gated pull,
which the block's server answers as soon as all n pushes of it have landed. Blocks flow back while
later ones still flow out, as a ring allreduce's buckets do; a block pushed early (``push_early``,
during backward) may come back before backward ends. The n-th push of a block in step t is also
every worker's word that it has finished step t - 1 (it pulled before it pushed again), which is all
the barrier told.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from parambox.box.base import BoxConfig, ParameterBox, open_box, wait_all
from parambox.box.node_cache import applies
from parambox.runtime.world import World

AREAS = 3
BLOCK = 1 << 17  # elements (512 KiB): the most of a vector one shard holds in one run


def _block(numel: int, ranks: int) -> int:
    """The run of the vector that goes to one shard: ``BLOCK``, or less, so that every shard gets some."""
    return max(1, min(BLOCK, -(-numel // ranks)))


def _padded(numel: int, ranks: int) -> int:
    """The cross box's size: the areas, plus room in each of up to ``ranks`` shards for its blocks."""
    return AREAS * (numel + 2 * ranks * _block(numel, ranks))


def _blocks(numel: int, ranks: int, bounds: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The vector's blocks ``(lo, hi)``, each at most ``_block(numel, ranks)`` long. With ``bounds``
    (where the vector's parts begin, e.g. a model's parameters, and its end) no block crosses a
    bound, save to merge small neighbours: a block of parts that backward finishes early never waits
    for a part it finishes last (the bench CNN's convolutions, 77 KB, sat in a 512 KiB block with the
    start of its fully connected layer, and the whole block crossed the link after backward)."""
    block = _block(numel, ranks)
    if bounds is None:
        return [(lo, min(numel, lo + block)) for lo in range(0, numel, block)]
    if bounds[0] != 0 or bounds[-1] != numel or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"bounds must rise from 0 to numel={numel}")
    blocks: list[tuple[int, int]] = []
    for a, b in zip(bounds, bounds[1:]):
        for lo in range(a, b, block):
            hi = min(b, lo + block)
            if blocks and hi - blocks[-1][0] <= block:  # small neighbours share a block
                blocks[-1] = (blocks[-1][0], hi)
            else:
                blocks.append((lo, hi))
    return blocks


def _area_pieces(
    box: ParameterBox, blocks: list[tuple[int, int]]
) -> list[list[tuple[int, int, int, int | None]]]:
    """Per area, ``(lo, hi, at, owner)``: ``v[lo:hi]`` lives at ``box[at:at + hi - lo]`` on rank
    ``owner`` (None: one buffer every rank maps, as shm's). Across shards the vector's ``blocks`` are
    dealt out in turn, each to the shard holding the fewest elements so far (its blocks of an area
    back to back), so that any stretch of the vector, as the last buckets backward finishes, is
    shared among all of them and every shard's share is within a block of the others'."""
    shards = getattr(box, "shards", None)
    numel = blocks[-1][1]
    if shards is None:
        return [[(0, numel, a * numel, None)] for a in range(AREAS)]
    owner, share = [], [0] * len(shards)
    for lo, hi in blocks:
        k = share.index(min(share))
        owner.append(k)
        share[k] += hi - lo
    pieces: list[list[tuple[int, int, int, int | None]]] = [[] for _ in range(AREAS)]
    placed = [0] * len(shards)
    for (lo, hi), k in zip(blocks, owner):
        s0, s1 = shards[k]
        assert AREAS * share[k] <= s1 - s0, "the cross box is padded for this"
        for a in range(AREAS):
            pieces[a].append((lo, hi, s0 + a * share[k] + placed[k], box.box_ranks[k]))
        placed[k] += hi - lo
    return pieces


class BoxMean:
    """``mean_(v, step, out)``: ``out`` = the mean over every worker of their ``v`` at ``step``.

    >>> m = BoxMean(BoxConfig(backend="rma"), world, numel=10, name="g")  # doctest: +SKIP
    >>> m.mean_(grad, step, out=mean)  # doctest: +SKIP

    ``bounds``: where the vector's parts begin (a model's parameters, in order) and its end: the
    blocks follow them (``_blocks``), so that a part pushed early comes back without waiting for one
    pushed late.
    """

    def __init__(
        self,
        box: BoxConfig,
        world: World,
        numel: int,
        name: str,
        *,
        layout_hash: int = 0,
        timeout: float = 60.0,
        two_level: bool | None = None,
        bounds: Sequence[int] | None = None,
    ):
        self.world, self.numel = world, numel
        if two_level is None:
            two_level = applies(box, world)
        self.two_level = two_level
        self.zeros = torch.zeros(numel)
        self.timers: Any = None
        self.early_step, self.early, self.pushed = -1, [], (0, 0)  # push_early's, this step
        self.pulls: list = []  # the gated pulls of this step so far
        self.sent: dict[int, int] = {}  # elements of each block pushed this step (gated)
        self.out: torch.Tensor | None = None  # where this step's mean goes (gated pulls)
        self.rounds = [0] * AREAS  # steps each area has summed (the gated pulls' targets)
        self.node: ParameterBox | None = None
        self.cross: ParameterBox | None = None
        if not two_level:
            self.cross = open_box(
                box,
                world,
                _padded(numel, world.world_size),
                0,
                name,
                layout_hash=layout_hash,
                timeout=timeout,
            )
            self.leader = True
            self.pieces = _area_pieces(self.cross, _blocks(numel, world.world_size, bounds))
            self.pushers = world.world_size
            return
        from mpi4py import MPI  # two levels are an rma box's: MPI is up

        self.leader = world.local_rank == 0
        leaders = MPI.COMM_WORLD.Split(0 if self.leader else MPI.UNDEFINED, world.rank)
        node_world = World(world.local_rank, world.local_world_size, world.local_rank, world.local_world_size)
        # Two areas per step in the node's box: the node's sum, then the mean its leader writes back.
        self.node = open_box(
            "shm",
            node_world,
            2 * AREAS * numel,
            0,
            f"{name}-node{world.node_rank}",
            layout_hash=layout_hash,
            timeout=timeout,
        )
        if self.leader:
            self.cross = open_box(
                box,
                world,
                _padded(numel, leaders.Get_size()),
                0,
                name,
                layout_hash=layout_hash,
                timeout=timeout,
                comm=leaders,
            )
            self.pieces = _area_pieces(self.cross, _blocks(numel, leaders.Get_size(), bounds))
            self.pushers = leaders.Get_size()
            self.mean_buf = torch.empty(numel)
            leaders.Free()

    def mean_(self, v: torch.Tensor, step: int, out: torch.Tensor, timers: Any = None) -> torch.Tensor:
        """``timers`` (a strategy's ``Timers``) get the phases: ``push``, ``barrier`` and ``pull``
        across the nodes; with two levels also ``node_sum`` and ``node_mean`` in the node's box."""
        self.timers = timers
        area = (step % AREAS) * self.numel
        later = ((step + 2) % AREAS) * self.numel
        n = self.world.world_size
        if self.node is None:
            self._cross_mean(v, 1.0 / n, step, out)
            return out
        with self._phase("node_sum"):
            self.node.push(v, scale=1.0 / n, start=area)
            self.node.barrier()
        if self.leader:
            node_sum = self.node.local_view()[area : area + self.numel]
            # no copy: the node's box is this process's memory
            self._cross_mean(node_sum, 1.0, step, self.mean_buf)
            self.node.write(self.mean_buf, start=AREAS * self.numel + area)
            self.node.write(self.zeros, start=later)  # the node's sum of step t + 2
        with self._phase("node_mean"):
            self.node.barrier()
            return self.node.pull(out, start=AREAS * self.numel + area)

    def push_early(self, v: torch.Tensor, lo: int, hi: int, step: int, out: torch.Tensor) -> None:
        """Push ``v[lo:hi] / n`` into step's sum now (one level: a gradient bucket that backward has
        finished); ``mean_`` of the same step, with the same ``out``, then pushes only the rest.
        Ranges come from the end of ``v`` towards its start, each below the last."""
        assert self.node is None, "early pushes are one level's"
        if self.early_step != step:
            self.early_step, self.early, self.pushed = step, [], (lo, hi)
            self._begin(out)
        assert hi == self.pushed[0] or self.early == [], "early ranges go down, each below the last"
        self.early += self._push(v, lo, hi, 1.0 / self.world.world_size, step)
        self.pushed = (lo, self.pushed[1])

    def _begin(self, out: torch.Tensor) -> None:
        self.pulls, self.sent, self.out = [], {}, out

    @property
    def gated(self) -> bool:
        return getattr(self.cross, "gated", False)

    def _push(self, v: torch.Tensor, lo: int, hi: int, scale: float, step: int) -> list:
        """Push ``scale * v[lo:hi]`` into step's area. Gated: each piece under its key (its place in
        the box, the same on every rank), asking for a piece's sum once this rank has pushed all of it."""
        handles = []
        for plo, phi, at, _ in self._remote_first(self.pieces[step % AREAS]):
            a, b = max(lo, plo), min(hi, phi)
            if a >= b:
                continue
            if not self.gated:
                handles.append(self.cross.push_async(v[a:b], scale, at + a - plo))
                continue
            handles.append(self.cross.push_keyed_async(v[a:b], scale, at + a - plo, at))
            self.sent[at] = self.sent.get(at, 0) + b - a
            if self.sent[at] == phi - plo:  # all of it on its way: ask for the sum of every rank's
                target = self.pushers * (self.rounds[step % AREAS] + 1) * (phi - plo)
                self.pulls.append(self.cross.pull_when_async(self.out[plo:phi], at, at, target))
        return handles

    def _cross_mean(self, v: torch.Tensor, scale: float, step: int, out: torch.Tensor) -> None:
        """Push ``scale * v`` into step's area of the cross box, get the sum into ``out`` (gated pulls,
        or a barrier and pulls), and zero this rank's own part of the area step + 2 will use (its
        shard: no link bytes). What ``push_early`` pushed of this step is not pushed again."""
        rank = self._cross_rank()
        pieces = self._remote_first(self.pieces[step % AREAS])
        early, (e0, e1) = (self.early, self.pushed) if self.early_step == step else ([], (0, 0))
        if self.early_step != step:
            self._begin(out)
        assert self.out is out, "push_early and mean_ of one step pull into the same out"
        self.early_step = -1
        with self._phase("push"):
            rest = []
            for lo, hi, _, _ in pieces:  # each piece less what was pushed early: [lo, e0) and [e1, hi)
                for a, b in ((lo, min(hi, e0)), (max(lo, e1), hi)) if e1 > e0 else ((lo, hi),):
                    if a < b:
                        rest += self._push(v, a, b, scale, step)
            if not self.gated:
                for h in early + rest:
                    h.wait()
        if not self.gated:
            with self._phase("barrier"):
                self.cross.barrier()
            self.pulls = [self.cross.pull_async(out[lo:hi], at) for lo, hi, at, _ in pieces]
        with self._phase("pull"):
            wait_all(self.pulls, self.cross.timeout, f"box {self.cross.name!r}: the step's sums")
        for h in early + rest if self.gated else ():
            h.wait()  # (acknowledged long since: every push had landed for the sums to come back)
        self.rounds[step % AREAS] += 1
        for lo, hi, at, owner in self.pieces[(step + 2) % AREAS]:
            if owner == rank or (owner is None and rank == 0):
                self.cross.write(self.zeros[: hi - lo], start=at)

    def _cross_rank(self) -> int:
        return self.cross.comm.Get_rank() if hasattr(self.cross, "comm") else self.world.rank

    def _remote_first(self, pieces: list) -> list:
        """Remote pieces first, this rank's own last: a request sent after the local copy queued behind
        the data its own server had begun to send the same peer (one TCP stream per pair of ranks),
        and the pulls ran one after the other (2 MiB each way at 0.1 Gbit/s: 250-330 ms, against
        175 ms remote first)."""
        rank = self._cross_rank()
        return sorted(pieces, key=lambda p: p[3] == rank)

    def _phase(self, name: str) -> AbstractContextManager[None]:
        return self.timers.phase(name) if self.timers is not None else nullcontext()

    def close(self) -> None:
        for box in (self.cross, self.node):
            if box is not None:
                box.close()
