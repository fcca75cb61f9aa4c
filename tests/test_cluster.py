"""The emulated cluster (parambox.runtime.cluster): topology, shaping, gloo and MPI across nodes, and
that nothing is left behind after a normal end, an exception, a failed set-up, SIGINT, SIGTERM, or
SIGKILL of the owner or its process group (also during an MPI job).

Needs root and ip/tc/nsenter/unshare; skipped otherwise (the error-message tests run anywhere).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from parambox.runtime import cluster, spawn
from parambox.runtime.cluster import ALLOWED_CONGESTION, ClusterConfig, ClusterUnavailable, EmulatedCluster
from parambox.runtime.cluster_agent import DROPPED_CONNECTION

CAN_RUN = os.geteuid() == 0 and all(shutil.which(t) for t in cluster.TOOLS)
needs_root = pytest.mark.skipif(not CAN_RUN, reason="needs root and ip, tc, nsenter, unshare")


pytestmark = pytest.mark.lock("netns")  # emulated nodes: one cluster at a time


# ----- helpers ------------------------------------------------------------------------------------
def _out(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True).stdout


def root_state() -> dict:
    """What a leak would change in the root namespace and the file system."""
    links = sorted(line.split(":")[1].strip().split("@")[0] for line in _out("ip", "-o", "link").splitlines())
    netns_dir = Path("/var/run/netns")
    return {
        "ip link": links,
        "ip netns": _out("ip", "netns", "list"),
        "/var/run/netns": sorted(os.listdir(netns_dir)) if netns_dir.exists() else [],
        "tc qdisc": _out("tc", "qdisc", "show"),
        "allowed congestion": Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text(),
    }


def live_namespaces() -> set[str]:
    """Every network namespace some process is in now (``net:[inode]``)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found.add(os.readlink(f"/proc/{entry}/ns/net"))
            except OSError:
                pass
    return found


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie holds no namespace
    except FileNotFoundError:
        return False


