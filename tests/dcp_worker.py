"""Every data-parallel rule through ``torch.distributed.checkpoint`` in the order that serves the rules
that copy the weights: 4 steps, ``get_state_dict`` and ``dcp.save``; then a fresh model loaded before
wrapping (``set_model_state_dict``), a fresh wrap given the optimizer's state after
(``set_optimizer_state_dict``), 4 more steps.

``torchrun --nproc-per-node 2 tests/dcp_worker.py STRATEGIES OUT``: each rank writes
``OUT/<strategy>-rank<r>.pt``, its weights after ``close()``. ``diloco+stream`` and ``diloco+astream``
run Streaming DiLoCo, synchronous and asynchronous.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import checkpoint
from torch.distributed.checkpoint import state_dict as dsd

import parambox


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)


def train(model: nn.Module, opt: parambox.DistributedOptimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + opt.rank)
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


# "diloco+stream": Streaming DiLoCo (two fragments, tau 1, alpha 0.5); "diloco+astream": asynchronous
STREAMING = {"inner_steps": 2, "fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
FORMS = {"stream": STREAMING, "astream": {**STREAMING, "asynchronous": True}}


def run(name: str, out: Path) -> None:
    folder = out / f"{name}-dcp"
    strategy, _, form = name.partition("+")
    options = FORMS.get(form)
    model, base = build()
    with parambox.DistributedOptimizer(model, base, strategy, options, timeout=60) as opt:
        train(model, opt, range(4))
        model_state, optim_state = dsd.get_state_dict(model, opt)
        checkpoint.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    model, base = build()
    state = {"model": dsd.get_model_state_dict(model)}
    checkpoint.load(state, checkpoint_id=folder)
    dsd.set_model_state_dict(model, state["model"])
    with parambox.DistributedOptimizer(model, base, strategy, options, timeout=60) as opt:
        state = {"optim": dsd.get_optimizer_state_dict(model, opt)}
        checkpoint.load(state, checkpoint_id=folder)
        dsd.set_optimizer_state_dict(model, opt, state["optim"])
        train(model, opt, range(4, 8))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(weights, out / f"{name}-rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    dist.init_process_group("gloo")  # the script's own group: dcp.save and load need one between wraps
    for name in sys.argv[1].split(","):
        run(name, Path(sys.argv[2]))
    dist.destroy_process_group()
