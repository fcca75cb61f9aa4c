"""The second audit's security items (issue 53): the shared-memory prefix, the torch pin, and one trust
rule for every path that imports code named in a run directory."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest

from parambox.box import open_box
from parambox.errors import UserError
from parambox.runtime.spawn import PREFIX_ENV, new_prefix
from parambox.runtime.world import World

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("bad", ["../../tmp/x", "pb/x_", "..", "pb x", "pb_\n"])
def test_the_shm_prefix_is_a_plain_name(bad, monkeypatch, tmp_path):
    """Before: ``PARAMBOX_SHM_PREFIX=../../tmp/x`` made the box ``/dev/shm/../../tmp/xNAME``."""
    monkeypatch.setenv(PREFIX_ENV, bad)
    with pytest.raises(UserError, match=PREFIX_ENV):
        open_box("shm", World(), 10, 1, "solo")
    assert not list(Path("/tmp").glob("xsolo*"))


def test_a_segment_name_traces_back_to_the_process_that_made_its_prefix():
    """Before: ``pb_<16 hex>_``, with nothing that says whose run left a segment behind."""
    prefix = new_prefix()
    assert re.fullmatch(rf"pb_{os.getpid()}_[0-9a-f]{{16}}_", prefix), prefix
    assert prefix != new_prefix()


def test_torch_is_pinned_past_the_weights_only_advisory():
    """GHSA-63cw-57p8-fm3p: ``torch.load(weights_only=True)`` bypass, fixed in torch 2.10.0."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [d for d in deps if re.match(r"torch\b", d)]
    assert torch.replace(" ", "") == "torch>=2.10", torch