def assert_gone(ns_ids: list[str], pids: list[int], before: dict, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not (set(ns_ids) & live_namespaces()) and not any(pid_alive(p) for p in pids):
            break
        time.sleep(0.05)
    assert not set(ns_ids) & live_namespaces(), "a namespace of the cluster is still held"
    assert not [p for p in pids if pid_alive(p)], "a holder or worker is still alive"
    assert root_state() == before


def recv_server(c: EmulatedCluster, node: int, port: int) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import socket, sys
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", {port})); s.listen(); print("ready", flush=True)
        a, _ = s.accept(); n = 0
        while True:
            b = a.recv(1 << 20)
            if not b: break
            n += len(b)
        print(n, flush=True)
    """)
    p = c.popen(node, [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def send(c: EmulatedCluster, node: int, host: str, port: int, nbytes: int) -> float:
    code = (
        f"import socket,time; s=socket.create_connection(({host!r},{port})); t=time.perf_counter();"
        f"s.sendall(b'x'*{nbytes}); s.shutdown(socket.SHUT_WR); s.recv(1); print(time.perf_counter()-t)"
    )
    r = subprocess.run(
        c.command(node, [sys.executable, "-c", code]), capture_output=True, text=True, check=True
    )
    return float(r.stdout)


# The owner takes SIGINT as a terminal's Ctrl-C would reach it. A suite started as a background job of a
# non-interactive shell (`cmd &` in a script) inherits SIGINT ignored, and Python then installs no
# KeyboardInterrupt handler: the owner would sleep on and never run close() (the 30 s time-outs seen
# under the full suite), whatever the load.
OWNER = textwrap.dedent("""
    import json, signal, subprocess, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
    from parambox.runtime.cluster import EmulatedCluster
    with EmulatedCluster(2, 0.1) as c:
        w = c.popen(1, ["sleep", "300"])                                      # dies with us (PDEATHSIG)
        s = subprocess.Popen(c.command(0, ["sleep", "300"]), start_new_session=True)  # a straggler
        print(json.dumps({{"ns": c.namespace_ids(), "pids": c.holder_pids() + [w.pid, s.pid]}}), flush=True)
        time.sleep(300)
""")


def start_owner() -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen(
        [sys.executable, "-c", OWNER.format()],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    info = json.loads(p.stdout.readline())
    time.sleep(0.2)  # let the sleeps exec
    return p, info


# ----- no root needed -----------------------------------------------------------------------------
def test_not_root_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterUnavailable, match="needs root") as e:
        EmulatedCluster(2, 1.0).start()
    assert "\n" not in str(e.value)


def test_missing_tool_is_named(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda t: None if t == "tc" else real(t))
    with pytest.raises(ClusterUnavailable, match=r"needs tc on PATH"):
        EmulatedCluster(2, 1.0).start()


@pytest.mark.skipif(not CAN_RUN or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_root_without_capabilities_is_one_clear_error():
    code = (
        "from parambox.runtime import cluster\n"
        "try:\n    cluster.EmulatedCluster(2, 1.0).start()\n"
        "except cluster.ClusterUnavailable as e:\n    print(e)"
    )
    r = subprocess.run(
        ["setpriv", "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.stdout.count("\n") == 1 and "cannot create a network namespace" in r.stdout, r.stdout + r.stderr


def test_bad_arguments():
    with pytest.raises(ClusterUnavailable):
        EmulatedCluster(0, 1.0)
    with pytest.raises(ClusterUnavailable):
        EmulatedCluster(2, -1.0)


# ----- topology and traffic -----------------------------------------------------------------------
@needs_root
def test_nodes_have_addresses_names_and_shaped_links_and_root_namespace_untouched():
    before = root_state()
    with EmulatedCluster(3, 1.0) as c:
        assert [c.node_address(k) for k in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
        assert len(set(c.namespace_ids())) == 4 and os.readlink("/proc/self/ns/net") not in c.namespace_ids()
        for k in range(3):
            out = _out(
                *c.command(k, ["sh", "-c", "hostname; ip -o -4 addr; tc qdisc show dev pbnet; ip -o link"])
            )
            assert out.startswith(f"node{k}\n")
            assert f"inet {c.node_address(k)}/16" in out and "inet 127.0.0.1/8" in out
            assert "qdisc tbf" in out and "rate 1Gbit" in out
        hub = _out("nsenter", f"--net={c.hub_netns_path()}", "tc", "qdisc")
        assert hub.count("qdisc tbf") == 3
        assert c.env(1)["GLOO_SOCKET_IFNAME"] == "pbnet" and c.env(1)["MASTER_ADDR"] == "10.77.0.1"
        assert root_state() == before  # nothing in the root namespace, even while running
    assert root_state() == before


@needs_root
def test_traffic_between_nodes_crosses_the_links_and_inside_a_node_does_not():
    with EmulatedCluster(2, 1.0) as c:
        server = recv_server(c, 0, 6001)
        sent0 = c.link_bytes(1)[0]
        send(c, 1, c.node_address(0), 6001, 2_000_000)
        assert server.stdout.readline().strip() == "2000000"
        server.wait(10)
        assert c.link_bytes(1)[0] - sent0 > 2_000_000  # payload plus headers went over node 1's link

        server = recv_server(c, 0, 6002)
        before = c.link_bytes(0)
        send(c, 0, c.node_address(0), 6002, 2_000_000)  # same node, to its own link address
        server.wait(10)
        after = c.link_bytes(0)
        assert after[0] - before[0] < 10_000 and after[1] - before[1] < 10_000


@needs_root
def test_rate_is_limited():
    nbytes = 2_500_000  # 0.2 s at 0.1 Gbit/s
    with EmulatedCluster(2, 0.1) as c:
        server = recv_server(c, 0, 6003)
        dt = send(c, 1, c.node_address(0), 6003, nbytes)
        server.wait(10)
    # The rate can only be lower under load, never higher (the 128 KiB burst is 5 % of the data).
    assert nbytes / dt < 0.1e9 / 8 * 1.1, f"{nbytes / dt / 1e6:.1f} MB/s through a 12.5 MB/s link"


# ----- clean-up in every exit path ---------------------------------------------------------------
@needs_root
def test_nothing_left_after_a_normal_end():
    before = root_state()
    with EmulatedCluster(2, 1.0) as c:
        ns, pids = c.namespace_ids(), c.holder_pids()
        worker = c.popen(1, ["sleep", "300"])
        pids.append(worker.pid)
        while worker.pid not in c.processes_inside():  # nsenter has not entered yet
            time.sleep(0.005)
    assert c.setup_s is not None and c.teardown_s is not None
    assert worker.wait(5) == -signal.SIGKILL  # close() kills what still runs inside
    assert_gone(ns, pids, before)
    assert c.close() == []  # idempotent


@needs_root
def test_nothing_left_after_an_exception():
    before = root_state()
    with pytest.raises(RuntimeError, match="boom"), EmulatedCluster(2, 1.0) as c:
        ns, pids = c.namespace_ids(), c.holder_pids()
        raise RuntimeError("boom")
    assert_gone(ns, pids, before)


@needs_root
def test_nothing_left_when_set_up_fails(monkeypatch):
    before, ns_before = root_state(), live_namespaces()
    made = []

    def failing(self):
        made.extend(self.holder_pids())
        raise ClusterUnavailable("cannot set up the emulated cluster: simulated")

    monkeypatch.setattr(EmulatedCluster, "_configure", failing)
    with pytest.raises(ClusterUnavailable, match="simulated"):
        EmulatedCluster(2, 1.0).start()
    assert len(made) == 3
    assert_gone(list(live_namespaces() - ns_before), made, before)


@pytest.mark.parametrize(
    "how",
    [
        "SIGINT",
        "SIGTERM",
        "SIGKILL",
        "SIGKILL of the process group",
    ],
)
@needs_root
def test_nothing_left_after_the_owner_is_signalled(how):
    before = root_state()
    owner, info = start_owner()
    assert set(info["ns"]) <= live_namespaces() and all(pid_alive(p) for p in info["pids"])
    if how == "SIGKILL of the process group":
        os.killpg(owner.pid, signal.SIGKILL)
    else:
        owner.send_signal(getattr(signal, how))
    try:
        owner.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(owner.pid, signal.SIGKILL)  # leave nothing behind for the tests after this one
        owner.wait(30)
        raise
    assert_gone(info["ns"], info["pids"], before)


# ----- gloo and MPI across nodes -------------------------------------------------------------------
GLOO = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    r = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="tcp://%s:29555" % os.environ["MASTER_ADDR"], rank=r, world_size=2)
    t = torch.full((1000,), float(r + 1)); dist.all_reduce(t)
    print(t[0].item(), os.uname().nodename, flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.slow
@needs_root
def test_gloo_across_two_nodes():
    pytest.importorskip("torch")
    with EmulatedCluster(2, 1.0) as c:
        env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR")
        ps = [
            c.popen(
                k, [sys.executable, "-c", GLOO], env=dict(env, RANK=str(k)), stdout=subprocess.PIPE, text=True
            )
            for k in range(2)
        ]
        outs = [p.communicate(timeout=120)[0].split() for p in ps]
        assert outs == [["3.0", "node0"], ["3.0", "node1"]]
        assert c.link_bytes(1)[0] > 4000  # the all_reduce went over the link


MPI_HELLO = textwrap.dedent("""
    import json, os
    from mpi4py import MPI
    c = MPI.COMM_WORLD
    s = c.allreduce(c.Get_rank() + 1)
    rows = c.gather((c.Get_rank(), MPI.Get_processor_name(), os.readlink("/proc/self/ns/net"),
                     os.environ["PARAMBOX_NODE_RANK"]), root=0)
    if c.Get_rank() == 0:
        print(json.dumps([s, rows]), flush=True)
""")


@pytest.mark.slow
@needs_root
def test_mpi_ranks_run_on_their_nodes(tmp_path):
    pytest.importorskip("mpi4py")
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    if not Path(mpiexec).exists():
        pytest.skip("no mpiexec")
    with EmulatedCluster(2, 1.0) as c:
        script = tmp_path / "mpi_hello.py"
        script.write_text(MPI_HELLO)
        r = subprocess.run(
            c.mpi_command(4, [sys.executable, str(script)], mpiexec=mpiexec),
            env=c.mpi_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        total, rows = json.loads(r.stdout)
        assert total == 10
        assert [[h, node] for _, h, _, node in rows] == [
            ["node0", "0"],
            ["node0", "0"],
            ["node1", "1"],
            ["node1", "1"],
        ]
        ns = c.namespace_ids()
        assert [n for _, _, n, _ in rows] == [ns[1], ns[1], ns[2], ns[2]]
        assert c.link_bytes(1)[0] > 1000


OWNER_MPI = textwrap.dedent("""
    import json, subprocess, sys, time
    from parambox.runtime.cluster import EmulatedCluster
    app = "from mpi4py import MPI; import time; MPI.COMM_WORLD.Barrier(); print('up', flush=True); time.sleep(300)"
    with EmulatedCluster(2, 1.0) as c:
        p = subprocess.Popen(c.mpi_command(4, [sys.executable, "-c", app], mpiexec={mpiexec!r}),
                             env=c.mpi_env(), stdout=subprocess.PIPE, text=True)
        for _ in range(4):
            p.stdout.readline()
        print(json.dumps({{"ns": c.namespace_ids(), "inside": c.processes_inside()}}), flush=True)
        time.sleep(300)
""")


@pytest.mark.slow
@needs_root
@pytest.mark.solo  # looks at /tmp
def test_nothing_left_after_sigkill_during_an_mpi_job(tmp_path):
    """mpiexec's daemon and ranks on node 1 are not our children: the holders' sweep kills them. Open
    MPI's files go to a private directory, as ``spawn.start_mpi`` gives a run (killed, mpiexec leaves
    PMIx's contact files behind: they used to land in /tmp)."""
    pytest.importorskip("mpi4py")
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    if not Path(mpiexec).exists():
        pytest.skip("no mpiexec")
    before = root_state()
    tmp_before = {p.name for p in Path("/tmp").glob("ompi.*")}
    private = {k: str(tmp_path) for k in spawn.MPI_FILE_PARAMS}
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_MPI.format(mpiexec=mpiexec)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **private},
    )
    try:
        info = json.loads(owner.stdout.readline())
        names = sorted(Path(f"/proc/{p}/comm").read_text().strip() for p in info["inside"])
        assert "prted" in names and names.count("python") == 5, names  # 4 ranks, the mpiexec filter
    finally:
        owner.kill()
        owner.wait(10)
    assert_gone(info["ns"], info["inside"], before)
    assert {p.name for p in Path("/tmp").glob("ompi.*")} <= tmp_before


