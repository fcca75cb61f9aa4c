"""Temporary folders removed even when every process that made them was killed (runtime/scratch.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from parambox.runtime import scratch, spawn

_MAKE_AND_DIE = textwrap.dedent(
    """
    import os, signal, sys
    from parambox.runtime import scratch
    path, fd = scratch.make(sys.argv[1], sys.argv[2])
    print(path, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no exit handler runs
    """
)


def _killed_maker(prefix: str, root: Path) -> Path:
    proc = subprocess.run(
        [sys.executable, "-c", _MAKE_AND_DIE, prefix, str(root)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return Path(proc.stdout.strip())


def test_a_folder_is_removed_when_its_block_ends(tmp_path):
    with scratch.folder("pb-test-", str(tmp_path)) as path:
        assert Path(path).parent == tmp_path and (Path(path) / scratch.MARKER).exists()
        (Path(path) / "a file").write_text("x")
    assert list(tmp_path.iterdir()) == []


def test_a_killed_makers_folder_is_swept_by_the_next_of_its_kind_and_nothing_else(tmp_path):
    left = _killed_maker("pb-test-", tmp_path)
    assert left.is_dir()  # nobody removed it
    other_kind = _killed_maker("pb-other-", tmp_path)
    not_ours = Path(tempfile.mkdtemp(prefix="pb-test-", dir=tmp_path))  # same name, no marker
    with scratch.folder("pb-test-", str(tmp_path)) as mine:
        assert not left.exists()
        assert other_kind.is_dir() and not_ours.is_dir()
        assert scratch.sweep("pb-test-", str(tmp_path)) == []  # its own, locked, stays
        assert Path(mine).is_dir()
    assert sorted(tmp_path.iterdir()) == sorted([other_kind, not_ours])


def test_the_reaper_holds_the_lock_until_it_has_cleaned_up(tmp_path):
    path, lock = scratch.make("pb-test-", str(tmp_path))
    guard, reaper = spawn._start_reaper(path, lock=lock)  # the lock is the reaper's now
    try:
        assert not scratch.remove_if_unlocked(path) and Path(path).is_dir()
    finally:
        os.close(guard)  # as a launcher that died: the reaper removes the folder, then ends
    reaper.wait(10)
    assert not Path(path).exists()


def test_a_folder_locked_by_a_live_process_is_never_swept(tmp_path):
    code = "from parambox.runtime import scratch; import sys, time; print(scratch.make('pb-test-', sys.argv[1])[0], flush=True); time.sleep(60)"  # noqa: E501
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        held = Path(proc.stdout.readline().strip())
        assert scratch.sweep("pb-test-", str(tmp_path)) == [] and held.is_dir()
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5
    while not scratch.sweep("pb-test-", str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)  # the lock goes with the process
    assert not held.exists()
