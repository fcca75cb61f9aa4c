"""One measuring process for ``parambox predict``, started by :mod:`parambox.perfmodel.measure`.

Run as ``python -m parambox.perfmodel._worker '<json spec>'`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set. Rank 0 prints one line ``PARAMBOX_RESULT {json}``; nothing is pickled between processes.

Modes:
- ``profile``: T_comp at each of ``batch_sizes`` in a fresh process with ``threads`` threads (a process that
  ran torch with more threads first stays slower after switching down).
- ``bandwidth``: gloo allreduce of a tiny and of a ``probe_bytes`` message between the ranks.
- ``validate``: with 1 rank, the step time of plain training at the global batch; with 2 ranks, rounds of
  (compute-only step, DDP-like step: backward, then one allreduce of the flat gradient, then SGD), plus the
  bandwidth probe, all measured in the same processes so they share the cores as the real step does. A
  round's time is the slower rank's (a synchronous step waits for it); the result is the fastest round.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from parambox.perfmodel.compute import time_calls
from parambox.perfmodel.sample import Sample, build_measured_model
from parambox.runtime.dist import destroy_distributed
from parambox.runtime.heap import keep_freed_memory
from parambox.runtime.mpi import exit_now

RESULT_MARKER = "PARAMBOX_RESULT "


def allreduce_time_s(numel: int, repeats: int) -> float:
    """Fastest time of an allreduce of ``numel`` float32 values; a barrier first so both ranks start together."""
    buf = torch.ones(numel)
    dist.all_reduce(buf)  # warm-up: connection set-up and buffer allocation
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - t0)
    return min(times)


def probe_network(probe_bytes: int, repeats: int) -> dict:
    return {
        "tiny_s": allreduce_time_s(1, 4 * repeats),
        "probe_s": allreduce_time_s(max(1, probe_bytes // 4), repeats),
        "probe_bytes": probe_bytes,
    }


def flat_grads_(model: nn.Module) -> torch.Tensor:
    """Point every parameter's .grad into one flat buffer (as DDP's gradient_as_bucket_view), so the
    gradient allreduce is one message with no copies; backward accumulates into the views in place."""
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def make_steps(spec: dict, batch: int, world_size: int):
    sample = Sample.from_json(spec["sample"])
    torch.manual_seed(0)
    model = build_measured_model(spec["model"], sample)
    model.train()
    flat = flat_grads_(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    data = sample.batch(batch)

    def compute_step(communicate: bool = False) -> None:
        flat.zero_()
        sample.loss(model, data).backward()
        if communicate:
            dist.all_reduce(flat)
            flat.div_(world_size)
        opt.step()

    def ddp_step() -> None:
        compute_step(communicate=True)

    return compute_step, ddp_step


def fastest(xs: list[float]) -> float:
    # The minimum, as in compute.best_times_s: foreign load on a shared machine only adds time.
    return min(xs)


def validate(spec: dict, rank: int, world_size: int) -> dict:
    batch = spec["global_batch"] // world_size
    compute_step, ddp_step = make_steps(spec, batch, world_size)
    rounds = spec["rounds"]
    if world_size == 1:
        compute_step()  # warm-up
        return {"step_s": fastest(time_calls(compute_step, rounds)), "local_batch": batch}
    compute_step(), ddp_step()  # warm-up: allocator, gloo pairs
    comp, step = [], []
    for _ in range(rounds):
        # One of each per round, both ranks released together: the compute-only and the real step see the
        # same foreign load, and a round's compute times on the two ranks are concurrent.
        dist.barrier()
        comp += time_calls(compute_step, 1)
        dist.barrier()
        step += time_calls(ddp_step, 1)
    net = probe_network(spec["probe_bytes"], spec["repeats"])
    per_rank = _gather(comp + step, world_size)
    comp_all = [max(r[i] for r in per_rank) for i in range(rounds)]  # a sync step waits for the slowest
    step_all = [max(r[rounds + i] for r in per_rank) for i in range(rounds)]
    return {"compute_s": fastest(comp_all), "step_s": fastest(step_all), "local_batch": batch, **net}


def _gather(values: list[float], world_size: int) -> list[list[float]]:
    mine = torch.tensor(values, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)  # tensors, not pickled objects
    return [t.tolist() for t in every]


def profile(spec: dict) -> dict:
    from parambox.perfmodel.compute import time_batches

    sample = Sample.from_json(spec["sample"])
    torch.manual_seed(0)
    model = build_measured_model(spec["model"], sample)
    times = time_batches(model, sample, spec["batch_sizes"], spec["repeats"])
    return {str(b): t for b, t in times.items()}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    torch.set_num_threads(spec["threads"])
    keep_freed_memory()  # timed as a training rank runs
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size > 1:
        timeout = timedelta(seconds=spec.get("timeout_s", 120))
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    try:
        if spec["mode"] == "bandwidth":
            result = probe_network(spec["probe_bytes"], spec["repeats"])
        elif spec["mode"] == "profile":
            result = profile(spec)
        else:
            result = validate(spec, rank, world_size)
    finally:
        if world_size > 1:
            destroy_distributed()
    if rank == 0:
        print(RESULT_MARKER + json.dumps(result), flush=True)
    if world_size > 1:
        exit_now(0)  # gloo's threads may abort in C++ destructors at a normal exit
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
