"""The library API in one process: references, the public names, config errors, a user's data through
the loader, test-set metrics, and each bad input answered by a UserError naming the function."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset, default_collate

import parambox
from parambox.data.base import GlobalBatchSampler
from parambox.runtime import scratch
from parambox.workload import loader, refs
from parambox.workload.evaluate import evaluate
from parambox.workload.loader import LoaderSource
from parambox.workload.losses import default_loss
from parambox.workload.workload import CheckedLoss
from tests.workloads import user_regression as user

WORKLOAD = user.__file__
QUIET = {"progress": False, "eval_every": 0, "threads": 1}


# -- public names -----------------------------------------------------------------------------------


def test_public_api():
    assert issubclass(parambox.UserError, ValueError)
    assert "easgd" in parambox.STRATEGIES and "single" in parambox.STRATEGIES
    assert callable(parambox.train)
    assert {"train", "UserError", "STRATEGIES"} <= set(dir(parambox))


def test_import_parambox_is_light():
    code = "import sys, parambox; print('torch' in sys.modules, 'pydantic' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# -- references -------------------------------------------------------------------------------------


def test_reference_of_module_function_and_class():
    assert refs.reference_of(user.make_model) == "tests.workloads.user_regression:make_model"
    assert refs.reference_of(user.Net) == "tests.workloads.user_regression:Net"
    assert refs.resolve("tests.workloads.user_regression:Net") is user.Net


def test_lambda_and_closure_cannot_reach_workers():
    with pytest.raises(parambox.UserError, match="lambda or a function defined inside"):
        refs.reference_of(lambda: nn.Linear(1, 1), "model")

    def local():
        return nn.Linear(1, 1)

    with pytest.raises(parambox.UserError, match="model 'test_lambda.*local'.*module level"):
        refs.reference_of(local, "model")


def test_resolve_file_reference(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("def fn():\n    return 7\nif __name__ == '__main__':\n    raise SystemExit('ran main')\n")
    assert refs.resolve(f"{f}:fn", "model")() == 7
    assert refs.absolute("mine.py:fn").endswith("/mine.py:fn")


@pytest.mark.parametrize(
    "ref,message",
    [
        ("no_such_module_xyz:fn", "no module named 'no_such_module_xyz'"),
        ("tests.workloads.user_regression:nothing", "has no 'nothing'"),
        ("tests.workloads.user_regression:VOCAB", "is a int, not callable"),
        ("/no/such/file.py:fn", "file /no/such/file.py does not exist"),
        ("<in-process>:make", "function of the process that started the run"),
    ],
)
def test_bad_references_name_themselves(ref, message):
    with pytest.raises(parambox.UserError, match=message) as e:
        refs.resolve(ref, "model")
    assert str(e.value).startswith(f"model {ref!r}") and "\n" not in str(e.value)


# -- config errors from Python ----------------------------------------------------------------------


def test_bad_field_names_it():
    with pytest.raises(parambox.UserError, match="config field 'steps'"):
        parambox.train(model="mlp", steps=0)
    with pytest.raises(parambox.UserError, match="config field 'no_such_field'"):
        parambox.train(model="mlp", no_such_field=1)
    with pytest.raises(parambox.UserError, match="config field 'options.easgd.tau'|tau"):
        parambox.train(model="mlp", strategy="easgd", options={"tau": 0})


def test_lambda_with_spawned_workers_is_one_line(tmp_path):
    with pytest.raises(parambox.UserError, match="cannot reach worker processes") as e:
        parambox.train(model=lambda: nn.Linear(64, 10), workers=2, out=str(tmp_path / "r"), **QUIET)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


# -- in-process runs (one worker: any callable works) ------------------------------------------------


def test_one_worker_in_process_with_lambdas(tmp_path):
    summary = parambox.train(
        model=lambda: user.Net(),
        data=user.make_data,
        loss=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(),
        metrics=user.regression_metrics,
        strategy="single",
        workers=1,
        steps=30,
        batch_size=32,
        lr=0.05,
        out=str(tmp_path / "r"),
        **QUIET,
    )
    assert summary["final_test_mse"] == pytest.approx(summary["final_test_loss"], rel=1e-5)
    assert "final_test_accuracy" not in summary and summary["final_test_mae"] > 0
    assert summary["model"] == "<in-process>:test_one_worker_in_process_with_lambdas.<locals>.<lambda>"


def test_zoo_model_on_a_user_dataset_needs_num_classes(tmp_path):
    with pytest.raises(parambox.UserError, match="num_classes attribute"):
        parambox.train(model="mlp", data=user.make_data, strategy="single", workers=1, steps=1, **QUIET)


BAD = [
    ({"model": user.model_raises}, "model factory model_raises raised RuntimeError: no GPU memory"),
    (
        {"model": user.model_wrong_type},
        "model factory model_wrong_type returned a str, not a torch.nn.Module",
    ),
    ({"loss": user.loss_vector}, r"loss loss_vector returned a tensor of shape \(32, 1\), not a scalar"),
    ({"loss": user.loss_nan}, "loss loss_nan is nan on the first step"),
    ({"data": user.data_ragged}, "data data_ragged: items cannot be batched by default_collate"),
    ({"batch_size": 300}, "batch_size 300 is more than the 256 training items of data make_data"),
    ({"data": lambda: [1, 2, 3]}, "returned a list; expected \\(train, test\\)"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_input_from_python(change, message, tmp_path):
    args = {"model": user.make_model, "data": user.make_data, "loss": user.mse, "batch_size": 32, **change}
    with pytest.raises(parambox.UserError, match=message) as e:
        parambox.train(strategy="single", workers=1, steps=2, out=str(tmp_path / "r"), **args, **QUIET)
    assert "\n" not in str(e.value)
    assert "Traceback" in (tmp_path / "r" / "logs" / "rank0.err").read_text()  # the traceback: in the log


# -- the loader: the global batch whatever the workers, resumable, background workers -------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_follows_the_global_batch_sampler(num_workers):
    ds = TensorDataset(torch.arange(40).float()[:, None], torch.arange(40))
    sampler = GlobalBatchSampler(40, 4, 1, 2, seed=3)
    src = LoaderSource(ds, sampler, default_collate, "ds", num_workers)
    try:
        got = [src.batch(t)[1] for t in range(12)]  # 12 steps of 8 cross two epochs
        resumed = src.batch(7)[1]  # a jump (resume): restarts at step 7
    finally:
        src.close()
        loader.remove_scratch()
    for t, y in enumerate(got):
        assert torch.equal(y, sampler.indices(t))
    assert torch.equal(resumed, sampler.indices(7))


def _tree(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)).split("/")[0] + ("/" if p.is_dir() else "") for p in root.iterdir()
    )


def test_loaders_make_their_temporary_files_in_a_scratch_folder_removed_at_the_end(short_tmp, monkeypatch):
    """The loader processes' pymp-* folder (multiprocessing's, for handing over the batches' shared
    memory) lands inside the rank's scratch folder, which goes when the run's loaders are stopped."""
    tmp_path = short_tmp
    loader.remove_scratch()  # one made by an earlier test in this process, elsewhere
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ds = TensorDataset(torch.arange(40).float()[:, None], torch.arange(40))
    src = LoaderSource(ds, GlobalBatchSampler(40, 4, 0, 1, seed=0), default_collate, "ds", 2)
    try:
        for t in range(4):
            src.batch(t)
        (folder,) = tmp_path.iterdir()  # nothing else in the temporary directory
        assert folder.name.startswith(loader.SCRATCH_PREFIX)
        assert any(p.name.startswith("pymp-") for p in folder.iterdir())
    finally:
        src.close()
        loader.remove_scratch()
    assert list(tmp_path.iterdir()) == []


_KILLED_MAKER = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    from torch.utils.data import TensorDataset, default_collate
    from parambox.data.base import GlobalBatchSampler
    from parambox.workload.loader import LoaderSource
    ds = TensorDataset(torch.arange(40).float()[:, None], torch.arange(40))
    src = LoaderSource(ds, GlobalBatchSampler(40, 4, 0, 1, seed=0), default_collate, "ds", 2)
    for t in range(4):
        src.batch(t)
    print(os.listdir(os.environ["TMPDIR"]), flush=True)
    time.sleep(1.0)  # the loaders' prefetch full: none is inside torch's shared-memory allocation,
    # where a SIGKILL leaves its /dev/shm/torch_* file (the microseconds between creating and unlinking it)
    os.killpg(0, signal.SIGKILL) if sys.argv[1] == "group" else os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _kill_a_maker(tmp_path: Path, who: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_MAKER, who],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        start_new_session=True,  # its own process group: "group" kills it and its loaders
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9 and loader.SCRATCH_PREFIX in proc.stdout, proc.stderr[-2000:]


@pytest.mark.timeout(120)
def test_a_killed_ranks_loaders_remove_its_scratch_folder_when_they_end(short_tmp):
    """The rank is SIGKILLed (no exit handlers), its loaders live on: they notice (every 5 s) and
    end, and the last of them removes the folder."""
    tmp_path = short_tmp
    _kill_a_maker(tmp_path, "self")
    deadline = time.monotonic() + 30
    while list(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
def test_a_scratch_folder_whose_rank_and_loaders_were_killed_is_swept_by_the_next(short_tmp, monkeypatch):
    """All of them SIGKILLed: the folder stays, its lock free, until the next parambox process on the
    machine makes or removes a scratch folder; a live process's folder is left alone."""
    tmp_path = short_tmp
    _kill_a_maker(tmp_path, "group")
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(loader.SCRATCH_PREFIX)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    loader.remove_scratch()
    try:
        mine = loader.scratch_dir()  # sweeps first, then makes (and locks) this process's own
        assert _tree(tmp_path) == [Path(mine).name + "/"]
        scratch.sweep(loader.SCRATCH_PREFIX)  # held: stays
        assert Path(mine).is_dir()
    finally:
        loader.remove_scratch()
    assert list(tmp_path.iterdir()) == []


