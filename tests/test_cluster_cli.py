"""``--emulate-nodes`` as a user runs it: ``parambox train`` on 2 emulated nodes (gloo, and MPI with
the rma box), World's node ranks in every rank's metrics, nothing left behind after a normal end or
SIGKILL of the launcher's process group, and the one-line errors.

Needs root and ip/tc/nsenter/unshare (skipped otherwise, except the not-root error).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import MPI_ENV, ROOT, run_cli, summary
from tests.test_cluster import live_namespaces, needs_root, root_state
from tests.workloads.constant_gradient import weight_after

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.lock("netns"),
]  # emulated nodes: one cluster at a time


def world_records(run_dir: Path, workers: int) -> list[dict]:
    """Each rank's first metrics record: where World says it ran."""
    names = ["metrics.jsonl"] + [f"metrics.rank{r}.jsonl" for r in range(1, workers)]
    return [json.loads((run_dir / n).read_text().splitlines()[0]) for n in names]


@pytest.mark.slow
@needs_root
def test_train_on_two_nodes_over_gloo_through_a_partition(tmp_path):
    """Also a partition (issue 18): rank 2 takes node 1's link down for 2 s at its step 10; every rank
    waits in that step's allreduce and the run goes on when the link is back."""
    before, ns_before = root_state(), live_namespaces()
    out = tmp_path / "run"
    run_cli(
        "train", "--workers", "4", "--emulate-nodes", "2", "--link-gbps", "1", "--steps", "20",
        "--eval-every", "0", "--no-progress", "--out", str(out),
        env={"PARAMBOX_FAULT": "2:10:partition=2"},
    )  # fmt: skip
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in steps if r.get("kind") == "step"}
    # the fault's step 10 counts from 0: the metrics' step 11 waits the partition out (3.2 s here:
    # TCP's retransmission backoff runs past the 2 s), every other step took tens of ms
    assert sorted(times) == list(range(1, 21)) and times[11] - times[10] >= 1.8
    rows = world_records(out, 4)
    assert [(r["node_rank"], r["local_rank"], r["local_world_size"], r["num_nodes"]) for r in rows] == [
        (0, 0, 2, 2),
        (0, 1, 2, 2),
        (1, 0, 2, 2),
        (1, 1, 2, 2),
    ]
    s = summary(out)
    assert s["num_nodes"] == 2 and s["config"]["cluster"]["link_gbps"] == 1.0
    assert root_state() == before and live_namespaces() <= ns_before


@pytest.mark.slow
@needs_root
@pytest.mark.long
def test_a_partition_longer_than_the_timeout_is_survived_by_a_restart(tmp_path):
    """Issue 18: node 1's link down for 6 s at rank 2's step 10, with --timeout 3. Every rank's step
    times out; the launcher restarts all of them from the step-10 checkpoint (node 1's ranks wait in
    the rendezvous until the link is back), and the weights end at the fault-free closed form: 20
    steps of the 4 ranks' mean gradient. (Across emulated nodes a lost worker is not survived in
    place: ``on_failure=shrink`` works under the local launcher on one host.)"""
    before, ns_before = root_state(), live_namespaces()
    out, w = tmp_path / "run", "tests/workloads/constant_gradient.py"
    run_cli(
        "train", "--workers", "4", "--emulate-nodes", "2", "--link-gbps", "1", "--steps", "20",
        "--timeout", "3", "--max-restarts", "1", "--checkpoint-every", "5", "--eval-every", "0",
        "--model", f"{w}:make_model", "--data", f"{w}:make_data", "--loss", f"{w}:loss",
        "--metrics", f"{w}:metrics", "--lr", "0.01", "--momentum", "0", "--batch-size", "4",
        "--threads", "1", "--no-progress", "--out", str(out),
        env={"PARAMBOX_FAULT": "2:10:partition=6"},
    )  # fmt: skip
    s = summary(out)
    assert s["restarts"] == 1 and s["lost_workers"] == []
    assert abs(s["final_test_loss"] - 8 * weight_after(0.01, [(20, [0, 1, 2, 3])])) < 1e-5
    assert root_state() == before and live_namespaces() <= ns_before


