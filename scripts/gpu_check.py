"""The GPU path of every strategy (CUDA tensors, nccl), on a machine with at least one GPU.

    python scripts/gpu_check.py [--out DIR] [--parallel 4] [--steps N] [--strategies a,b]

Runs each strategy's default digits run as a user types it (``parambox train --strategy X``, two
workers) and prints, per strategy, the device and backend its summary records, the test accuracy
and the seconds, or the last line of its error; the DistributedOptimizer example under torchrun
with the model on the GPU; ``gpu_check.json`` in ``--out`` holds it all.

Where a node has fewer GPUs than workers, every process is given an ``NCCL_HOSTID`` of its own, so
that NCCL takes the ranks for separate hosts and joins them over its socket transport (it refuses two
ranks on one GPU otherwise): the collectives, the CUDA tensors and the copies to and from the host
box are those of a cluster with a GPU per rank; NVLink and peer-to-peer copies are not exercised.
hogwild keeps its model in host shared memory: it runs with ``PARAMBOX_DEVICE=cpu``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # parambox from this checkout, installed or not
CPU_ONLY = {"hogwild"}
# Each process names a host of its own for NCCL. The variable is set at start (the launcher's check
# of GPUs per node reads it) and again, to this process's own, before each process group is made: a
# worker forked by parambox's zygote takes its launcher's environment.
SITE = """import faulthandler, os, signal
faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: where a stuck process is
def _own_host():
    os.environ["NCCL_HOSTID"] = "parambox-gpu-check-%d" % os.getpid()
_own_host()
import torch.distributed.distributed_c10d as _c10d
_make = _c10d._new_process_group_helper
def _new_group(*args, **kwargs):
    _own_host()
    return _make(*args, **kwargs)
