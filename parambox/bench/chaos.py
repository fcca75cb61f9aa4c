"""``parambox bench chaos``: runs that keep losing workers, against the same runs without faults (torchft's schedule).

For each setup, two runs of ``parambox train --workers 3`` (MNIST, LeNet; ``--quick``: digits, the MLP
and fewer steps), one after the other, as a user starts them. MNIST for its 10,000 test samples: the
two runs' accuracies are compared to half a point, 50 samples there; on digits' 359 one sample was
0.28 points, and two runs of the same asynchronous setup differed by one to three samples either way:

- ``clean``: no fault;
- ``chaos``: the same run with ``--max-restarts`` high and a fault about every ``fault_every_s``
  seconds (torchft's CPU chaos run: one about every 30 s), the kinds in turn:
  ``kill`` (SIGKILL a random worker that is training), ``stop`` (SIGSTOP it for ``stop_s``, longer
  than the run's ``--timeout``: the launcher kills it once stopped for ``--timeout`` and replaces it;
  a synchronous run fences it out first; the SIGCONT at ``stop_s`` finds it gone), and ``kill-at-start`` (rank 1 SIGKILLs
  itself before its first step, ``PARAMBOX_FAULT``: before the first collective of a synchronous run).

Setups (``SETUPS``): ``easgd`` and ``diloco-async`` (asynchronous over the shm box: a dead worker is
replaced by a new process that pulls the center and trains on; the run ends once the workers' steps
add up to ``workers x --steps``, ``termination=average``), ``allreduce``
(``on_failure=shrink``: the survivors go on in place over a new process group, and the replacement
joins at a step boundary with its state from the leader); those three by default, and on request
``box-sync`` (the same as allreduce's, through the shm box's slots) and ``easgd-rma`` (easgd over the
rma box under mpiexec, its center on a memory rank that the loop may kill too; a dead worker of an MPI
job is lost, not replaced). Any rank may be hit, rank 0 too (a synchronous run's oldest survivor then
leads).

Reported per setup: ``throughput_retained`` (both runs do the same training, every rank's
``--steps``: the clean run's time over the chaos run's, each from the launcher's start to its exit,
as a user waits for it), ``steps_logged_ratio`` (the steps every life of every worker logged in the
chaos run over the clean run's: above 1, steps done again after a restart from a checkpoint; below 1,
a lost rank's steps nobody trained before its replacement joined), ``accuracy_clean``,
``accuracy_chaos``, ``faults`` by kind, ``replacements`` (restarts) and ``mean_recovery_s`` (from a
fault to the hit rank's next logged step, a replacement's or its own after waking), and each run's
times.
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from parambox.errors import RunFailed
from parambox.runtime import scratch, spawn, zygote

WORKERS = 3


@dataclass(frozen=True)
class ChaosSetup:
    args: tuple[str, ...]
    steps: int  # the full form's: ~10 min of clean training here (3 workers on 2 cores, LeNet on MNIST)
    quick_steps: int  # the quick form's (the MLP): a few seconds
    hits_rank0: bool = True  # the fault loop may hit rank 0
    memory_ranks: int = 0  # ranks after the workers that hold the box (--box rma): the loop may kill them
    spare_ranks: int = 0  # ranks between the workers and the memory ranks that wait (box.spare_ranks)


# The asynchronous setups end on the workers' total steps (``termination=average``: ShmCaffe's
# alignment; torchft's replicas likewise count one global step): a replaced worker's lag is then
# trained by whoever is running, not by it alone at the end while the others wait.
_SHARED_END = "termination=average"
_EASGD_RMA = (
    "--strategy",
    "easgd",
    "--box",
    "rma",
    "--set",
    f"easgd.{_SHARED_END}",
    "--set",
    "box.memory_ranks=1",
)
SETUPS = {
    "easgd": ChaosSetup(("--strategy", "easgd", "--set", f"easgd.{_SHARED_END}"), 75_000, 3000),
    "diloco-async": ChaosSetup(
        ("--strategy", "diloco", "--set", "diloco.asynchronous=true", "--set", f"diloco.{_SHARED_END}"),
        65_000,
        3000,
    ),
    # Every step waits for all three ranks on two cores: about half easgd's steps a second.
    "allreduce": ChaosSetup(
        ("--strategy", "allreduce", "--set", "on_failure=shrink", "--checkpoint-every", "500"),
        40_000,
        800,
    ),
    # On request (--setups box-sync): synchronous through the shm box, surviving in place as allreduce.
    "box-sync": ChaosSetup(
        ("--strategy", "box-sync", "--set", "on_failure=shrink", "--checkpoint-every", "500"),
        55_000,
        800,
    ),
    # On request (--setups easgd-rma): easgd over the rma box under mpiexec, its center on a memory rank
    # (rank 3) that the loop may kill too. On one host Open MPI's windows outlive it: the workers train on.
    # A worker that dies is lost, not replaced (an MPI job has a fixed set of ranks): the others train its
    # share (termination=average).
    "easgd-rma": ChaosSetup(
        _EASGD_RMA,
        75_000,
        3000,
        memory_ranks=1,
    ),
    # On request (--setups easgd-rma-spares): the same with four spare ranks (box.spare_ranks, ranks 3-6,
    # the memory rank 7): a dead worker's place goes to a spare, which does its steps. The loop hits the
    # workers only (and a spare that took a worker's place): the first memory rank hands the places out.
    "easgd-rma-spares": ChaosSetup(
        (*_EASGD_RMA, "--set", "box.spare_ranks=4"),
        75_000,
        3000,
    ),
    # On request (--setups easgd-rma-spares-memory): 3 workers, 4 spares and two memory ranks (7, 8), the
    # memory ranks drawn with the workers for a kill: where the one handing out places dies, the other
    # takes the book over (on one host the box outlives them both).
    "easgd-rma-spares-memory": ChaosSetup(
        (*_EASGD_RMA, "--set", "box.spare_ranks=4", "--set", "box.memory_ranks=2"),
        75_000,
        3000,
        memory_ranks=2,
        spare_ranks=4,
    ),
}
DEFAULT_SETUPS = ("easgd", "diloco-async", "allreduce")  # torchft's chaos run's kinds of rule
KINDS = ("kill", "stop")  # the fault loop's kinds, in turn; kill-at-start comes from PARAMBOX_FAULT
# A fault every 30 s (torchft's CPU chaos run). --timeout 3: a step here takes milliseconds, and a stopped
# rank (stop_s 25) is far past it; a synchronous run's stall costs about --timeout (allreduce, 30,000
# steps: 0.74 of the clean throughput with --timeout 10, 0.88 with 3; docs/results/chaos.md).
FULL = {"model": "lenet", "data": "mnist", "fault_every_s": 30.0, "stop_s": 25.0, "timeout": 3.0}
QUICK = {
    "model": "mlp",
    "data": "digits",
    "fault_every_s": 0.5,
    "stop_s": 7.0,
    "timeout": 3.0,
    "max_faults": 2,
}
RETRY_S = 0.2
SPARE_STEPS = 20  # a worker this close to its target is not hit: its replacement would only finish


def run_bench_chaos(
    steps: int | None = None,
    quick: bool = False,
    fault_every_s: float | None = None,
    setups: list[str] | None = None,
    seed: int = 0,
    timeout: float | None = None,
    rounds: int = 1,
    kinds: list[str] | None = None,
    hit_ranks: list[int] | None = None,
) -> dict[str, Any]:
    """``rounds`` > 1: that many pairs of a clean and a chaos run per setup, their order alternating
    (a drift of the machine's speed then weighs on both), each run ``1/rounds`` as long as the full
    form's (``steps`` overrides), a fresh fault sequence per round; the ratios are medians of the
    rounds' ratios (one pair of 10-minute runs spread 0.02-0.03 here). ``kinds``: the fault loop's
    kinds, in turn (default ``KINDS``); ``hit_ranks``: the ranks it may hit (default any, rank 0
    too), e.g. ``kinds=["stop"], hit_ranks=[0]``: rank 0 stopped again and again."""
    from parambox.errors import UserError

    setups = setups or list(DEFAULT_SETUPS)
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        raise UserError(f"bench chaos: unknown setups {unknown}; choose from {', '.join(SETUPS)}")
    bad = [k for k in kinds or () if k not in KINDS]
    if bad or kinds == []:
        raise UserError(f"bench chaos: --faults takes a comma list of {', '.join(KINDS)}, got {kinds}")
    # the workers, then any spare ranks and memory ranks
    most = WORKERS + max(SETUPS[s].spare_ranks + SETUPS[s].memory_ranks for s in setups)
    if hit_ranks is not None and (not hit_ranks or not all(0 <= r < most for r in hit_ranks)):
        raise UserError(
            f"bench chaos: --hit-ranks are ranks of its {WORKERS} workers (0-{WORKERS - 1})"
            + (f" or its spare and memory ranks ({WORKERS}-{most - 1})" if most > WORKERS else "")
        )
    plan = dict(QUICK if quick else FULL)
    plan["kinds"] = list(kinds or KINDS)
    if hit_ranks is not None:
        plan["hit_ranks"] = sorted(set(hit_ranks))
    plan["fault_every_s"] = fault_every_s or plan["fault_every_s"]
    plan["timeout"] = timeout or plan["timeout"]
    if plan["stop_s"] <= plan["timeout"]:
        raise UserError(f"bench chaos: --timeout {timeout} must be under the stops' {plan['stop_s']} s")
    result: dict[str, Any] = {"workers": WORKERS, **plan, "rounds": rounds, "setups": {}}
    if plan["data"] == "mnist":
        from parambox.data.mnist import fetch_mnist

        fetch_mnist()  # once, before any timed run (from the local cache where it is there)
    with scratch.folder(scratch.BENCH) as tmp:
        for name in setups:
            setup = SETUPS[name]
            plan["steps"] = steps or max(1, (setup.quick_steps if quick else setup.steps) // rounds)
            args = ["train", *setup.args, "--workers", str(WORKERS), "--model", plan["model"]]
            args += ["--data", plan["data"]]
            args += ["--steps", str(plan["steps"]), "--eval-every", "0", "--no-progress"]
            args += ["--timeout", str(plan["timeout"])]
            pairs = []
            for k in range(rounds):
                pair = {}
                for kind in ("clean", "chaos") if k % 2 == 0 else ("chaos", "clean"):
                    out = Path(tmp) / f"{name}-{kind}-{k}"
                    if kind == "clean":
                        pair[kind] = _run(args, out)
                    else:
                        pair[kind] = _run(
                            [*args, "--max-restarts", "1000"],
                            out,
                            faults=_FaultLoop(plan, setup, random.Random(seed + k)),
                            env={"PARAMBOX_FAULT": "1:0:kill"},  # kill-at-start: before the first collective
                        )
                pairs.append(pair)
            result["setups"][name] = _summary(plan["steps"], pairs)
    return result


def _summary(steps: int, pairs: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """One setup's figures over its rounds: medians of the per-round ratios, faults summed."""
    chaos = [p["chaos"] for p in pairs]
    retained = [p["clean"]["command_s"] / max(p["chaos"]["command_s"], 1e-9) for p in pairs]
    recoveries = [c["mean_recovery_s"] for c in chaos if c["mean_recovery_s"] is not None]
    return {
        "steps": steps,
        "throughput_retained": statistics.median(retained),
        "throughput_retained_rounds": retained,
        "steps_logged_ratio": statistics.median(
            p["chaos"]["steps_logged"] / max(p["clean"]["steps_logged"], 1) for p in pairs
        ),
        "accuracy_clean": statistics.median(p["clean"]["final_test_accuracy"] for p in pairs),
        "accuracy_chaos": statistics.median(c["final_test_accuracy"] for c in chaos),
        "faults": {k: sum(c["faults"][k] for c in chaos) for k in chaos[0]["faults"]},
        # each fault of the loop as kind@rank: which ranks were hit, and how
        "faults_by_rank": dict(
            sorted(
                collections.Counter(f"{f['kind']}@{f['rank']}" for c in chaos for f in c["fault_log"]).items()
            )
        ),
        "replacements": sum(c["restarts"] + c.get("spares_used", 0) for c in chaos),
        "lost_workers": [c["lost_workers"] for c in chaos],
        "mean_recovery_s": statistics.mean(recoveries) if recoveries else None,
        "runs": pairs,
    }


class _FaultLoop:
    """Hits a random training worker every ``fault_every_s``, the kinds in turn; wakes stopped ones."""

    def __init__(self, plan: dict[str, Any], setup: ChaosSetup, rng: random.Random):
        self.plan, self.setup, self.rng = plan, setup, rng
        self.log: list[dict[str, Any]] = []
        self.stopped: list[tuple[float, psutil.Process]] = []  # (wake at, process)
        self.next_at = 0.0

    def start(self, t0: float) -> None:
        self.next_at = t0 + self.plan["fault_every_s"]

    def tick(self, out: Path) -> None:
        now = time.monotonic()
        for wake_at, proc in [p for p in self.stopped if p[0] <= now]:
            self.stopped.remove((wake_at, proc))
            try:
                proc.send_signal(signal.SIGCONT)  # a fenced one is gone already: nothing to wake
            except psutil.Error:
                pass
        if now < self.next_at or len(self.log) >= self.plan.get("max_faults", 10**9):
            return
        kinds = self.plan.get("kinds", KINDS)
        kind = kinds[len(self.log) % len(kinds)]
        ranks = self.plan.get("hit_ranks")
        hit = _hit_one(
            out,
            self.plan["steps"],
            self.rng,
            kind,
            self.setup.hits_rank0,
            ranks,
            self.setup.memory_ranks,
            self.setup.spare_ranks,
        )
        if hit is None:  # nobody training yet (or all near their end): look again soon
            self.next_at = now + RETRY_S
            return
        rank, proc = hit
        self.log.append({"t": time.time(), "rank": rank, "kind": kind})
        if kind == "stop":
            self.stopped.append((now + self.plan["stop_s"], proc))
        self.next_at += self.plan["fault_every_s"]

    def finish(self) -> None:
        for _, proc in self.stopped:
            try:
                proc.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass


def _run(
    args: list[str], out: Path, faults: _FaultLoop | None = None, env: dict[str, str] | None = None
) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "parambox", *args, "--out", str(out)]
    log = out.parent / f"{out.name}.log"
    t0 = time.monotonic()
    with open(log, "wb") as sink:
        # The workers fork from this process's zygote (started once, not in every run's launcher);
        # _hit_one finds them below this process.
        env = {**os.environ, **zygote.shared_env(), **(env or {})}
        launcher = spawn.start(cmd, env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            if faults:
                faults.start(t0)
            while launcher.poll() is None:
                time.sleep(0.1)
                if faults:
                    faults.tick(out)
        finally:
            if faults:
                faults.finish()
            spawn.stop([launcher])
    command_s = time.monotonic() - t0
    if launcher.returncode != 0 or not (out / "summary.json").exists():
        raise _failed(out, log, launcher.returncode)
    s = json.loads((out / "summary.json").read_text())
    result = {
        "command_s": command_s,
        "wall_time_s": s["wall_time_s"],
        "samples_per_s": s["samples_per_s"],
        # Every life's steps, from the metrics files: also a lost rank's steps that no exchange kept
        # (the summary's rate counts the kept ones only)
        "steps_logged": _logged_steps(out),
        "final_test_accuracy": s["final_test_accuracy"],
        "restarts": s["restarts"],
        "spares_used": s.get("spares_used", 0),  # box.spare_ranks: places a spare rank took
        "lost_workers": s["lost_workers"],
    }
    if faults is not None:
        log_ = faults.log
        recoveries = [r for r in (_recovery_s(out, f) for f in log_) if r is not None]
        kinds = [f["kind"] for f in log_] + (["kill-at-start"] if env and "PARAMBOX_FAULT" in env else [])
        result.update(
            faults={k: kinds.count(k) for k in (*KINDS, "kill-at-start")},
            fault_log=log_,
            mean_recovery_s=sum(recoveries) / len(recoveries) if recoveries else None,
        )
    return result


def _logged_steps(out: Path) -> int:
    """Steps every life of every rank logged (one ``step`` record each: ``log_every`` is 1). A rank that
    took over the lead (rank 0 died) copies its records into ``metrics.jsonl`` after a ``leader``
    record: counted once, in its own file."""
    count = 0
    for path in out.glob("metrics*.jsonl"):
        with open(path, "rb") as f:
            for line in f:
                if b'"kind": "leader"' in line:
                    break
                count += b'"kind": "step"' in line
    return count


def _recovery_s(out: Path, fault: dict[str, Any]) -> float | None:
    """Seconds from ``fault`` to its rank's next logged step (any life), on the metrics' wall clock."""
    path = _metrics_of(out, fault["rank"])
    epoch = None
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "world":
            epoch = rec.get("epoch")
        elif rec.get("kind") == "step" and epoch is not None and epoch + rec["time"] > fault["t"]:
            return epoch + rec["time"] - fault["t"]
    return None


def _metrics_of(out: Path, rank: int) -> Path:
    """The file a rank logs its steps to: rank 0's ``metrics.jsonl``, unless a replacement of rank 0
    joined a synchronous run led by another rank (then ``metrics.rank0.jsonl``: it does not lead)."""
    own = out / f"metrics.rank{rank}.jsonl"
    return own if rank != 0 or own.exists() else out / "metrics.jsonl"


def _hit_one(
    out: Path,
    steps: int,
    rng: random.Random,
    kind: str,
    hits_rank0: bool,
    ranks: list[int] | None = None,
    memory_ranks: int = 0,
    spare_ranks: int = 0,
) -> tuple[int, psutil.Process] | None:
    """SIGKILL or SIGSTOP one random worker that is training (it has logged steps in this life, and is
    not about to finish: a replacement still starting up is spared), while at least two are; returns
    its rank and process (one of ``ranks`` where given). The workers are below this process: under the
    run's launcher, or under this process's zygote. A live memory rank (ranks ``WORKERS`` on, after any
    ``spare_ranks``; they log no steps) is drawn with the workers, for a SIGKILL only: a stopped one
    would stall the box, not test it. A spare is hit once it has taken a worker's place (its rank's name)."""
    workers, memory = {}, {}
    for child in psutil.Process().children(recursive=True):
        try:
            rank = _rank_of(child)
            born = child.create_time()
            if child.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                continue
        except (psutil.Error, ValueError):
            continue
        if WORKERS + spare_ranks <= rank < WORKERS + spare_ranks + memory_ranks:
            memory[rank] = child
            continue
        logged, step = _last_step(out, rank)
        if rank >= (0 if hits_rank0 else 1) and logged > born and 0 < step < steps - SPARE_STEPS:
            workers[rank] = child
    if len(workers) < 2:  # the last one training finishes in peace: failures hit a run, not its tail end
        return None
    if kind == "kill":
        workers |= memory
    eligible = sorted(r for r in workers if ranks is None or r in ranks)
    if not eligible:
        return None
    rank = rng.choice(eligible)
    try:
        workers[rank].send_signal(signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    except psutil.Error:
        return None
    return rank, workers[rank]


def _failed(out: Path, log: Path, code: int | None) -> RunFailed:
    """A run that failed, its log and files kept (the bench's scratch folder goes when it ends)."""
    kept = Path(tempfile.mkdtemp(prefix=f"parambox-chaos-{out.name}-"))
    shutil.copy(log, kept)
    if out.is_dir():
        shutil.copytree(out, kept / out.name, ignore=shutil.ignore_patterns("*.pt"))
    tail = log.read_text(errors="replace").strip().splitlines()[-5:]
    return RunFailed(
        f"bench chaos: the {out.name} run exited {code}; its log is kept in {kept}\n" + "\n".join(tail)
    )


def _rank_of(child: psutil.Process) -> int:
    """The rank a worker process runs: its name (``parambox-r3``), or, for a warm spare that has
    not taken one yet, the metrics file it has open."""
    rank = spawn.rank_of(child)
    if rank is not None:
        return rank
    for f in child.open_files():
        name = Path(f.path).name
        if name == "metrics.jsonl":
            return 0
        if name.startswith("metrics.rank") and name.endswith(".jsonl"):
            return int(name[len("metrics.rank") : -len(".jsonl")])
    return -1


def _last_step(out: Path, rank: int) -> tuple[float, int]:
    """(when, which) the last step this rank logged (every life of a rank appends to one file)."""
    path = _metrics_of(out, rank)
    try:
        with open(path, "rb") as f:
            logged = os.fstat(f.fileno()).st_mtime
            f.seek(max(0, f.seek(0, 2) - 4096))
            lines = f.read().splitlines()
    except OSError:
        return 0.0, 0
    for line in reversed(lines):
        try:
            return logged, int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return logged, 0
