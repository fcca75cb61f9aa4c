"""A loop written the way DDP and nanoGPT users write theirs, run under torchrun with DistributedOptimizer.

``python tests/realloop_worker.py STRATEGIES OUT K START STOP``: for each strategy in turn, steps
``START`` to ``STOP`` of a run of ``STEPS`` with ``K`` micro-batches per step (the first ``K - 1``
inside ``opt.no_sync()``), ``clip_grad_norm_`` between backward and step, AdamW with a cosine
schedule and warmup set through ``opt.param_groups``, ``zero_grad(set_to_none=True)``. ``START > 0``
resumes from ``OUT/<strategy>-ckpt-rank<r>.pt`` (the model's and the optimizer's ``state_dict()``,
loaded in this fresh process); every run saves that checkpoint at ``STOP`` and
``torch.save(model)`` mid-run. Each rank writes its final weights to ``OUT/<strategy>-rank<r>.pt``.
A sixth argument ``horovod`` writes the loop as horovod's users do: ``backward_passes_per_step=K``
and K plain backward passes, then ``opt.synchronize()``, the clip, ``with opt.skip_synchronize():
opt.step()``; ``dcp`` checkpoints through ``torch.distributed.checkpoint`` instead, as torchtitan does
(``get_state_dict`` and ``dcp.save`` at ``STOP``; ``dcp.load`` into a fresh wrap and ``set_state_dict``);
``restart`` is a job under ``torchrun --max-restarts``: it checkpoints every 2 steps, rank 1 SIGKILLs itself
at step 5 in the first life, and each life resumes from the last checkpoint there is.
:func:`reference` is the same loop in one process on the global batch: what a synchronous rule gives.
"""

from __future__ import annotations

import io
import math
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

B, DIM, STEPS, WARMUP, LR, CLIP = 8, 8, 10, 3, 0.02, 0.05


class Net(nn.Module):
    """A tied-weight residual map, no dropout: the same function in every process."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(DIM, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.dec = nn.Linear(DIM, DIM)
        self.dec.weight = self.enc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.enc(x))
        return self.dec(h + torch.tanh(self.mid(h)))


def lr_at(step: int) -> float:
    """nanoGPT's schedule: linear warmup, then cosine decay to a tenth."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    ratio = (step - WARMUP) / max(1, STEPS - WARMUP)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * ratio)))


def batch(step: int, micro: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro`` of ``step``'s global batch (``world_size * B`` samples)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(world_size * B, DIM, generator=g)
    return x, torch.sin(3 * x.flip(1)) + 0.1 * torch.randn(world_size * B, DIM, generator=g)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(7)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def reference(k: int, world_size: int, resized: dict[int, int] | None = None) -> dict[str, torch.Tensor]:
    """One process, the global batch, the same loop: accumulation, clipping, AdamW, schedule.
    ``resized = {step: n, ...}``: from that step on, the global batch of ``n`` ranks (a job resumed at n)."""
    model, opt = build()
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        world_size = (resized or {}).get(step, world_size)
        for micro in range(k):
            x, y = batch(step, micro, world_size)
            (F.mse_loss(model(x), y) / k).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: v.detach().clone() for n, v in model.state_dict().items()}


def run(
    strategy: str,
    out: Path,
    k: int,
    start: int,
    stop: int,
    horovod: bool = False,
    dcp: bool = False,
    restart: bool = False,
) -> None:
    import parambox

    rank = int(os.environ.get("RANK", "0"))
    run_name, (strategy, _, form) = strategy, strategy.partition("+")  # "easgd+sync", "diloco+int8"
    options = {"tau": 2} if strategy in ("easgd", "hybrid") else {}
    options.update({"inner_steps": 2, "asynchronous": form == "async"} if strategy == "diloco" else {})
    options.update({"sync": True} if form == "sync" else {})
    options.update({"compression": "int8"} if form == "int8" else {})  # error feedback in opt.state_dict()
    options.update({"period": 2} if strategy == "weight-avg" else {})
    if form in ("stream", "astream"):  # Streaming DiLoCo: two fragments, each landing a step late, mixed
        options.update(
            fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5, asynchronous=form == "astream"
        )
    model, base = build()
    passes = k if horovod else 1
    opt = parambox.DistributedOptimizer(
        model, base, strategy, options, steps=STEPS, timeout=60, backward_passes_per_step=passes
    )
    ckpt = out / f"{run_name}-ckpt-rank{rank}.pt"
    first_life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if restart and ckpt.exists():  # torchrun restarted the job: from the last checkpoint
        start = int(torch.load(ckpt, weights_only=True)["step"])
    if start and dcp:
        from torch.distributed import checkpoint
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(model, opt)  # the fresh objects' state: what to load into
        state = {"model": model_state, "optim": optim_state}
        checkpoint.load(state, checkpoint_id=out / f"{run_name}-dcp")
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert opt.step_count == 0, opt.step_count  # torch's state initialisation stepped nothing
    elif start:
        saved = torch.load(ckpt, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        assert opt.step_count == start, (opt.step_count, start)
    ws, r = opt.world_size, opt.rank
    for step in range(start, stop):
        if restart and first_life and rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        for micro in range(k):
            x, y = batch(step, micro, ws)
            loss = F.mse_loss(model(x.chunk(ws)[r]), y.chunk(ws)[r]) / k
            if micro < k - 1 and not horovod:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if horovod:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            with opt.skip_synchronize():
                opt.step()
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
        opt.zero_grad(set_to_none=True)
        if step == start:
            torch.save(model, io.BytesIO())  # the user's model stays picklable mid-run
        if restart and step % 2 == 1:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}
            torch.save(state, ckpt.with_suffix(".tmp"))
            os.replace(ckpt.with_suffix(".tmp"), ckpt)  # (a death while writing keeps the last one)
    if stop < STEPS and dcp:
        from torch.distributed import checkpoint
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, opt)
        checkpoint.save({"model": model_state, "optim": optim_state}, checkpoint_id=out / f"{run_name}-dcp")
    elif stop < STEPS:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ckpt)
    if stop < STEPS:
        opt.abort()  # the job ends here (a time limit): no close, the next process resumes
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return
    opt.close()
    torch.save(model, io.BytesIO())
    torch.save({n: v.detach().clone() for n, v in model.state_dict().items()}, out / f"{run_name}-rank{r}.pt")


if __name__ == "__main__":
    names, folder, k, start, stop = sys.argv[1:6]
    horovod, dcp, restart = ("horovod" in sys.argv[6:]), ("dcp" in sys.argv[6:]), ("restart" in sys.argv[6:])
    for name in names.split(","):
        run(name, Path(folder), int(k), int(start), int(stop), horovod, dcp, restart)
