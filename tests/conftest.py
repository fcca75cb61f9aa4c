"""Shared fixtures: run the CLI (in this process, or as a user would), and kill any orphaned worker after
each test. Under pytest-xdist (``scripts/test.sh``: a worker more than the cores, ``--dist loadfile``)
a test marked ``solo`` runs alone: the ones that judge what is left in /dev/shm or /tmp, where a test
beside them would leave its own files. Tests marked ``lock(NAME)`` run one at a time among themselves:
"netns", the emulated-cluster tests (their checks see every network namespace).

Tests marked ``long`` (an end-to-end run of a minute or so: a SLURM job through its time limits, a study,
a chaos bench, an emulated cluster's failure) are the long tier: ``--tier long`` runs only them, ``--tier
all`` everything, and the default suite leaves them out (CI runs both, ``.ci/run``). A test named by its
id on the command line runs whatever its tier."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_osc": "^ucx",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}


def one_line(capsys) -> str:
    """The one line a user error prints (``parambox: error: ...``), with no traceback: what it says."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("parambox: error: "), err
    return lines[0]


def slurm_running() -> bool:
    """A SLURM whose controller answers (``../shared/tools/slurm-up.sh`` starts one); installed but
    stopped counts as none."""
    import shutil

    if not all(shutil.which(t) for t in ("srun", "sbatch", "scontrol")):
        return False
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return ping.returncode == 0 and "UP" in ping.stdout


NO_SLURM = "no SLURM controller here (../shared/tools/slurm-up.sh starts one)"

# The benchmarks' smoke runs check keys, not speed: their workers fork warm from the session's zygote.
os.environ.setdefault("PARAMBOX_BENCH_WARM", "1")
# A hung smoke run fails with its workers' stacks (bench/workers.py DEADLINE_ENV) well before the
# test's own timeout, which would show only the parent waiting.
os.environ.setdefault("PARAMBOX_BENCH_DEADLINE_S", "100")


LOCKS = "PARAMBOX_TEST_LOCKS"  # the directory of the lock files every xdist worker shares


TIERS = ("suite", "long", "all")


def pytest_addoption(parser):
    parser.addoption(
        "--tier", choices=TIERS, default="suite",
        help="suite: every test but those marked long (the default); long: only those; all: both",
    )  # fmt: skip


def _in_tier(item, tier: str) -> bool:
    return tier == "all" or (item.get_closest_marker("long") is not None) == (tier == "long")


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER") is None and getattr(config.option, "numprocesses", None):
        os.environ[LOCKS] = tempfile.mkdtemp(prefix="pytest-locks-")  # the workers inherit it


def pytest_unconfigure(config):
    if os.environ.get("PYTEST_XDIST_WORKER") is None and os.environ.get(LOCKS):
        import shutil

        shutil.rmtree(os.environ.pop(LOCKS), ignore_errors=True)


def pytest_collection_modifyitems(session, config, items):
    """The tests of the ``--tier`` asked for (every one named by id), the files with the most slow tests
    first (in their own order): under ``--dist loadfile`` the long files then start early, and the suite
    does not end on one worker finishing a long file alone."""
    tier = config.getoption("tier")
    if not any("::" in arg for arg in config.args):
        dropped = [item for item in items if not _in_tier(item, tier)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if _in_tier(item, tier)]
    slow: dict[str, int] = {}
    for item in items:
        slow[item.fspath.strpath] = slow.get(item.fspath.strpath, 0) + (
            item.get_closest_marker("slow") is not None
        )
    items.sort(key=lambda item: -slow[item.fspath.strpath])  # stable: a file's tests keep their order