@pytest.mark.slow
@needs_root
def test_hybrid_over_mpi_groups_the_ranks_of_each_node(tmp_path):
    pytest.importorskip("mpi4py")
    before, ns_before = root_state(), live_namespaces()
    out = tmp_path / "run"
    proc = run_cli(
        "train", "--strategy", "hybrid", "--box", "rma", "--workers", "4", "--emulate-nodes", "2",
        "--link-gbps", "1", "--steps", "8", "--eval-every", "0", "--no-progress", "--out", str(out),
        env=MPI_ENV,
    )  # fmt: skip
    assert "highly unusual" not in proc.stderr  # the mpiexec filter took Open MPI's race warning out
    rows = world_records(out, 4)
    assert [(r["launcher"], r["node_rank"], r["local_rank"], r["local_world_size"]) for r in rows] == [
        ("mpi", 0, 0, 2),
        ("mpi", 0, 1, 2),
        ("mpi", 1, 0, 2),
        ("mpi", 1, 1, 2),
    ]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()[1:]]
    assert all("allreduce" in r["comm"] for r in steps if r["kind"] == "step")  # inside node 0's group
    assert summary(out)["num_nodes"] == 2
    assert root_state() == before and live_namespaces() <= ns_before


def _mpi_rank(run_dir: Path, rank: int) -> psutil.Process | None:
    """The process of MPI rank ``rank`` of the run in ``run_dir`` (on whichever emulated node)."""
    for proc in psutil.process_iter(["cmdline"]):
        try:
            mine = str(run_dir) in " ".join(proc.info["cmdline"] or [])
            if mine and proc.environ().get("OMPI_COMM_WORLD_RANK") == str(rank):
                return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


@pytest.mark.slow
@needs_root
@pytest.mark.long
@pytest.mark.parametrize(
    "strategy", ["downpour", "easgd"]
)  # easgd: its exchange one request, cut by the death
def test_a_memory_rank_lost_across_nodes_restarts_the_job_with_the_box_rebuilt_from_the_replicas(
    strategy, tmp_path
):
    """Issue 50: across nodes a memory rank's part of the box is its own memory, lost with it (on one
    host Open MPI's windows outlive it). With --max-restarts the launcher starts the MPI job again, every
    rank; the workers kept their replicas when the box went, and rank 0 puts their mean back as the
    center: each worker goes on at the step it had reached, past the last checkpoint's."""
    pytest.importorskip("mpi4py")
    before, ns_before = root_state(), live_namespaces()
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "parambox", "train", "--strategy", strategy, "--box", "rma",
        "--set", "box.memory_ranks=2", "--workers", "2", "--emulate-nodes", "2", "--link-gbps", "1",
        "--steps", "1500", "--checkpoint-every", "100", "--timeout", "5", "--max-restarts", "1", "--model", "logreg",
        "--eval-every", "0", "--no-progress", "--threads", "1", "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, **MPI_ENV)
    launcher = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "last.pt").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.2)
        memory = _mpi_rank(out, 3)  # 2 workers on node 0, then the memory ranks on node 1
        assert memory is not None
        memory.kill()
        _, err = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
    assert launcher.returncode == 0, err
    assert "restarting the workers from the last checkpoint (1 of 1): the MPI job failed: box" in err, err
    assert "rank 3 died, and the part of the box it held went with it" in err, err
    rebuilt = re.search(
        r"ranks 0, 1 kept when it was lost, at their steps (\d+), (\d+) \(the last checkpoint: step (\d+)",
        err,
    )
    assert rebuilt, err
    kept, last = [int(rebuilt[1]), int(rebuilt[2])], int(rebuilt[3])
    assert kept[0] >= last > 0, err  # (rank 1 checkpoints at its own pace: it may be behind)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lives = [r for r in records if r.get("kind") == "world"]
    assert [r["step"] for r in lives] == [0, kept[0]], lives  # rank 0 went on from its own replica's step
    s = summary(out)
    assert s["rebuilt_box"] == {"ranks": [0, 1], "steps": kept, "checkpoint_step": last}, s
    # Each worker counted to its last step, also a rank 1 that died before its first own checkpoint
    # (it starts again at last.pt's step, its count in the box with it)
    assert (s["restarts"], s["memory_ranks"], s["worker_steps"]) == (1, 2, [1500, 1500]), s
    assert root_state() == before and live_namespaces() <= ns_before


