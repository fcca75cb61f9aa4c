"""The second audit's rough edges in what a run writes (issue 53): config.json replaced atomically,
the temporary files of interrupted writes removed, a full disk named as such."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

from parambox.cli import main
from parambox.errors import UserError

TRAIN = ["train", "--strategy", "single", "--steps", "2", "--eval-every", "0", "--no-progress"]


def test_resume_replaces_config_json_atomically_and_removes_interrupted_writes(tmp_path):
    """Before: config.json rewritten in place on every resume (a crash meanwhile left half of it), and
    the ``.tmp`` files of writes interrupted by a SIGKILL stayed forever."""
    run = tmp_path / "run"
    assert main([*TRAIN, "--out", str(run)]) == 0
    leftovers = [run / "checkpoints" / ".last.pt.k1ll3d.tmp", run / ".summary.json.k1ll3d.tmp"]
    for path in leftovers:
        path.write_bytes(b"half a file")
    before = os.stat(run / "config.json").st_ino
    assert main([*TRAIN, "--out", str(run), "--resume", "--steps", "3"]) == 0
    assert os.stat(run / "config.json").st_ino != before  # a new file renamed over the old one
    assert [p for p in leftovers if p.exists()] == []


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB file system (tmpfs), where there is the right to mount one."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)]).returncode
    ):
        pytest.skip("mounting a small tmpfs needs root")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_disk_while_checkpointing_says_so(tiny_disk):
    """Before: ``[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598``."""
    from parambox.training.checkpoint import atomic_save, atomic_write_json

    with pytest.raises(UserError, match=f"no space left on device.*{tiny_disk / 'last.pt'}"):
        atomic_save({"model": torch.zeros(100_000)}, tiny_disk / "last.pt")
    with pytest.raises(UserError, match="no space left on device"):
        atomic_write_json(tiny_disk / "summary.json", {"x": "y" * 100_000})
    assert list(tiny_disk.iterdir()) == []  # nor a temporary file left


def test_a_full_disk_maps_only_no_space():
    from parambox.training.checkpoint import no_space_left

    inner = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise inner
        except OSError:
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
            ) from None
    except RuntimeError as e:
        assert no_space_left(e)
    assert not no_space_left(OSError(errno.EIO, "I/O error")) and not no_space_left(RuntimeError("x"))
