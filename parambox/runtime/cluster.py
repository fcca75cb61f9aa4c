"""An emulated cluster on one machine: N network namespaces ("nodes") joined by rate-limited links.

``parambox train --emulate-nodes 2 --link-gbps 1`` (``[cluster]`` in TOML, ``--set cluster.nodes=2``)
runs the local launcher's workers on it: consecutive ranks per node, gloo and MPI between nodes over
the shaped links, nothing but a node's own loopback inside it. Topology (nothing of it in the root namespace)::

    node k (net + uts namespace)       hub (net namespace)
    ┌──────────────────┐   veth pair   ┌───────────────────────────┐
    │ lo (up)          │               │ lo (up)                   │
    │ pbnet ───────────┼───────────────┼── n<k> ── bridge pbbr     │
    │ 10.77.0.<k+1>/16 │ tbf on egress │  tbf on egress (to node k)│
    │ host name node<k>│  of both ends │                           │
    └──────────────────┘               └───────────────────────────┘

* Each namespace is held only by a process: ``unshare --net [--uts] -- sh -c HOLDER``, whose stdin is
  a pipe whose only writer is the owning Python process (a non-inheritable fd). When the owner ends in
  any way (normal end, exception, SIGINT, SIGTERM, SIGKILL of it or of its process group) the kernel
  closes that pipe; each holder reads EOF, SIGKILLs whatever else still runs in its namespace and
  exits, and the namespaces vanish with the veth pairs, the bridge and the queueing disciplines in
  them. Nothing is created in the root namespace and nothing is bind-mounted (no ``ip netns add``). A
  pipe rather than PR_SET_PDEATHSIG for the holders: PDEATHSIG fires when the *thread* that spawned
  the child exits, which would tear the cluster down under an owner that built it in a short-lived
  thread. (A child the owner forks without exec inherits the pipe and keeps the cluster up with it.)
* The veth pairs are created inside the hub with their node end placed straight into the node's
  namespace (``peer ... netns <pid>``): not even a transient link appears in the root namespace.
* Every node's end of its link is called ``pbnet``, so one ``GLOO_SOCKET_IFNAME`` /
  ``btl_tcp_if_include`` serves every node (``env``). Traffic inside a node goes over its own loopback;
  traffic between nodes crosses node A's egress tbf, then the hub's egress tbf towards node B: a
  switch with one full-duplex link per node.
* Each node has its own host name (``node<k>``, a UTS namespace): Open MPI then treats nodes as
  separate hosts (its ``han`` collectives hang when two "nodes" share a host name, and btl ``sm`` would
  not know where a node ends). The names resolve nowhere: tools get addresses.
* Open MPI: ``mpi_command`` runs mpiexec inside node 0 and starts its daemons in the other nodes
  through ``cluster_agent.py rsh`` (an ssh stand-in); ranks talk TCP, over their node's loopback
  inside a node and over the links between nodes (``MPI_MCA`` says why not shared memory).

Not root, ``ip``/``tc``/``nsenter``/``unshare`` missing, or namespaces/tbf not permitted: a
``ClusterUnavailable`` (a ``UserError``: one line, exit 2).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from parambox.errors import UserError
from parambox.runtime import cluster_agent
from parambox.runtime.cluster_agent import ENV_NODE_ADDR, ENV_NODE_ADDRS, ENV_NODE_HOLDERS, ENV_NODE_RANK
from parambox.runtime.spawn import Placement

TOOLS = ("ip", "tc", "nsenter", "unshare")
NODE_IFNAME = "pbnet"  # the node's end of its link, the same name in every node
BRIDGE = "pbbr"
SUBNET = (10, 77)  # node k is 10.77.x.y with x.y = k + 1, prefix /16
PREFIX_LEN = 16
MAX_NODES = 65000
# tbf: TCP goodput 0.956-0.967 of nominal at 1 and 0.1 Gbit/s under load (0.956 is the ceiling: 1448
# payload bytes per 1514-byte frame). A 32 KiB burst gave only 0.80 at 1 Gbit/s under load (the tbf
# watchdog cannot refill it in time), 64 KiB 0.67-0.88; 256 KiB gives short transfers a free 21 ms at
# 0.1 Gbit/s. So at least 128 KiB, and 1 ms of traffic for faster links.
MIN_BURST_BYTES = 128 * 1024
BURST_S = 1e-3
DEFAULT_LATENCY_MS = 20.0  # the tbf queue: at most this long a wait, then tail drop
# TCP congestion control inside the nodes: Linux's default, as a cluster's nodes run it, whatever the host
# uses (a namespace inherits the host's; BBR slowed box-sync's two-way traffic at 0.1 Gbit/s, bench cluster).
DEFAULT_TCP_CONGESTION = "cubic"
_IPV4 = Path("/proc/sys/net/ipv4")
ALLOWED_CONGESTION = _IPV4 / "tcp_allowed_congestion_control"


@contextlib.contextmanager
def allowed_congestion(name: str) -> Iterator[None]:
    """Within it, a new namespace may take ``name`` as its TCP congestion control.

    Linux lets a namespace other than the host's default to an algorithm only if the host allows it
    (``tcp_allowed_congestion_control``); a host that runs BBR may allow only ``reno bbr``, though
    CUBIC is built in. As root, ``name`` is added to the host's list while the nodes are set up and
    the list is restored right after (a namespace keeps its default once set), under a lock on the
    list itself, so that clusters set up at once leave it as they found it."""
    if not ALLOWED_CONGESTION.exists():
        yield
        return
    with open(ALLOWED_CONGESTION) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _allow(name)
        try:
            yield
        finally:
            if found is not None:
                ALLOWED_CONGESTION.write_text(" ".join(found))


def _allow(name: str) -> list[str] | None:
    """Add ``name`` to the host's allowed algorithms: the list as it was, or None where nothing
    changed (allowed already, not built in, or not root: the nodes' setup then says what failed)."""
    try:
        allowed = ALLOWED_CONGESTION.read_text().split()
        if name in allowed or name not in (_IPV4 / "tcp_available_congestion_control").read_text().split():
            return None
        ALLOWED_CONGESTION.write_text(" ".join([*allowed, name]))
        return allowed
    except OSError:
        return None


READY_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 5.0
# Open MPI across emulated nodes.
MPI_MCA = {
    "pml": "ob1",
    # TCP only, also between the ranks of one node (over the node's loopback, never the links). Over
    # TCP and sm, one-sided operations are active messages the target must progress: TCP has a progress
    # thread, sm has none, so a Fetch_and_op to a node-mate blocked outside MPI (hybrid: in its group's
    # gloo allreduce, waiting for this very rank) never completed. And no uct: a 25 MB Accumulate took
    # 1.2-16 s with it.
    "btl": "self,tcp",
    "osc": "^ucx",  # osc rdma (over btl tcp) for windows spanning nodes; osc sm for windows inside one
    # A 25 MB Accumulate across nodes at 1 Gbit/s: 1.2-1.9 s with the default 32 KiB buffers,
    # 0.48-0.53 s with 4 MiB (get + put at link speed is 0.42 s) ...
    "osc_rdma_buffer_size": str(4 << 20),
    # Open MPI's default, as on a cluster: no TCP progress thread (the memory server progresses its own
    # messages, and the thread costs training CPU, bench cluster). MPI's windows across nodes need it: WINDOWS_MCA.
    "btl_tcp_progress_thread": "0",
}
# For a job that puts MPI windows across the nodes (``box.server=false``): without the progress thread a
# passive-target Accumulate waits until the target rank next calls MPI (3.5 s while the target computed
# for 3 s); with it, 0.47 s whatever the target does. It costs MPI collectives ~25 % (a 25 MB
# Allreduce: 0.41-0.44 s with it, 0.31-0.36 s without).
WINDOWS_MCA = {"btl_tcp_progress_thread": "1"}
ENV_NUM_NODES = "PARAMBOX_NUM_NODES"
AGENT = os.path.abspath(cluster_agent.__file__)

# The holder: wait for EOF on stdin (the owner closed the lifeline or died), then SIGKILL every other
# process still in this network namespace (three sweeps, for processes forked meanwhile). Shell
# built-ins only in the loop (dash's `test -ef` compares the namespace inodes). $1 is the owner's
# namespace: unshare never execs the script without a new one, but if it ever did, the sweep would
# kill every process of the machine.
HOLDER_SCRIPT = r"""
while read -r _; do :; done
[ "$(readlink /proc/$$/ns/net)" = "$1" ] && exit 1  # never sweep the owner's namespace
for _ in 1 2 3; do
  for p in /proc/[0-9]*; do
    [ "${p#/proc/}" = "$$" ] && continue
    [ "$p/ns/net" -ef "/proc/$$/ns/net" ] && kill -9 "${p#/proc/}" 2>/dev/null
  done
done
exit 0
"""


class ClusterUnavailable(UserError):
    """The emulated cluster cannot be built here; the message says why in one line."""


class ClusterConfig(BaseModel):
    """The run's emulated cluster: ``[cluster]`` in TOML, ``--emulate-nodes N --link-gbps G``.

    >>> ClusterConfig(nodes=2, link_gbps=1.0).enabled
    True
    >>> ClusterConfig().enabled  # no emulation: workers on loopback
    False
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    nodes: int | None = Field(
        None, ge=1, le=MAX_NODES, description="emulated nodes, consecutive ranks per node (None: loopback)"
    )
    link_gbps: float | None = Field(None, gt=0, description="each node's link in Gbit/s (None: unshaped)")
    burst_bytes: int | None = Field(None, ge=2048, description="tbf burst (default max(128 KiB, 1 ms))")
    latency_ms: float = Field(DEFAULT_LATENCY_MS, gt=0, description="tbf queue length in milliseconds")
    tcp_congestion: str = Field(
        DEFAULT_TCP_CONGESTION,
        pattern=r"^[a-z0-9_]+$",
        description="TCP congestion control in the nodes (default cubic, Linux's; 'host': the host's)",
    )

    @model_validator(mode="after")
    def _needs_nodes(self) -> ClusterConfig:
        if self.nodes is None and (self.link_gbps is not None or self.burst_bytes is not None):
            raise ValueError("--link-gbps (cluster.link_gbps) needs --emulate-nodes (cluster.nodes)")
        return self

    @property
    def enabled(self) -> bool:
        return self.nodes is not None

    def nodes_for(self, world_size: int) -> int:
        """Nodes a run of ``world_size`` workers uses: all of them, or one per worker when there are
        fewer workers than nodes (a 1-worker run of a sweep on a 2-node cluster runs on one node)."""
        return min(self.nodes or 1, world_size)

    def ranks_per_node(self, world_size: int) -> int:
        """Workers per node; a ``UserError`` unless they spread evenly."""
        nodes = self.nodes_for(world_size)
        if world_size % nodes:
            raise UserError(
                f"--workers {world_size} does not spread evenly over --emulate-nodes {nodes}: give a multiple"
            )
        return world_size // nodes

    def build(self, world_size: int) -> EmulatedCluster:
        """The cluster for ``world_size`` workers, not yet started (``with cfg.build(n) as cluster:``)."""
        self.ranks_per_node(world_size)
        return EmulatedCluster(
            self.nodes_for(world_size),
            self.link_gbps,
            burst_bytes=self.burst_bytes,
            latency_ms=self.latency_ms,
            tcp_congestion=self.tcp_congestion,
        )


def check_environment() -> None:
    """Raise ClusterUnavailable unless this process can build an emulated cluster."""
    if not sys.platform.startswith("linux"):
        raise ClusterUnavailable("--emulate-nodes needs Linux network namespaces")
    if os.geteuid() != 0:
        raise ClusterUnavailable(
            "--emulate-nodes needs root (network namespaces, veth links, tc): run as root or drop it"
        )
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise ClusterUnavailable(
            f"--emulate-nodes needs {', '.join(missing)} on PATH (Debian packages iproute2, util-linux)"
        )


def _ns_id(pid: int | str, kind: str = "net") -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def _die_with_thread() -> None:
    """preexec_fn: SIGKILL this child when the thread that started it dies (PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def link_bytes(pid: int | str = "self", ifname: str = NODE_IFNAME) -> tuple[int, int]:
    """(bytes sent, bytes received) on ``ifname`` in process ``pid``'s network namespace, L2, since
    set-up. A worker calls it with the default ``pid`` to read its own node's link."""
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                fields = rest.split()
                return int(fields[8]), int(fields[0])
    raise RuntimeError(f"no interface {ifname} in the network namespace of process {pid}")


class EmulatedCluster:
    """``num_nodes`` namespaces ("nodes"), each with its own address and a ``link_gbps`` link.

    >>> with EmulatedCluster(2, link_gbps=0.1) as c:  # doctest: +SKIP
    ...     subprocess.run(c.command(1, ["ping", "-c1", c.node_address(0)]), env={**os.environ, **c.env(1)})

    ``link_gbps=None``: links not shaped (veth speed). ``hostnames=False``: nodes keep the machine's
    host name (then Open MPI needs ``--mca coll ^han``).
    """

    def __init__(
        self,
        num_nodes: int,
        link_gbps: float | None = 1.0,
        *,
        burst_bytes: int | None = None,
        latency_ms: float = DEFAULT_LATENCY_MS,
        mtu: int = 1500,
        hostnames: bool = True,
        tcp_congestion: str = DEFAULT_TCP_CONGESTION,
    ) -> None:
        if not 1 <= num_nodes <= MAX_NODES:
            raise ClusterUnavailable(f"--emulate-nodes must be between 1 and {MAX_NODES}, not {num_nodes}")
        if link_gbps is not None and not link_gbps > 0:
            raise ClusterUnavailable(f"--link-gbps must be positive, not {link_gbps}")
        self.num_nodes = num_nodes
        self.link_gbps = link_gbps
        rate_bytes = (link_gbps or 0) * 1e9 / 8
        self.burst_bytes = burst_bytes or max(MIN_BURST_BYTES, round(rate_bytes * BURST_S))
        self.latency_ms = latency_ms
        self.mtu = mtu
        self.hostnames = hostnames
        self.tcp_congestion = tcp_congestion
        self._hub: subprocess.Popen | None = None
        self._nodes: list[subprocess.Popen] = []
        self._lifeline: int | None = None  # write end of the pipe every holder reads
        self._ns_ids: list[str] = []  # net:[inode] of the hub and the nodes, in that order
        self._lock = threading.Lock()
        self.setup_s: float | None = None
        self.teardown_s: float | None = None

    # ----- life cycle -------------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> EmulatedCluster:
        check_environment()
        if self._hub is not None:
            raise RuntimeError("the emulated cluster is already running")
        t0 = time.perf_counter()
        try:
            read_end, self._lifeline = os.pipe()  # both ends non-inheritable (PEP 446)
            try:
                self._hub = self._spawn_holder(read_end, uts=False)
                self._nodes = [
                    self._spawn_holder(read_end, uts=self.hostnames) for _ in range(self.num_nodes)
                ]
            finally:
                os.close(read_end)
            for p in [self._hub, *self._nodes]:
                self._ns_ids.append(self._wait_unshared(p))
            self._configure()
        except BaseException:  # KeyboardInterrupt during set-up too
            self.close()
            raise
        self.setup_s = time.perf_counter() - t0
        return self

    def close(self) -> list[int]:
        """Tear everything down; returns the pids of processes still inside that it SIGKILLed.
        Idempotent; safe in a finally block."""
        with self._lock:
            holders = [p for p in [self._hub, *self._nodes] if p is not None]
            if not holders and self._lifeline is None:
                return []
            t0 = time.perf_counter()
            pins, ids = self._pin_namespaces(holders)
            killed = self._kill_inside(ids)  # not reaped here: their Popen objects do that
            if self._lifeline is not None:
                os.close(self._lifeline)  # EOF: each holder sweeps its namespace and exits
                self._lifeline = None
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for p in holders:
                try:
                    p.wait(max(0.01, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                if p.stderr is not None:
                    p.stderr.close()
            # A process that opened a node's namespace just before the sweeps (an nsenter between
            # open and setns) lands in it afterwards and keeps it alive: sweep again, briefly.
            for _ in range(3):
                time.sleep(0.01)
                killed += self._kill_inside(ids)
            for fd in pins:
                os.close(fd)
            self._hub, self._nodes, self._ns_ids = None, [], []
            self.teardown_s = time.perf_counter() - t0
            return killed

    def _pin_namespaces(self, holders: list[subprocess.Popen]) -> tuple[list[int], set[str]]:
        """Hold the namespaces open while sweeping: a freed namespace's inode number is reused at once
        by the next one created, so a sweep by number alone could hit a stranger's. Only namespaces
        verified at set-up as new ones: a holder whose unshare failed is still in the owner's
        namespace, and sweeping that one would kill the whole machine."""
        pins, ids, own = [], set(), _ns_id("self")
        for p in holders:
            try:
                fd = os.open(f"/proc/{p.pid}/ns/net", os.O_RDONLY)
            except OSError:
                continue
            ns = f"net:[{os.fstat(fd).st_ino}]"
            if ns in self._ns_ids and ns != own:
                pins.append(fd)
                ids.add(ns)
            else:
                os.close(fd)
        return pins, ids

    def _kill_inside(self, ids: set[str]) -> list[int]:
        pids = self.processes_inside(ids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def _spawn_holder(self, read_end: int, uts: bool) -> subprocess.Popen:
        # Own session: a terminal's Ctrl-C reaches the owner (which then closes in order), not the
        # holders, so the network stays up while the owner stops its workers.
        argv = ["unshare", "--net", *(["--uts"] if uts else []), "--", "sh", "-c", HOLDER_SCRIPT]
        return subprocess.Popen(
            [*argv, "holder", _ns_id("self")],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def _wait_unshared(self, p: subprocess.Popen) -> str:
        """The holder's new namespace (``net:[inode]``), once it differs from the owner's."""
        own = _ns_id("self")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if p.poll() is not None:
                err = p.stderr.read().decode(errors="replace").strip().splitlines() if p.stderr else []
                why = err[-1] if err else f"unshare exited with {p.returncode}"
                raise ClusterUnavailable(
                    f"--emulate-nodes cannot create a network namespace (needs CAP_SYS_ADMIN and "
                    f"CAP_NET_ADMIN, e.g. root outside an unprivileged container): {why}"
                )
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                ns = _ns_id(p.pid)
                if ns != own and os.readlink(f"/proc/{p.pid}/exe").endswith("sh"):
                    return ns  # unshared and exec'd the holder script
            if time.monotonic() > deadline:
                raise ClusterUnavailable("timed out waiting for a network namespace to be created")
            time.sleep(0.002)

    def _configure(self) -> None:
        """One nsenter + sh per namespace; each veth is born in the hub with its peer in the node."""
        qdisc = self.tbf_spec()
        hub = ["ip link set lo up", f"ip link add {BRIDGE} type bridge", f"ip link set {BRIDGE} up"]
        for k, node in enumerate(self._nodes):
            hub += [
                f"ip link add n{k} mtu {self.mtu} type veth peer name {NODE_IFNAME} mtu {self.mtu} "
                f"netns {node.pid}",
                f"ip link set n{k} master {BRIDGE}",
                f"ip link set n{k} up",
            ]
            if qdisc:
                hub.append(f"tc qdisc add dev n{k} root {qdisc}")
        self._sh(self._hub.pid, hub, uts=False)
        with allowed_congestion(self.tcp_congestion):
            self._configure_nodes(qdisc)

    def _configure_nodes(self, qdisc: str | None) -> None:
        for k, node in enumerate(self._nodes):
            cmds = [f"hostname {self.node_name(k)}"] if self.hostnames else []
            cmds += [
                # No IPv6 on the link: gloo and MPI then see one address per interface.
                f"echo 1 > /proc/sys/net/ipv6/conf/{NODE_IFNAME}/disable_ipv6 2>/dev/null || true",
                "ip link set lo up",
                f"ip addr add {self.node_address(k)}/{PREFIX_LEN} dev {NODE_IFNAME}",
                f"ip link set {NODE_IFNAME} up",
            ]
            if qdisc:
                cmds.append(f"tc qdisc add dev {NODE_IFNAME} root {qdisc}")
            if self.tcp_congestion != "host":
                cmds.append(self._set_congestion())
            self._sh(node.pid, cmds, uts=self.hostnames)

    def _set_congestion(self) -> str:
        """The shell line that makes the node's new TCP sockets use ``tcp_congestion``."""
        name, where = self.tcp_congestion, "/proc/sys/net/ipv4/tcp_congestion_control"
        why = f"TCP congestion control {name} is not available here (cluster.tcp_congestion; host: the host default)"
        return f'echo {name} > {where} 2>/dev/null || {{ echo "{why}" >&2; exit 1; }}'

    def tbf_spec(self) -> str | None:
        """The qdisc put on both ends of every link, or None for unshaped links."""
        if self.link_gbps is None:
            return None
        rate_kbit = max(8, round(self.link_gbps * 1e6))
        return f"tbf rate {rate_kbit}kbit burst {self.burst_bytes} latency {self.latency_ms:g}ms"

    def _sh(self, pid: int, commands: list[str], uts: bool) -> str:
        ns = [f"--net=/proc/{pid}/ns/net"] + ([f"--uts=/proc/{pid}/ns/uts"] if uts else [])
        script = "set -e\n" + "\n".join(commands)
        r = subprocess.run(["nsenter", *ns, "--", "sh", "-c", script], capture_output=True, text=True)
        if r.returncode != 0:
            msg = (r.stderr.strip() or f"exit {r.returncode}").splitlines()[-1]
            if "qdisc kind is unknown" in msg:
                msg = "the kernel has no tbf queueing discipline (sch_tbf)"
            raise ClusterUnavailable(f"cannot set up the emulated cluster: {msg}")
        return r.stdout

    # ----- what workers need ------------------------------------------------------------------
    def _node(self, k: int) -> subprocess.Popen:
        if not self._nodes:
            raise RuntimeError("the emulated cluster is not running")
        if not 0 <= k < self.num_nodes:
            raise IndexError(f"node {k} of {self.num_nodes}")
        return self._nodes[k]

    def node_address(self, k: int) -> str:
        """IPv4 address of node ``k``: 10.77.0.1, 10.77.0.2, ... (the same in every cluster: each
        cluster has its own private hub, so concurrent clusters cannot clash)."""
        if not 0 <= k < self.num_nodes:
            raise IndexError(f"node {k} of {self.num_nodes}")
        host = k + 1
        return f"{SUBNET[0]}.{SUBNET[1]}.{host >> 8}.{host & 0xFF}"

    def node_name(self, k: int) -> str:
        """Host name of node ``k`` when ``hostnames`` (it resolves nowhere)."""
        return f"node{k}"

    def payload_bandwidth(self) -> float | None:
        """Bytes/s of TCP payload a shaped link carries: tbf counts whole Ethernet frames, and a frame
        of MTU 1500 carries 1448 payload bytes in 1514 (IP, TCP with timestamps, Ethernet headers):
        0.956 of the rate, what a TCP socket measured between two nodes (0.956-0.967 at 1 and 0.1
        Gbit/s, the burst adding a little). None for unshaped links."""
        if self.link_gbps is None:
            return None
        return self.link_gbps * 1e9 / 8 * (self.mtu - 52) / (self.mtu + 14)

    @property
    def master_addr(self) -> str:
        return self.node_address(0)

    def hub_netns_path(self) -> str:
        if self._hub is None:
            raise RuntimeError("the emulated cluster is not running")
        return f"/proc/{self._hub.pid}/ns/net"

    def command(self, k: int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run in node ``k`` (nsenter execs it: no extra process, and a
        PR_SET_PDEATHSIG set by the caller's preexec_fn carries over)."""
        return [*cluster_agent.nsenter_prefix(self._node(k).pid, self.hostnames), *argv]

    def env(self, k: int) -> dict[str, str]:
        """Environment additions for a process of node ``k``: node rank, count and address, the
        rendezvous address (node 0), and the interface gloo, TensorPipe and Open MPI must use."""
        self._node(k)
        return {
            ENV_NODE_RANK: str(k),
            ENV_NUM_NODES: str(self.num_nodes),
            ENV_NODE_ADDR: self.node_address(k),
            ENV_NODE_ADDRS: ",".join(self.node_address(j) for j in range(self.num_nodes)),
            ENV_NODE_HOLDERS: ",".join(str(p.pid) for p in self._nodes) + (";uts" if self.hostnames else ""),
            "MASTER_ADDR": self.master_addr,
            "PARAMBOX_MASTER_ADDR": self.master_addr,  # parambox's rendezvous under mpiexec
            # Without it gloo binds to the host name's address (127.0.0.1 here) and advertises it:
            # the peer on another node connects to its own loopback, a silent hang.
            "GLOO_SOCKET_IFNAME": NODE_IFNAME,
            "TP_SOCKET_IFNAME": NODE_IFNAME,
            "OMPI_MCA_btl_tcp_if_include": NODE_IFNAME,
            "PRTE_MCA_oob_tcp_if_include": NODE_IFNAME,
        }

    def placement(self, world_size: int) -> Placement:
        """Where the spawner puts rank r (``spawn.start_ranks(..., placement=...)``): on node
        r // (world_size / num_nodes), with that node's environment and the node-local ranks as
        torchrun and parambox's local launcher spell them."""
        per = -(-world_size // self.num_nodes)

        def place(rank: int, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
            node = rank // per
            local_size = min(per, world_size - node * per)
            out = {**env, **self.env(node)}
            out.update(LOCAL_RANK=str(rank % per), LOCAL_WORLD_SIZE=str(local_size), GROUP_RANK=str(node))
            # c10d warns on every rank that 10.77.x.y has no reverse DNS name: noise, not news.
            out.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            return self.command(node, argv), out

        return place

    def popen(self, k: int, argv: Sequence[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start ``argv`` in node ``k`` with ``env(k)`` added, dying with this thread (PDEATHSIG)."""
        full_env = {**(os.environ if env is None else env), **self.env(k)}
        kw.setdefault("preexec_fn", _die_with_thread)
        return subprocess.Popen(self.command(k, argv), env=full_env, **kw)

    def mpi_command(
        self,
        num_ranks: int,
        argv: Sequence[str],
        mpiexec: str = "mpiexec",
        ranks_per_node: int | None = None,
        mca: dict[str, str] | None = None,
    ) -> list[str]:
        """``mpiexec`` run inside node 0, ranks in blocks of ``ranks_per_node`` (default: spread
        evenly) over the nodes, its daemons on the other nodes started by the ``rsh`` agent; run it
        with ``mpi_env()``. ``mca`` overrides ``MPI_MCA``."""
        per = ranks_per_node or -(-num_ranks // self.num_nodes)
        hosts = ",".join(f"{self.node_address(k)}:{per}" for k in range(self.num_nodes))
        agent = f"{sys.executable} {AGENT} rsh"
        mca_args = [w for name, value in {**MPI_MCA, **(mca or {})}.items() for w in ("--mca", name, value)]
        head = [mpiexec, "-n", str(num_ranks), "--host", hosts, "--map-by", "slot", "--bind-to", "none"]
        quiet = [sys.executable, AGENT, "mpiexec"]  # without a known harmless warning (cluster_agent)
        return self.command(0, [*quiet, *head, "--mca", "plm_rsh_agent", agent, *mca_args, *argv])

    def mpi_env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """The environment for ``mpi_command`` (ranks on node k get node k's values through the agent)."""
        out = {**(os.environ if env is None else env), **self.env(0)}
        out.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        out.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        return out

    def mpi_launch(
        self,
        mpiexec: str,
        num_ranks: int,
        argv: list[str],
        env: dict[str, str],
        mca: dict[str, str] | None = None,
    ) -> tuple[list[str], dict[str, str]]:
        """The hook ``spawn.start_mpi(..., mpi_command=cluster.mpi_launch)`` takes: (argv, env); bind
        ``mca`` (``WINDOWS_MCA``) with ``functools.partial``."""
        return self.mpi_command(num_ranks, argv, mpiexec=mpiexec, mca=mca), self.mpi_env(env)

    # ----- inspection -------------------------------------------------------------------------
    def namespace_ids(self) -> list[str]:
        """``net:[inode]`` of the hub and of every node (to check later that they are gone)."""
        return list(self._ns_ids)

    def holder_pids(self) -> list[int]:
        return [p.pid for p in [self._hub, *self._nodes] if p is not None]

    def processes_inside(self, ids: set[str] | None = None) -> list[int]:
        """Pids, other than the holders, whose network namespace is one of this cluster's."""
        ids = (set(self._ns_ids) if ids is None else set(ids)) - {_ns_id("self")}
        holders = set(self.holder_pids())
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in holders:
                with contextlib.suppress(OSError):
                    if _ns_id(entry) in ids:
                        found.append(int(entry))
        return found

    def link_bytes(self, k: int) -> tuple[int, int]:
        """(bytes node ``k`` sent onto its link, bytes it received from it), L2, since set-up."""
        return link_bytes(self._node(k).pid)

    def qdisc_stats(self, k: int) -> str:
        """``tc -s qdisc`` of node ``k``'s end of its link (bytes sent, drops, overlimits)."""
        return self._sh(self._node(k).pid, [f"tc -s qdisc show dev {NODE_IFNAME}"], uts=False)
