"""``easgd.compression`` over the rma box's memory servers, under mpiexec: the elastic push's codes cross the link.

Two ranks, each holding half of the box (``num_shards=2``, ``server=True``), each an asynchronous EASGD
worker (``CenterClient.elastic_encoded_``: ``e = x - c; x -= alpha e; c += alpha D(Q(e + err))``) whose
push is encoded with error feedback, one message a shard (``PushEncoder`` over ``code_pieces``): its own
half decoded in place, the other half's bytes sent to the other rank's server, which decodes them and adds
``alpha`` times the values. The center equals ``alpha`` times the sum of both workers' decoded messages,
rebuilt here by independent encoders from the ``e`` each exchange encoded; the center plus ``alpha`` times
the errors still owed is ``alpha`` times the sum of every ``e`` (nothing lost, only late). The bytes each
worker sent to the other's server are its messages' (``ServerBox.payload_bytes``: a pull sends none),
against 4 bytes an element for the uncompressed exchange (``elastic_``). Run as a script this file is the
worker.
"""

from __future__ import annotations

import json

import pytest

NUMEL = 300_007  # a bf16 half is 300 KB: more than one chunk of bytes
STEPS, TAU, ALPHA = 8, 2, 0.25
MODES = ("bf16", "int8", "sign", "topk")


def updates(rank: int) -> list:
    import torch

    g = torch.Generator().manual_seed(200 + rank)
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

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    world = World(rank, size, rank, size, 0, 1, "mpi")
    out: dict = {"rank": rank}
    for mode in (*MODES, "none"):
        box = open_box(
            "rma", world, NUMEL, CounterMap(size).num_counters, f"ea{mode}", server=True, num_shards=2
        )
        pieces = box.code_pieces(0, NUMEL)
        client = CenterClient(box, NUMEL)
        encoder = None if mode == "none" else PushEncoder(mode, pieces, 0, block=256, ratio=0.05)
        inputs: list = []  # each exchange's e (uncompressed: the exact move alpha e of x, as x - x_after)
        x, e = torch.zeros(NUMEL), torch.empty(NUMEL)
        for step, u in enumerate(updates(rank)):
            x.add_(u)
            if (step + 1) % TAU:
                continue
            before = x.clone()
            if encoder is None:
                assert client.elastic_(x, ALPHA)
                inputs.append((before - x) / ALPHA)
            else:
                assert client.elastic_encoded_(x, ALPHA, encoder, e)
                inputs.append(e.clone())
                assert torch.allclose(before - x, ALPHA * e, atol=1e-6)  # x moves by the exact alpha e
        sent = box.payload_bytes
        owed = torch.zeros(NUMEL) if encoder is None else encoder.error.clone()
        box.barrier()
        center = box.pull(torch.empty(NUMEL))
        everyone = comm.gather((inputs, owed, sent), root=0)
        if rank == 0:
            r = out[mode] = {"pieces": [hi - lo for lo, hi in pieces], "exchanges": len(inputs)}
            moved = ALPHA * sum(sum(ins) for ins, _, _ in everyone)
            if encoder is None:
                r["center"] = float((center - moved).abs().max())
            else:
                expected = torch.zeros(NUMEL)
                for ins, _, _ in everyone:
                    ref = PushEncoder(mode, pieces, 0, block=256, ratio=0.05)
                    expected += sum(ALPHA * ref.decode(ref.encode(a)) for a in ins)
                r["center"] = float((center - expected).abs().max())
                r["owed"] = float((center + ALPHA * sum(o for _, o, _ in everyone) - moved).abs().max())
                r["lossy"] = float((center - moved).abs().max())
            r["sent"] = everyone[0][2]  # rank 0's bytes to rank 1's server (rank 0 holds the first half)
        box.barrier()
        box.close()
    print(json.dumps(out), flush=True)


@pytest.mark.timeout(120)
def test_the_servers_decode_the_elastic_pushes_and_the_link_carries_the_codes():
    from parambox.strategies.compress import PushEncoder
    from tests.conftest import mpi_rank0_result  # (not at the top: the file is also the worker)

    result = mpi_rank0_result(__file__)
    exchanges = STEPS // TAU
    plain = result["none"]
    assert plain["center"] <= 1e-5, plain  # float32 pushes: alpha times every e
    half = plain["pieces"][1]
    assert plain["exchanges"] == exchanges and plain["sent"] == 4 * half * exchanges
    for mode in MODES:
        r = result[mode]
        assert r["pieces"] == plain["pieces"] and len(r["pieces"]) == 2
        assert r["center"] <= 1e-5 and r["owed"] <= 1e-5 and r["lossy"] > 1e-4, (mode, r)  # bf16: 9e-4
        remote = PushEncoder(mode, [(0, NUMEL - half), (NUMEL - half, NUMEL)], 0, ratio=0.05)
        assert r["sent"] == remote.parts[1].message_bytes(0) * exchanges, (mode, r)
        assert r["sent"] <= 0.51 * plain["sent"]  # bf16 half of float32; the others far less


if __name__ == "__main__":
    worker()
