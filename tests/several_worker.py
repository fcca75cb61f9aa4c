"""Several models or optimizers in one loop, as users write them: a GAN's two models, each wrapped in
its own DistributedOptimizer (:func:`gan`), and one model with two optimizers, Muon for its weight
matrices and AdamW for the rest, given to one DistributedOptimizer as a list (:func:`muon_adamw`).

The discriminator ``D`` steps on real and generated samples, then the generator ``G`` steps through
``D``: unless ``D`` is frozen there, that backward gives ``D`` gradients too (and, on a synchronous
rule, exchanges them), which the loop zeroes at the next ``D`` step. ``zero`` says how: ``"opt"``
(``optD.zero_grad()``, zeroes in place), ``"module"`` (``D.zero_grad()``, as PyTorch's DCGAN example:
it sets ``.grad = None``) or ``"torch"`` (no parambox: :func:`gan` in one process is the reference).
``two_passes``: ``D``'s real and fake losses in two backward passes (the DCGAN example), else one.

``torchrun ... tests/several_worker.py STRATEGY OUT ZERO FREEZE TWO_PASSES`` (``ZERO`` = ``muon``: the
second loop; ``zero``: :func:`zero_adamw`): each rank writes ``OUT/STRATEGY-rank<r>.pt`` (the weights after ``close()``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

B, STEPS = 8, 6


def gan(
    strategy: str | None, zero: str = "opt", freeze: bool = False, two_passes: bool = False
) -> dict[str, torch.Tensor]:
    """The loop on this rank's share of each global batch (``strategy=None``: plain PyTorch, one
    process, the whole batch); both models' weights at the end, ``D.*`` and ``G.*``."""
    import parambox

    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt_g = torch.optim.SGD(G.parameters(), lr=0.05, momentum=0.5)
    opt_d = torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.5)
    rank, world = 0, 1
    if strategy is not None:
        opt_g = parambox.DistributedOptimizer(G, opt_g, strategy)
        opt_d = parambox.DistributedOptimizer(D, opt_d, strategy)
        rank, world = opt_g.rank, opt_g.world_size
    share = slice(rank * B // world, (rank + 1) * B // world)
    g = torch.Generator().manual_seed(1)
    bce = nn.BCEWithLogitsLoss()
    try:
        for _ in range(STEPS):
            z, real = torch.randn(B, 4, generator=g)[share], torch.randn(B, 8, generator=g)[share]
            ones, zeros = torch.ones(len(z), 1), torch.zeros(len(z), 1)
            D.zero_grad() if zero == "module" else opt_d.zero_grad()
            fake = G(z)
            if two_passes:
                bce(D(real), ones).backward()
                bce(D(fake.detach()), zeros).backward()
            else:
                (bce(D(real), ones) + bce(D(fake.detach()), zeros)).backward()
            opt_d.step()
            G.zero_grad() if zero == "module" else opt_g.zero_grad()
            D.requires_grad_(not freeze)
            bce(D(fake), ones).backward()
            D.requires_grad_(True)
            opt_g.step()
            F.mse_loss(G(z), fake.detach())  # a look at G in grad mode, no backward: begins its next step
    except BaseException:  # a refused loop: release both, as a `with` block does
        if strategy is not None:
            opt_d.abort()
            opt_g.abort()
        raise
    if strategy is not None:
        opt_d.close()
        opt_g.close()
    return {
        f"{name}.{k}": v.detach().clone()
        for name, m in (("D", D), ("G", G))
        for k, v in m.state_dict().items()
    }


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _fit(model: nn.Module, opts: list, share: slice, world: int, seed: int, target, scheds=()) -> nn.Module:
    """``STEPS`` steps regressing ``target`` of the inputs on this rank's ``share`` of each global batch
    of ``world * B``, stepping each of ``opts`` (then each of ``scheds``)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        x = torch.randn(world * B, 8, generator=g)[share]
        for o in opts:
            o.zero_grad()
        F.mse_loss(model(x), target(x[:, :4])).backward()
        for o in opts:
            o.step()
        for sched in scheds:
            sched.step()
    return model


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def muon_adamw(strategy: str | None, world: int = 1) -> dict[str, torch.Tensor]:
    """Muon on the matrices, AdamW on the biases, a StepLR on each; this rank's share of each global
    batch (``strategy=None``: plain PyTorch on the whole batch of ``world`` ranks)."""
    import parambox

    model = _net()
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    opts = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=0.01)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in opts]
    if strategy is None:
        return _weights(_fit(model, opts, slice(None), world, 2, torch.sin, scheds))
    with parambox.DistributedOptimizer(model, opts, strategy) as opt:
        _fit(model, [opt], slice(opt.rank * B, (opt.rank + 1) * B), opt.world_size, 2, torch.sin, scheds)
    return _weights(model)  # after close(): the model every rank ends with


def zero_adamw(strategy: str | None, world: int = 1) -> dict[str, torch.Tensor]:
    """AdamW sharded by torch's ZeroRedundancyOptimizer (DDP users' memory saver) under allreduce, this
    rank's share of each global batch (``strategy=None``: plain AdamW on the whole batch)."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import parambox

    model = _net()
    if strategy is None:
        adamw = torch.optim.AdamW(model.parameters(), lr=0.01)
        return _weights(_fit(model, [adamw], slice(None), world, 3, torch.cos))
    dist.init_process_group("gloo")  # ZeroRedundancyOptimizer needs the group when it is made
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    with parambox.DistributedOptimizer(model, zero, strategy) as opt:
        _fit(model, [opt], slice(opt.rank * B, (opt.rank + 1) * B), opt.world_size, 3, torch.cos)
    dist.destroy_process_group()
    return _weights(model)


if __name__ == "__main__":
    strategy, out, zero, freeze, two = sys.argv[1:6]
    if zero == "zero":
        state = zero_adamw(strategy)
    elif zero == "muon":
        state = muon_adamw(strategy)
    else:
        state = gan(strategy, zero, freeze == "1", two == "1")
    torch.save(state, Path(out) / f"{strategy}-rank{os.environ.get('RANK', '0')}.pt")
