"""The coordinator's side of the sharded L-BFGS: each vector operation goes to every shard holder.

:class:`HolderOps` is :class:`~parambox.strategies.sandblaster.shards.Ops` over the holders' shards:
an ``axpby`` is a task to every remote holder (in order with the portions) and runs on rank 0's own
shard where it holds one; a reduction comes back as one float64 per holder; an evaluation all-gathers
the point among the holders, farms out the portions, and tells each worker which of its portions won
(the holders then all-reduce the winners' gradients among themselves).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parambox.strategies.sandblaster.farm import REPLY

if TYPE_CHECKING:
    from parambox.strategies.sandblaster.strategy import Sandblaster

GATHER, REDUCE, AXPBY, REDUCTION = 2.0, 3.0, 4.0, 5.0  # task kinds: the vector operations
REDUCTIONS = ("dot", "amax", "asum")


class HolderOps:
    """The coordinator's :class:`~parambox.strategies.sandblaster.shards.Ops`: each operation goes to
    every remote holder as a task (in order with the portions), runs on rank 0's own shard here, and
    the reductions come back as one float64 per holder."""

    def __init__(self, sb: Sandblaster):
        self.sb, self.farm = sb, sb.farm
        self.remote = [r for r in sb.holders if r != 0]
        self.local = sb.store  # rank 0's shard, if it holds one
        self.bytes_in = 0  # the replies' bytes (the farm's receiving thread counts the results')

    def axpby(self, c: int, alpha: float, a: int, beta: float, b: int) -> None:
        for r in self.remote:
            self.farm.send_task(r, [AXPBY, 0, 0, c, alpha, a, beta, b])
        if self.local is not None:
            self.local.axpby(c, alpha, a, beta, b)

    def _reduction(self, op: str, a: int, b: int = 0) -> list[float]:
        for r in self.remote:
            self.farm.send_task(r, [REDUCTION, 0, REDUCTIONS.index(op), a, b])
        values = [] if self.local is None else [self.local.reduce(op, a, b)]
        reply = torch.empty(1, dtype=torch.float64)
        for r in self.remote:
            with self.sb.collective(f"sandblaster {op} reply"):
                dist.recv(reply, src=r, tag=REPLY, group=self.sb.group)
            self.bytes_in += reply.numel() * reply.element_size()
            self.farm.delivered(r)
            values.append(float(reply))
        return values

    def dot(self, a: int, b: int) -> float:
        return sum(self._reduction("dot", a, b))

    def amax(self, a: int) -> float:
        return max(self._reduction("amax", a))

    def asum(self, a: int) -> float:
        return sum(self._reduction("asum", a))

    def evaluate(self, src: int, dst: int) -> float:
        """The objective (mean loss + weight decay) at ``src``; its gradient into ``dst`` on the shards."""
        sb, farm = self.sb, self.farm
        for r in self.remote:
            farm.send_task(r, [GATHER, 0, 0, src])
        weights = sb.all_gather(src) if self.local is not None else None  # the coordinator's thread's
        ev = farm.evaluate(weights, sb.batch)
        eval_id, num = farm.eval_id, sb.options.num_portions
        for r in self.remote:
            flags = [float(ev.winners.get(p) == r) for p in range(num)]
            farm.send_task(r, [REDUCE, eval_id, 0, dst, src, ev.samples, sb.weight_decay], flags)
        if self.local is not None:
            won = [p for p, r in sorted(ev.winners.items()) if r == 0]
            sb.reduce(farm.local.grads, eval_id, won, dst, src, ev.samples, sb.weight_decay)
        stats = sb.step_stats
        stats["evals"] += 1
        stats["batch_s"] += ev.seconds
        stats["backups"] += ev.backups
        stats["backup_wins"] += ev.backup_wins
        sb.last_data_loss = ev.loss_sum / ev.samples
        return sb.last_data_loss + 0.5 * sb.weight_decay * self.dot(src, src)
