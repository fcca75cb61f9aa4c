"""Replay every bad input of the test tables as a user meets it, repeatedly and under load (issue 53).

``PYTHONPATH=$PWD python scripts/bad_inputs.py --repeat 3 --parallel 2``: each case is ``python -m parambox
...`` in a directory of its own, ``--repeat`` rounds of the whole table (each round in a shuffled order),
``--parallel`` at once (``--burn B`` adds B processes that only spin, for more load). Each run must end with
exit 2 and exactly one line on stderr (``parambox: error: ...`` naming the problem, no traceback), and leave
nothing behind: no ``/dev/shm/pb_{pid}_*`` segment of its process, no file in its ``TMPDIR``, no process of
it alive 3 s after it ended. Prints a summary table per table of the tests, then every failure; exit 1 if
any. The tables are the tests' (tests/test_bad_inputs.py, tests/test_cli_errors.py,
tests/test_audit_failures.py), which run each case once, in process.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import test_audit_failures as audit  # noqa: E402
from tests import test_bad_inputs as bad  # noqa: E402
from tests import test_cli_errors as cli  # noqa: E402

TRAIN = bad.TRAIN
MARK = "BAD_INPUTS_CASE"  # in every case's environment: how its processes are found afterwards
# What a case must not inherit: the launchers' variables and parambox's own
INHERITED_OUT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Case:
    table: str
    name: str
    argv: list[str]  # after ``python -m parambox``; ``{tmp}`` is the case's directory
    pieces: list[str]  # each must be in the one line
    env: dict[str, str] = field(default_factory=dict)
    setup: Callable[[Path], object] = bad.make_files


def _train(args: list[str]) -> list[str]:
    return [*TRAIN, *([] if "--out" in args else ["--out", "{tmp}/run"]), *args]


def _workload(fields: dict[str, str]) -> list[str]:
    named = {"model": "linear", "data": "data"} | fields
    refs = [a for f, fn in named.items() for a in (f"--{f}", f"{{tmp}}/bad_workload.py:{fn}")]
    return [*TRAIN, *refs, "--loader-workers", "0", "--out", "{tmp}/run"]


def _exits(where: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / f"exits_{where}.py").write_text(audit.EXITS[where])

    return setup


def _garbled(text: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / "garbled").mkdir()
        (tmp / "garbled" / "config.json").write_text(text)

    return setup


def cases() -> list[Case]:
    out = [Case("train (issue 21)", " ".join(a), _train(a), [m]) for a, m in bad.ISSUE + bad.MORE]
    out += [
        Case(
            "train (CLI)",
            " ".join(a),
            ["train", *a] if a == ["--resume"] else ["train", "--out", "{tmp}/r", *a],
            [m],
        )
        for a, m in cli.BAD
    ]
    out += [Case("train (own)", " ".join(a) or str(e), _train(a), [m], e) for a, e, m in bad.OWN]
    out += [Case("workloads", "-".join(f.values()), _workload(f), p) for f, p in bad.WORKLOADS]
    out += [Case("environment", f"{n}={v}", _train([]), [n, p], {n: v}) for n, v, p in bad.ENVIRONMENT]
    out += [
        Case("environment", f"{n}={v}", _train([]), [n], bad.TORCHRUN_RANK_0 | {n: v})
        for n, v in bad.LAUNCHER_VARIABLES
    ]
    out += [Case("train (seed)", str(s), _train(["--seed", str(s)]), ["'seed'"]) for s in bad.SEEDS]
    ref = "tests.workloads.user_regression"
    dict_data = ["--model", f"{ref}:make_model", "--data", f"{ref}:make_dict_data", "--loader-workers", "0"]
    out.append(Case("workloads", "dict items", _train(dict_data), ["default loss", "--loss"]))
    out += [
        Case(
            "workloads",
            f"sys.exit {where}",
            _train(
                [
                    "--model",
                    f"{{tmp}}/exits_{where}.py:make_model",
                    "--data",
                    audit.DATA,
                    "--loader-workers",
                    "0",
                ]
            ),
            ["sys.exit"],
            setup=_exits(where),
        )
        for where in sorted(audit.EXITS)
    ]
    out += [Case("other commands", " ".join(a), a, [m]) for a, m in bad.OTHER_COMMANDS]
    out += [Case("other commands", f"bench {' '.join(a)}", ["bench", *a], [m]) for a, m in cli.BENCH]
    out += [
        Case(
            "other commands",
            f"slurm {f}",
            ["slurm", f, v, "--", "--strategy", "single"],
            [f, "control characters"],
        )
        for f, v in bad.SLURM_FIELDS
    ]
    export = ["export", "{tmp}/garbled", "--onnx", "{tmp}/m.onnx"]
    out.append(Case("other commands", "export garbled", export, ["garbled JSON"], setup=_garbled("{garbled")))
    not_a_config = _garbled(json.dumps({"stepz": 3}))
    out.append(
        Case("other commands", "export not a config", export, ["not a run's config"], setup=not_a_config)
    )
    return out


@dataclass
class Outcome:
    case: Case
    round: int
    seconds: float
    problems: list[str]
    out_left: bool  # the run directory exists afterwards (reported, not a failure: a failed run's record)


def _environment(case: Case, tmp: Path, mark: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMBOX_") and k not in INHERITED_OUT}
    env.update(PYTHONPATH=str(ROOT), TMPDIR=str(tmp / "tmp"), **{MARK: mark}, **case.env)
    # torch's compile cache (made in TMPDIR once per user and kept, by any process that builds an
    # optimizer): shared by the cases, outside the TMPDIR whose leftovers count
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp.parent / "torchinductor"))
    return env


def _ours(mark: str) -> list[int]:
    """The live processes whose environment holds ``mark``."""
    needle, found = f"{MARK}={mark}".encode(), []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry.name))
            except OSError:
                pass
    return found


def run_case(case: Case, round_: int, base: Path, limit_s: float) -> Outcome:
    tmp = Path(tempfile.mkdtemp(prefix="case_", dir=base))
    (tmp / "tmp").mkdir()
    case.setup(tmp)
    mark = uuid.uuid4().hex
    argv = [a.replace("{tmp}", str(tmp)) for a in case.argv]
    start, problems = time.monotonic(), []
    proc = subprocess.Popen(
        [sys.executable, "-m", "parambox", *argv],
        cwd=tmp,
        env=_environment(case, tmp, mark),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        problems.append(f"still running after {limit_s:g} s")
    seconds = time.monotonic() - start
    lines = err.strip().splitlines()
    if proc.returncode != 2:
        problems.append(f"exit {proc.returncode}")
    if "Traceback" in err or len(lines) != 1:
        problems.append(f"{len(lines)} lines on stderr: {' | '.join(lines[-3:])[:300]}")
    elif not lines[0].startswith("parambox: error: "):
        problems.append(f"not an error line: {lines[0][:200]}")
    elif missing := [p for p in case.pieces if p not in lines[0]]:
        problems.append(f"the line lacks {missing[0]!r}: {lines[0][:200]}")
    deadline = time.monotonic() + 3.0
    while (alive := _ours(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive:
        problems.append(f"{len(alive)} process(es) left: {alive}")
        for pid in alive:  # ours alone (found by the mark in their environment)
            os.kill(pid, signal.SIGKILL)
    segments = sorted(p.name for p in Path("/dev/shm").glob(f"pb_{proc.pid}_*"))
    if segments:
        problems.append(f"/dev/shm left: {segments}")
        for name in segments:
            (Path("/dev/shm") / name).unlink(missing_ok=True)
    left = sorted(str(p.relative_to(tmp / "tmp")) for p in (tmp / "tmp").rglob("*"))
    if left:
        problems.append(f"temp files left: {left[:5]}")
    out_left = (tmp / "run").exists() or (tmp / "r").exists()
    shutil.rmtree(tmp, ignore_errors=True)
    return Outcome(case, round_, seconds, problems, out_left)


def _burn(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def report(outcomes: list[Outcome], wall_s: float) -> int:
    tables: dict[str, list[Outcome]] = {}
    for o in outcomes:
        tables.setdefault(o.case.table, []).append(o)
    head = f"{'table':<18} {'cases':>5} {'runs':>5} {'ok':>5} {'failed':>6} {'mean s':>7} {'max s':>6} {'--out left':>10}"
    print(head)
    print("-" * len(head))
    rows = [*tables.items(), ("all", outcomes)]
    for name, got in rows:
        ok = sum(not o.problems for o in got)
        secs = [o.seconds for o in got]
        n_cases = len({(o.case.table, o.case.name) for o in got})
        left = sum(o.out_left for o in got)
        print(
            f"{name:<18} {n_cases:>5} {len(got):>5} {ok:>5} {len(got) - ok:>6} "
            f"{sum(secs) / len(secs):>7.2f} {max(secs):>6.2f} {left:>10}"
        )
    print(f"wall time {wall_s:.0f} s")
    failed = [o for o in outcomes if o.problems]
    for o in failed:
        print(f"FAILED [{o.case.table}] {o.case.name} (round {o.round}): {'; '.join(o.problems)}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the whole table (default 3)")
    ap.add_argument("--parallel", type=int, default=2, help="cases at once (default 2)")
    ap.add_argument("--burn", type=int, default=0, help="spinning processes alongside, for more load")
    ap.add_argument("--limit", type=float, default=180.0, help="seconds one case may take (default 180)")
    ap.add_argument("-k", default="", help="only the cases whose table or name holds this")
    ap.add_argument("--list", action="store_true", help="list the cases and stop")
    args = ap.parse_args(argv)
    table = [c for c in cases() if args.k in f"{c.table} {c.name}"]
    if args.list:
        for c in table:
            print(f"[{c.table}] {c.name}")
        print(f"{len(table)} cases")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped replay still cleans up
    base = Path(tempfile.mkdtemp(prefix="parambox_bad_inputs_"))
    burners = _burn(args.burn)
    rng, start = random.Random(0), time.monotonic()
    jobs = [(c, r) for r in range(args.repeat) for c in rng.sample(table, len(table))]
    outcomes: list[Outcome] = []

    def one(job: tuple[Case, int]) -> None:
        o = run_case(*job, base, args.limit)
        outcomes.append(o)
        verdict = "ok" if not o.problems else "FAILED " + "; ".join(o.problems)
        print(
            f"{len(outcomes)}/{len(jobs)} [{o.case.table}] {o.case.name}: {verdict}",
            file=sys.stderr,
            flush=True,
        )

    pool = concurrent.futures.ThreadPoolExecutor(args.parallel)
    stopped = False
    try:
        list(pool.map(one, jobs))
    except (KeyboardInterrupt, SystemExit):
        stopped = True
    finally:
        pool.shutdown(cancel_futures=True)  # stopped (SIGTERM, ^C): the runs under way end, no more start
        for p in burners:
            p.kill()
            p.wait()
        shutil.rmtree(base, ignore_errors=True)
    print(f"{len(table)} cases x {args.repeat} rounds, {args.parallel} at once, {args.burn} spinning beside")
    if stopped:
        print(f"stopped: {len(outcomes)} of the {len(jobs)} runs done")
    return report(outcomes, time.monotonic() - start) or int(stopped)


if __name__ == "__main__":
    raise SystemExit(main())
