"""The shm box beyond the shared contract: in-process behaviour, permissions, and what is left in
/dev/shm after a normal close, a SIGKILLed worker, a creator killed inside ``open_box`` and SIGINT.

The other processes are forked ranks (``tests/forked.py``): no interpreter start per helper.
"""

from __future__ import annotations

import os
import secrets
import signal
import stat
import threading
import time
from pathlib import Path

import pytest
import torch

from parambox.box import PREFIX_ENV, Layout, open_box, remove_segments
from parambox.errors import CommTimeout, UserError
from parambox.runtime.world import World
from tests.forked import fork_ranks, join_or_kill

SHM = Path("/dev/shm")
CRASH_NUMEL = 4 << 20  # 16 MB: a push takes milliseconds, so the kill lands inside one


def _world(rank: int, size: int) -> World:
    return World(rank, size, rank, size, launcher="local")


# ---------------------------------------------------------------------------------------------------
# helper processes
# ---------------------------------------------------------------------------------------------------


def _hold_rank(_: int, size: int, tmp: str) -> None:
    """Rank 1: takes the first stripe's lock and keeps it (the test then SIGSTOPs it)."""
    import fcntl

    torch.set_num_threads(1)
    box = open_box("shm", _world(1, size), 1000, 1, "held", timeout=30)
    fcntl.lockf(box._fd, fcntl.LOCK_EX, 1, 64)  # stripe 0's byte
    Path(tmp, "held").touch()
    time.sleep(120)


