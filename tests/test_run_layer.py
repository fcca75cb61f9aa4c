"""The run layer under both entry points: the import order, the result a caller holds, the checks made
before any process starts, messages in the caller's language, a resume that continues the recorded
run, a strategy added through the registry alone, and a user's metric name."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import parambox
from parambox import cli
from parambox.strategies import STRATEGIES, USER_STRATEGIES_ENV, register
from parambox.training import checkpoint
from tests.workloads import user_regression as user

ROOT = Path(__file__).resolve().parents[1]
QUIET = {"progress": False, "eval_every": 0, "threads": 1}
TOP = {"commands", "api", "cli"}  # the entry points: nothing below them imports them


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_no_module_below_the_entry_points_imports_them():
    below = [
        p
        for p in (ROOT / "parambox").rglob("*.py")
        if p.relative_to(ROOT / "parambox").parts[0]
        not in {"commands", "api", "cli.py", "__init__.py", "__main__.py"}
    ]
    bad = {
        str(p.relative_to(ROOT)): sorted(
            m for m in _imports(p) if m.split(".")[:2] in (["parambox", t] for t in TOP)
        )
        for p in below
    }
    assert not {k: v for k, v in bad.items() if v}
    # ... and workload/ no longer reaches up into training/ (its default loss lives in workload/losses.py)
    workload = [m for p in (ROOT / "parambox" / "workload").rglob("*.py") for m in _imports(p)]
    assert not [m for m in workload if m.startswith("parambox.training")]


# -- the result --------------------------------------------------------------------------------------


def test_result_holds_the_summary_and_the_trained_model(tmp_path):
    out = tmp_path / "r"
    result = parambox.train(
        model=user.make_model,
        data=user.make_data,
        loss=user.mse,
        metrics=user.regression_metrics,
        strategy="single",
        steps=20,
        batch_size=16,
        lr=0.05,
        out=str(out),
        **QUIET,
    )
    assert isinstance(result, dict) and result["steps"] == 20 == result.steps  # the summary, as before
    assert result == json.loads((out / "summary.json").read_text())
    x = torch.randn(5, 4)
    expected = user.make_model()
    expected.load_state_dict(checkpoint.load(out / "checkpoints" / "last.pt")["model"])
    with torch.no_grad():
        assert torch.equal(result.model(x), expected.eval()(x))
    with pytest.raises(AttributeError, match="no field 'nope'"):
        _ = result.nope


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_result_model_on_every_rank_under_torchrun(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        import parambox
        from parambox.training import checkpoint
        from tests.workloads import user_regression as user
        if __name__ == "__main__":
            r = parambox.train(model=user.make_model, data=user.make_data, loss=user.mse,
                               metrics=user.regression_metrics, strategy="allreduce", steps=10,
                               batch_size=8, out={str(tmp_path / "run")!r}, progress=False, eval_every=0)
            m = user.make_model()
            m.load_state_dict(checkpoint.load(r.run_dir / "checkpoints" / "last.pt")["model"])
            x = torch.randn(3, 4)
            same = torch.equal(r.model(x), m.eval()(x))
            sys.stdout.write(f"rank-ok {{r['steps']}} {{same}}\\n")  # one write: a whole line (print
            sys.stdout.flush()  # writes its pieces one by one unbuffered, and two ranks' lines mixed)
    """)
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--log-dir",
        str(tmp_path / "torchrun"),
        "--nproc-per-node",
        "2",
        str(script),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(proc.stdout.splitlines()) == ["rank-ok 10 True"] * 2, proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_workers_see_the_callers_sys_path(tmp_path):
    """A script's ``sys.path.insert(...)`` then an import from there: the spawned workers import it too."""
    lib = tmp_path / "mylib"
    lib.mkdir()
    (lib / "my_models.py").write_text("import torch\ndef make():\n    return torch.nn.Linear(4, 1)\n")
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        sys.path.insert(0, {str(lib)!r})
        import parambox, my_models
        from tests.workloads import user_regression as user
        if __name__ == "__main__":
            r = parambox.train(model=my_models.make, data=user.make_data, loss=user.mse,
                               metrics=user.regression_metrics, workers=2, steps=5, batch_size=8,
                               out={str(tmp_path / "run")!r}, progress=False, eval_every=0)
            print("done", r.steps)
    """)
    )
    from parambox.runtime import zygote

    env = {**os.environ, **zygote.shared_env()}  # the workers fork from this session's zygote
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=220, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done 5" in proc.stdout


# -- checks before any process starts, in the caller's language --------------------------------------


@pytest.mark.parametrize(
    "strategy,workers,options,message",
    [
        ("hybrid", 3, {"group_size": 2}, "group_size=2 must divide the number of workers \\(3\\)"),
        ("pipeline-dp", 3, None, "num_stages=2 must divide the number of workers \\(3\\)"),
        ("pipeline", 1, None, "needs at least 2 workers"),
        ("single", 2, None, "runs one process, not 2"),
    ],
)
def test_a_worker_count_the_strategy_cannot_take_is_refused_before_any_process(
    strategy, workers, options, message, tmp_path
):
    with pytest.raises(parambox.UserError, match=message):
        parambox.train(strategy=strategy, workers=workers, options=options, out=str(tmp_path / "r"), **QUIET)
    assert not (tmp_path / "r").exists()  # nothing written, nothing started


def test_an_existing_run_directory_speaks_the_callers_language(tmp_path, capsys):
    out = str(tmp_path / "r")
    parambox.train(strategy="single", steps=2, out=out, **QUIET)
    with pytest.raises(parambox.UserError, match=r"pass resume=True to continue it, or another out=\.\.\."):
        parambox.train(strategy="single", steps=2, out=out, **QUIET)
    assert cli.main(["train", "--strategy", "single", "--steps", "2", "--out", out, "--no-progress"]) == 2
    assert "pass --resume to continue it, or another --out OUT" in capsys.readouterr().err


def test_resume_continues_the_recorded_run_and_refuses_a_changed_flag(tmp_path, capsys):
    out = str(tmp_path / "r")
    args = ["train", "--strategy", "single", "--model", "mlp", "--lr", "0.05", "--out", out, "--no-progress"]
    assert cli.main([*args, "--steps", "6", "--eval-every", "0"]) == 0
    # The README's form: --out and --resume alone continue the recorded strategy, model and rate.
    assert cli.main(["train", "--out", out, "--resume", "--steps", "9", "--no-progress"]) == 0
    summary = json.loads((Path(out) / "summary.json").read_text())
    assert (summary["strategy"], summary["model"], summary["lr"], summary["steps"]) == (
        "single",
        "mlp",
        0.05,
        9,
    )
    capsys.readouterr()
    assert cli.main(["train", "--out", out, "--resume", "--lr", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "--lr 0.1 differs from the recorded 0.05" in err and err.count("\n") == 1
    with pytest.raises(parambox.UserError, match="model='lenet' differs from the recorded 'mlp'"):
        parambox.train(model="lenet", out=out, resume=True, **QUIET)


# -- a strategy of one's own, through the registry alone ----------------------------------------------


@pytest.fixture
def toy_strategy(tmp_path, monkeypatch):
    (tmp_path / "toy_strategy.py").write_text(
        textwrap.dedent("""
        from parambox.strategies.allreduce import AllReduce

        class Toy(AllReduce):
            name = "toy"
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(STRATEGIES, "toy", "toy_strategy:Toy")  # restored after the test
    monkeypatch.setenv(USER_STRATEGIES_ENV, "")
    register("toy", "toy_strategy:Toy")
    return "toy"


