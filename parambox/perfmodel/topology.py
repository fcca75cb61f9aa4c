"""Communication time per training step, T_comm(n), for each way of sharing parameters.

All formulas take ``size_bytes`` S (the gradient or weight message: 4 bytes x parameter count), the worker
count n and a :class:`Network` (per-link bandwidth BW in bytes/s, per-message latency alpha in seconds).
They are the textbook alpha-beta costs that Keuper & Pfreundt use to bound data-parallel scaling:

- ``ring``: ring allreduce (reduce-scatter + all-gather), 2(n-1)/n * S/BW + 2(n-1) * alpha.
  The bandwidth term stays under 2 S/BW for any n, but the latency term grows linearly.
- ``tree``: binary-tree reduce then broadcast, 2 log2(n) * S/BW + 2 log2(n) * alpha (the whole message
  crosses every level, no pipelining).
- ``ps``: one parameter server; its one link carries n gradients in and n weight copies out:
  2n * S/BW + 2 alpha.
- ``ps-sharded``: the parameters split over k servers (DistBelief): the servers' k links share the
  2n * S bytes, but a worker's own link still moves S up and S down, so
  2 S/BW * max(n/k, 1) + 2 alpha.
- ``box``: the shared parameter buffer (SMB / ShmCaffe): each worker accumulates its update (one-sided,
  no server CPU, no matching receive) and reads the result back, S up and S down over its own link,
  2 S/BW. The box's aggregate bandwidth BW_box (its NICs, or its memory bandwidth for the one-node shm box;
  by default k x BW: a box sharded over the same k ranks as ``ps-sharded``) is shared: in the worst case a
  worker's accesses queue behind the other n-1 workers', the contention term 2(n-1) * S/BW_box. So
  2 S/BW + 2(n-1) * S/BW_box + 2 alpha. It differs from ``ps-sharded`` by assuming queueing (additive) rather
  than perfectly pipelined (max) sharing, which is what concurrent accumulates into one window do.

A single worker (n = 1) needs no collective: ring and tree cost 0, while the server and box topologies still
move the update to the server and back (a job that keeps its parameters remote pays for that).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from parambox.errors import UserError


@dataclass(frozen=True)
class Network:
    """Per-link bandwidth (bytes/s) and latency (s); ``servers`` k and the box's aggregate bandwidth.

    >>> net = Network.from_gbps(10.0, latency_us=10.0)
    >>> round(ring_allreduce_s(2, 1.25e9, net), 6)  # S/BW + 2 alpha for n = 2
    1.00002
    """

    bandwidth: float
    latency: float = 0.0
    servers: int = 4
    box_bandwidth: float | None = None  # None: servers x bandwidth

    @classmethod
    def from_gbps(
        cls, gbps: float, latency_us: float = 0.0, servers: int = 4, box_gbps: float | None = None
    ) -> Network:
        box = None if box_gbps is None else box_gbps * 1e9 / 8
        return cls(gbps * 1e9 / 8, latency_us * 1e-6, servers, box)

    def __post_init__(self):
        if not self.bandwidth > 0:
            raise UserError(f"bandwidth must be > 0, got {self.bandwidth} bytes/s")
        if self.latency < 0:
            raise UserError(f"latency must be >= 0, got {self.latency} s")
        if self.servers < 1:
            raise UserError(f"--servers must be >= 1, got {self.servers}")
        if self.box_bandwidth is not None and not self.box_bandwidth > 0:
            raise UserError(f"box bandwidth must be > 0, got {self.box_bandwidth} bytes/s")

    @property
    def box_bw(self) -> float:
        return self.box_bandwidth if self.box_bandwidth is not None else self.servers * self.bandwidth


def ring_allreduce_s(n: int, size_bytes: float, net: Network) -> float:
    return 2 * (n - 1) / n * size_bytes / net.bandwidth + 2 * (n - 1) * net.latency


def tree_allreduce_s(n: int, size_bytes: float, net: Network) -> float:
    levels = math.log2(n)
    return 2 * levels * size_bytes / net.bandwidth + 2 * levels * net.latency


def parameter_server_s(n: int, size_bytes: float, net: Network) -> float:
    return 2 * n * size_bytes / net.bandwidth + 2 * net.latency


def sharded_server_s(n: int, size_bytes: float, net: Network) -> float:
    return 2 * size_bytes / net.bandwidth * max(n / net.servers, 1.0) + 2 * net.latency


def box_s(n: int, size_bytes: float, net: Network) -> float:
    own_link = 2 * size_bytes / net.bandwidth
    contention = 2 * (n - 1) * size_bytes / net.box_bw
    return own_link + contention + 2 * net.latency


TOPOLOGIES: dict[str, Callable[[int, float, Network], float]] = {
    "ring": ring_allreduce_s,
    "tree": tree_allreduce_s,
    "ps": parameter_server_s,
    "ps-sharded": sharded_server_s,
    "box": box_s,
}


def parse_topologies(text: str) -> list[str]:
    """``"all"``, one name or a comma list -> names in a stable order; unknown names raise UserError."""
    if text.strip() == "all":
        return list(TOPOLOGIES)
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in TOPOLOGIES]
    if bad or not names:
        raise UserError(f"--topology {text!r}: choose from all, {', '.join(TOPOLOGIES)}")
    return list(dict.fromkeys(names))


def comm_time_s(topology: str, n: int, size_bytes: float, net: Network) -> float:
    assert n >= 1 and topology in TOPOLOGIES
    return TOPOLOGIES[topology](n, size_bytes, net)
