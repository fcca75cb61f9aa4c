"""The shm box beyond the shared contract: in-process behaviour, permissions, and what is left in
/dev/shm after a normal close, a SIGKILLed worker, a creator killed inside ``open_box`` and SIGINT.

Run as a script this file is a helper process: ``python tests/test_box_shm.py MODE RANK SIZE``.
"""

from __future__ import annotations

import os
import secrets
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from parambox.box import PREFIX_ENV, Layout, open_box, remove_segments
from parambox.errors import CommTimeout, UserError
from parambox.runtime.world import World

SHM = Path("/dev/shm")
CRASH_NUMEL = 4 << 20  # 16 MB: a push takes milliseconds, so the kill lands inside one


def _world(rank: int, size: int) -> World:
    return World(rank, size, rank, size, launcher="local")


# ---------------------------------------------------------------------------------------------------
# helper processes
# ---------------------------------------------------------------------------------------------------


def helper_main(mode: str, rank: int, size: int) -> None:
    if mode == "create":  # local rank 0 of a box nobody else attaches to: waits inside open_box
        open_box("shm", _world(0, size), 1000, 1, "lonely", timeout=60)
        return
    if mode == "store":  # no PARAMBOX_SHM_PREFIX: local rank 0 hands one out through the store
        _store_worker(rank, size)
        return
    if mode == "hold":  # takes the first stripe's lock and keeps it (the test then SIGSTOPs it)
        box = open_box("shm", _world(rank, size), 1000, 1, "held", timeout=30)
        import fcntl

        fcntl.lockf(box._fd, fcntl.LOCK_EX, 1, 64)  # stripe 0's byte
        print("held", flush=True)
        time.sleep(120)
        return
    box = open_box("shm", _world(rank, size), CRASH_NUMEL, 1 + size, "crash", timeout=30)
    print("open", flush=True)
    if rank == size - 1:  # the victim: pushes until it is killed
        ones = torch.ones(CRASH_NUMEL)
        while True:
            box.push(ones)
    flag = Path(os.environ["PARAMBOX_TEST_FLAG"])
    while not flag.exists():
        time.sleep(0.01)
    for _ in range(10):
        box.push(torch.full((CRASH_NUMEL,), 2.0))
    box.add_counter(0, 1)
    while box.read_counter(0) < size - 1:  # the survivors' own barrier: the victim never arrives
        time.sleep(0.01)
    got = box.pull(torch.empty(CRASH_NUMEL)) - 2.0 * 10 * (size - 1)
    # The victim's pushes are whole, except at most the one it was killed in: every element saw
    # the same number of them, or one more.
    print(f"result {float(got.min())} {float(got.max())}", flush=True)
    box.close()


def _store_worker(rank: int, size: int) -> None:
    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size)
    box = open_box("shm", World(rank, size, rank, size, launcher="torchrun"), 8, 1, "viastore", timeout=30)
    box.push(torch.ones(8))
    box.barrier()
    print(f"{box.path} {float(box.pull(torch.empty(8)).sum())}", flush=True)
    box.close()
    dist.destroy_process_group()


def _spawn(mode: str, rank: int, size: int, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), mode, str(rank), str(size)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def prefix(monkeypatch):
    value = f"pb_test_{secrets.token_hex(6)}_"
    monkeypatch.setenv(PREFIX_ENV, value)
    yield value
    remove_segments(value)


def _entries(prefix: str) -> list[str]:
    return sorted(p.name for p in SHM.glob(f"{prefix}*"))


def _wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------------------
# in one process
# ---------------------------------------------------------------------------------------------------


def test_single_process_box(prefix: str) -> None:
    with open_box("shm", World(), 10, 2, "solo") as box:
        assert _entries(prefix) == []  # unlinked as soon as everyone (here: one process) has it mapped
        box.push(torch.arange(10.0), scale=0.5)
        box.push(torch.ones(3, dtype=torch.float64), start=7)  # other dtypes are converted
        assert box.pull(torch.empty(10)).tolist() == [0, 0.5, 1, 1.5, 2, 2.5, 3, 4.5, 5, 5.5]
        box.write(torch.zeros(2), start=0)
        assert box.tensor()[:3].tolist() == [0, 0, 1]
        assert (box.add_counter(1, 5), box.add_counter(1, -2), box.read_counter(1)) == (0, 5, 3)
        box.barrier()
        with pytest.raises(ValueError, match="outside"):
            box.push(torch.ones(4), start=7)
        with pytest.raises(ValueError, match="counter 2"):
            box.read_counter(2)
    box.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        box.push(torch.ones(1))


def test_open_box_rejects_bad_arguments(prefix: str) -> None:
    with pytest.raises(UserError, match="backend 'nfs'"):
        open_box("nfs", World(), 10)
    with pytest.raises(UserError, match="name"):
        open_box("shm", World(), 10, name="a/b")
    with pytest.raises(UserError, match="num_shards"):
        open_box("shm", World(), 10, num_shards=2)
    with pytest.raises(UserError, match="numel"):
        open_box("shm", World(), 0)
    with pytest.raises(UserError, match="one node"):
        open_box("shm", World(0, 4, 0, 2, 0, 2), 10)