def _create_rank(rank: int, size: int) -> None:
    """Local rank 0 of a box nobody else attaches to: waits inside open_box (until killed)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
    torch.set_num_threads(1)  # forked: stay out of the parent's OpenMP pool
    open_box("shm", _world(0, size), 1000, 1, "lonely", timeout=60)


def _crash_rank(rank: int, size: int, tmp: str) -> None:
    """Every rank opens the box and says so (``tmp/open.RANK``); the last pushes until it is killed;
    the others wait for ``tmp/go``, push, meet, and write the pushes the victim left (``tmp/result.RANK``)."""
    torch.set_num_threads(1)
    box = open_box("shm", _world(rank, size), CRASH_NUMEL, 1 + size, "crash", timeout=30)
    Path(tmp, f"open.{rank}").touch()
    if rank == size - 1:  # the victim: pushes until it is killed
        ones = torch.ones(CRASH_NUMEL)
        while True:
            box.push(ones)
    _wait_for(Path(tmp, "go"), 60)
    for _ in range(10):
        box.push(torch.full((CRASH_NUMEL,), 2.0))
    box.add_counter(0, 1)
    while box.read_counter(0) < size - 1:  # the survivors' own barrier: the victim never arrives
        time.sleep(0.01)
    got = box.pull(torch.empty(CRASH_NUMEL)) - 2.0 * 10 * (size - 1)
    # The victim's pushes are whole, except at most the one it was killed in: every element saw
    # the same number of them, or one more.
    Path(tmp, f"result.{rank}").write_text(f"{float(got.min())} {float(got.max())}")
    box.close()


def _store_rank(rank: int, size: int, port: int, out_dir: str) -> None:
    """A forked rank under an external launcher's environment; no PARAMBOX_SHM_PREFIX: local rank 0
    hands one out through the store. Writes ``PATH SUM`` to ``out_dir/RANK``."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # forked: stay out of the parent's OpenMP pool
    os.environ.pop(PREFIX_ENV, None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    box = open_box("shm", World(rank, size, rank, size, launcher="torchrun"), 8, 1, "viastore", timeout=30)
    box.push(torch.ones(8))
    box.barrier()
    Path(out_dir, str(rank)).write_text(f"{box.path} {float(box.pull(torch.empty(8)).sum())}")
    box.close()
    dist.destroy_process_group()


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
    procs = fork_ranks(_crash_rank, 2, (2, str(tmp_path)), wait=False, shm_prefix=prefix)
    try:  # rank 0 survives, rank 1 is killed
        for r in range(2):
            _wait_for(tmp_path / f"open.{r}")
        time.sleep(0.3)
        procs[1].kill()  # SIGKILL, most likely inside a push, holding a stripe lock
        procs[1].join(10)
        assert _entries(prefix) == []
        (tmp_path / "go").touch()
        procs[0].join(60)
        assert procs[0].exitcode == 0
        lo, hi = map(float, (tmp_path / "result.0").read_text().split())
        assert lo >= 1 and hi - lo <= 1, (lo, hi)
        assert _entries(prefix) == []
    finally:
        join_or_kill(procs, 0)


@pytest.mark.timeout(60)
def test_push_against_a_stopped_lock_holder_times_out(prefix: str, tmp_path) -> None:
    """Before: a blocking fcntl lock waited for good behind a SIGSTOPped holder. The wait is the box's
    timeout and a quarter, at least 1 s more (2 s: 3 s): a local launcher kills a holder stopped for
    the timeout first."""
    [holder] = fork_ranks(_hold_rank, 1, (2, str(tmp_path)), wait=False, shm_prefix=prefix)
    try:
        box = open_box("shm", _world(0, 2), 1000, 1, "held", timeout=30)
        _wait_for(tmp_path / "held")
        box.timeout = 2.0
        os.kill(holder.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(CommTimeout, match=r"box 'held' push \(stripe 0\).*held for 3 s"):
            box.push(torch.ones(1000))
        assert time.monotonic() - t0 < 10
        box.close()
    finally:
        holder.kill()
        holder.join()


@pytest.mark.timeout(60)
def test_creator_killed_inside_open(prefix: str) -> None:
    [creator] = fork_ranks(_create_rank, 1, (2,), wait=False, shm_prefix=prefix)
    try:
        path = SHM / f"{prefix}lonely"
        _wait_for(path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        creator.kill()
        creator.join(10)
        assert _entries(prefix) == [path.name]  # killed inside open_box: the name is still there
        # A late attacher finds the header but no creator: it gives up, naming rank 0, and unlinks.
        with pytest.raises(CommTimeout, match="local rank 0"):
            open_box("shm", _world(1, 2), 1000, 1, "lonely", timeout=0.5)
        assert _entries(prefix) == []
    finally:
        join_or_kill([creator], 0)


@pytest.mark.parametrize("size", [0, 4096])
def test_a_box_whose_creator_died_before_its_header_is_named_and_removed(prefix: str, size: int) -> None:
    """The creator killed between making the name and writing the header (CI, under load): the late
    attacher names local rank 0 and removes the name, as it does when the header is there."""
    path = SHM / f"{prefix}headless"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)
    with pytest.raises(CommTimeout, match="local rank 0"):
        open_box("shm", _world(1, 2), 1000, 1, "headless", timeout=0.3)
    assert _entries(prefix) == []


def test_under_the_launcher_a_replacement_of_rank0_finds_the_box_after_the_others_exited(
    prefix: str, monkeypatch
) -> None:
    """Rank 0 of two dies just after the rendezvous, and rank 1 finishes before the launcher has kept
    a descriptor of the box (27 Nov, CI: a downpour run's replacement of rank 0 made a new, empty box
    and waited the whole --timeout for rank 1, which had exited). Under the launcher the box's name
    stays until the run ends, and nobody waits for a rank the board shows exited: the replacement
    attaches to the run's box, its contents intact, at once."""
    from parambox.runtime import control

    board = control.WorkerBoard.create(2)
    monkeypatch.setenv(control.BOARD_ENV, str(board.fd))
    try:
        board.set_state(1, control.EXITED)  # rank 1 attached, trained and exited long ago
        with open_box("shm", _world(0, 2), 10, 1, "center", timeout=2) as box:
            box.push(torch.arange(10.0))
        assert _entries(prefix) == [f"{prefix}center"]  # kept for a replacement
        monkeypatch.setenv(control.REJOIN_ENV, "1")  # the replacement of rank 0, no descriptor given
        start = time.monotonic()
        with open_box("shm", _world(0, 2), 10, 1, "center", timeout=2) as box:
            assert box.pull(torch.empty(10)).tolist() == list(range(10))
        assert time.monotonic() - start < 1.0
    finally:
        control._OPEN.pop(board.fd, None)
        os.close(board.fd)


@pytest.mark.timeout(60)
def test_sigint_inside_open_unlinks(prefix: str) -> None:
    [creator] = fork_ranks(_create_rank, 1, (2,), wait=False, shm_prefix=prefix)
    try:
        _wait_for(SHM / f"{prefix}lonely")
        os.kill(creator.pid, signal.SIGINT)
        creator.join(20)
        assert creator.exitcode is not None and _entries(prefix) == []
    finally:
        join_or_kill([creator], 0)


@pytest.mark.timeout(60)
def test_prefix_through_the_store_under_an_external_launcher(tmp_path: Path) -> None:
    from parambox.runtime.dist import free_port

    procs = fork_ranks(_store_rank, 2, (2, free_port(), str(tmp_path)), timeout=50)
    assert [p.exitcode for p in procs] == [0, 0]
    (path0, total0), (path1, total1) = ((tmp_path / str(r)).read_text().split() for r in range(2))
    assert path0 == path1 and Path(path0).name.startswith("pb_") and not Path(path0).exists()
    assert float(total0) == float(total1) == 16.0


def test_remove_segments(tmp_path: Path) -> None:
    for name in ("pb_x_a", "pb_x_b", "pb_y_a"):
        (tmp_path / name).write_bytes(b"")
    assert sorted(remove_segments("pb_x_", root=str(tmp_path))) == ["pb_x_a", "pb_x_b"]
    assert [p.name for p in tmp_path.iterdir()] == ["pb_y_a"]
    with pytest.raises(ValueError):
        remove_segments("", root=str(tmp_path))