@needs_root
def test_nodes_run_cubic_tcp_unless_told_otherwise():
    """The nodes' congestion control is Linux's default, not whatever the host runs, even where the host
    does not allow namespaces to take it (a BBR host's ``reno bbr``); ``host`` keeps the host's; a name
    the kernel lacks is one clear error, and nothing is left behind, the host's allowed list included."""
    where, allowed = "/proc/sys/net/ipv4/tcp_congestion_control", Path(ALLOWED_CONGESTION)
    host, found = Path(where).read_text().strip(), allowed.read_text()
    try:
        allowed.write_text(" ".join(a for a in found.split() if a != "cubic"))
        before = root_state()
        for asked, seen in (("cubic", "cubic"), ("host", host)):
            with EmulatedCluster(2, 1.0, tcp_congestion=asked) as c:
                assert [_out(*c.command(k, ["cat", where])).strip() for k in range(2)] == [seen, seen]
        with pytest.raises(ClusterUnavailable, match="TCP congestion control nosuch is not available"):
            ClusterConfig(nodes=2, tcp_congestion="nosuch").build(2).start()
        assert Path(where).read_text().strip() == host and root_state() == before
    finally:
        allowed.write_text(found)


# ----- the parts parambox adds: config, placement, the mpiexec filter ------------------------------
def test_cluster_config_checks_its_fields():
    assert ClusterConfig(nodes=2, link_gbps=0.1).ranks_per_node(4) == 2
    with pytest.raises(ValueError, match="needs --emulate-nodes"):
        ClusterConfig(link_gbps=1.0)
    with pytest.raises(ValueError):
        ClusterConfig(nodes=2, link_gbps=0)
    with pytest.raises(ValueError, match="spread evenly"):  # pydantic wraps it: the CLI says it in one line
        ClusterConfig(nodes=2).ranks_per_node(3)
    assert ClusterConfig(nodes=2).nodes_for(1) == 1  # fewer workers than nodes: one node each
    assert ClusterConfig(nodes=4).build(2).num_nodes == 2