def test_a_registered_strategy_reaches_distributed_optimizer_pick_and_the_accuracy_study(toy_strategy):
    from parambox.studies.accuracy import plan
    from parambox.studies.pick.candidates import registry_candidates

    model = torch.nn.Linear(4, 1)
    opt = parambox.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="toy")
    opt.zero_grad()
    loss = model(torch.ones(2, 4)).sum()
    loss.backward()
    opt.step(loss=loss)
    assert opt.last_result.loss == pytest.approx(float(loss.detach()))  # the user's loop sees its loss
    opt.close()
    assert [c.strategy for c in registry_candidates(2, ["toy"])] == ["toy"]
    runs = plan({"workers": 2, "lr": 0.03, "steps": 5}, ["toy"], [None], [0], 1)
    assert runs[0].config["strategy"] == "toy"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_registered_strategy_trains_from_the_cli_with_spawned_workers(toy_strategy, tmp_path, capsys):
    out = tmp_path / "run"
    args = [
        "train",
        "--strategy",
        "toy",
        "--workers",
        "2",
        "--steps",
        "4",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert cli.main([*args, "--eval-every", "0", "--threads", "1"]) == 0, capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["strategy"] == "toy"


# -- a user's metric name ------------------------------------------------------------------------------


def test_target_metric_names_the_users_metric_in_report(tmp_path):
    from parambox.report import load_run
    from parambox.report.page import summary_rows

    out = tmp_path / "r"
    parambox.train(
        model=user.make_model,
        data=user.make_data,
        loss=user.mse,
        metrics=user.regression_metrics,
        strategy="single",
        steps=5,
        batch_size=16,
        out=str(out),
        target_metric="mse",
        **QUIET,
    )
    header, rows = summary_rows([load_run(out)])
    assert "final test mse" in header
    assert rows[0][header.index("final test mse")] not in ("-", "")


@pytest.mark.parametrize(
    "data, cluster, fetched", [("mnist", True, 1), ("mnist", False, 0), ("digits", True, 0)]
)
def test_mnist_is_fetched_before_an_emulated_cluster_starts(monkeypatch, data, cluster, fetched):
    """An emulated node has no network: a run on one fetches MNIST on the host first (it failed in
    every worker with pip's "No matching distribution" before)."""
    import parambox.data.mnist as mnist
    import parambox.runtime.launcher as launcher
    from parambox.run import execute
    from parambox.run.plan import CLI, Plan, build
    from parambox.runtime.world import World
    from parambox.strategies import strategy_class

    calls = []
    monkeypatch.setattr(mnist, "fetch_mnist", lambda: calls.append("fetch"))
    monkeypatch.setattr(launcher, "launch_local", lambda *a, **k: calls.append("launch"))
    cfg = build({"strategy": "allreduce", "data": data, **({"cluster": {"nodes": 2}} if cluster else {})})
    execute._launch_local(Plan(cfg, strategy_class("allreduce"), World(), CLI, False), Path("/nonexistent"))
    assert calls == ["fetch"] * fetched + ["launch"]


@pytest.mark.parametrize(
    "box, windows",
    [({"backend": "rma", "server": False}, True), ({"backend": "rma"}, False), ({"backend": "shm"}, False)],
)
def test_only_a_run_with_mpi_windows_across_nodes_gets_open_mpis_progress_thread(monkeypatch, box, windows):
    """The memory server (the rma box's default across nodes) progresses its own messages; MPI's
    windows across nodes (``box.server=false``) need Open MPI's TCP progress thread to be served."""
    import parambox.runtime.launcher as launcher
    from parambox.run import execute
    from parambox.run.plan import CLI, Plan, build
    from parambox.runtime.world import World
    from parambox.strategies import strategy_class

    seen = {}
    monkeypatch.setattr(launcher, "launch_local", lambda *a, **k: seen.update(k))
    cfg = build({"strategy": "easgd", "box": box, "cluster": {"nodes": 2}})
    execute._launch_local(Plan(cfg, strategy_class("easgd"), World(), CLI, False), Path("/nonexistent"))
    assert seen["mpi_windows"] is windows
