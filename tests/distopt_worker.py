"""User scripts for the DistributedOptimizer tests, run under torchrun, and the references they meet.

``python tests/distopt_worker.py numerics STRATEGIES OUT``: a plain loop (DistributedOptimizer
starts the process group from torchrun's environment, and ends it) on a tied-weight, non-Sequential
regression model, 20 SGD steps at batch ``B`` per rank, for each strategy in turn; each rank saves
its final state to ``OUT/<strategy>-rank<r>.pt``.

``python tests/distopt_worker.py uneven STRATEGY OUT``: rank 1 runs two steps more than rank 0.

``python tests/distopt_worker.py anymodel STRATEGIES OUT``: the script initialises torch.distributed
itself (its store holding the keys a dead life of the job left: torchrun's agents keep their store
across restarts) and runs every strategy in turn on :class:`AnyNet` (BatchNorm, a tied weight, a frozen layer,
a branch used every third step), saving ``OUT/<strategy>-rank<r>.pt`` and ``OUT/init.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

B = 8  # samples per rank and step
DIM = 8
NUMERICS_STEPS, ANYMODEL_STEPS = 20, 6
SYNC = ("allreduce", "ps-sync", "box-sync", "weight-avg")  # closed form: the one-process reference


class TiedNet(nn.Module):
    """Not a Sequential: a residual block between an input map and its tied output map."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(DIM, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.dec = nn.Linear(DIM, DIM)
        self.dec.weight = self.enc.weight  # tied: one parameter, two uses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.enc(x))
        return self.dec(h + torch.tanh(self.mid(h)))


class AnyNet(TiedNet):
    """TiedNet plus BatchNorm, a frozen layer and a branch used only when ``use_aux``."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.aux = nn.Linear(DIM, DIM)
        self.use_aux = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn(self.enc(x)))
        h = h + torch.tanh(self.frozen(h))
        if self.use_aux:
            h = h + self.aux(h)
        return self.dec(h + torch.tanh(self.mid(h)))


def build(cls: type[nn.Module], rank: int) -> nn.Module:
    # Each rank builds its own weights: DistributedOptimizer starts everyone from rank 0's.
    torch.manual_seed(100 + rank)
    return cls()


def global_batch(step: int, world_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(world_size * B, DIM, generator=g)
    return x, torch.sin(x.flip(1)) + 0.1 * torch.randn(world_size * B, DIM, generator=g)


def uses_aux(step: int) -> bool:
    return step % 3 == 0


def make_sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- references: one process, the whole global batch ---------------------------------------------------


def reference_numerics(steps: int = NUMERICS_STEPS, world_size: int = 2) -> dict[str, torch.Tensor]:
    """The plain loop on the 2b batch: what allreduce at b per rank must give."""
    model = build(TiedNet, 0)
    opt = make_sgd(model)
    for step in range(steps):
        x, y = global_batch(step, world_size)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return snapshot(model)


def reference_anymodel(buffers: str, steps: int = ANYMODEL_STEPS, world_size: int = 2) -> dict:
    """The one-process loop on the global batch with each rank's batch-norm statistics (as DDP has
    them without SyncBatchNorm): the gradient is the mean of the per-slice gradients; the running
    statistics are rank 0's slice's (``buffers="rank0"``) or the mean over the slices' (``"mean"``)."""
    model = build(AnyNet, 0)
    opt = make_sgd(model)
    for step in range(steps):
        model.use_aux = uses_aux(step)
        x, y = global_batch(step, world_size)
        start = [b.clone() for b in model.buffers()]
        after = []
        opt.zero_grad()
        for xs, ys in zip(x.chunk(world_size), y.chunk(world_size)):
            with torch.no_grad():
                for b, s in zip(model.buffers(), start):
                    b.copy_(s)
            (F.mse_loss(model(xs), ys) / world_size).backward()  # the mean of the slices' gradients
            after.append([b.clone() for b in model.buffers()])
        with torch.no_grad():
            for i, b in enumerate(model.buffers()):
                mean = torch.stack([a[i] for a in after]).float().mean(0).to(b.dtype)
                b.copy_(after[0][i] if buffers == "rank0" or not b.is_floating_point() else mean)
        opt.step()
    return snapshot(model)


# -- the user scripts --------------------------------------------------------------------------------


