"""Measurements on this machine: loopback bandwidth/latency and the ``--validate`` step times.

Workers are separate Python processes (``parambox.perfmodel._worker``) joined by gloo on 127.0.0.1, or on the
nodes of an emulated cluster (``--emulate-nodes 2 --link-gbps G``: gloo over the rate-limited links); their
results come back as one JSON line, never pickled. Every wait has a timeout that names what hung.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parambox.errors import RunFailed
from parambox.perfmodel._worker import RESULT_MARKER
from parambox.perfmodel.compute import ComputeProfile, profile_from_times
from parambox.perfmodel.sample import Sample
from parambox.perfmodel.scaling import iteration_time_s
from parambox.perfmodel.topology import Network, ring_allreduce_s
from parambox.runtime import spawn
from parambox.workload import refs

if TYPE_CHECKING:
    from parambox.runtime.cluster import EmulatedCluster


def probe_size(size_bytes: float) -> int:
    """Probe with the model's own message size S (clipped to 1 MiB .. 512 MiB): gloo's throughput depends
    on the message size (caches, chunking), so the bandwidth that matters is the one at S."""
    return int(min(max(size_bytes, 2**20), 2**29))


def run_workers(
    spec: dict, world_size: int, timeout_s: float = 180.0, cluster: EmulatedCluster | None = None
) -> dict:
    """Start ``world_size`` worker processes on loopback (or one per node of ``cluster``) and return
    rank 0's JSON result."""
    env = spawn.loopback_env(threads=spec["threads"])
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # a cluster's placement sets its link instead
    cmd = [sys.executable, "-m", "parambox.perfmodel._worker", json.dumps(spec)]
    place = cluster.placement(world_size) if cluster is not None else None
    with contextlib.ExitStack() as stack:
        # Output to files, not pipes: a chatty worker cannot block on a full pipe while we wait on another.
        logs = [stack.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in range(world_size)]
        procs = spawn.start_ranks(
            cmd, world_size, env, stdout=logs, stderr=subprocess.STDOUT, text=True, placement=place
        )
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            raise RunFailed(
                f"{spec['mode']} measurement: workers still running after {timeout_s:.0f} s"
            ) from None
        finally:
            spawn.stop(procs)
        texts = []
        for log in logs:
            log.seek(0)
            texts.append(log.read())
    return _result(spec["mode"], procs, texts)


def _result(mode: str, procs: list[subprocess.Popen], texts: list[str]) -> dict:
    for rank, (p, text) in enumerate(zip(procs, texts)):
        if p.returncode != 0:
            tail = text.strip().splitlines()[-1:] or ["(no output)"]
            raise RunFailed(f"{mode} measurement: worker {rank} exited {p.returncode}: {tail[0]}")
    for line in texts[0].splitlines():
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    raise RunFailed(f"{mode} measurement: worker 0 printed no result")


def network_from_probe(probe: dict) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) from two 2-rank allreduces, by the ring model at n = 2:
    T(S) = S/BW + 2 alpha, so alpha = T(tiny)/2 and BW = S / (T(S) - T(tiny))."""
    latency = probe["tiny_s"] / 2
    transfer = max(probe["probe_s"] - probe["tiny_s"], 1e-9)
    return probe["probe_bytes"] / transfer, latency


def measure_loopback(size_bytes: float, threads: int = 1, repeats: int = 5) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of a gloo allreduce between 2 processes on loopback at size S."""
    spec = {
        "mode": "bandwidth",
        "probe_bytes": probe_size(size_bytes),
        "repeats": repeats,
        "threads": threads,
    }
    return network_from_probe(run_workers(spec, 2))


def measure_compute(
    model: str, sample: Sample, batch_sizes: list[int], threads: int, repeats: int
) -> ComputeProfile:
    """T_comp at each batch size, timed in a fresh process with ``threads`` threads; ``model`` a zoo name or a
    reference to a factory (``file.py:fn``, made absolute: the process may start elsewhere)."""
    spec = {"mode": "profile", "model": refs.absolute(model), "sample": sample.as_json()}
    spec.update(batch_sizes=batch_sizes, threads=threads, repeats=repeats)
    times = run_workers(spec, 1, timeout_s=600.0)
    return profile_from_times({int(b): t for b, t in times.items()}, threads)


_NOTE_REST = (
    "and T_comp measured with both processes computing at once (they share cores and memory bandwidth); n=1 "
    "uses the single-process T_comp profile. All times are the fastest of several repeats; a load average above "
    "the core count means other processes competed for the cores and the figures are noisy"
)


