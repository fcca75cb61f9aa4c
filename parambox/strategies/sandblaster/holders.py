"""The coordinator's side of the sharded L-BFGS: each vector operation goes to every shard holder.

:class:`HolderOps` is :class:`~parambox.strategies.sandblaster.shards.Ops` over the holders' shards:
an ``axpby`` or ``lincomb`` is a task to every remote holder (in order with the portions) and runs on
rank 0's own shard where it holds one; a ``reduce`` comes back as one float64 message per holder
(the block of dot products, then ``max |v|``, ``sum |v|``); an evaluation all-gathers
the point among the holders, farms out the portions, and tells each worker which of its portions won
(the holders then all-reduce the winners' gradients among themselves).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parambox.strategies.sandblaster.farm import REPLY
from parambox.strategies.sandblaster.shards import Reduced, combine, num_slots, reply_length

if TYPE_CHECKING:
    from parambox.strategies.sandblaster.strategy import Sandblaster

GATHER, REDUCE, AXPBY, REDUCTION, LINCOMB = 2.0, 3.0, 4.0, 5.0, 6.0  # task kinds: the vector operations


def payload_width(num_portions: int, history_size: int) -> int:
    """Floats after a task's fields: a flag per portion, a reduction's slots (at most every slot as
    rows and as columns), or a combination's slots and coefficients."""
    return max(num_portions, 2 * num_slots(history_size))


class HolderOps:
    """The coordinator's :class:`~parambox.strategies.sandblaster.shards.Ops`: each operation goes to
    every remote holder as a task (in order with the portions), runs on rank 0's own shard here, and
    the reductions come back as one float64 per holder."""

    def __init__(self, sb: Sandblaster):
        self.sb, self.farm = sb, sb.farm
        self.remote = [r for r in sb.holders if r != 0]
        self.local = sb.store  # rank 0's shard, if it holds one
        self.weight_decay = sb.weight_decay
        self.bytes_in = 0  # the replies' bytes (the farm's receiving thread counts the results')

    def axpby(self, c: int, alpha: float, a: int, beta: float, b: int) -> None:
        for r in self.remote:
            self.farm.send_task(r, [AXPBY, 0, 0, c, alpha, a, beta, b], defer=True)
        if self.local is not None:
            self.local.axpby(c, alpha, a, beta, b)

    def lincomb(self, c: int, terms: dict[int, float]) -> None:
        slots, coefs = list(terms), list(terms.values())
        for r in self.remote:
            self.farm.send_task(r, [LINCOMB, 0, 0, c, len(slots)], slots + coefs, defer=True)
        if self.local is not None:
            self.local.lincomb(c, terms)

    def reduce(self, rows: list[int], cols: list[int], amax: int = -1, asum: int = -1) -> Reduced:
        for r in self.remote:
            self.farm.send_task(r, [REDUCTION, 0, 0, len(rows), len(cols), amax, asum], rows + cols)
        replies = [] if self.local is None else [self.local.reduce(rows, cols, amax, asum)]
        for r in self.remote:
            reply = torch.empty(reply_length(rows, cols), dtype=torch.float64)
            with self.sb.collective("sandblaster reduction reply"):
                dist.recv(reply, src=r, tag=REPLY, group=self.sb.group)
            self.bytes_in += reply.numel() * reply.element_size()
            self.farm.delivered(r)
            replies.append(reply)
        return combine(replies, rows, cols)

    def evaluate(self, src: int, dst: int) -> float:
        """The mean loss at ``src``; the gradient (weight decay included) into ``dst`` on the shards."""
        sb, farm = self.sb, self.farm
        for r in self.remote:
            farm.send_task(r, [GATHER, 0, 0, src])
        weights = sb.all_gather(src) if self.local is not None else None  # the coordinator's thread's
        ev = farm.evaluate(weights, sb.batch)
        eval_id, num = farm.eval_id, sb.options.num_portions
        for r in self.remote:
            flags = [float(ev.winners.get(p) == r) for p in range(num)]
            farm.send_task(r, [REDUCE, eval_id, 0, dst, src, ev.samples, sb.weight_decay], flags, defer=True)
        if self.local is not None:  # the all-reduce below needs the remote holders: no waiting
            farm.flush()
            won = [p for p, r in sorted(ev.winners.items()) if r == 0]
            sb.reduce(farm.local.grads, eval_id, won, dst, src, ev.samples, sb.weight_decay)
        stats = sb.step_stats
        stats["evals"] += 1
        stats["batch_s"] += ev.seconds
        stats["backups"] += ev.backups
        stats["backup_wins"] += ev.backup_wins
        sb.last_data_loss = ev.loss_sum / ev.samples
        return sb.last_data_loss
