"""The mean through the box in two levels (ShmCaffe: a node's workers sum in its shm box, its leader
alone crosses to the cross-node box) equals the one-level mean and the closed form, to 1e-6, with
the memory server's gated pulls (no barrier: each block answered once all its pushes landed).

2 nodes x 2 workers on loopback: 4 ranks under mpiexec, each told its node (``World`` built here:
ranks 0-1 are node 0, 2-3 node 1), the rma box with its memory server. Run as a script this file is
the worker; it prints one JSON line per rank.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from parambox.runtime import spawn
from parambox.runtime.spawn import find_mpiexec

SIZE, PER_NODE, NUMEL, STEPS = 4, 2, 10_001, 6
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_osc": "^ucx"}


def worker() -> None:
    import time

    import torch

    from parambox.box import BoxConfig, levels
    from parambox.box.levels import BoxMean
    from parambox.runtime.world import World

    levels.BLOCK = 1000  # several gated blocks per shard's piece, each answered once its pushes landed

    rank = World.from_env().rank
    world = World(rank, SIZE, rank % PER_NODE, PER_NODE, rank // PER_NODE, SIZE // PER_NODE, "mpi")
    box = BoxConfig(backend="rma", server=True)
    ramp = torch.arange(NUMEL, dtype=torch.float32) / NUMEL
    errors = {}
    for two in (False, True):
        mean = BoxMean(box, world, NUMEL, f"g{int(two)}", timeout=30, two_level=two)
        x, out, worst = torch.zeros(NUMEL), torch.empty(NUMEL), 0.0
        for step in range(STEPS):
            g = ramp * (rank + 1) + step  # constant per rank and step: the mean is known
            time.sleep(0.02 * ((rank + step) % 3))  # ranks arrive in a different order each step
            mean.mean_(g, step, out)
            want = ramp * (sum(range(1, SIZE + 1)) / SIZE) + step
            worst = max(worst, float((out - want).abs().max()))
            x -= 0.1 * out
        errors[f"two_level={two}"] = {"max_error": worst, "x": x[:: NUMEL // 7].tolist()}
        assert mean.two_level == two
        mean.close()
    print(json.dumps({"rank": rank, **errors}), flush=True)


def _dealt(numel, ranks, shards, bounds=None):
    from types import SimpleNamespace

    from parambox.box.layout import shard_range
    from parambox.box.levels import _area_pieces, _blocks, _padded

    total = _padded(numel, ranks)
    box = SimpleNamespace(
        shards=[shard_range(total, k, shards) for k in range(shards)], box_ranks=list(range(shards))
    )
    blocks = _blocks(numel, ranks, bounds)
    return box, blocks, _area_pieces(box, blocks)


@pytest.mark.parametrize(
    "numel,ranks,shards,bounds",
    [
        (10_001, 2, 2, None),
        (7, 3, 3, None),
        (1_000_003, 4, 4, None),
        (5, 8, 8, None),
        (300_001, 4, 2, None),
        # the bench CNN's parameters and box-sync's flags; big and small parts in turn
        (1_070_802, 2, 2, [0, 864, 896, 19328, 19392, 1067968, 1068224, 1070784, 1070794, 1070802]),
        (1_000_000, 2, 2, [0, 200_000, 200_010, 400_000, 400_010, 600_000, 600_010, 1_000_000]),
        (10_000, 3, 3, [0, 1, 2, 3, 9_000, 10_000]),
    ],
)
def test_every_area_is_dealt_over_every_shard(numel, ranks, shards, bounds):
    """Each rank sends and receives the same bytes (both directions of a link at once): the blocks of
    every area go round the shards, each inside its owner's shard, they cover the vector, no two
    overlap in the box, and the shards' shares differ by one block at most."""
    from parambox.box.levels import AREAS, _block

    box, blocks, pieces = _dealt(numel, ranks, shards, bounds)
    block = _block(numel, ranks)
    assert [lo for lo, _ in blocks] == [0, *(hi for _, hi in blocks[:-1])] and blocks[-1][1] == numel
    assert all(0 < hi - lo <= block for lo, hi in blocks)
    if bounds is None:
        assert blocks == [(lo, min(numel, lo + block)) for lo in range(0, numel, block)]
    used = set()
    for area in pieces:
        assert [p[:2] for p in area] == blocks
        if len({hi - lo for lo, hi in blocks}) == 1 or bounds is None:
            assert [p[3] for p in area][: shards * (len(area) // shards)] == [
                j % shards for j in range(shards * (len(area) // shards))
            ]
        share = [sum(hi - lo for lo, hi, _, k in area if k == owner) for owner in range(shards)]
        assert max(share) - min(share) <= block
        for lo, hi, at, owner in area:
            s0, s1 = box.shards[owner]
            assert s0 <= at and at + hi - lo <= s1
            span = range(at, at + hi - lo)
            assert not used.intersection(span)
            used.update(span)
    assert len(used) == AREAS * numel


def test_blocks_keep_what_backward_finishes_last_apart():
    """With the parameters' bounds, a part of at least a block starts a block of its own, so the bench
    CNN's convolutions (finished last by backward) are one 77 KB block, not the head of a 512 KiB one
    that holds the fully connected layer's start (finished first); small neighbours share a block."""
    from parambox.box.levels import _blocks

    cnn = [0, 864, 896, 19328, 19392, 1067968, 1068224, 1070784, 1070794, 1070802]
    blocks = _blocks(1_070_802, 2, cnn)
    assert blocks[0] == (0, 19392) and blocks[1] == (19392, 19392 + 131072)
    assert blocks[-1] == (1067968, 1070802)  # the last layer's small parameters and the flags
    assert len(blocks) == 10
    assert _blocks(10, 2, [0, 10]) == [(0, 5), (5, 10)]
    with pytest.raises(ValueError, match="bounds"):
        _blocks(10, 2, [0, 5, 4, 10])


@pytest.mark.timeout(150)
def test_two_level_mean_equals_one_level_and_the_closed_form():
    if find_mpiexec() is None:
        pytest.skip("no mpiexec found")
    prefix = f"pb_test_{secrets.token_hex(6)}_"
    env = {**os.environ, **MPI_ENV, "OMP_NUM_THREADS": "1", "PARAMBOX_SHM_PREFIX": prefix}
    # Open MPI's files in a private directory that a reaper removes, whatever way the job ends.
    cmd = [sys.executable, str(Path(__file__).resolve())]
    proc = spawn.start_mpi(cmd, SIZE, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=140)
        left = list(Path("/dev/shm").glob(f"{prefix}*"))  # before the backstop below removes them
    finally:
        spawn.stop([proc])
        spawn.remove_segments(prefix)
    lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    assert sorted(line["rank"] for line in lines) == list(range(SIZE)), stderr[-3000:]
    for line in lines:
        one, two = line["two_level=False"], line["two_level=True"]
        assert one["max_error"] <= 1e-6 and two["max_error"] <= 1e-6, line
        assert max(abs(a - b) for a, b in zip(one["x"], two["x"])) <= 1e-6, line
    assert not left  # the node boxes unlinked themselves


if __name__ == "__main__":
    worker()