def test_no_scratch_folder_where_the_temporary_directory_is_too_long_for_one(monkeypatch):
    long = "/tmp/" + "d" * (loader._LONGEST_SCRATCH - 8)
    monkeypatch.setattr(tempfile, "tempdir", long)  # never made: nothing is created there
    loader.remove_scratch()
    assert loader.scratch_dir() is None


# -- metrics --------------------------------------------------------------------------------------


def test_metrics_are_weighted_by_batch_size():
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    batches = [(torch.ones(3, 1), torch.full((3, 1), 2.0)), (torch.ones(1, 1), torch.full((1, 1), 6.0))]
    out = evaluate(model, batches, user.regression_metrics, user.mse, "cpu")
    assert out["test_mse"] == pytest.approx((3 * 4 + 36) / 4)
    assert out["test_mae"] == pytest.approx((3 * 2 + 6) / 4)
    assert out["test_loss"] == pytest.approx(out["test_mse"])  # always there: the run's loss


def test_default_metrics_accuracy_only_for_class_logits():
    clf = nn.Linear(2, 3)
    x, y = torch.randn(5, 2), torch.randint(0, 3, (5,))
    assert set(evaluate(clf, [(x, y)], None, default_loss, "cpu")) == {"test_loss", "test_accuracy"}
    custom = CheckedLoss(lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), "ce")
    assert set(evaluate(clf, [(x, y)], None, custom, "cpu")) == {"test_loss", "test_accuracy"}
    reg = nn.Linear(2, 1)
    assert set(evaluate(reg, [(x, torch.randn(5, 1))], None, user.mse, "cpu")) == {"test_loss"}


class DictItems(torch.utils.data.Dataset):
    """Items as dicts, and a num_classes attribute (so a zoo model fits it)."""

    num_classes = 3

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(n)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"features": self.x[i], "label": self.y[i]}


def dict_data():
    return DictItems(96), DictItems(32)


def dict_loss(model, batch):
    return nn.functional.cross_entropy(model(batch["features"]), batch["label"])


def test_dict_items_and_a_zoo_model_on_user_data(tmp_path):
    summary = parambox.train(
        model="logreg", data=dict_data, loss=dict_loss, strategy="single", workers=1, steps=5, batch_size=8,
        out=str(tmp_path / "r"), **QUIET,
    )  # fmt: skip
    assert summary["final_test_loss"] > 0 and "final_test_accuracy" not in summary  # dict batches: loss only
    weights = torch.load(tmp_path / "r" / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert [tuple(w.shape) for w in weights.values()] == [(3, 6), (3,)]  # 6 features -> 3 classes
