"""The peers the benchmarks hold parambox against, built as their own documentation builds them.

- ``post_local_sgd_stepper``: PyTorch's ``PostLocalSGDOptimizer`` (DDP with the post-local-SGD comm
  hook on size-1 subgroups, ``PeriodicModelAverager``), i.e. local SGD with the weights averaged every
  ``period`` steps: parambox's ``weight-avg``. ``warmup_steps = period - 1`` makes it average after the
  same steps (the 4th, 8th, ...) as ``weight-avg`` (their models then agree exactly).
- ``torchft_diloco_stepper``: torchft's ``DiLoCo`` (synchronous, over allreduce; torchft has no
  asynchronous form), each rank its own replica group, a lighthouse in rank 0's process. torchft is
  optional (``pip install 'parambox[peers]'``, a CPU wheel for CPython 3.11 on Linux):
  ``torchft_missing()`` says why it cannot run, and the benchmarks then report its figures as null
  with that reason. ``init_sync=False``: every replica starts from the same seeded weights; with
  torchft's default a replica first heals from another one over HTTP, which is not DiLoCo's first
  round.

A stepper is ``(step(batch, i), close())``, as the timed rounds of ``bench sync`` and ``bench cluster``
take them; every rank builds its setups in the same order (they make process groups collectively).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


def post_local_sgd_stepper(model: nn.Module, make_optimizer: OptimizerFactory, period: int = 4):
    """PostLocalSGDOptimizer at ``period``, as PyTorch documents it (CPU: gloo, no device_ids)."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
        post_localSGD_hook,
    )
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    # Local SGD from the first step: DDP's gradient allreduce runs on a 1-rank subgroup (a no-op);
    # the subgroup must be given on CPU (the default size is the CUDA device count).
    subgroup, _ = dist.new_subgroups(group_size=1)
    ddp.register_comm_hook(PostLocalSGDState(None, subgroup, start_localSGD_iter=0), post_localSGD_hook)
    averager = PeriodicModelAverager(period=period, warmup_steps=period - 1)
    opt = PostLocalSGDOptimizer(optim=make_optimizer(ddp.parameters()), averager=averager)

    def step(batch, i):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()

    return step, lambda: None


def torchft_missing() -> str | None:
    """Why torchft's DiLoCo cannot run here (None: it can)."""
    try:
        import torchft  # noqa: F401
        from torchft.local_sgd import DiLoCo  # noqa: F401
    except Exception as e:  # an ImportError, or a wheel built for another torch
        return f"torchft is not importable ({type(e).__name__}: {e}); pip install 'parambox[peers]'"
    return None


def torchft_diloco_stepper(
    model: nn.Module,
    make_optimizer: OptimizerFactory,
    sync_every: int,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    timeout_s: float = 120.0,
):
    """torchft 0.2.0 DiLoCo: each rank one replica group; rank 0 runs the lighthouse, its address
    reaches the others over the default process group (a byte tensor, no pickle)."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo

    rank, world_size = dist.get_rank(), dist.get_world_size()
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=world_size) if rank == 0 else None
    # the lighthouse names itself by host name; it listens on loopback only
    port = lighthouse.address().rsplit(":", 1)[1] if lighthouse else ""
    address = _broadcast_text(f"http://127.0.0.1:{port}" if lighthouse else "")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this replica group's
    inner = make_optimizer(model.parameters())
    nesterov = outer_momentum > 0
    outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
    wait = timedelta(seconds=timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=wait),
        min_replica_size=world_size,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        use_async_quorum=False,  # DiLoCo requires it
        replica_id=f"parambox_bench_{rank}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=address,
        hostname="127.0.0.1",
        timeout=wait,
        quorum_timeout=wait,
        connect_timeout=wait,
        init_sync=False,
    )
    diloco = DiLoCo(manager, [model], inner, outer, sync_every=sync_every)
    diloco.__enter__()
    stores = [store]

    def step(batch, i):
        x, y = batch
        inner.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        inner.step()  # torchft's post-hook: every sync_every steps, the outer step

    def close():
        diloco.__exit__(None, None, None)
        manager.shutdown(wait=False)
        stores.clear()  # the replica group's store lives until here: the Manager holds only its port
        dist.barrier()  # nobody's lighthouse goes before the others are done with it
        if lighthouse is not None:
            lighthouse.shutdown()

    return step, close


def _broadcast_text(text: str, size: int = 256) -> str:
    buf = torch.zeros(size, dtype=torch.uint8)
    data = text.encode()[:size]
    buf[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return bytes(buf.tolist()).rstrip(b"\0").decode()
