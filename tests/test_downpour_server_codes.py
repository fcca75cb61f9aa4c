"""``downpour.compression`` over the rma box's memory servers, under mpiexec: the codes cross the link.

Two ranks, each holding half of the box (``num_shards=2``, ``server=True``), each a downpour worker whose
pushes are encoded with error feedback, one message a shard (``PushEncoder`` over ``code_pieces``): its own
half decoded in place, the other half's bytes sent to the other rank's server, which decodes and adds them.
Plain pushes (fetch 2, push 3) and fused push-pulls (fetch = push = 1). The center equals the sum of both
workers' decoded messages, rebuilt here by independent encoders; the bytes each worker sent to the other's
server are its messages' (``ServerBox.payload_bytes``), against 4 bytes an element uncompressed. Run as a
script this file is the worker.
"""

from __future__ import annotations

import json

import pytest

NUMEL = 300_007  # a bf16 half is 300 KB: more than one chunk of bytes
STEPS = 7
MODES = ("bf16", "int8", "sign", "topk")


def updates(rank: int) -> list:
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(NUMEL, generator=g) * 0.1 for _ in range(STEPS)]


def worker() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's tests
    import torch
    from mpi4py import MPI

    from parambox.box import open_box
    from parambox.runtime.world import World
    from parambox.strategies.center import CenterClient, CounterMap
    from parambox.strategies.compress import PushEncoder
    from parambox.strategies.downpour import DownpourWorker

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    world = World(rank, size, rank, size, 0, 1, "mpi")
    out: dict = {"rank": rank}
    for mode in (*MODES, "none"):
        for n_fetch, n_push in ((2, 3), (1, 1)):
            name = f"dpc{mode}{n_push}"
            box = open_box(
                "rma", world, NUMEL, CounterMap(size).num_counters, name, server=True, num_shards=2
            )
            pieces = box.code_pieces(0, NUMEL)
            encoder = None if mode == "none" else PushEncoder(mode, pieces, 0, block=256, ratio=0.05)
            inputs = []
            if encoder is not None:
                encode = encoder.encode
                encoder.encode = lambda x, encode=encode, inputs=inputs: inputs.append(x.clone()) or encode(x)
            x = torch.zeros(NUMEL)
            w = DownpourWorker(
                CenterClient(box, NUMEL), x, n_fetch, n_push, fuse=n_push == 1, encoder=encoder
            )
            for step, u in enumerate(updates(rank)):
                w.before_step(step)
                x.add_(u)
                assert w.after_step(step)
            if w.acc_live or not torch.equal(x, w.snap):
                assert w.push()
            sent = box.payload_bytes
            box.barrier()
            center = box.pull(torch.empty(NUMEL))
            everyone = comm.gather((inputs, sent), root=0)
            if rank == 0:
                key = f"{mode}-{n_push}"
                r = out[key] = {"pieces": [hi - lo for lo, hi in pieces]}
                total = sum(torch.stack(updates(k)).sum(0) for k in range(size))
                if encoder is None:
                    r["center"] = float((center - total).abs().max())
                else:
                    expected = torch.zeros(NUMEL)
                    for ins, _ in everyone:
                        ref = PushEncoder(mode, pieces, 0, block=256, ratio=0.05)
                        expected += sum(ref.decode(ref.encode(a)) for a in ins)
                    r["center"] = float((center - expected).abs().max())
                    r["lossy"] = float((center - total).abs().max())
                r["pushes"] = -(-STEPS // n_push)
                r["sent"] = everyone[0][1]  # rank 0's bytes to rank 1's server (rank 0 holds the first half)
            box.barrier()
            box.close()
    print(json.dumps(out), flush=True)


@pytest.mark.timeout(120)
def test_the_servers_decode_the_pushes_and_the_link_carries_the_codes():
    from parambox.strategies.compress import PushEncoder
    from tests.conftest import mpi_rank0_result  # (not at the top: the file is also the worker)

    result = mpi_rank0_result(__file__)
    pushes = {1: STEPS, 3: -(-STEPS // 3)}
    for n_push in (3, 1):
        plain = result[f"none-{n_push}"]
        assert plain["center"] <= 1e-5, plain  # float32 pushes: the sum of every update
        half = plain["pieces"][1]
        assert plain["sent"] == 4 * half * pushes[n_push]  # float32 to the other half's server
        for mode in MODES:
            r = result[f"{mode}-{n_push}"]
            assert r["pieces"] == plain["pieces"] and len(r["pieces"]) == 2
            assert r["center"] <= 1e-5 and r["lossy"] > 1e-3, (mode, r)
            assert r["pushes"] == pushes[n_push]
            remote = PushEncoder(mode, [(0, NUMEL - half), (NUMEL - half, NUMEL)], 0, ratio=0.05)
            assert r["sent"] == remote.parts[1].message_bytes(0) * pushes[n_push], (mode, r)
            assert r["sent"] <= 0.51 * plain["sent"]  # bf16 half of float32; the others far less


if __name__ == "__main__":
    worker()
