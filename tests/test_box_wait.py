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