def test_run_config_takes_the_cluster_table_from_set_and_toml(tmp_path):
    from parambox.config import build_config, load_toml, parse_set

    cfg = build_config({"workers": 4}, parse_set(["cluster.nodes=2", "cluster.link_gbps=0.1"]))
    assert (cfg.cluster.nodes, cfg.cluster.link_gbps) == (2, 0.1)
    toml = tmp_path / "run.toml"
    toml.write_text("workers = 2\n[cluster]\nnodes = 2\nlink_gbps = 1.0\n")
    assert build_config(load_toml(toml)).cluster.link_gbps == 1.0
    with pytest.raises(ValueError, match="spread evenly"):  # pydantic wraps it: the CLI says it in one line
        build_config({"workers": 3}, parse_set(["cluster.nodes=2"]))


def test_mpiexec_filter_drops_only_the_dropped_connection_warning():
    script = textwrap.dedent(f"""
        import sys
        w = sys.stderr.write
        w("-" * 20 + "\\n{DROPPED_CONNECTION}\\n  Known IPs of peer (0): NONE\\n" + "-" * 20 + "\\n")
        w("\\x00[node0:1] 1 more process has sent help message help-mpi-btl-tcp.txt / dropped inbound connection\\n")
        w("-" * 20 + "\\nsome other Open MPI help\\n" + "-" * 20 + "\\n")
        w("a real error\\n")
        sys.exit(3)
    """)
    r = subprocess.run(
        [sys.executable, cluster.AGENT, "mpiexec", sys.executable, "-c", script],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 3
    assert DROPPED_CONNECTION not in r.stderr and "dropped inbound" not in r.stderr
    assert "some other Open MPI help" in r.stderr and r.stderr.endswith("a real error\n")


@needs_root
def test_placement_puts_consecutive_ranks_on_each_node():
    with EmulatedCluster(2, None) as c:
        place = c.placement(4)
        rows = []
        for rank in range(4):
            argv, env = place(rank, ["hostname"], {"RANK": str(rank)})
            out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.strip()
            rows.append((out, env["PARAMBOX_NODE_RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]))
        assert rows == [
            ("node0", "0", "0", "2"),
            ("node0", "0", "1", "2"),
            ("node1", "1", "0", "2"),
            ("node1", "1", "1", "2"),
        ]
        assert "qdisc tbf" not in _out(*c.command(0, ["tc", "qdisc", "show", "dev", "pbnet"]))  # unshaped


def test_world_reads_the_node_the_local_launcher_placed_it_on():
    from parambox.runtime.world import LOCAL_LAUNCHER_ENV, World

    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    env.update({LOCAL_LAUNCHER_ENV: "1", "PARAMBOX_NODE_RANK": "1", "PARAMBOX_NUM_NODES": "2"})
    w = World.from_env(env)
    got = (w.launcher, w.rank, w.local_rank, w.local_world_size, w.node_rank, w.num_nodes)
    assert got == ("local", 3, 1, 2, 1, 2)
    plain = World.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", LOCAL_LAUNCHER_ENV: "1"})
    assert (plain.local_world_size, plain.node_rank, plain.num_nodes) == (2, 0, 1)  # loopback: one node


def test_rma_box_on_an_emulated_cluster_has_no_memory_rank_unless_asked():
    """A memory rank would be one process more than the nodes share evenly (the README's example)."""
    from parambox.config import build_config
    from parambox.run import plan

    def planned(cfg):  # the plan decides the memory ranks once, from the strategy class
        p = plan.resolve(cfg, plan.CLI)
        return p.cfg.box.memory_ranks, p.processes

    base = {"strategy": "easgd", "workers": 2, "box": "rma"}
    assert planned(build_config({**base, "cluster": {"nodes": 2}})) == (0, 2)
    assert planned(build_config(base)) == (1, 3)  # an asynchronous strategy's memory rank, off the cluster
    assert planned(build_config({**base, "box": {"backend": "rma", "num_shards": 2}})) == (0, 2)  # placed
    assert planned(build_config({**base, "strategy": "box-sync"})) == (0, 2)  # synchronous: on the workers
