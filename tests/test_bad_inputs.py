"""Tier (c), in-process: bad input anywhere on the command line is one line ``parambox: error: ...``, exit 2,
no traceback (issue 21's list, then more of the kind). No worker process is started: each ends in set-up."""

from __future__ import annotations

import json

import pytest

from parambox.cli import main
from tests.conftest import one_line

TRAIN = ["train", "--strategy", "single", "--steps", "2", "--eval-every", "0", "--no-progress"]

# (argv after TRAIN, a piece of the one line); {tmp} is the test's directory
ISSUE = [
    (["--config", "{tmp}"], "is a directory"),
    (["--config", "{tmp}/cluster3.toml"], "'cluster': expected a table"),
    (["--set", "cluster=3"], "'cluster': expected a table"),
    (["--set", "box=[1]"], "'box': expected a table"),
    (["--set", "options=5"], "'options': expected a table"),
    (["--out", "/proc/parambox-unwritable"], "cannot write the run directory"),
    (["--timeout", "inf"], "'timeout'"),
    (["--set", "easgd.taux=3"], "did you mean 'tau'?"),
]
MORE = [
    (["--lr", "nan"], "'lr'"),
    (["--lr", "inf"], "'lr'"),
    (["--momentum", "1"], "'momentum'"),
    (["--steps", "0"], "'steps'"),
    (["--timeout", "0"], "'timeout'"),
    (["--seed", "-1"], "'seed'"),
    (["--workers", "5000"], "'workers'"),
    (["--threads", "0"], "'threads'"),
    (["--set", "lr"], "expected key=value"),
    (["--set", "=3"], "expected key=value"),
    (["--set", "momentun=0.5"], "did you mean 'momentum'?"),
    (["--set", "easgd.tau=0"], "'easgd.tau'"),
    (["--set", "easgd.alpha=2"], "'easgd.alpha'"),
    (["--set", "easgd.alpha=0.1", "--set", "easgd.rho=1"], "alpha or rho"),
    (["--set", "diloco.asynchronous=maybe"], "'diloco.asynchronous'"),
    (["--set", "options={easgd=3}"], "'[easgd]': expected a table"),
    (["--set", "sandblaster.slow_worker=abc"], "RANK:FACTOR"),
    (["--set", "cluster.nodes=x"], "'cluster.nodes'"),
    (["--loss", "notaref"], "is no reference"),
    (["--model", "parambox_no_such_module:make"], "parambox_no_such_module"),
    (["--data", "{tmp}/missing.py:make"], "missing.py"),
    (["--config", "{tmp}/badtype.toml"], "'easgd.tau'"),
    (["--config", "{tmp}/stepz.toml"], "did you mean 'steps'?"),
    (["--resume", "--out", "{tmp}/empty"], "last.pt does not exist"),
    (["--out", "{tmp}/done"], "already holds a run"),
    (["--batch-size", "100000"], "training items"),
]


# Inputs found since (issue 53's "20 more of your own"): CLI values, config files, environment variables.
OWN = [
    (["--lr", "abc"], {}, "'lr'"),
    (["--steps", "-5"], {}, "'steps'"),
    (["--batch-size", "0"], {}, "'batch_size'"),
    (["--eval-every", "-1"], {}, "'eval_every'"),
    (["--strategy", ""], {}, "unknown strategy ''"),
    (["--set", "steps=abc"], {}, "'steps'"),
    (["--set", "lr="], {}, "'lr'"),
    (["--set", "steps=1e400"], {}, "'steps'"),
    (["--set", "box.backend=nvme"], {}, "'box.backend'"),
    (["--momentum", "-0.5"], {}, "'momentum'"),
    (["--max-restarts", "-1"], {}, "'max_restarts'"),
    (["--threads", "abc"], {}, "'threads'"),
    (["--seed", "1.5"], {}, "'seed'"),
    (["--loader-workers", "-1"], {}, "'loader_workers'"),
    (["--precision", "fp7"], {}, "'precision'"),
    (["--optimizer", ""], {}, "'optimizer'"),
    (["--config", "{tmp}/unfinished.toml"], {}, "is not valid TOML"),
    (["--config", "{tmp}/config.yaml"], {}, "is not valid TOML"),
    (["--config", "{tmp}/binary.toml"], {}, "is not valid TOML"),
    (["--config", "{tmp}/negative_tau.toml"], {}, "'easgd.tau'"),
    (["--config", "{tmp}/workers_two.toml"], {}, "'workers'"),
    (["--model", "{tmp}/nope.py:make"], {}, "does not exist"),
    (["--model", "{tmp}/bad_workload.py:missing_fn"], {}, "has no 'missing_fn'"),
    ([], {"PARAMBOX_DEVICE": "tpu"}, "PARAMBOX_DEVICE"),
    ([], {"PARAMBOX_FAULT": "0:1:kill:x"}, "RANK:STEP:KIND"),
    ([], {"PARAMBOX_FAULT": "-1:1:kill"}, "counts from 0"),  # before: silently nothing
    ([], {"PARAMBOX_FAULT": "9:1:kill"}, "no rank 9"),  # before: silently nothing
    ([], {"PARAMBOX_THREADS": "0"}, "PARAMBOX_THREADS"),
    ([], {"PARAMBOX_JOIN_FROM": "x"}, "PARAMBOX_JOIN_FROM"),  # before: a worker's traceback
]


