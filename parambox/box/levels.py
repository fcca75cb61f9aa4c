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
"""

from __future__ import annotations

import torch

from parambox.box.base import BoxConfig, ParameterBox, open_box
from parambox.runtime.world import World

AREAS = 3


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
        self.node: ParameterBox | None = None
        self.cross: ParameterBox | None = None
        if not two_level:
            self.cross = open_box(
                box, world, AREAS * numel, 0, name, layout_hash=layout_hash, timeout=timeout
            )
            self.leader = True
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
                box, world, AREAS * numel, 0, name, layout_hash=layout_hash, timeout=timeout, comm=leaders
            )
            self.mean_buf = torch.empty(numel)
            leaders.Free()

    def mean_(self, v: torch.Tensor, step: int, out: torch.Tensor) -> torch.Tensor:
        area = (step % AREAS) * self.numel
        later = ((step + 2) % AREAS) * self.numel
        n = self.world.world_size
        if self.node is None:
            self.cross.push(v, scale=1.0 / n, start=area)
            self.cross.barrier()
            self.cross.pull(out, start=area)
            self._zero_own(self.cross, later, self.world.rank)
            return out
        self.node.push(v, scale=1.0 / n, start=area)
        self.node.barrier()
        if self.leader:
            node_sum = self.node.local_view()[area : area + self.numel]
            self.cross.push(node_sum, start=area)  # no copy: the node's box is this process's memory
            self.cross.barrier()
            self.cross.pull(self.mean_buf, start=area)
            self.node.write(self.mean_buf, start=AREAS * self.numel + area)
            self._zero_own(self.cross, later, self.cross_rank())
            self.node.write(self.zeros, start=later)  # the node's sum of step t + 2
        self.node.barrier()
        return self.node.pull(out, start=AREAS * self.numel + area)

    def cross_rank(self) -> int:
        return self.cross.comm.Get_rank()

    def _zero_own(self, box: ParameterBox, area: int, rank: int) -> None:
        """Zero this rank's own part of the sum at ``area`` (its shard: no link bytes)."""
        stop = area + self.numel
        shards = getattr(box, "shards", None)
        if shards is None:  # one shared buffer (shm): rank 0 zeroes it all
            lo, hi = (area, stop) if rank == 0 else (0, 0)
        else:
            mine = [shards[k] for k, r in enumerate(box.box_ranks) if r == rank]
            lo, hi = (max(area, mine[0][0]), min(stop, mine[0][1])) if mine else (0, 0)
        if hi > lo:
            box.write(self.zeros[: hi - lo], start=lo)

    def close(self) -> None:
        for box in (self.cross, self.node):
            if box is not None:
                box.close()