@dataclass
class Validation:
    """Measured vs predicted step time at n = 1, 2 (ring allreduce over loopback) at one global batch."""

    global_batch: int
    measured_s: dict[int, float]
    predicted_s: dict[int, float]
    bandwidth: float
    latency: float
    compute_s: dict[int, float]
    compute_profile_s: dict[int, float]
    probe: dict  # the allreduce probe: tiny_s, probe_s, probe_bytes
    load_average: float  # the higher 1-minute load average of the start and the end
    link_gbps: float | None = None  # n=2 ran on 2 emulated nodes joined by links of this rate
    probe_bandwidth: float | None = (
        None  # bytes/s the probe measured, where ``bandwidth`` is the link's payload
    )

    @property
    def rel_error(self) -> dict[int, float]:
        return {n: abs(self.predicted_s[n] - m) / m for n, m in self.measured_s.items()}

    @property
    def max_rel_error(self) -> float:
        return max(self.rel_error.values())

    def as_json(self) -> dict:
        def ms(d):
            return {str(k): v * 1e3 for k, v in d.items()}

        out = {
            "global_batch": self.global_batch,
            "topology": "ring",
            "validation_bandwidth_gbps": self.bandwidth * 8 / 1e9,
            "validation_latency_us": self.latency * 1e6,
            "measured_step_ms": ms(self.measured_s),
            "predicted_step_ms": ms(self.predicted_s),
            "rel_error": {str(k): v for k, v in self.rel_error.items()},
            "max_rel_error": self.max_rel_error,
            "t_comp_ms_used": ms(self.compute_s),
            "t_comp_ms_single_process": ms(self.compute_profile_s),
            "allreduce_probe": {
                "bytes": self.probe["probe_bytes"],
                "ms": self.probe["probe_s"] * 1e3,
                "tiny_ms": self.probe["tiny_s"] * 1e3,
            },
            "load_average_1m": round(self.load_average, 2),
            "cpu_count": os.cpu_count(),
            "note": "n=2 is 2 processes on this machine over loopback: the prediction uses the loopback bandwidth "
            "and latency probed by allreduces of S bytes and of 4 bytes, " + _NOTE_REST,
        }
        if self.link_gbps is not None:
            out["emulated_link_gbps"] = self.link_gbps
            out["probe_bandwidth_gbps"] = self.probe_bandwidth * 8 / 1e9
            out["note"] = (
                f"n=2 is 2 processes on 2 emulated nodes joined by {self.link_gbps:g} Gbit/s links (gloo over "
                "them): the prediction takes as BW the TCP payload the link's rate carries (1448 bytes per "
                "1514-byte frame; the allreduce probe's bandwidth is reported beside it) and the latency probed "
                "by an allreduce of 4 bytes, "
                + _NOTE_REST
                + ". A link that idled lets a burst (128 KiB up to 1 Gbit/s) pass "
                "unshaped (tbf's bucket), so a model of a few hundred KB runs faster than S/BW: validate with "
                "one whose S is many times that (the bench CNN, 4.3 MB)"
            )
        return out


def validate(
    model: str,
    sample: Sample,
    global_batch: int,
    profile: ComputeProfile,
    size_bytes: float,
    overlap: float = 0.0,
    threads: int = 1,
    repeats: int = 4,
    cluster: EmulatedCluster | None = None,
) -> Validation:
    """Measure real step times with 1 and 2 processes and predict them with the ring model; with
    ``cluster`` (2 nodes), the 2 processes run one per node and the prediction takes its link's rate."""
    spec = {
        "mode": "validate",
        "model": refs.absolute(model),
        "sample": sample.as_json(),
        "global_batch": global_batch,
        "repeats": repeats,
        "rounds": 3 * repeats,  # 12 by default: the fastest of fewer rounds swung by 30 % under foreign load
        "probe_bytes": probe_size(size_bytes),
        "threads": threads,
    }
    load_before = os.getloadavg()[0]
    one = run_workers(spec, 1)
    two = run_workers(spec, 2, cluster=cluster)
    probed, latency = network_from_probe(two)
    link_gbps = cluster.link_gbps if cluster is not None else None
    bandwidth = probed if link_gbps is None else cluster.payload_bandwidth()
    net = Network(bandwidth, latency)
    comp = {1: profile.time_s(global_batch), 2: two["compute_s"]}
    predicted = {
        1: comp[1],
        2: iteration_time_s(comp[2], ring_allreduce_s(2, size_bytes, net), overlap),
    }
    return Validation(
        global_batch,
        {1: one["step_s"], 2: two["step_s"]},
        predicted,
        bandwidth,
        latency,
        comp,
        {1: profile.time_s(global_batch), 2: profile.time_s(global_batch / 2)},
        {k: two[k] for k in ("tiny_s", "probe_s", "probe_bytes")},
        max(load_before, os.getloadavg()[0]),
        link_gbps,
        probed,
    )