def make_files(tmp_path):
    """The files the tables' ``{tmp}`` arguments name."""
    (tmp_path / "cluster3.toml").write_text("cluster = 3\n")
    (tmp_path / "badtype.toml").write_text('[easgd]\ntau = "four"\n')
    (tmp_path / "stepz.toml").write_text("stepz = 3\n")
    (tmp_path / "unfinished.toml").write_text("steps = \n")
    (tmp_path / "config.yaml").write_text("steps: 3\n")
    (tmp_path / "binary.toml").write_bytes(b"\x00\x01\xff")
    (tmp_path / "negative_tau.toml").write_text("[easgd]\ntau = -1\n")
    (tmp_path / "workers_two.toml").write_text('workers = "two"\n')
    (tmp_path / "bad_workload.py").write_text(BAD_WORKLOAD)
    (tmp_path / "done").mkdir(exist_ok=True)
    (tmp_path / "done" / "summary.json").write_text("{}")
    return tmp_path


@pytest.fixture
def files(tmp_path):
    return make_files(tmp_path)


@pytest.mark.parametrize("args,env,message", OWN)
def test_more_bad_train_input(args, env, message, files, capsys, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = [a.replace("{tmp}", str(files)) for a in args]
    assert main([*TRAIN, "--out", str(files / "run"), *args]) == 2
    assert message in one_line(capsys)


@pytest.mark.parametrize("args,message", ISSUE + MORE)
def test_bad_train_input(args, message, files, capsys):
    args = [a.replace("{tmp}", str(files)) for a in args]
    out = [] if "--out" in args else ["--out", str(files / "run")]
    assert main([*TRAIN, *out, *args]) == 2
    assert message in one_line(capsys)


def test_export_of_a_garbled_run(files, capsys):
    run = files / "garbled"
    run.mkdir()
    (run / "config.json").write_text("{garbled")
    assert main(["export", str(run), "--onnx", str(files / "m.onnx")]) == 2
    assert "garbled JSON" in one_line(capsys)
    (run / "config.json").write_text(json.dumps({"stepz": 3}))
    assert main(["export", str(run), "--onnx", str(files / "m.onnx")]) == 2
    assert "not a run's config" in one_line(capsys)


OTHER_COMMANDS = [
    (["bench", "defaults", "--seeds", "x"], "--seeds 'x'"),
    (["bench", "box", "--seeds", "0-1"], "bench defaults only"),
    (["bench", "defaults", "--strategies", "nope"], "unknown strategy 'nope'"),
    (["export", "/nonexistent-run", "--onnx", "m.onnx"], "does not exist"),
]


@pytest.mark.parametrize("argv,message", OTHER_COMMANDS)
def test_bad_input_of_other_commands(argv, message, capsys):
    assert main(argv) == 2
    assert message in one_line(capsys)


def test_dict_items_without_a_loss_name_the_default_loss(tmp_path, capsys):
    """Before: "'str' object has no attribute 'transpose'" (the default loss unpacked the dict's keys)."""
    ref = "tests.workloads.user_regression"
    argv = [*TRAIN, "--model", f"{ref}:make_model", "--data", f"{ref}:make_dict_data", "--out", str(tmp_path)]
    assert main([*argv, "--loader-workers", "0"]) == 2
    line = one_line(capsys)
    assert "default loss" in line and "(x, y)" in line and "--loss" in line and "'x', 'target'" in line


SLURM_FIELDS = [
    ("--job-name", "x\nrm -rf ~"),
    ("--partition", "gpu\n#SBATCH --exclusive"),
    ("--account", "a b"),
    ("--time", "01:00:00\r"),
    ("--script", "job\n.sbatch"),
]


@pytest.mark.parametrize("flag,value", SLURM_FIELDS)
def test_slurm_header_fields_are_one_token(flag, value, capsys):
    """Before: a newline in --job-name wrote a shell line into the batch script."""
    assert main(["slurm", flag, value, "--", "--strategy", "single"]) == 2
    line = one_line(capsys)
    assert flag in line and "control characters" in line


def test_export_runs_another_users_run_directory_only_with_trust(tmp_path, capsys):
    """A run directory names code (config.json's model/data/loss references): export says what it will
    import, and imports it from a directory someone else owns only with --trust."""
    import os

    from parambox.config import RunConfig

    run = tmp_path / "theirs"
    run.mkdir()
    ref = "tests.workloads.user_regression:make_model"
    cfg = RunConfig(model=ref, data="tests.workloads.user_regression:make_data", loss="x:y")
    (run / "config.json").write_text(json.dumps(cfg.model_dump()))
    argv = ["export", str(run), "--onnx", str(tmp_path / "m.onnx")]
    if os.geteuid() == 0:  # root can give the directory away; others test only the owner's path
        os.chown(run, 65534, -1)
        assert main(argv) == 2
        line = one_line(capsys)
        assert "--trust" in line and ref in line and "uid 65534" in line
        os.chown(run, 0, -1)
    assert main(argv) == 2  # ours: it says what it imports, then fails on the missing checkpoint
    err = capsys.readouterr().err
    assert f"export imports and runs model={ref}" in err and "Traceback" not in err


# Issue 53's audit: bad workloads the default loss met with a traceback, and environment variables that crashed.
BAD_WORKLOAD = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x), x


