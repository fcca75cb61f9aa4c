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

Where the cross-node box is sharded over several ranks, every area is cut over all of them (shard k
holds part k of each area): each rank then sends and receives the same bytes, both directions of
every link carry the exchange at once, as in a ring allreduce. Laid end to end, one area would sit
on one rank, its link busy one way while the other way idles (box-sync ran at 0.60x allreduce at
0.1 Gbit/s that way).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from parambox.box.base import BoxConfig, ParameterBox, open_box
from parambox.box.layout import shard_range
from parambox.runtime.world import World

AREAS = 3


def _padded(numel: int, ranks: int) -> int:
    """The cross box's size: the areas, plus room for each shard's part of them to be whole."""
    return AREAS * (numel + 2 * ranks)


def _area_pieces(box: ParameterBox, numel: int) -> list[list[tuple[int, int, int, int | None]]]:
    """Per area, ``(lo, hi, at, owner)``: ``v[lo:hi]`` lives at ``box[at:at + hi - lo]`` on rank
    ``owner`` (None: one buffer every rank maps, as shm's). Part k of every area is in shard k."""
    shards = getattr(box, "shards", None)
    if shards is None:
        return [[(0, numel, a * numel, None)] for a in range(AREAS)]
    pieces: list[list[tuple[int, int, int, int | None]]] = [[] for _ in range(AREAS)]
    for k, (s0, s1) in enumerate(shards):
        lo, hi = shard_range(numel, k, len(shards))
        assert AREAS * (hi - lo) <= s1 - s0, "the cross box is padded for this"
        for a in range(AREAS):
            if hi > lo:
                pieces[a].append((lo, hi, s0 + a * (hi - lo), box.box_ranks[k]))
    return pieces


class BoxMean:
    """``mean_(v, step, out)``: ``out`` = the mean over every worker of their ``v`` at ``step``.

    >>> m = BoxMean(BoxConfig(backend="rma"), world, numel=10, name="g")  # doctest: +SKIP
    >>> m.mean_(grad, step, out=mean)  # doctest: +SKIP
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
    ):
        self.world, self.numel = world, numel
        if two_level is None:
            two_level = box.backend == "rma" and world.num_nodes > 1 and world.local_world_size > 1
        self.two_level = two_level
        self.zeros = torch.zeros(numel)
        self.timers: Any = None
        self.early_step, self.early, self.pushed = -1, [], (0, 0)  # push_early's, this step
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
            self.pieces = _area_pieces(self.cross, numel)
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
            self.pieces = _area_pieces(self.cross, numel)
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

    def push_early(self, v: torch.Tensor, lo: int, hi: int, step: int) -> None:
        """Push ``v[lo:hi] / n`` into step's sum now (one level: a gradient bucket that backward has
        finished); ``mean_`` of the same step then pushes only the rest. Ranges come from the end of
        ``v`` towards its start, each below the last."""
        assert self.node is None, "early pushes are one level's"
        if self.early_step != step:
            self.early_step, self.early, self.pushed = step, [], (lo, hi)
        assert hi == self.pushed[0] or self.early == [], "early ranges go down, each below the last"
        scale = 1.0 / self.world.world_size
        for plo, phi, at, _ in self.pieces[step % AREAS]:
            a, b = max(lo, plo), min(hi, phi)
            if a < b:
                self.early.append(self.cross.push_async(v[a:b], scale, at + a - plo))
        self.pushed = (lo, self.pushed[1])

    def _cross_mean(self, v: torch.Tensor, scale: float, step: int, out: torch.Tensor) -> None:
        """Push ``scale * v`` into step's area of the cross box, meet there, pull the sum into ``out``,
        and zero this rank's own part of the area step + 2 will use (its shard: no link bytes). What
        ``push_early`` pushed of this step is not pushed again."""
        rank = self.cross.comm.Get_rank() if hasattr(self.cross, "comm") else self.world.rank
        # Remote pieces first, this rank's own last: a request sent after the local copy queued behind
        # the data its own server had begun to send the same peer (one TCP stream per pair of ranks),
        # and the pulls ran one after the other (2 MiB each way at 0.1 Gbit/s: 250-330 ms, against
        # 175 ms remote first).
        pieces = sorted(self.pieces[step % AREAS], key=lambda p: p[3] == rank)
        early, (e0, e1) = (self.early, self.pushed) if self.early_step == step else ([], (0, 0))
        self.early_step = -1
        with self._phase("push"):
            rest = []
            for lo, hi, at, _ in pieces:  # each piece less what was pushed early: [lo, e0) and [e1, hi)
                for a, b in ((lo, min(hi, e0)), (max(lo, e1), hi)) if e1 > e0 else ((lo, hi),):
                    if a < b:
                        rest.append(self.cross.push_async(v[a:b], scale, at + a - lo))
            for h in early + rest:
                h.wait()
        with self._phase("barrier"):
            self.cross.barrier()
        with self._phase("pull"):
            for h in [self.cross.pull_async(out[lo:hi], at) for lo, hi, at, _ in pieces]:
                h.wait()
        for lo, hi, at, owner in self.pieces[(step + 2) % AREAS]:
            if owner == rank or (owner is None and rank == 0):
                self.cross.write(self.zeros[: hi - lo], start=at)

    def _phase(self, name: str) -> AbstractContextManager[None]:
        return self.timers.phase(name) if self.timers is not None else nullcontext()

    def close(self) -> None:
        for box in (self.cross, self.node):
            if box is not None:
                box.close()
