"""``wait_until``'s polling (tier a, on a fake clock): short waits look often, a long wait naps a share
of what it has waited, and a wait past its deadline raises."""

from __future__ import annotations

import pytest

from parambox.box import base
from parambox.errors import CommTimeout


class FakeClock:
    """``time`` as wait_until uses it: sleeping moves the clock; a look costs nothing."""

    def __init__(self):
        self.now, self.naps = 0.0, []

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, s: float) -> None:
        self.naps.append(s)
        self.now += s


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(base, "time", fake)
    monkeypatch.setattr(base.os, "sched_yield", lambda: setattr(fake, "now", fake.now + 1e-6))
    return fake


@pytest.mark.parametrize("wait_s", [0.002, 0.04, 0.5, 5.0])
def test_a_wait_naps_a_share_of_its_wait_and_is_seen_at_most_that_share_late(clock, wait_s):
    looks = []

    def ready():
        looks.append(clock.now)
        return clock.now >= wait_s

    assert base.wait_until(ready, 60, lambda: "")
    late = clock.now - wait_s
    # the answer is seen at most a 64th of the wait (or one short nap) after it came
    assert late <= max(base.NAP_S, wait_s * base.LONG_WAIT_SHARE) + 1e-9
    naps = clock.naps
    assert naps[:4] == pytest.approx([5e-5, 1e-4, 2e-4, 4e-4][: len(naps[:4])])  # doubling, as before
    assert max(naps) <= base.LONG_NAP_S
    if wait_s >= 0.5:  # a long wait: a few hundred looks, not one every 0.4 ms (1,250 for 0.5 s)
        assert len(looks) < 0.3 * wait_s / base.NAP_S
    if wait_s <= 0.002:
        assert max(naps) <= base.NAP_S  # a short wait looks as often as before


def test_a_wait_past_its_deadline_raises_with_its_message(clock):
    with pytest.raises(CommTimeout, match="no answer"):
        base.wait_until(lambda: False, 2.0, lambda: "no answer")
    assert 2.0 <= clock.now <= 2.0 + base.LONG_NAP_S + 1e-9


@pytest.mark.parametrize("gap_s", [0.002, 0.021, 0.2])
def test_the_servers_naps_between_landings_look_a_third_as_often_and_see_a_landing_at_most_half_late(gap_s):
    """The memory server between two landings ``gap_s`` apart (a 256 KiB chunk lands every 21 ms at
    0.1 Gbit/s): first naps as before, then half the quiet time, at most 4 ms."""
    from parambox.box import server

    now, nap, naps = 0.0, server.FIRST_NAP_S, []
    while now < gap_s:
        nap = server.next_nap(nap, False, True, now)
        naps.append(nap)
        now += nap
    assert naps[:4] == pytest.approx([1e-4, 2e-4, 4e-4, 5e-4][: len(naps[:4])])
    assert max(naps) <= server._QUIET_NAP_S == 4e-3
    assert now - gap_s <= max(server._NAP_S, min(gap_s / 2, 4e-3)) + 1e-9
    old_rule = 4 + (gap_s - 1.25e-3) / server._NAP_S  # doubling to 0.5 ms, then 0.5 ms naps
    if gap_s >= 0.02:
        assert len(naps) <= old_rule / 3
    assert server.next_nap(nap, True, True, 0.0) == server.FIRST_NAP_S  # a landing: look soon again
    assert server.next_nap(2e-3, False, False, 5.0) == server._IDLE_NAP_S  # idle: as before