def pair_model():
    return Pair()


def linear():
    return nn.Linear(4, 3)


def no_parameters():
    return nn.Identity()


def frozen():
    return nn.Linear(4, 3).requires_grad_(False)


def data():
    return TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,))), None


def int_data():
    return TensorDataset(torch.randint(0, 5, (64, 4)), torch.randint(0, 3, (64,))), None


def wide_data():
    return TensorDataset(torch.randn(64, 7), torch.randint(0, 3, (64,))), None


def float_labels():
    return TensorDataset(torch.randn(64, 4), torch.randn(64, 5)), None


def constant_loss(model, batch):
    return torch.tensor(1.0)


def detached_loss(model, batch):
    return model(batch[0]).pow(2).mean().detach()


def vector_loss(model, batch):
    return model(batch[0]).pow(2).mean(dim=1)


def not_a_module():
    return 3


def raises():
    raise ValueError("my factory is broken")


def none_model():
    return None


def needs_width(width):
    return nn.Linear(width, 3)


NOT_CALLABLE = 5


def train_only():
    return TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))


def empty():
    return TensorDataset(torch.randn(0, 4), torch.randint(0, 3, (0,))), None


def test_set_only():
    return None, TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))


def labels_out_of_range():
    return TensorDataset(torch.randn(64, 4), torch.randint(5, 9, (64,))), None


def triples():
    return TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)), torch.randn(64)), None


def float_loss(model, batch):
    return 1.0


def one_argument_loss(model):
    return model.weight.sum()


def integer_loss(model, batch):
    return torch.tensor(3)
