"""Audit item 2: ``weight-avg`` with ``compression`` and ``on_failure=shrink`` survives a lost worker in place.

Rank 1 SIGKILLed before step 5 of 12 (3 workers, period 1, int8: a constant gradient's update quantizes
exactly): the survivors repeat the compressed exchange among themselves and end at the closed form, as the
uncompressed average does (before, both survivors died with an unhandled ``PeerLost``, exit 1).
"""

from __future__ import annotations

import pytest

from tests.test_survive_in_place import _check_closed_form, _run


@pytest.mark.timeout(170)
def test_weight_avg_with_compression_survives_a_kill_in_place(tmp_path):
    out, _ = _run(
        tmp_path, "weight-avg", "kill", timeout_s=30, extra=("--set", "weight-avg.compression=int8")
    )
    _check_closed_form(out)
