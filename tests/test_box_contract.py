"""One contract, both box backends: the same checks run by 3 processes over shm, rma (shared-memory
osc), rma over the network path (osc rdma, btl tcp), and the rma box's memory server (``box.server``)
over shared memory and over TCP.

Run as a script this file is the worker (``python tests/test_box_contract.py shm RANK SIZE``, or
``rma`` under mpiexec): it runs every check in order and prints one JSON line per check. pytest
starts the workers once per backend and asserts on those lines.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest

from parambox.runtime.spawn import find_mpiexec

SIZE = 3
CHECK_TIMEOUT = 2.0  # seconds a failed open may wait before it must report an error
NUMEL = 100_003  # not a multiple of the stripe or shard size
HOT_PUSHES = 300
HOT_NUMEL = 1 << 18  # 1 MB: within one default stripe, so every pusher hits the same lock
COUNTER_ADDS = 5000
SERVER_ENV = "PB_TEST_BOX_SERVER"
CHECKS = [
    "push_sum",
    "push_hot",
    "pull_after_push",
    "push_pull",
    "elastic",
    "counters",
    "shard_bounds",
    "mismatch",
    "missing",
    "gated",
]
PUSH_PULL_NUMEL = 1_000_003  # more than one server message (box/server.py's CHUNK) per shard


# ---------------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------------


class Worker:
    def __init__(self, backend: str, world, server: bool = False):
        self.backend, self.world, self.rank, self.server = backend, world, world.rank, server
        self.keep = None

    def open(self, numel: int, name: str, num_counters: int = 0, **kw):
        from parambox.box import open_box

        if self.backend == "shm":
            kw.setdefault("stripe_bytes", 4096)  # many stripes, so stripe edges are exercised
            kw.pop("num_shards", None)
        else:
            kw.pop("stripe_bytes", None)
            kw["server"] = self.server  # the box ranks apply pushes themselves
        kw.setdefault("timeout", 20.0)  # a failing check ends in an error, not a long hang
        return open_box(self.backend, self.world, numel, num_counters, name, **kw)

    def check_push_sum(self):
        import torch

        box = self.open(NUMEL, "sum")
        v = torch.arange(NUMEL, dtype=torch.float32) % 13
        for i in range(30):
            if i % 2:
                box.push(v, scale=self.rank + 1)
            else:
                box.push_async(v * (self.rank + 1)).wait()
        box.barrier()
        got = box.pull(torch.empty(NUMEL))
        want = v * 30 * sum(range(1, SIZE + 1))
        box.close()
        return bool(torch.equal(got, want)), f"max error {float((got - want).abs().max())}"

    def check_push_hot(self):
        """Pushes to the same elements at the same time: a lost update would show."""
        import torch

        box = self.open(HOT_NUMEL, "hot", stripe_bytes=4 << 20)
        ones = torch.ones(HOT_NUMEL)
        box.barrier()
        for _ in range(HOT_PUSHES):
            box.push(ones)
        box.barrier()
        got = box.pull(torch.empty(HOT_NUMEL))
        box.close()
        return bool(got.eq(HOT_PUSHES * SIZE).all()), f"min {float(got.min())} max {float(got.max())}"

    def check_pull_after_push(self):
        import torch

        box = self.open(1000, "seen")
        if self.rank == 0:
            box.push(torch.full((990,), 5.0), start=10)
        box.barrier()
        first = box.pull(torch.empty(1000))
        box.barrier()
        if self.rank == 1:
            box.write(torch.full((2,), -1.0), start=998)
        box.barrier()
        second = torch.empty(2, 2)
        box.pull_async(second, start=996).wait()
        box.close()
        ok_first = first[:10].eq(0).all() and first[10:].eq(5).all()
        ok_second = second.flatten().tolist() == [5.0, 5.0, -1.0, -1.0]
        return bool(ok_first and ok_second), f"first[8:12]={first[8:12].tolist()} second={second.tolist()}"

    def check_push_pull(self):
        """Every rank push-pulls at once: each answer holds its own pushes so far and no more than
        all of them; the last state is every push. A float64 answer is staged through the host."""
        import torch

        n, rounds = PUSH_PULL_NUMEL, 12
        box = self.open(n + 5, "pp")
        ones, out, ok, seen = torch.ones(n), torch.empty(n), True, []
        box.barrier()
        for i in range(rounds):
            if i % 3:
                box.push_pull(ones, out, scale=2.0, start=5)
            else:
                box.push_pull_async(ones, out, 2.0, 5).wait()
            seen.append((float(out.min()), float(out.max())))
            ok = ok and 2 * (i + 1) <= out.min() and out.max() <= 2 * rounds * SIZE
        wide = torch.empty(n, dtype=torch.float64)
        box.push_pull(torch.zeros(n), wide, start=5)
        box.barrier()
        got = box.pull(torch.empty(n + 5))
        box.close()
        ok = ok and bool(got[:5].eq(0).all() and got[5:].eq(2 * rounds * SIZE).all())
        ok = ok and float(wide.min()) >= 2 * rounds
        return ok, f"answers (min, max) {seen[:3]}..., last {float(got[5:].min())}..{float(got.max())}"

    def check_elastic(self):
        """EASGD's exchange by every rank at once: in whatever order they land, each moves the center
        by alpha e and its own x by -alpha e, so x summed over the ranks plus the center is what it was
        (1 + 2 + 3); the values before ``start`` are untouched. Alone (the others at a barrier), one
        exchange is the closed form: e = x - c, c + alpha e after."""
        import torch

        n, alpha = PUSH_PULL_NUMEL, 0.25
        box, total = self.open(n + 5, "elastic"), self.open(n, "elastic-sum")
        x, e = torch.full((n,), float(self.rank + 1)), torch.empty(n)
        box.barrier()
        for _ in range(6):
            box.elastic_async(x, e, alpha, 5).wait()
            x.sub_(e, alpha=alpha)
        box.barrier()
        alone = True
        if self.rank == 0:
            before = box.pull(torch.empty(n), start=5)
            box.elastic_async(x, e, alpha, 5).wait()
            after = box.pull(torch.empty(n), start=5)
            alone = torch.equal(e, x - before) and torch.allclose(after, before + alpha * e, atol=1e-6)
            x.sub_(e, alpha=alpha)
        box.barrier()
        total.push(x)
        total.barrier()
        c, xs = box.pull(torch.empty(n + 5)), total.pull(torch.empty(n))
        box.close()
        total.close()
        kept = float((xs + c[5:] - 6.0).abs().max())
        ok = alone and bool(c[:5].eq(0).all()) and kept < 1e-4 and 1.0 < float(c[5:].min()) < 3.0
        return (
            ok,
            f"alone {alone}, sum x + c - 6 at most {kept:.2e}, c {float(c[5:].min()):.4f}..{float(c.max()):.4f}",
        )

    def check_counters(self):
        box = self.open(8, "count", num_counters=1 + SIZE)
        box.barrier()
        half = COUNTER_ADDS // 2
        olds = [box.add_counter(0, 1) for _ in range(half)]
        ordered = olds == sorted(set(olds))
        for _ in range((COUNTER_ADDS - half) // 4):  # four adds in flight at once
            olds += [h.wait() for h in [box.add_counter_async(0, 1) for _ in range(4)]]
        for _ in range(50):
            box.add_counter_async(1 + self.rank, 2).wait()
        box.barrier()
        total, steps = box.read_counter(0), [box.read_counter(1 + r) for r in range(SIZE)]
        box.close()
        ok = (
            total == COUNTER_ADDS * SIZE and steps == [100] * SIZE and ordered and len(set(olds)) == len(olds)
        )
        return ok, f"total={total} steps={steps}", sum(olds)

    def check_shard_bounds(self):
        import torch

        from parambox.box import shard_range

        n = 1001
        box = self.open(n, "shards", num_shards=SIZE)
        ramp = torch.arange(n, dtype=torch.float32)
        if self.rank == 0:
            box.write(ramp)
        box.barrier()
        bounds = [shard_range(n, k, SIZE) for k in range(SIZE)]
        ok = (
            bounds[0][0] == 0 and bounds[-1][1] == n and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        )
        for _, stop in bounds[:-1]:  # windows that straddle each shard edge
            got = box.pull(torch.empty(4), start=stop - 2)
            ok = ok and got.tolist() == ramp[stop - 2 : stop + 2].tolist()
        box.barrier()  # every rank has checked the edges before anyone pushes
        lo, hi = bounds[self.rank]
        box.push(torch.ones(hi - lo), scale=self.rank + 1, start=lo)
        box.barrier()
        got = box.pull(torch.empty(n))
        want = ramp + torch.cat([torch.full((b - a,), k + 1.0) for k, (a, b) in enumerate(bounds)])
        box.close()
        return bool(ok and torch.equal(got, want)), f"bounds={bounds}"

    def _expect_error(self, name: str, **kw) -> tuple[bool, str]:
        from parambox.errors import CommTimeout, UserError

        try:
            box = self.open(timeout=CHECK_TIMEOUT, name=name, **kw)
        except (UserError, CommTimeout) as e:
            return True, f"{type(e).__name__}: {e}"
        box.close()
        return False, f"opening {name!r} did not fail"

    def check_mismatch(self):
        import torch

        wrong_size = self._expect_error("mm", numel=500 + (self.rank == 2))
        wrong_layout = self._expect_error("ml", numel=500, layout_hash=7 if self.rank == 2 else 8)
        intact = torch.equal(self.keep.pull(torch.empty(64)), torch.arange(64.0))
        # Every rank gets an error naming the box; the one that asked for another size is told both.
        named = "'mm'" in wrong_size[1] and "'ml'" in wrong_layout[1]
        sizes = "500" in wrong_size[1] and "501" in wrong_size[1] if self.rank == 2 else True
        ok = wrong_size[0] and wrong_layout[0] and intact and named and sizes
        return ok, f"{wrong_size[1]} | {wrong_layout[1]} | keep intact={intact}"

    def check_gated(self):
        """The memory server's gated pulls (``box/levels.py``'s barrier-free mean): a pull of a key
        parked until every rank's keyed pushes of it have landed returns their whole sum, from a
        remote shard and from this rank's own; a target never reached ends in CommTimeout."""
        import time

        import torch

        from parambox.errors import CommTimeout

        box = self.open(3000, "gated")
        if not getattr(box, "gated", False):
            box.close()
            return True, "no gated pulls on this box"
        s0, s1 = box.shards[-1]  # the last rank's shard: remote for the others, its own for it
        at, n = s0 + 7, 200
        key, out = at, torch.empty(n)
        pull = box.pull_when_async(out, at, key, target=SIZE * n)  # asked before anyone pushed
        time.sleep(0.1 * self.rank)  # the ranks' pushes land one after another
        for part in range(4):  # in parts: the server counts elements, not requests
            box.push_keyed_async(torch.ones(n // 4), self.rank + 1.0, at + part * n // 4, key).wait()
        pull.wait()
        want = float(sum(range(1, SIZE + 1)))
        summed = bool(out.eq(want).all())
        box.barrier()
        box.timeout = 1.0
        timed_out = True
        if self.rank == SIZE - 1:  # its own shard (a remote request would stay parked, then dropped)
            try:
                box.pull_when_async(torch.empty(n), at, key, target=SIZE * n + 1).wait()
                timed_out = False
            except CommTimeout as e:
                timed_out = "gated pull" in str(e)
        box.timeout = 20.0
        box.barrier()
        box.close()
        return (
            summed and timed_out,
            f"sum {float(out.min())}..{float(out.max())} (want {want}), timeout {timed_out}",
        )

    def check_missing(self):
        import torch

        name = "ghost" if self.rank == 2 else "real"
        ok, detail = self._expect_error(name, numel=100)
        ok = ok and ("ghost" in detail or "real" in detail)
        intact = torch.equal(self.keep.pull(torch.empty(64)), torch.arange(64.0))
        return ok and intact, f"{detail} | keep intact={intact}"

    def run(self) -> None:
        import torch

        self.keep = self.open(64, "keep")
        if self.rank == 0:
            self.keep.write(torch.arange(64.0))
        self.keep.barrier()
        for check in CHECKS:
            t0 = time.perf_counter()
            try:
                ok, detail, *value = getattr(self, f"check_{check}")()
            except Exception as e:  # report, and let the other checks run
                ok, detail, value = False, f"{type(e).__name__}: {e}", []
            line = {
                "rank": self.rank,
                "server": self.server,
                "check": check,
                "ok": bool(ok),
                "detail": detail,
            }
            line["seconds"] = round(time.perf_counter() - t0, 2)
            print(json.dumps(line | ({"value": value[0]} if value else {})), flush=True)
            self.keep.barrier()
        self.keep.close()


def worker_main(argv: list[str]) -> None:
    from parambox.runtime.world import World

    backend = argv[0]
    if backend == "shm":
        rank, size = int(argv[1]), int(argv[2])
        world = World(rank, size, rank, size, launcher="local")
        Worker(backend, world).run()
        return
    world = World.from_env()
    for server in os.environ.get(SERVER_ENV, "0").split(","):  # one job: the windows, then the server
        Worker(backend, world, server=server == "1").run()


# ---------------------------------------------------------------------------------------------------
# pytest side
# ---------------------------------------------------------------------------------------------------

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_osc": "^ucx"}
TRANSPORTS = {"sm": MPI_ENV, "tcp": MPI_ENV | {"OMPI_MCA_osc": "rdma", "OMPI_MCA_btl": "self,tcp"}}
# variant: (transport, the memory server (box/server.py: two-sided messages) or the windows). One
# mpiexec job per transport runs the checks over both: a job's start is most of its time.
VARIANTS = {
    "shm": (None, False),
    "rma-sm": ("sm", False),
    "rma-tcp": ("tcp", False),
    "rma-server-sm": ("sm", True),
    "rma-server-tcp": ("tcp", True),
}


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PARAMBOX_SHM_PREFIX"}
    return env | {"OMP_NUM_THREADS": "1"} | extra


def contract_run(variant: str) -> tuple[dict[str, list[dict]], str, str]:
    """The workers' lines of ``variant``: ({check: [line per rank]}, combined output, shm prefix)."""
    transport, server = VARIANTS[variant]
    results, output, prefix = _job(transport)
    return results.get(server, {}), output, prefix


@cache
def _job(transport: str | None) -> tuple[dict[bool, dict[str, list[dict]]], str, str]:
    """Run the workers once per transport (shm: the shm box): ({server: {check: [line per rank]}}, ...)."""
    me = str(Path(__file__).resolve())
    prefix = f"pb_test_{secrets.token_hex(6)}_"
    if transport is None:
        env = _env({"PARAMBOX_SHM_PREFIX": prefix})
        procs = [
            subprocess.Popen(
                [sys.executable, me, "shm", str(r), str(SIZE)], env=env, stdout=subprocess.PIPE, text=True
            )
            for r in range(SIZE)
        ]
        try:
            outs = [p.communicate(timeout=90)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
                p.wait()
    else:
        cmd = [
            find_mpiexec() or "mpiexec",
            "-n",
            str(SIZE),
            "--oversubscribe",
            sys.executable,
            me,
            "rma",
        ]
        env = _env(TRANSPORTS[transport] | {SERVER_ENV: "0,1"})
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
        outs = [done.stdout, done.stderr[-3000:]]
    results: dict[bool, dict[str, list[dict]]] = {}
    for raw in "\n".join(outs).splitlines():
        if raw.startswith("{"):
            line = json.loads(raw)
            results.setdefault(line["server"], {}).setdefault(line["check"], []).append(line)
    return results, "\n".join(outs)[-4000:], prefix


def _skip_without_mpi(variant: str) -> None:
    if variant.startswith("rma") and find_mpiexec() is None:
        pytest.skip("no mpiexec found")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize(
    "variant", [v if v == "shm" else pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS]
)  # mpiexec jobs: the full suite
def test_box_contract(variant: str, check: str) -> None:
    _skip_without_mpi(variant)
    results, output, _ = contract_run(variant)
    lines = results.get(check, [])
    assert sorted(line["rank"] for line in lines) == list(range(SIZE)), (
        f"missing ranks for {check}:\n{output}"
    )
    bad = [line for line in lines if not line["ok"]]
    assert not bad, f"{variant} {check}: {bad}"
    if check == "counters":  # fetch-and-add handed out every old value exactly once
        n = COUNTER_ADDS * SIZE
        assert sum(line["value"] for line in lines) == n * (n - 1) // 2


@pytest.mark.timeout(120)
def test_shm_contract_leaves_no_segments() -> None:
    _, _, prefix = contract_run("shm")
    assert not list(Path("/dev/shm").glob(f"{prefix}*"))


if __name__ == "__main__":
    worker_main(sys.argv[1:])