"""

WORKLOADS = [
    ({"model": "pair_model"}, ["model Pair returned a tuple", "--loss"]),
    ({"data": "int_data"}, ["default loss", "must have the same dtype"]),
    ({"data": "wide_data"}, ["default loss", "shapes cannot be multiplied"]),
    ({"data": "float_labels"}, ["default loss", "first step"]),
    ({"loss": "constant_loss"}, ["loss constant_loss", "does not depend on the model's parameters"]),
    ({"loss": "detached_loss"}, ["loss detached_loss", "does not depend on the model's parameters"]),
    ({"loss": "vector_loss"}, ["loss vector_loss", "not a scalar"]),
    ({"model": "no_parameters"}, ["model factory no_parameters", "no trainable parameters"]),
    ({"model": "frozen"}, ["model factory frozen", "no trainable parameters"]),
    # issue 53's "20 more of your own"
    ({"model": "not_a_module"}, ["model factory not_a_module returned a int"]),
    ({"model": "raises"}, ["model factory raises raised ValueError: my factory is broken"]),
    ({"model": "none_model"}, ["returned a NoneType, not a torch.nn.Module"]),
    ({"model": "needs_width"}, ["model factory needs_width raised TypeError"]),
    ({"model": "NOT_CALLABLE"}, ["is a int, not callable"]),
    ({"data": "train_only"}, ["data factory train_only returned a TensorDataset", "(train, test)"]),
    ({"data": "empty"}, ["data factory empty: the training set is empty"]),
    (
        {"data": "test_set_only"},
        ["data factory test_set_only returned no training set"],
    ),  # before: a traceback
    ({"data": "labels_out_of_range"}, ["default loss", "out of bounds"]),
    ({"data": "triples"}, ["default loss", "a list of 3 items"]),
    ({"loss": "float_loss"}, ["loss float_loss returned a float, not a scalar tensor"]),
    ({"loss": "one_argument_loss"}, ["loss one_argument_loss raised TypeError"]),
    ({"loss": "integer_loss"}, ["loss integer_loss does not depend on the model's parameters"]),
]


@pytest.mark.parametrize(
    "fields,pieces", WORKLOADS, ids=lambda v: "-".join(v.values()) if isinstance(v, dict) else ""
)
def test_bad_workloads_are_one_line(fields, pieces, tmp_path, capsys):
    """Before: exit 1 and a traceback (but for the vector loss): the default loss was not checked, nor
    a loss's gradient, nor a model's parameters."""
    module = tmp_path / "bad_workload.py"
    module.write_text(BAD_WORKLOAD)
    named = {"model": "linear", "data": "data"} | fields
    argv = [a for f, fn in named.items() for a in (f"--{f}", f"{module}:{fn}")]
    assert main([*TRAIN, *argv, "--loader-workers", "0", "--out", str(tmp_path / "run")]) == 2
    line = one_line(capsys)
    assert all(p in line for p in pieces), line


ENVIRONMENT = [
    ("PARAMBOX_FAULT", "garbage", "RANK:STEP:KIND"),
    ("PARAMBOX_FAULT", "0:x:nan", "RANK:STEP:KIND"),
    ("PARAMBOX_FAULT", "0:1:bogus", "'bogus'"),
    ("PARAMBOX_FAULT", "0:1:partition=x", "partition=SECONDS"),
    ("PARAMBOX_THREADS", "abc", "a positive integer"),
    ("PARAMBOX_THREADS", "-3", "a positive integer"),
    ("PARAMBOX_LIFE", "x", "PARAMBOX_LIFE"),
    ("PARAMBOX_STRATEGIES", "garbage", "name=module:Class"),
    ("PARAMBOX_STRATEGIES", "toy=nomodule", "name=module:Class"),
]


@pytest.mark.parametrize("name,value,piece", ENVIRONMENT)
def test_bad_environment_variables_are_one_line(name, value, piece, tmp_path, capsys, monkeypatch):
    """Before: exit 1 with a traceback (``ValueError: invalid literal for int()``, ``not enough values
    to unpack``), or, for an unknown fault, silently ignored."""
    monkeypatch.setenv(name, value)
    assert main([*TRAIN, "--out", str(tmp_path / "run")]) == 2
    line = one_line(capsys)
    assert name in line and piece in line, line


LAUNCHER_VARIABLES = [("LOCAL_RANK", "z"), ("WORLD_SIZE", "two"), ("MASTER_PORT", "99999")]
TORCHRUN_RANK_0 = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("name,value", LAUNCHER_VARIABLES)
def test_a_bad_launcher_variable_is_one_line(name, value, tmp_path, capsys, monkeypatch):
    """Before: ``ValueError: invalid literal for int()``, a traceback and exit 1, from torchrun's
    variables (the rest of its environment is a valid rank 0 of 2)."""
    for key, good in TORCHRUN_RANK_0.items():
        monkeypatch.setenv(key, good)
    monkeypatch.setenv(name, value)
    assert main([*TRAIN, "--out", str(tmp_path / "run")]) == 2
    assert name in one_line(capsys)


SEEDS = [2**60 + 1, 2**64 + 1]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_seed_too_large_for_torch_is_one_line(seed, tmp_path, capsys):
    """Before: ``ValueError: Overflow when unpacking long long`` from ``torch.manual_seed``."""
    assert main([*TRAIN, "--seed", str(seed), "--out", str(tmp_path / "run")]) == 2
    assert "'seed'" in one_line(capsys)


def test_the_largest_seed_trains(tmp_path):
    from parambox.run.plan import MAX_SEED

    assert main([*TRAIN, "--seed", str(MAX_SEED), "--out", str(tmp_path / "run")]) == 0
