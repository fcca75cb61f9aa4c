"""Tier (c): `parambox bench chaos --quick --json` runs every setup clean and under faults (a kill, a SIGSTOP
past --timeout, a kill before the first step) and reports its keys (the figures come from the full form,
run on a quiet machine: `parambox bench chaos --json`)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.long
def test_bench_chaos_quick():
    result = json.loads(
        run_cli("bench", "chaos", "--quick", "--timeout", "2.5", "--json", timeout=390).stdout
    )
    assert set(result["setups"]) == {"easgd", "diloco-async", "allreduce"}
    assert result["timeout"] == 2.5  # the runs' --timeout (the stops, 7 s, are past it)
    for name, r in result["setups"].items():
        faults = r["faults"]
        assert faults["kill-at-start"] == 1 and faults["kill"] >= 1 and faults["stop"] >= 1, (name, r)
        # every kill is replaced; a rank stopped past --timeout is killed by the launcher and replaced
        # too (a synchronous one fenced out first), or lost if the others finished meanwhile
        (run,) = r["runs"]  # one round: a clean run and a chaos run
        stopped = {f["rank"] for f in run["chaos"]["fault_log"] if f["kind"] == "stop"}
        if name in ("allreduce", "box-sync"):
            assert r["replacements"] >= 3 and run["chaos"]["lost_workers"] == [], (name, r)
        else:
            assert r["replacements"] >= 2 and set(run["chaos"]["lost_workers"]) <= stopped, (name, r)
        assert r["throughput_retained_rounds"] == [run["clean"]["command_s"] / run["chaos"]["command_s"]]
        assert r["throughput_retained"] > 0 and r["accuracy_chaos"] > 0.8, (name, r)
        assert r["mean_recovery_s"] is not None and r["mean_recovery_s"] > 0, (name, r)
    bad = run_cli("bench", "chaos", "--quick", "--setups", "nope", check=False)
    assert bad.returncode == 2 and "unknown setups ['nope']" in bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.long
def test_bench_chaos_quick_box_sync_survives_in_place():
    """box-sync on request, every fault of the loop on rank 0 (--hit-ranks 0): a kill of rank 1 before
    its first step (a restart of all), then rank 0 SIGSTOPped past --timeout and rank 0 killed, each
    survived in place (another rank leads), nobody lost. 1,600 steps, not the quick form's 800, so that
    the faults come well before the end; still, under the full suite's load the last replacement may start
    after the others have finished (2 replacements, not 3: at 800, 1,600 and 2,400 steps, once each)."""
    result = json.loads(
        run_cli(
            "bench", "chaos", "--quick", "--setups", "box-sync", "--timeout", "2.5", "--faults", "stop,kill",
            "--hit-ranks", "0", "--steps", "1600", "--json", timeout=190,
        ).stdout
    )  # fmt: skip
    r = result["setups"]["box-sync"]
    assert r["faults"] == {"kill": 1, "stop": 1, "kill-at-start": 1}, r
    assert r["faults_by_rank"] == {"kill@0": 1, "stop@0": 1}, r
    assert r["replacements"] >= 2 and r["runs"][0]["chaos"]["lost_workers"] == [], r
    assert r["accuracy_chaos"] > 0.8 and r["mean_recovery_s"] > 0, r


def test_bench_quick_is_refused_where_there_is_none():
    proc = run_cli("bench", "box", "--quick", check=False)
    assert proc.returncode == 2 and "no --quick form" in proc.stderr


def test_rounds_alternate_and_their_ratios_are_medians(monkeypatch):
    """In process, with the runs faked: rounds alternate which run goes first, each run is 1/rounds of
    the full form, every chaos run has a fault sequence of its own, and the figures are medians."""
    from parambox.bench import chaos

    calls, times = [], iter([100, 110, 120, 100, 100, 125])  # seconds, in call order

    def fake_run(args, out, faults=None, env=None):
        calls.append((out.name, int(args[args.index("--steps") + 1]), faults and faults.rng.random()))
        t, acc = next(times), 0.99 if faults is None else 0.98
        run = {
            "command_s": t,
            "steps_logged": 30,
            "final_test_accuracy": acc,
            "restarts": 0,
            "lost_workers": [],
        }
        if faults is not None:
            log = [{"t": 0.0, "rank": 0, "kind": "kill"}, {"t": 1.0, "rank": 2, "kind": "stop"}]
            run.update(
                restarts=2,
                faults={"kill": 1, "stop": 1, "kill-at-start": 1},
                mean_recovery_s=1.0,
                fault_log=log,
            )
        return run

    monkeypatch.setattr(chaos, "_run", fake_run)
    monkeypatch.setattr("parambox.data.mnist.fetch_mnist", lambda: None)  # the runs are fakes
    r = chaos.run_bench_chaos(setups=["allreduce"], rounds=3)["setups"]["allreduce"]
    assert [c[0] for c in calls] == [
        "allreduce-clean-0", "allreduce-chaos-0", "allreduce-chaos-1",
        "allreduce-clean-1", "allreduce-clean-2", "allreduce-chaos-2",
    ]  # fmt: skip
    assert {c[1] for c in calls} == {chaos.SETUPS["allreduce"].steps // 3}
    assert len({c[2] for c in calls if c[2] is not None}) == 3  # one fault sequence per round
    assert r["throughput_retained_rounds"] == [100 / 110, 100 / 120, 100 / 125]
    assert r["throughput_retained"] == 100 / 120
    assert r["faults"] == {"kill": 3, "stop": 3, "kill-at-start": 3} and r["replacements"] == 6
    assert r["faults_by_rank"] == {"kill@0": 3, "stop@2": 3}
    assert (r["accuracy_clean"], r["accuracy_chaos"]) == (0.99, 0.98)


def test_the_fault_loop_draws_a_memory_rank_with_the_workers_for_a_kill_only(monkeypatch, tmp_path):
    """easgd-rma's memory rank (rank 3, after the 3 workers) logs no steps: it is drawn with the workers
    that train, for a SIGKILL, never stopped, and never once fewer than two workers train."""
    import random
    import signal
    from types import SimpleNamespace

    from parambox.bench import chaos

    class Proc:
        def __init__(self, rank, status="running"):
            self.rank, self._status, self.signals = rank, status, []

        def create_time(self):
            return 0.0

        def status(self):
            return self._status

        def send_signal(self, sig):
            self.signals.append(sig)

    procs = [Proc(r) for r in range(4)]
    fake = SimpleNamespace(
        Process=lambda: SimpleNamespace(children=lambda recursive: procs),
        STATUS_STOPPED="stopped",
        STATUS_ZOMBIE="zombie",
        Error=Exception,
    )
    training = {0, 1, 2}
    monkeypatch.setattr(chaos, "psutil", fake)
    monkeypatch.setattr(chaos, "_rank_of", lambda p: p.rank)
    monkeypatch.setattr(chaos, "_last_step", lambda out, rank: (1.0, 100) if rank in training else (0.0, 0))
    assert chaos.SETUPS["easgd-rma"].memory_ranks == 1 and chaos.WORKERS == 3
    rng = random.Random(0)
    drawn = {chaos._hit_one(tmp_path, 3000, rng, "kill", True, None, 1)[0] for _ in range(60)}
    assert drawn == {0, 1, 2, 3}
    assert chaos._hit_one(tmp_path, 3000, rng, "kill", True, [3], 1)[0] == 3
    assert procs[3].signals[-1] == signal.SIGKILL
    assert chaos._hit_one(tmp_path, 3000, rng, "stop", True, [3], 1) is None  # a memory rank is not stopped
    assert chaos._hit_one(tmp_path, 3000, rng, "kill", True, [3], 0) is None  # a setup without one
    # easgd-rma-spares-memory: spares at 3-6 (waiting: no steps, not hit), memory ranks at 7-8
    setup = chaos.SETUPS["easgd-rma-spares-memory"]
    assert (setup.spare_ranks, setup.memory_ranks) == (4, 2)
    procs[:] = [Proc(r) for r in range(9)]
    drawn = {chaos._hit_one(tmp_path, 3000, rng, "kill", True, None, 2, 4)[0] for _ in range(100)}
    assert drawn == {0, 1, 2, 7, 8}
    training = {0}  # the last worker training finishes in peace, with or without the box
    monkeypatch.setattr(chaos, "_last_step", lambda out, rank: (1.0, 100) if rank in training else (0.0, 0))
    assert chaos._hit_one(tmp_path, 3000, rng, "kill", True, None, 1) is None


def test_hit_ranks_take_the_memory_rank_only_with_a_setup_that_has_one():
    ok = run_cli("bench", "chaos", "--quick", "--setups", "nope", "--hit-ranks", "3", check=False)
    assert ok.returncode == 2 and "unknown setups" in ok.stderr  # the setups are checked first
    bad = run_cli("bench", "chaos", "--quick", "--setups", "easgd", "--hit-ranks", "3", check=False)
    assert bad.returncode == 2 and "ranks of its 3 workers (0-2)" in bad.stderr, bad.stderr
    assert "memory" not in bad.stderr


def test_a_run_that_fails_is_one_line_on_the_cli_and_its_log_is_kept(tmp_path, monkeypatch, capsys):
    """A chaos run that exits non-zero: its log and files are kept past the bench's scratch folder, and
    the CLI prints where, with the log's last lines, exit code 1 and no traceback."""
    import re
    import shutil
    from pathlib import Path

    from parambox import cli
    from parambox.bench import chaos
    from parambox.commands import bench
    from parambox.errors import RunFailed

    out = tmp_path / "bad-run"
    with pytest.raises(RunFailed) as failed:
        chaos._run(["train", "--strategy", "no-such-rule"], out)
    kept = Path(re.search(r"kept in (\S+)", str(failed.value))[1])
    try:
        assert "no-such-rule" in (kept / "bad-run.log").read_text() and "no-such-rule" in str(failed.value)
        assert str(failed.value).startswith("bench chaos: the bad-run run exited 2; its log is kept in ")
    finally:
        shutil.rmtree(kept)

    def fail(args):
        raise failed.value

    monkeypatch.setattr(bench, "run", fail)
    assert cli.main(["bench", "chaos", "--quick"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("parambox: error: bench chaos: the bad-run run exited 2") and "Traceback" not in err
