"""One rank of the fencing test (``tests/test_survive_in_place.py``), without a launcher:
``python -m tests.elastic_worker RANK WORLD_SIZE OUT_JSON``, the store named in ``PARAMBOX_GROUP_STORE``.

Every rank joins; rank 1 then stalls past the others' timeout (as a SIGSTOPped process would: its
connections stay open, it answers nothing), wakes and sends its stale contribution (1000) into the old
group and tries to regroup. The survivors regroup without it and keep allreducing ones; what each sum
was is written to OUT_JSON, with ``fenced`` for a rank that was left out."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from parambox.runtime.elastic import ElasticGroup, Fenced, PeerLost

# fenced at ~9 s: the timeout, then the grace (4 + 1). A 2 s timeout was too short for a survivor to
# check in within the grace on a loaded machine (the suite's CI left rank 2 out once).
TIMEOUT_S, STALL_S, SURVIVE_S = 4.0, 12.0, 15.0


def allreduce(group: ElasticGroup, value: float, step: int) -> float:
    """One guarded allreduce, repeated over the survivors after a lost peer."""
    while True:
        t = torch.tensor([value])
        try:
            with group.guard("test allreduce", step):
                dist.all_reduce(t)
            return float(t)
        except PeerLost:
            group.regroup(step)


def main() -> None:
    rank, world_size, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    group = ElasticGroup.from_env(rank, world_size, TIMEOUT_S, "gloo")
    group.join()
    record: dict = {"sums": [allreduce(group, 1.0, 0)]}
    start = time.monotonic()
    try:
        if rank == 1:
            time.sleep(STALL_S)
            record["sums"].append(allreduce(group, 1000.0, 1))  # stale: must never reach the survivors
        else:
            step = 1
            while time.monotonic() - start < SURVIVE_S:
                record["sums"].append(allreduce(group, 1.0, step))
                step += 1
                time.sleep(0.2)
        record["members"] = group.members
    except Fenced as e:
        record["fenced"] = str(e)
    finally:
        dist.destroy_process_group() if dist.is_initialized() else None
    with open(out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