@needs_root
def test_mpi_windows_across_nodes_train(tmp_path):
    """``box.server=false``: MPI's windows across the nodes, served by Open MPI's TCP progress thread,
    which only such a run gets (the memory server progresses its own messages)."""
    pytest.importorskip("mpi4py")
    out = tmp_path / "run"
    run_cli(
        "train", "--strategy", "easgd", "--box", "rma", "--set", "box.server=false", "--workers", "2",
        "--emulate-nodes", "2", "--link-gbps", "1", "--steps", "40", "--eval-every", "0", "--no-progress",
        "--out", str(out), env=MPI_ENV,
    )  # fmt: skip
    s = summary(out)
    assert (s["launcher"], s["num_nodes"], s["worker_steps"]) == ("mpi", 2, [40, 40])


@needs_root
def test_a_shm_box_across_nodes_is_one_line_naming_rma(tmp_path):
    proc = run_cli(
        "train", "--strategy", "easgd", "--workers", "2", "--emulate-nodes", "2", "--steps", "5",
        "--no-progress", "--out", str(tmp_path / "run"), check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "use --box rma" in proc.stderr, proc.stderr


@pytest.mark.slow
@needs_root
def test_nothing_left_after_sigkill_of_the_launchers_process_group(tmp_path):
    before = root_state()
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "parambox", "train", "--emulate-nodes", "2", "--link-gbps", "0.1"]
    cmd += ["--steps", "100000", "--eval-every", "0", "--no-progress", "--out", str(out)]
    launcher = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.rank1.jsonl").exists():  # both workers train on their nodes
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        ours = os.readlink("/proc/self/ns/net")
        inside = [p for p in psutil.Process(launcher.pid).children(recursive=True) if _netns(p.pid) != ours]
        cluster_ns = {_netns(p.pid) for p in inside} - {None}
        assert len(cluster_ns) >= 2  # the workers' two nodes (the hub holds no worker)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
    deadline = time.monotonic() + 10
    while (cluster_ns & live_namespaces() or any(_alive(p) for p in inside)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not cluster_ns & live_namespaces()
    assert not [p.pid for p in inside if _alive(p)]
    assert root_state() == before


def test_not_root_is_one_line_exit_2(tmp_path):
    code = (
        "import os, sys; os.geteuid = lambda: 1000\n"
        "from parambox.cli import main\n"
        f"sys.exit(main(['train', '--emulate-nodes', '2', '--out', {str(tmp_path / 'run')!r}]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "parambox: error: --emulate-nodes needs root (network namespaces, veth links, tc): run as root or drop it"
    ]
    assert not (tmp_path / "run").exists()


def _netns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
@needs_root
def test_bench_cluster_quick_form_has_every_key():
    pytest.importorskip("mpi4py")
    before = root_state()
    setups = "ddp,allreduce,easgd-tau4,ceiling"  # gloo and MPI setups; the full list takes longer
    argv = ["bench", "cluster", "--quick", "--setups", setups, "--gbps", "0.1", "--json"]
    result = json.loads(run_cli(*argv, env=MPI_ENV, timeout=230).stdout)
    assert set(result["by_gbps"]) == {"0.1"} and result["workers"] == result["nodes"] == 2
    for entry in result["by_gbps"].values():
        assert set(entry["samples_per_s"]) == set(setups.split(","))
        assert set(entry["ratio_vs_ddp"]) == {"allreduce", "easgd-tau4", "ceiling"}
        for key in ("ddp_vs_loopback", "best_setup", "best_vs_ddp", "best_vs_ceiling", "load_average_1m"):
            assert key in entry
        assert entry["best_setup"] in ("allreduce", "easgd-tau4")
        comm = entry["comm"]
        # What crosses the link: DDP's gradients both ways (2 x 4.28 MB per step), never the ceiling's.
        assert comm["ddp"]["link_bytes_per_step"] > 8e6 > 1e5 > comm["ceiling"]["link_bytes_per_step"]
        assert comm["allreduce"]["comm_s_per_step"] > 0 and comm["ddp"]["comm_s_per_step"] is None
        assert len(comm["easgd-tau4"]["comm_s_per_step_per_rank"]) == 2  # every rank's, not rank 0's
        for c in comm.values():  # CPU a step, every rank's: the main thread's within the process's
            cpu, main = c["cpu_ms_per_step_per_rank"], c["main_thread_cpu_ms_per_step_per_rank"]
            assert len(cpu) == len(main) == 2 and all(0 < m <= p + 1e-6 for m, p in zip(main, cpu))
            assert c["machine_cpu_ms_per_step"] > 0  # the whole machine's: every process and the kernel
        # each setup beside its simulation on the run's own compute time (the ceiling's step)
        assert set(entry["simulated"]) == {"ddp", "allreduce", "easgd-tau4"}
        assert all(v["simulated_ms"] > v["compute_ms"] > 0 for v in entry["simulated"].values())
    assert root_state() == before


@pytest.mark.slow
@needs_root
@pytest.mark.long
def test_bench_cluster_with_two_workers_a_node_sets_each_setup_beside_its_simulation():
    """--workers-per-node 2: four workers on two emulated nodes, each setup beside the simulator's step for
    two workers a node; allreduce's ring over the four crosses each link with 2 x 3/4 of the gradient
    each way, as simulated."""
    pytest.importorskip("mpi4py")
    before = root_state()
    setups = "allreduce,box-sync,downpour,hybrid,ceiling"
    argv = [
        "bench",
        "cluster",
        "--quick",
        "--setups",
        setups,
        "--gbps",
        "1",
        "--workers-per-node",
        "2",
        "--json",
    ]
    result = json.loads(run_cli(*argv, env=MPI_ENV, timeout=280).stdout)
    assert (result["workers"], result["workers_per_node"]) == (4, 2)
    entry = result["by_gbps"]["1"]
    assert set(entry["simulated"]) == {"allreduce", "box-sync", "downpour", "hybrid"}
    assert all(v["simulated_ms"] >= v["compute_ms"] > 0 for v in entry["simulated"].values())
    size = 4.0 * result["parameters"]
    assert entry["comm"]["allreduce"]["link_bytes_per_step_per_node"][0] == pytest.approx(
        2 * 1.5 * size, rel=0.02
    )
    assert root_state() == before


@pytest.mark.slow
@needs_root
def test_predict_validate_on_the_cluster_quick_form():
    before = root_state()
    argv = ["predict", "--model", "mlp", "--topology", "ring", "--validate", "--json", "--max-workers", "2"]
    given = ["--comp-ms", "0.05"]  # T_comp given: no profiling process (n=1's error is then meaningless)
    proc = run_cli(*argv, *given, "--global-batch", "32", "--emulate-nodes", "2", "--link-gbps", "0.1")
    result = json.loads(proc.stdout)
    v = result["validation"]
    assert v["emulated_link_gbps"] == 0.1 and result["network"]["bandwidth_gbps"] == 0.1
    assert v["validation_bandwidth_gbps"] == pytest.approx(0.1 * 1448 / 1514)  # the TCP payload of the rate
    assert set(v["rel_error"]) == {"1", "2"} and result["validation_max_rel_error"] == v["max_rel_error"]
    # The link binds: 0.8 MB of gradients at 12 MB/s cannot cross in less than the burst allows.
    s_bytes = result["message_bytes"]
    assert v["measured_step_ms"]["2"] > (s_bytes - 2 * 131072) / 12.5e6 * 1e3
    assert v["probe_bandwidth_gbps"] < 0.12
    assert root_state() == before


def test_predict_on_the_cluster_needs_validate():
    proc = run_cli("predict", "--emulate-nodes", "2", "--link-gbps", "1", "--comp-ms", "1", check=False)
    assert proc.returncode == 2 and "go with --validate" in proc.stderr