def numerics(strategies: list[str], out: Path) -> None:
    """One strategy after the other, each DistributedOptimizer starting (and ending) the group itself."""
    import parambox

    for strategy in strategies:
        model = build(TiedNet, int(os.environ.get("RANK", "0")))
        opt = parambox.DistributedOptimizer(
            model, make_sgd(model), strategy, steps=NUMERICS_STEPS, timeout=60
        )
        for step in range(NUMERICS_STEPS):
            x, y = global_batch(step, opt.world_size)
            xs, ys = x.chunk(opt.world_size)[opt.rank], y.chunk(opt.world_size)[opt.rank]
            loss = F.mse_loss(model(xs), ys)
            loss.backward()
            opt.step()
            opt.zero_grad()
        opt.close()
        assert not dist.is_initialized()
        torch.save(snapshot(model), out / f"{strategy}-rank{opt.rank}.pt")


def anymodel(strategies: list[str], out: Path) -> None:
    import parambox

    dist.init_process_group("gloo")  # the user's own group: DistributedOptimizer must leave it alone
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:  # what a dead life left in the store torchrun's agents keep across restarts
        from parambox.box.shm import new_prefix

        store = dist.distributed_c10d._get_default_store()
        store.set("parambox/shm_prefix/node0", new_prefix())
        for board in range(2 * len(strategies)):
            store.set(f"parambox/board/{board}", "127.0.0.1:1")
    dist.barrier()
    for run in strategies:  # "easgd+sync": easgd with sync=true
        strategy, _, form = run.partition("+")
        options = {"tau": 2} if strategy in ("easgd", "eamsgd", "hybrid") else {}
        options.update({"sync": True} if form == "sync" else {})
        if strategy == "diloco":  # "diloco+async": the asynchronous form over the box
            options.update(inner_steps=2, asynchronous=form == "async")
        model = build(AnyNet, rank)
        with parambox.DistributedOptimizer(model, make_sgd(model), strategy, options, timeout=60) as opt:
            for step in range(ANYMODEL_STEPS):
                model.use_aux = uses_aux(step)
                x, y = global_batch(step, world_size)
                opt.zero_grad()
                F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
                opt.step()
            before_close = {name: b.clone() for name, b in model.named_buffers()}
        tied = model.dec.weight is model.enc.weight
        result = {"state": snapshot(model), "tied": tied, "buffers_before_close": before_close}
        torch.save(result, out / f"{run}-rank{rank}.pt")
    if rank == 0:
        torch.save(snapshot(build(AnyNet, 0)), out / "init.pt")
    assert dist.is_initialized(), "DistributedOptimizer destroyed the user's process group"
    dist.barrier()
    dist.destroy_process_group()


def uneven(strategies: list[str], out: Path) -> None:
    """Rank 0 runs 3 steps, rank 1 runs 5 (no ``steps=``): each rank writes what it was told."""
    import parambox

    rank = int(os.environ.get("RANK", "0"))
    model = build(TiedNet, rank)
    opt = parambox.DistributedOptimizer(model, make_sgd(model), strategies[0], timeout=60)
    told = "no error"
    try:
        for step in range(3 + 2 * rank):
            x, y = global_batch(step, opt.world_size)
            opt.zero_grad()
            F.mse_loss(model(x.chunk(2)[rank]), y.chunk(2)[rank]).backward()
            opt.step()
        opt.close()
    except parambox.UserError as e:
        told = str(e)
    (out / f"uneven-rank{rank}.txt").write_text(told)


def bf16_run(strategy: str | None, out: Path | None = None) -> dict[str, torch.Tensor]:
    """TiedNet in bfloat16 throughout (``model.to(torch.bfloat16)``, AdamW), this rank's half of each
    global batch; ``strategy=None``: plain PyTorch on the whole batch, the reference."""
    import parambox

    model = build(TiedNet, 0).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    rank, world = 0, 1
    if strategy is not None:
        opt = parambox.DistributedOptimizer(model, opt, strategy)
        rank, world = opt.rank, opt.world_size
    for step in range(NUMERICS_STEPS):
        x, y = global_batch(step, 2)
        x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
        if strategy is not None:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    if strategy is not None:
        opt.close()
    state = snapshot(model)
    if out is not None:
        torch.save(state, out / f"bf16-{strategy}-rank{rank}.pt")
    return state


if __name__ == "__main__":
    if sys.argv[1] == "bf16":
        bf16_run(sys.argv[2], Path(sys.argv[3]))
    elif sys.argv[1] == "uneven":
        uneven(sys.argv[2].split(","), Path(sys.argv[3]))
    elif sys.argv[1] == "numerics":
        numerics(sys.argv[2].split(","), Path(sys.argv[3]))
    else:
        anymodel(sys.argv[2].split(","), Path(sys.argv[3]))