def test_hogwild_parameters_live_in_the_box(prefix: str) -> None:
    model = torch.nn.Linear(3, 2)
    layout = Layout.from_model(model)
    box = open_box("shm", World(), layout.numel, 1, "hog", layout_hash=layout.fingerprint())
    layout.bind_params_(model, box.tensor(), copy_values=True)
    before = box.pull(torch.empty(layout.numel))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # writes the box in place, no copy
    assert not torch.equal(box.pull(torch.empty(layout.numel)), before)
    box.close()
    assert model.weight.sum().isfinite()  # the mapping outlives close() while parameters use it


def test_threads_of_one_process_push_exactly(prefix: str) -> None:
    box = open_box("shm", World(), 50_000, 1, "threads", stripe_bytes=4096)
    ones = torch.ones(50_000)
    threads = [threading.Thread(target=lambda: [box.push(ones) for _ in range(40)]) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert box.tensor().eq(120).all()
    box.close()


# ---------------------------------------------------------------------------------------------------
# clean-up across processes
# ---------------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_sigkilled_worker_leaves_nothing_and_no_lock(prefix: str, tmp_path: Path) -> None:
    flag = tmp_path / "go"
    env = dict(os.environ, PARAMBOX_TEST_FLAG=str(flag), OMP_NUM_THREADS="1")
    procs = [_spawn("crash", r, 2, env) for r in range(2)]  # rank 0 survives, rank 1 is killed
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "open", p.stderr.read()
        time.sleep(0.3)
        procs[1].send_signal(signal.SIGKILL)  # most likely inside a push, holding a stripe lock
        procs[1].wait(10)
        assert _entries(prefix) == []
        flag.touch()
        for p in procs[:1]:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            lo, hi = map(float, out.split()[-2:])
            assert lo >= 1 and hi - lo <= 1, out
        assert _entries(prefix) == []
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.timeout(60)
def test_push_against_a_stopped_lock_holder_times_out(prefix: str) -> None:
    """Before: a blocking fcntl lock waited for good behind a SIGSTOPped holder."""
    holder = _spawn("hold", 1, 2, dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        box = open_box("shm", _world(0, 2), 1000, 1, "held", timeout=30)  # the helper imports torch
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        box.timeout = 2.0
        holder.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(CommTimeout, match=r"box 'held' push \(stripe 0\).*held for 2 s"):
            box.push(torch.ones(1000))
        assert time.monotonic() - t0 < 10
        box.close()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.timeout(60)
def test_creator_killed_inside_open(prefix: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    creator = _spawn("create", 0, 2, env)
    try:
        path = SHM / f"{prefix}lonely"
        _wait_for(path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        creator.send_signal(signal.SIGKILL)
        creator.wait(10)
        assert _entries(prefix) == [path.name]  # killed inside open_box: the name is still there
        # A late attacher finds the header but no creator: it gives up, naming rank 0, and unlinks.
        with pytest.raises(CommTimeout, match="local rank 0"):
            open_box("shm", _world(1, 2), 1000, 1, "lonely", timeout=0.5)
        assert _entries(prefix) == []
    finally:
        creator.kill()
        creator.wait()


@pytest.mark.timeout(60)
def test_sigint_inside_open_unlinks(prefix: str) -> None:
    creator = _spawn("create", 0, 2, dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        _wait_for(SHM / f"{prefix}lonely")
        creator.send_signal(signal.SIGINT)
        creator.wait(20)
        assert _entries(prefix) == []
    finally:
        creator.kill()
        creator.wait()


@pytest.mark.timeout(60)
def test_prefix_through_the_store_under_an_external_launcher() -> None:
    from parambox.runtime.dist import free_port

    env = {k: v for k, v in os.environ.items() if k != PREFIX_ENV}
    env |= {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [_spawn("store", r, 2, env) for r in range(2)]
    try:
        outs = [p.communicate(timeout=50) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    (path0, total0), (path1, total1) = (out.split() for out, _ in outs)
    assert path0 == path1 and Path(path0).name.startswith("pb_") and not Path(path0).exists()
    assert float(total0) == float(total1) == 16.0


def test_remove_segments(tmp_path: Path) -> None:
    for name in ("pb_x_a", "pb_x_b", "pb_y_a"):
        (tmp_path / name).write_bytes(b"")
    assert sorted(remove_segments("pb_x_", root=str(tmp_path))) == ["pb_x_a", "pb_x_b"]
    assert [p.name for p in tmp_path.iterdir()] == ["pb_y_a"]
    with pytest.raises(ValueError):
        remove_segments("", root=str(tmp_path))


if __name__ == "__main__":
    helper_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
