"""``diloco.compression`` (asynchronous) over the rma box's memory servers, under mpiexec: the arrival's codes
cross the link and the server decodes them before its outer step.

Two ranks, each holding half of the box (``num_shards=2``, ``server=True``). Each rank in turn sends an
arrival (its pseudo-gradient encoded with error feedback, one message a shard: ``outer_step_encoded_async``)
to one box, and the pseudo-gradient as the worker decodes it (float32: ``outer_step_async``, the step the
server applied before) to a second box, with the same coefficients: Delayed Nesterov's arrivals (the last of
each block moves the momentum) and the quorum rule's. Theta, the momentum and the accumulator of both boxes
are the same, and so is the theta each arrival brought back: the server's decoding is the worker's. The
bytes each rank sent to the other's server are its messages' (``ServerBox.payload_bytes``), against 4 bytes
an element for the float32 arrival. Run as a script this file is the worker.
"""

from __future__ import annotations

import json

import pytest

NUMEL = 300_007  # more than one chunk of bytes a half
ARRIVALS = 3  # each rank's
MODES = ("bf16", "int8", "sign", "topk")
DELAYED = (0.7, 0.9, 0.5, 0.2, -0.8)  # lr, beta, 1 / N, k, k_last
QUORUM = (0.35, 0.9, 0.5, 0.0, 0.0)  # lr, beta, share


def worker() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's tests
    import torch
    from mpi4py import MPI

    from parambox.box import open_box
    from parambox.box.server import QUORUM as QUORUM_FLAG
    from parambox.runtime.world import World
    from parambox.strategies.compress import PushEncoder

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    world = World(rank, size, rank, size, 0, 1, "mpi")
    gen = torch.Generator().manual_seed(300 + rank)
    out: dict = {"rank": rank}
    for mode in MODES:
        for rule, coefficients in (("delayed", DELAYED), ("quorum", QUORUM)):
            coded, plain = (
                open_box("rma", world, NUMEL, 1, f"dc{mode}{rule}{k}", server=True, num_shards=2)
                for k in "cp"
            )
            pieces = coded.code_pieces(0, NUMEL)
            encoder = PushEncoder(mode, pieces, 0, block=256, ratio=0.05)
            theta_gap, lossy, sent_plain = 0.0, 0.0, 0
            for t in range(ARRIVALS * size):  # arrivals in turn: rank t % size sends the t-th
                if t % size == rank:
                    g = torch.randn(NUMEL, generator=gen) * 0.1
                    messages = encoder.encode(g)
                    g_hat = encoder.decode(messages)  # what the worker decoded before
                    lossy = max(lossy, float((g_hat - g).abs().max()))
                    flags = int(t % size == size - 1) | (QUORUM_FLAG if rule == "quorum" else 0)
                    a, b = torch.empty(NUMEL), torch.empty(NUMEL)
                    coded.outer_step_encoded_async(
                        messages, NUMEL, encoder.code, encoder.params, a, coefficients, flags
                    ).wait()
                    before = plain.payload_bytes
                    plain.outer_step_async(g_hat, b, coefficients, flags).wait()
                    sent_plain += plain.payload_bytes - before
                    theta_gap = max(theta_gap, float((a - b).abs().max()))
                comm.Barrier()
            state = [
                torch.cat(
                    [
                        box.pull(torch.empty(NUMEL)),
                        *(box.pull_companion(torch.empty(NUMEL), r) for r in (0, 1)),
                    ]
                )
                for box in (coded, plain)
            ]
            everyone = comm.gather((theta_gap, lossy, coded.payload_bytes, sent_plain), root=0)
            if rank == 0:
                out[f"{mode}-{rule}"] = {
                    "pieces": [hi - lo for lo, hi in pieces],
                    "state": float((state[0] - state[1]).abs().max()),
                    "moved": float(state[0].abs().max()),
                    "theta_back": max(e[0] for e in everyone),
                    "lossy": min(e[1] for e in everyone),
                    "sent": everyone[0][2],  # rank 0's bytes to rank 1's server (rank 0 holds the first half)
                    "sent_plain": everyone[0][3],
                }
            for box in (coded, plain):
                box.barrier()
                box.close()
    print(json.dumps(out), flush=True)


@pytest.mark.timeout(120)
def test_the_servers_decode_the_arrivals_then_step_as_on_the_decoded_float32():
    from parambox.strategies.compress import PushEncoder
    from tests.conftest import mpi_rank0_result  # (not at the top: the file is also the worker)

    result = mpi_rank0_result(__file__)
    for mode in MODES:
        for rule in ("delayed", "quorum"):
            r = result[f"{mode}-{rule}"]
            assert len(r["pieces"]) == 2 and r["moved"] > 0.01, (mode, rule, r)
            assert r["state"] == 0.0 and r["theta_back"] == 0.0, (mode, rule, r)  # the same float32 step
            assert r["lossy"] > 1e-4, (mode, rule, r)  # the decoded g is not g: the test can tell
            half = r["pieces"][1]
            assert r["sent_plain"] == 4 * half * ARRIVALS
            remote = PushEncoder(mode, [(0, 1), (1, half + 1)], 0, ratio=0.05).parts[1]
            assert r["sent"] == remote.message_bytes(0) * ARRIVALS, (mode, rule, r)
            assert r["sent"] <= 0.51 * r["sent_plain"]


if __name__ == "__main__":
    worker()
