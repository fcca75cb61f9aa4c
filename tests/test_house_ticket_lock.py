"""Audit item 4: the ticket lock of asynchronous DiLoCo passes over a holder the launcher's board knows is dead
at once, instead of waiting ``stall_s`` (``--timeout``, 300 s by default) for it."""

from __future__ import annotations

import time
import uuid

import pytest

from parambox.box import open_box
from parambox.runtime.control import DEAD, WorkerBoard
from parambox.runtime.world import World
from parambox.strategies.delayed_nesterov import TicketLock

STALL_S = 5.0


@pytest.fixture
def lock_box():
    b = open_box("shm", World(), 1, 5, name=f"lock-{uuid.uuid4().hex[:8]}")
    yield b
    b.close()


def _lock(box, rank: int, board: WorkerBoard) -> TicketLock:
    return TicketLock(box, 0, 1, 2, rank, 3, STALL_S, board=board)  # 0 ticket, 1 served, 2.. 3 ranks' slots


def test_a_turn_whose_holder_the_board_says_is_dead_is_passed_over_at_once(lock_box):
    board = WorkerBoard.create(3)
    try:
        assert _lock(lock_box, 0, board).acquire() == 0  # rank 0 holds the turn ...
        second = _lock(lock_box, 1, board)
        assert second.take() == 1  # ... rank 1 waits behind it, alive
        board.set_state(0, DEAD)  # rank 0 dies: its launcher says so
        third = _lock(lock_box, 2, board)
        t0 = time.monotonic()
        assert third.take() == 2
        # a live waiter (rank 1) is before rank 2 in line: not rank 2's to pass over
        assert not third._dead_before(0, 2)
        assert second.wait(1) == 1  # rank 1, next in line, passes the dead holder over at once
        assert time.monotonic() - t0 < STALL_S / 2 and second.passed_over == 1
        second.release(1)
        assert third.wait(2) == 2 and time.monotonic() - t0 < STALL_S / 2
    finally:
        board.close()
