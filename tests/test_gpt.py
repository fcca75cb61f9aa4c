"""The zoo's transformer (``gpt``) and its byte-level corpus (``text``): sizes, causality, the corpus
and its split, the metrics, and a short run as a user types it."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys

import pytest
import torch

from parambox.data import load_dataset
from parambox.data.text import CONTEXT, split, stdlib_files, windows
from parambox.errors import UserError
from parambox.models import build_model, count_parameters
from parambox.models.gpt import build_gpt, gpt_with_mask_buffer
from parambox.workload.evaluate import evaluate
from parambox.workload.losses import sequence_loss
from tests.conftest import run_cli


def test_named_sizes_have_their_parameter_counts():
    counts = {name: count_parameters(build_model(name, (128,), 256)) for name in ("gpt", "gpt-6m", "gpt-25m")}
    # per block 12 w^2 + 13 w; embeddings 256 w + 128 w (positions); final LayerNorm 2 w; head tied
    assert counts == {"gpt": 1_040_768, "gpt-6m": 6_416_896, "gpt-25m": 25_416_704}


def test_forward_shape_and_byte_inputs():
    torch.manual_seed(0)
    model = build_model("gpt", (32,), 256)
    x = torch.randint(0, 256, (3, 32))
    out = model(x)
    assert out.shape == (3, 32, 256) and torch.isfinite(out).all()
    assert torch.equal(model(x.to(torch.uint8)), out)  # any integer dtype of byte ids goes in as it is
    assert model(x[:, :5]).shape == (3, 5, 256)  # shorter than the context: fine
    assert model[-1].weight is model[0].tok.weight  # the output layer is tied to the token embedding
    untied = build_gpt("gpt", context=32, tied=False)
    assert count_parameters(untied) == count_parameters(build_gpt("gpt", context=32)) + 256 * 128


@pytest.mark.parametrize("mask_buffer", [False, True])
def test_a_later_byte_does_not_change_earlier_logits(mask_buffer):
    torch.manual_seed(0)
    model = build_gpt("gpt", context=24, mask_buffer=mask_buffer).eval()
    x = torch.randint(0, 256, (2, 24))
    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_mask_buffer_is_the_same_function_with_a_minus_inf_buffer():
    torch.manual_seed(0)
    plain = build_gpt("gpt", context=16).eval()
    masked = build_gpt("gpt", context=16, mask_buffer=True).eval()
    missing, unexpected = masked.load_state_dict(plain.state_dict(), strict=False)
    assert unexpected == [] and missing == [f"{i}.mask" for i in range(1, 6)]
    assert torch.isinf(masked[1].mask).any()  # what a non-finite check on buffers must let through
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.allclose(plain(x), masked(x), atol=1e-5)
    factory = gpt_with_mask_buffer()  # --model parambox.models.gpt:gpt_with_mask_buffer --data text
    assert len(factory[0].pos) == CONTEXT and "1.mask" in factory.state_dict()


def test_pipeline_cuts_between_blocks():
    torch.manual_seed(0)
    model = build_model("gpt", (16,), 256).eval()
    kinds = [type(m).__name__ for m in model]
    assert kinds == ["Embedding"] + ["Block"] * 5 + ["Head"]
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.allclose(model[3:](model[:3](x)), model(x))


def test_gpt_refuses_image_data_and_image_models_refuse_text():
    from parambox.config import build_config
    from parambox.workload import build_workload

    with pytest.raises(UserError, match="model 'gpt' needs sequences of bytes.*--data text"):
        build_model("gpt", (1, 8, 8), 10)
    workload = build_workload(build_config({"model": "mlp", "data": "text"}))
    with pytest.raises(UserError, match="model 'mlp' does not read byte sequences: .* gpt, gpt-25m, gpt-6m"):
        workload.build_model()


def test_a_zoo_model_brings_its_data_set_and_strategies_their_sequence_defaults():
    from parambox.config import build_config
    from parambox.strategies.sandblaster.strategy import Sandblaster

    assert build_config({"model": "gpt"}).data == "text"  # the model's own data set
    assert build_config({"model": "lenet"}).data == "digits" and build_config({}).data == "digits"
    assert build_config({"model": "gpt", "data": "digits"}).data == "digits"  # the user's choice stands
    on_text = build_config({"strategy": "sandblaster", "model": "gpt"})
    on_digits = build_config({"strategy": "sandblaster"})
    assert (on_digits.batch_size, on_digits.steps) == (1438, 200)  # the whole digits training set
    sequence = Sandblaster.default_run_sequence
    assert (on_text.batch_size, on_text.steps) == (sequence["batch_size"], sequence["steps"])
    assert on_text.weight_decay == on_digits.weight_decay == 1e-3  # the rest of its default run
    given = build_config({"strategy": "sandblaster", "model": "gpt", "batch_size": 16})
    assert given.batch_size == 16 and given.steps == sequence["steps"]


def test_stdlib_corpus_is_deterministic_offline_and_split_disjoint(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the text corpus must not touch the network")

    monkeypatch.setattr(socket, "socket", no_network)
    a, b = load_dataset("text"), load_dataset("text", seed=7)  # the split does not follow the seed
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    assert a.input_shape == (CONTEXT,) and a.num_classes == 256 and a.sequence
    assert a.train_x.dtype == torch.int64 and len(a.test_x) == 256 and len(a.train_x) > 30_000
    assert torch.equal(a.train_x[0, 1:], a.train_y[0, :-1])  # the targets are the next bytes
    files = stdlib_files()
    assert files[0].name == "__future__.py" and not any("site-packages" in p.parts for p in files)
    assert bytes(a.train_x[0, :20].tolist()) == files[0].read_bytes()[:20]
    stream = torch.arange(4000) % 256
    train, test = split(stream, 8)  # 25 test windows (5 %) from the ends of 16 chunks: 1 each
    assert len(train) == len(test) == 16 and all(len(t) == 9 for t in test)
    assert torch.equal(torch.cat([p for pair in zip(train, test) for p in pair]), stream)  # disjoint, all


def test_user_text_folder_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"b" * 3000)
    (tmp_path / "a.txt").write_bytes(b"a" * 3000)
    (tmp_path / ".hidden").write_bytes(b"h" * 3000)
    ds = load_dataset("text", tmp_path)
    assert (
        bytes(ds.train_x[0].tolist()) == b"a" * CONTEXT and bytes(ds.train_y[-1].tolist()) == b"b" * CONTEXT
    )
    # 5 % of 6,000 bytes: 2 test windows, one from the end of each half (a's, then b's)
    assert [bytes(x.tolist()) for x in ds.test_x] == [b"a" * CONTEXT, b"b" * CONTEXT]
    assert len(ds.train_x) == 2 * ((3000 - CONTEXT - 1 - 1) // CONTEXT)
    (tmp_path / "short.txt").write_bytes(b"x" * 257)
    with pytest.raises(UserError, match="needs at least 258 bytes"):
        load_dataset("text", tmp_path / "short.txt")
    with pytest.raises(UserError, match="neither a file nor a folder"):
        load_dataset("text", tmp_path / "missing")


def test_windows_are_views_of_one_stream():
    stream = torch.arange(9, dtype=torch.uint8)
    x, y = windows(stream, 4)
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and y.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert x.untyped_storage().data_ptr() == stream.untyped_storage().data_ptr()


def test_metrics_are_bits_per_byte_and_perplexity():
    torch.manual_seed(0)
    model = build_gpt("gpt", context=8)
    batches = [(torch.randint(0, 256, (k, 8)), torch.randint(0, 256, (k, 8))) for k in (3, 5)]
    m = evaluate(model, batches, None, sequence_loss, "cpu")
    assert set(m) == {"test_loss", "test_bits_per_byte", "test_perplexity", "test_accuracy"}
    with torch.no_grad():
        mean = sum(len(x) * float(sequence_loss(model, (x, y))) for x, y in batches) / 8
    assert m["test_loss"] == pytest.approx(mean, rel=1e-6)
    assert m["test_bits_per_byte"] == pytest.approx(mean / math.log(2), rel=1e-6)
    assert m["test_perplexity"] == pytest.approx(math.exp(mean), rel=1e-6)
    assert 7.5 < m["test_bits_per_byte"] < 8.5  # an untrained model: about uniform over 256 bytes


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_trains_gpt_on_text_to_fewer_bits_per_byte(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--model", "gpt", "--data", "text", "--strategy", "allreduce", "--workers", "2"]
    run_cli(
        *args, "--steps", "30", "--batch-size", "4", "--eval-every", "0", "--no-progress", "--out", str(out)
    )
    s = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r["kind"] == "step")  # the loss of the step-0 weights
    assert first["step"] == 1 and first["loss"] / math.log(2) > 7.0
    assert s["final_test_bits_per_byte"] < first["loss"] / math.log(2) - 1.0
    assert s["final_test_perplexity"] == pytest.approx(math.exp(s["final_test_loss"]), rel=1e-9)
    assert s["final_test_bits_per_byte"] == pytest.approx(s["final_test_loss"] / math.log(2), rel=1e-9)


def test_bench_workbench_trains_gpt_on_text_with_the_plain_loss():
    import torch.nn.functional as F

    from parambox.bench.workbench import Workbench
    from parambox.bench.workers import random_batches

    assert Workbench.of("gpt-25m") == Workbench("gpt-25m", "text", 8)  # the model's own data set
    small = Workbench.of("gpt")
    assert small.size() == {"parameters": 1_040_768, "model_mb": pytest.approx(4.163, abs=0.001)}
    x, y = small.batches(0)[0]
    assert x.shape == (8, CONTEXT) and y.shape == (8 * CONTEXT,) and y.dtype == torch.int64
    flat = small.build()  # every setup's loss is cross_entropy(model(x), y): the per-byte mean
    with torch.no_grad():
        assert float(F.cross_entropy(flat(x), y)) == pytest.approx(
            float(sequence_loss(flat.model, (x, y.view(8, CONTEXT)))), rel=1e-6
        )
    assert not torch.equal(small.batches(1)[0][0], x)  # each rank its own batches
    cnn_x, cnn_y = Workbench.of().batches(1)[0]  # the CNN's figures keep their batches
    assert torch.equal(cnn_x, random_batches(1)[0][0]) and torch.equal(cnn_y, random_batches(1)[0][1])


def test_bench_defaults_on_text_aim_at_a_perplexity():
    from parambox.bench.defaults import Goal, unigram_perplexity

    goal = Goal.of("gpt", None)
    assert (goal.data, goal.metric, goal.lower_is_better) == ("text", "perplexity", True)
    assert goal.target == round(unigram_perplexity(load_dataset("text").train_y), 1)
    assert 10 < goal.target < 40 and goal.reached(goal.target - 1) and not goal.reached(goal.target + 1)
    assert goal.flags() == ["--model", "gpt", "--data", "text"]
    assert Goal.of(None, None).flags() == [] and Goal.of(None, None).reached(0.96)
    proc = run_cli("bench", "sync", "--model", "gpt", check=False)
    assert proc.returncode == 2 and "apply to bench cluster and defaults only" in proc.stderr
    # --data given: nothing else imports the zoo before the model's name is checked (a fresh process)
    code = "from parambox.bench.defaults import Goal; print(Goal.of('gpt', 'text').metric)"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0 and fresh.stdout.strip() == "perplexity", fresh.stderr


def test_a_pipeline_cut_between_the_tied_embedding_and_head_shares_that_one_weight():
    """The tied token embedding is held by the first stage (the embedding) and the last (the head): one
    shared parameter, named once; untied, or with both uses in one stage, none."""
    from parambox.models.gpt import build_gpt, gpt_untied
    from parambox.strategies.pipeline.stages import shared_parameters, stage_bounds

    tied = build_gpt("gpt", 16)
    assert shared_parameters(tied, stage_bounds([3], len(tied))) == [("0.tok.weight", (0, 1))]
    assert shared_parameters(tied, stage_bounds([2, 4], len(tied))) == [("0.tok.weight", (0, 2))]
    assert shared_parameters(tied, stage_bounds([], len(tied))) == []
    untied = gpt_untied()
    assert shared_parameters(untied, stage_bounds([3], len(untied))) == []
