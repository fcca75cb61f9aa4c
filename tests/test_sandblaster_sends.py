"""Sandblaster's coordinator lets go of each task message once the worker has it.

gloo's sends cannot be polled: a send's work says it is completed only once waited on. The farm polled
them, so every message of the run stayed in its list and every result scanned the list again: near
the end of a converged run (ten evaluations a step, the line search failing) a step took seconds,
then minutes, and ``parambox train --strategy sandblaster --steps 130`` seemed to hang after step
100. An answer from a worker proves it has received the message it answers and all before it: the
farm waits those sends then (at once) and drops them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parambox.strategies.sandblaster.farm import (
    BYE,
    COMPUTE,
    END_STEP,
    FRAMES,
    REPLY,
    RESULT,
    RESULT_LEN,
    TASK,
    PortionFarm,
    task_message_len,
)
from parambox.strategies.sandblaster.holders import AXPBY, REDUCTION
from parambox.strategies.sandblaster.portions import portion_bounds
from tests.forked import fork_ranks

EVALS, PORTIONS, SAMPLES = 30, 4, 8


def _serve(payload: int) -> None:
    """Rank 1: each portion's result (loss sum 1 and its sample count), a reduction's reply, bye at the end."""
    import torch.distributed as dist

    msg = torch.empty(task_message_len(payload), dtype=torch.float64)
    while True:
        dist.recv(msg, src=0, tag=TASK)
        for task in msg[1:].view(FRAMES, -1)[: int(msg[0])]:
            kind, eval_id, portion = task[:3].tolist()
            if kind == END_STEP:
                bye = torch.zeros(RESULT_LEN)
                bye[0] = BYE
                dist.send(bye, dst=0, tag=RESULT)
                return
            if kind == COMPUTE:
                start, end = portion_bounds(SAMPLES, PORTIONS)[int(portion)]
                out = torch.tensor([eval_id, portion, 1.0, float(end - start), 0.0])
                dist.send(out, dst=0, tag=RESULT)
            elif kind == REDUCTION:
                dist.send(torch.zeros(1, dtype=torch.float64), dst=0, tag=REPLY)


def _coordinate(out: Path) -> None:
    """Rank 0: evaluations as the L-BFGS step makes them (portions, then a deferred vector operation
    and a reduction answered by a reply); after each, the sends still held."""
    import torch.distributed as dist

    farm = PortionFarm([1], PORTIONS, timeout_s=30.0)
    held, sums = [], []
    for _ in range(EVALS):
        ev = farm.evaluate(None, (None, portion_bounds(SAMPLES, PORTIONS)))
        sums.append((ev.loss_sum, ev.samples))
        farm.send_task(1, [AXPBY, 0, 0, 3, 1.0, 0, 0.5, 2], defer=True)
        farm.send_task(1, [REDUCTION, 0, 0, 1, 1, -1, -1], [0, 0])
        dist.recv(torch.empty(1, dtype=torch.float64), src=1, tag=REPLY)
        farm.delivered(1)
        held.append(len(farm.sends[1]))
    farm.end_step(0.0)
    farm.close()
    assert sums == [(float(PORTIONS), SAMPLES)] * EVALS
    out.write_text(" ".join(map(str, held)))


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # forked: stay out of the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 0:
            _coordinate(Path(out))
        else:
            _serve(PORTIONS)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_the_coordinator_holds_no_send_the_worker_has_answered(tmp_path: Path) -> None:
    from parambox.runtime.dist import free_port

    out = tmp_path / "held"
    procs = fork_ranks(_rank, 2, (free_port(), str(out)), timeout=80)
    assert [p.exitcode for p in procs] == [0, 0]
    # Every message went before the reply came: none is held (before the fix: 5 more per evaluation).
    assert out.read_text().split() == ["0"] * EVALS
