"""Agents that another tool starts inside an emulated cluster (``parambox.runtime.cluster``).

Run by path (``python .../cluster_agent.py``), standard library only, so that Open MPI's daemon start
costs no parambox or torch import. Both need some node's ``EmulatedCluster.env(k)`` inherited:

* ``rsh HOST word...``: Open MPI's ``plm_rsh_agent`` (an ssh stand-in): runs ``sh -c "word..."`` in
  the node whose address (or ``node<k>`` name) is HOST;
* ``exec-node K cmd...``: execs ``cmd`` in node K;
* ``mpiexec cmd...``: runs ``cmd`` (an mpiexec command line) with Open MPI's "dropped inbound
  connection" warnings taken out of its stderr. With ``btl_tcp_progress_thread`` (which passive-target
  one-sided MPI across nodes needs) the progress thread sometimes accepts a peer's first TCP connection
  before that peer's addresses arrived, drops it and the peer retries: a known, harmless race
  (open-mpi/ompi#3035) that printed "This is highly unusual" in about half of the runs here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

ENV_NODE_RANK = "PARAMBOX_NODE_RANK"
ENV_NODE_ADDR = "PARAMBOX_NODE_ADDR"
ENV_NODE_ADDRS = "PARAMBOX_NODE_ADDRS"  # every node's address, comma-separated
ENV_NODE_HOLDERS = "PARAMBOX_NODE_HOLDERS"  # "pid,pid,...[;uts]": every node's namespace holder


def nsenter_prefix(pid: int | str, uts: bool) -> list[str]:
    """``nsenter`` into the network (and UTS) namespace that process ``pid`` holds; it execs the command."""
    return ["nsenter", f"--net=/proc/{pid}/ns/net", *([f"--uts=/proc/{pid}/ns/uts"] if uts else []), "--"]


DROPPED_CONNECTION = "Open MPI detected an inbound MPI TCP connection request"
DROPPED_SUMMARY = "help-mpi-btl-tcp.txt / dropped inbound connection"


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_filtered(cmd: list[str]) -> int:
    """Run ``cmd``; copy its stderr to ours without the dropped-connection help blocks (each block
    sits between two lines of dashes); exit as it exited, by the same signal if it was killed."""
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _: p.send_signal(s))
    block: list[str] = []
    for raw in iter(p.stderr.readline, b""):
        line = raw.decode(errors="replace").replace("\x00", "")  # PRRTE pads its help summaries with NULs
        if not line:
            continue
        if line.startswith("-----"):
            block.append(line)
            if len(block) > 1:  # the closing line of dashes
                _write([] if any(DROPPED_CONNECTION in x for x in block) else block)
                block = []
        elif block:
            block.append(line)
        elif DROPPED_SUMMARY not in line:
            _write([line])
    _write(block)
    code = p.wait()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _write(lines: list[str]) -> None:
    if lines:
        sys.stderr.write("".join(lines))
        sys.stderr.flush()


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "mpiexec":
        return run_filtered(argv[1:])
    if ENV_NODE_HOLDERS not in os.environ or ENV_NODE_ADDRS not in os.environ:
        print(f"{sys.argv[0]}: run me with an emulated node's environment", file=sys.stderr)
        return 2
    pids, _, uts = os.environ[ENV_NODE_HOLDERS].partition(";")
    addrs = os.environ[ENV_NODE_ADDRS].split(",")
    if len(argv) >= 3 and argv[0] == "rsh":
        host, cmd = argv[1], ["sh", "-c", " ".join(argv[2:])]
        k = addrs.index(host) if host in addrs else int(host.removeprefix("node"))
    elif len(argv) >= 3 and argv[0] == "exec-node":
        k, cmd = int(argv[1]), argv[2:]
    else:
        print(f"usage: {sys.argv[0]} rsh HOST word... | exec-node K cmd... | mpiexec cmd...", file=sys.stderr)
        return 2
    env = {**os.environ, ENV_NODE_RANK: str(k), ENV_NODE_ADDR: addrs[k]}
    os.execvpe("nsenter", [*nsenter_prefix(pids.split(",")[k], bool(uts)), *cmd], env)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