_c10d._new_process_group_helper = _new_group
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/gpu-check")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="default: each strategy's default run")
    ap.add_argument("--strategies", default=None, help="comma-separated; default: every strategy")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--only", default=None, help="comma-separated job names (as printed) to run")
    args = ap.parse_args()

    import torch

    from parambox.strategies import STRATEGIES

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    gpus = torch.cuda.device_count()
    if gpus < 2:
        site = Path(tempfile.mkdtemp(prefix="parambox-gpu-site-"))
        atexit.register(shutil.rmtree, site, ignore_errors=True)
        (site / "sitecustomize.py").write_text(SITE)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(ROOT), env.get("PYTHONPATH")) if p)
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")  # the ranks' "hosts" are this one
    else:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    header = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": gpus,
        "gpu": torch.cuda.get_device_name(0) if gpus else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
        "own_nccl_host_per_rank": gpus < 2,
    }
    print(json.dumps(header), flush=True)

    names = args.strategies.split(",") if args.strategies else sorted(STRATEGIES)
    jobs = {}
    for name in names:
        cmd = [sys.executable, "-m", "parambox", "train", "--strategy", name, "--no-progress"]
        cmd += ["--out", str(out / name)] + (["--steps", str(args.steps)] if args.steps else [])
        jobs[name] = (cmd, {**env, "PARAMBOX_DEVICE": "cpu"} if name in CPU_ONLY else env)
    # Surviving in place over nccl: rank 1 killed mid-run; the survivors go on, then a replacement joins.
    shrink = ["--workers", "3", "--set", "on_failure=shrink", "--timeout", "20", "--steps", "400"]
    survive = (
        ("shrink/allreduce", []),
        ("shrink-replace/allreduce", ["--max-restarts", "1"]),
        ("shrink-replace/weight-avg", ["--max-restarts", "1"]),
        ("shrink-replace/ps-sync", ["--max-restarts", "1"]),
        ("shrink-replace/easgd", ["--max-restarts", "1"]),
        ("shrink-replace/diloco", ["--max-restarts", "1"]),
        ("shrink-replace/box-sync", ["--max-restarts", "1"]),
    )
    for name, extra in survive:
        cmd = [sys.executable, "-m", "parambox", "train", "--strategy", name.split("/")[1], "--no-progress"]
        cmd += ["--out", str(out / name)] + shrink + extra
        jobs[name] = (cmd, {**env, "PARAMBOX_FAULT": "1:150:kill"})
    # An asynchronous run's replacement: it attaches to the shm box (the center) by name.
    for name in ("replace/downpour", "replace/easgd"):
        cmd = [sys.executable, "-m", "parambox", "train", "--strategy", name.split("/")[1], "--no-progress"]
        cmd += ["--out", str(out / name), "--max-restarts", "1"]
        jobs[name] = (cmd, {**env, "PARAMBOX_FAULT": "1:150:kill"})
    cmd = [
        sys.executable,
        "-m",
        "parambox",
        "train",
        "--strategy",
        "downpour",
        "--box",
        "rma",
        "--no-progress",
    ]
    jobs["rma/downpour"] = (cmd + ["--out", str(out / "rma" / "downpour")], env)
    for strategy in ("allreduce", "easgd", "downpour", "diloco"):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "examples" / "own_loop.py"),
        ]
        jobs[f"own_loop/{strategy}"] = (cmd + ["--device", "cuda", "--strategy", strategy], env)

    if args.only:
        jobs = {k: v for k, v in jobs.items() if k in args.only.split(",")}

    def run(item):
        name, (cmd, job_env) = item
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=job_env, capture_output=True, text=True, timeout=args.timeout)
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            text = "".join(
                t.decode() if isinstance(t, bytes) else t for t in (e.stdout or "", e.stderr or "")
            )
            rc = "timeout"
        seconds = round(time.perf_counter() - t0, 1)
        (out / f"{name.replace('/', '-')}.log").write_text(text)
        row = {"name": name, "rc": rc, "seconds": seconds}
        summary = out / name / "summary.json"
        if not name.startswith("own_loop") and summary.exists():
            s = json.loads(summary.read_text())
            keys = ("device", "backend", "final_test_accuracy", "steps", "lost_workers", "restarts")
            row.update({k: s.get(k) for k in keys})
            if name.startswith("shrink"):
                row["samples_vs_closed_form"] = _samples_vs_closed_form(out / name, s)
        elif name.startswith("own_loop"):
            accs = [line for line in text.splitlines() if "test accuracy" in line]
            row["result"] = accs[-1] if accs else None
        if rc != 0:
            lines = text.strip().splitlines() or ["(no output)"]
            named = [line for line in lines if "Error" in line or "error:" in line]
            row["error"] = (named or lines)[-1][:300]
        print(json.dumps(row), flush=True)
        return row

    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(run, jobs.items()))
    failed = [r["name"] for r in rows if r["rc"] != 0]
    (out / "gpu_check.json").write_text(json.dumps({**header, "runs": rows, "failed": failed}, indent=1))
    print(f"{len(rows) - len(failed)} of {len(rows)} ran; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


def _samples_vs_closed_form(run: Path, s: dict) -> float | None:
    """The summary's samples (rate x time) over the closed form of a shrink job: 3 ranks for the
    first 150 steps, 2 until the replacement joined (if one did), then 3 again. Local SGD (diloco,
    weight-avg, easgd) counts the lost rank's steps up to its last exchange: up to a round below."""
    try:
        lines = (run / "metrics.rank1.jsonl").read_text().splitlines()
        worlds = [json.loads(x) for x in lines if '"world"' in x]
        joined = worlds[-1]["step"] if worlds[-1]["life"] > 0 else s["steps"]
        steps, batch = s["steps"], s["config"]["batch_size"]
        expected = (150 * 3 + (joined - 150) * 2 + (steps - joined) * 3) * batch
        return round(s["samples_per_s"] * s["wall_time_s"] / expected, 6)
    except (OSError, KeyError, IndexError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