_KEPT: dict[str, io.TextIOWrapper] = {}  # the rw lock a solo test hands to the solo test after it


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A readers-writer lock over the xdist workers: a ``solo`` test (set-up, call and tear-down) holds
    it alone, every other test shares it. A turnstile keeps a waiting solo test from starving. A solo
    test followed by another keeps the lock for it: each new acquisition would first wait for the other
    worker's test under way to end (a file of 6 solo tests in a row waited 6 times). Then the test's
    named locks (``lock(NAME)``), each held alone."""
    where = os.environ.get(LOCKS) if os.environ.get("PYTEST_XDIST_WORKER") else None
    if not where:
        yield
        return
    solo = item.get_closest_marker("solo") is not None
    keep = solo and nextitem is not None and nextitem.get_closest_marker("solo") is not None
    named = [m.args[0] for m in item.iter_markers("lock")]
    with contextlib.ExitStack() as held:
        rw = _KEPT.pop("rw", None)  # held alone already, by the solo test before this one
        if rw is None:
            turnstile = held.enter_context(open(os.path.join(where, "turnstile"), "a"))
            rw = open(os.path.join(where, "rw"), "a")  # noqa: SIM115  (closed below, or by the next test)
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            fcntl.flock(rw, fcntl.LOCK_EX if solo else fcntl.LOCK_SH)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        if keep:
            _KEPT["rw"] = rw
        else:
            held.enter_context(rw)
        for name in sorted(set(named)):  # always after rw, in one order: no cycle
            fcntl.flock(held.enter_context(open(os.path.join(where, f"lock-{name}"), "a")), fcntl.LOCK_EX)
        yield  # closing the files releases the locks


@pytest.fixture(autouse=True)
def _kill_orphans():
    """Like hivemind's conftest: a failed multi-process test must not leave workers behind."""
    yield
    from parambox.runtime import zygote

    spared = zygote.pid()  # this session's zygote: its children (the test's workers) are not spared
    for child in psutil.Process().children(recursive=True):
        if child.pid == spared:
            continue
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def run_checks_in_own_process(script: str, calls: list[tuple[str, ...]], timeout: float = 240) -> dict:
    """Every ``(CHECK, *ARGV)`` of ``calls`` in one fresh interpreter, one after the other:
    ``python SCRIPT JSON`` from the checkout's root with it on PYTHONPATH, the test file's ``__main__``
    handing its ``globals()`` and the JSON to ``run_checks``. A fresh interpreter has none of the suite
    process's state (threads, signal handlers, an MPI singleton); one for a file's checks costs one
    start-up of torch, not one a check. Returns each call's outcome: "ok", or why not (its traceback)."""
    done = subprocess.run(
        [sys.executable, script, json.dumps(calls)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    outcomes = {tuple(c): f"did not run (exit {done.returncode}): {done.stderr[-3000:]}" for c in calls}
    for line in done.stdout.splitlines():
        if line.startswith('{"call"'):
            row = json.loads(line)
            outcomes[tuple(row["call"])] = row["outcome"]
    return outcomes


def run_checks(namespace: dict, calls_json: str) -> None:
    """The other side of ``run_checks_in_own_process``: call each ``namespace[CHECK](*ARGV)`` and print
    its outcome as a JSON line."""
    import traceback

    for check, *argv in json.loads(calls_json):
        try:
            namespace[check](*argv)
            outcome = "ok"
        except BaseException:
            outcome = traceback.format_exc()[-3000:]
        print(json.dumps({"call": [check, *argv], "outcome": outcome}), flush=True)


def run_cli(
    *args: str,
    timeout: float = 170,
    env: dict | None = None,
    prefix: list[str] | None = None,
    check: bool = True,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """``parambox ARGS``: in this process by default (``cli.main``; the workers a run spawns are still
    processes of their own), or ``python -m parambox ARGS`` in a fresh interpreter as a user runs it
    (``fresh``, or under a launcher given as ``prefix``). ``timeout`` bounds a fresh interpreter only:
    in this process pytest-timeout does."""
    if prefix or fresh:
        proc = _run_fresh(args, timeout, env, prefix)
    else:
        proc = _run_in_process(args, env)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"parambox {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def _run_fresh(
    args, timeout: float, env: dict | None, prefix: list[str] | None
) -> subprocess.CompletedProcess:
    from parambox.runtime import zygote

    # The session's zygote forks its workers, as pick's does for the runs it starts (a fresh launcher
    # would otherwise import torch twice over: once itself, once in a zygote of its own).
    from parambox.runtime.mpi import for_children

    # As from a user's shell: not the transport an in-process MPI test of this worker chose for itself
    full_env = for_children(dict(os.environ, PYTHONUNBUFFERED="1", **zygote.shared_env(), **(env or {})))
    cmd = [*(prefix or []), sys.executable, "-m", "parambox", *args]
    if prefix and prefix[-1] == "-m":  # torchrun takes the module itself
        cmd = [*prefix, "parambox", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


def _run_in_process(args, env: dict | None) -> subprocess.CompletedProcess:
    """``cli.main(args)`` with ``env`` set for the call, its exit code (argparse's SystemExit included),
    and what it and its children wrote: Python's streams and file descriptors 1 and 2 alike."""
    from parambox.cli import main

    threads = torch.get_num_threads()  # a one-process run sets the run's threads in this process
    mpi_before = "mpi4py.MPI" in sys.modules
    with contextlib.chdir(ROOT), _environ({"PYTHONUNBUFFERED": "1", **(env or {})}), _captured() as streams:
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    torch.set_num_threads(threads)
    # Importing mpi4py initialises MPI for the rest of the session: such a run needs fresh=True.
    assert mpi_before or "mpi4py.MPI" not in sys.modules, f"parambox {' '.join(args)} started MPI in pytest"
    return subprocess.CompletedProcess(["parambox", *args], code, streams["out"], streams["err"])


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _captured():
    """Both levels, as a subprocess's pipes would see them: sys.stdout/sys.stderr (print) and the
    descriptors (C++ warnings, children that inherit them)."""
    streams: dict[str, str] = {}
    sys.stdout.flush()
    sys.stderr.flush()
    texts = [io.StringIO(), io.StringIO()]
    saved_streams = sys.stdout, sys.stderr
    saved_fds = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout, sys.stderr = texts
        failed = True
        try:
            yield streams
            failed = False
        finally:
            sys.stdout, sys.stderr = saved_streams
            for fd, saved in zip((1, 2), saved_fds):
                os.dup2(saved, fd)
                os.close(saved)
            for key, text, f in zip(("out", "err"), texts, (out, err)):
                f.seek(0)
                streams[key] = text.getvalue() + f.read().decode(errors="replace")
            if failed:  # the call raised: what it and its children wrote goes to the test's report
                sys.stderr.write(streams["out"][-5000:] + streams["err"][-20000:])


# The synchronous numerics runs' flags (test_sync_numerics, test_pipeline): plain SGD, one thread.
NUMERICS = ["--model", "mlp", "--data", "digits", "--steps", "20", "--optimizer", "sgd", "--momentum", "0"]
NUMERICS += ["--lr", "0.1", "--eval-every", "0", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="session")
def single_b32(tmp_path_factory) -> dict[str, torch.Tensor]:
    """One process at batch 32 over ``NUMERICS``, once per session: the final weights that 2 workers at
    16 each (data parallel) and a pipeline at 32 must reach."""
    out = tmp_path_factory.mktemp("single_b32") / "run"
    run_cli(
        "train", "--strategy", "single", "--workers", "1", "--batch-size", "32", "--out", str(out), *NUMERICS
    )
    return final_weights(out)


def run_mpi_script(
    script: str, ranks: int, env: dict[str, str], timeout: float = 100
) -> tuple[str, str, int]:
    """``python SCRIPT`` as ``ranks`` MPI ranks (``spawn.start_mpi``: a private directory for Open
    MPI's files); its (stdout, stderr, exit code), the job stopped whatever happens."""
    from parambox.runtime import spawn

    if spawn.find_mpiexec() is None:
        pytest.skip("no mpiexec found")
    pytest.importorskip("mpi4py")
    cmd = [sys.executable, str(Path(script).resolve())]
    proc = spawn.start_mpi(cmd, ranks, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        spawn.stop([proc])
    return stdout, stderr, proc.returncode


def mpi_rank0_result(script: str, ranks: int = 2) -> dict:
    """``run_mpi_script`` with one thread a rank, for a script whose ranks print a JSON line each with
    their ``rank``: asserts the job exits 0 and returns rank 0's line."""
    stdout, stderr, code = run_mpi_script(script, ranks, {**os.environ, **MPI_ENV, "OMP_NUM_THREADS": "1"})
    assert code == 0, stderr[-3000:]
    lines = [json.loads(s) for s in stdout.splitlines() if s.startswith("{")]
    return next(x for x in lines if x["rank"] == 0)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture
def short_tmp():
    """A temporary directory with a short path (pytest's are too long to hold a Unix socket's)."""
    path = Path(tempfile.mkdtemp(prefix="pbt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
