"""The second audit's security items (issue 53): the shared-memory prefix, the torch pin, and one trust
rule for every path that imports code named in a run directory."""

from __future__ import annotations

import os
import re
import time
import tomllib
from pathlib import Path

import pytest

from parambox.box import open_box
from parambox.errors import UserError
from parambox.runtime.spawn import PREFIX_ENV, new_prefix
from parambox.runtime.world import World
from tests.conftest import one_line

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


REF = "tests.workloads.user_regression"
TRAIN = ["train", "--strategy", "single", "--steps", "2", "--eval-every", "0", "--no-progress"]
TRAIN_REFS = [*TRAIN, "--model", f"{REF}:make_model", "--data", f"{REF}:make_data", "--loader-workers", "0"]
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")


@pytest.fixture
def finished_run(tmp_path):
    from parambox.cli import main

    run = tmp_path / "theirs"
    assert main([*TRAIN_REFS, "--out", str(run)]) == 0
    return run


@as_root
def test_resume_of_another_users_run_directory_is_refused(finished_run, capsys):
    """Before: ``--resume`` imported and ran the code config.json names, from anyone's directory."""
    from parambox.cli import main

    os.chown(finished_run, 65534, -1)
    assert main([*TRAIN_REFS, "--out", str(finished_run), "--resume", "--steps", "3"]) == 2
    line = one_line(capsys)
    assert "uid 65534" in line and f"{REF}:make_model" in line and str(finished_run) in line, line
    os.chown(finished_run, 0, -1)
    (finished_run / "config.json").chmod(0o644)
    os.chown(finished_run / "config.json", 65534, -1)  # its config written by someone else
    assert main([*TRAIN_REFS, "--out", str(finished_run), "--resume", "--steps", "3"]) == 2
    assert "uid 65534" in one_line(capsys)


@as_root
def test_an_in_process_field_does_not_skip_exports_trust_check(tmp_path, capsys):
    """Before: any ``<in-process>`` field skipped the check, so the other fields' code was imported."""
    import json

    from parambox.cli import main
    from parambox.config import RunConfig

    marker, code = tmp_path / "imported", tmp_path / "theirs_code.py"
    code.write_text(f"open({str(marker)!r}, 'w').close()\n\ndef make_model():\n    pass\n")
    run = tmp_path / "theirs"
    run.mkdir()
    cfg = RunConfig(model=f"{code}:make_model", data=f"{REF}:make_data", loss="<in-process>:my_loss")
    (run / "config.json").write_text(json.dumps(cfg.model_dump()))
    os.chown(run, 65534, -1)
    assert main(["export", str(run), "--onnx", str(tmp_path / "m.onnx")]) == 2
    assert "<in-process>:my_loss" in one_line(capsys)
    assert not marker.exists(), "export imported the code of another user's run directory"


def test_load_model_takes_a_str_path(finished_run):
    """Before: ``TypeError: unsupported operand type(s) for /: 'str' and 'str'``."""
    from parambox.run import load_model

    model = load_model(str(finished_run))
    assert not model.training and sum(p.numel() for p in model.parameters()) > 0


@as_root
def test_load_model_checks_trust(finished_run):
    """Before: ``parambox.run.load_model`` imported the code of anyone's run directory."""
    from parambox.run import load_model

    os.chown(finished_run, 65534, -1)
    with pytest.raises(UserError, match="uid 65534.*trust=True"):
        load_model(finished_run)
    assert load_model(finished_run, trust=True) is not None


@pytest.mark.parametrize("fenced", ["[99]", "[-1]", "[2]", '{"1": 1}', '["1"]', "[true]", "7", "[1.5]"])
def test_what_the_launcher_reads_from_its_store_is_checked(fenced, tmp_path):
    """S-A: any local user can write a shrink run's store (torch's TCPStore has no password). Before:
    ``fenced=[99]`` crashed the launcher with a traceback (IndexError). Only ranks of the run are
    taken (rank 0 too: its death is survived in place)."""
    import signal
    import subprocess

    from torch.distributed import HashStore

    from parambox.runtime.elastic import FENCED_KEY
    from parambox.runtime.supervisor import Supervisor

    procs = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(2)]
    try:
        store = HashStore()
        sup = Supervisor(procs, tmp_path, tolerate_loss=False, stall_s=1.0, shrink_store=store)
        sup._life_store().set(FENCED_KEY, fenced)
        sup._kill_fenced([None, None])
        time.sleep(0.3)  # a SIGKILL sent would have ended them by now
        assert [p.poll() for p in procs] == [None, None]
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()


LISTENERS = r"""
import os
from mpi4py import MPI
import numpy as np

comm = MPI.COMM_WORLD
x = np.ones(1 << 16)
comm.Allreduce(MPI.IN_PLACE, x)  # the transports are up
mine = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if link.startswith("socket:["):
        mine.add(link[8:-1])
wide = []
for table, anywhere in (("tcp", "00000000"), ("tcp6", "00000000000000000000000000000000")):
    with open(f"/proc/self/net/{table}") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == "0A" and inode in mine and local.split(":")[0] == anywhere:
                wide.append(f"{table} port {int(local.split(':')[1], 16)}")
comm.Barrier()
print(f"rank {comm.Get_rank()} listens on every interface: {wide}", flush=True)
"""


@pytest.mark.slow
def test_a_local_mpi_jobs_ranks_listen_on_no_interface(tmp_path):
    """S-F: a local ``--box rma`` run's ranks listened on 0.0.0.0 and [::] (Open MPI's TCP transport,
    which ranks on one host do not use: they talk through shared memory)."""
    import subprocess

    from parambox.runtime import spawn

    if spawn.find_mpiexec() is None:
        pytest.skip("no mpiexec")
    prog = tmp_path / "listeners.py"
    prog.write_text(LISTENERS)
    import sys

    proc = spawn.start_mpi(
        [sys.executable, str(prog)], 2, dict(os.environ), stdout=subprocess.PIPE, text=True
    )
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        spawn.stop([proc])
    assert proc.returncode == 0
    assert sorted(out.strip().splitlines()) == [f"rank {r} listens on every interface: []" for r in (0, 1)], (
        out
    )
