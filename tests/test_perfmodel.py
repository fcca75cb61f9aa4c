"""``parambox predict``: closed forms of each topology, T_comp interpolation, n_peak, the CLI's JSON/files."""

from __future__ import annotations

import json
import math

import pytest
import torch

from parambox.cli import main
from parambox.errors import UserError
from parambox.perfmodel import ComputeProfile, Network, comm_time_s, parse_topologies, predict_curve
from parambox.perfmodel.compute import batch_sizes_to_measure, clamp_noise, parse_comp_table
from parambox.perfmodel.measure import Validation, network_from_probe
from parambox.perfmodel.scaling import iteration_time_s

S = 1e9  # bytes
NET = Network(bandwidth=1e9, latency=1e-5, servers=4)  # 1 GB/s, 10 us; box bandwidth 4 GB/s by default
A = 1e-5


@pytest.mark.parametrize(
    "topology, n, expected",
    [
        ("ring", 1, 0.0),
        ("ring", 4, 2 * 3 / 4 + 2 * 3 * A),
        ("ring", 1024, 2 * 1023 / 1024 + 2 * 1023 * A),
        ("tree", 1, 0.0),
        ("tree", 8, 2 * 3 + 2 * 3 * A),
        ("ps", 1, 2 + 2 * A),
        ("ps", 8, 16 + 2 * A),
        ("ps-sharded", 2, 2 + 2 * A),  # fewer workers than servers: the worker's own link bounds it
        ("ps-sharded", 16, 2 * 16 / 4 + 2 * A),
        ("box", 1, 2 + 2 * A),
        ("box", 8, 2 + 2 * 7 / 4 + 2 * A),
    ],
)
def test_comm_closed_forms(topology, n, expected):
    assert comm_time_s(topology, n, S, NET) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_network_units_and_box_bandwidth():
    net = Network.from_gbps(10, latency_us=5, servers=2, box_gbps=80)
    assert net.bandwidth == 1.25e9 and net.latency == pytest.approx(5e-6) and net.box_bw == 1e10
    assert Network.from_gbps(10, servers=3).box_bw == 3 * 1.25e9
    assert comm_time_s("box", 5, 1e10, net) == pytest.approx(2 * 8 + 2 * 4 * 1.0 + 2 * 5e-6)
    with pytest.raises(UserError, match="bandwidth"):
        Network.from_gbps(0)


def test_parse_topologies():
    assert parse_topologies("all") == ["ring", "tree", "ps", "ps-sharded", "box"]
    assert parse_topologies("box, ring,box") == ["box", "ring"]
    with pytest.raises(UserError, match="allgather"):
        parse_topologies("ring,allgather")


def test_compute_profile_interpolates_in_log_space():
    p = ComputeProfile({2: 0.004, 8: 0.016, 32: 0.032})
    assert p.time_s(4) == pytest.approx(0.008)  # exact power law between 2 and 8
    assert p.time_s(16) == pytest.approx(math.sqrt(0.016 * 0.032))  # geometric mean at the log midpoint
    assert p.time_s(128) == pytest.approx(0.128)  # linear above the largest batch
    assert p.time_s(1) == pytest.approx(0.002)  # first segment's slope (1) continued below
    assert ComputeProfile({2: 0.01, 4: 0.005}).time_s(1) == pytest.approx(0.01)  # slope clamped at 0
    assert ComputeProfile.per_sample(0.5).time_s(64) == pytest.approx(0.032)
    assert parse_comp_table("1:2.5,64:30").seconds_by_batch == {1: 0.0025, 64: 0.03}
    assert clamp_noise({1: 0.005, 2: 0.004, 4: 0.006}) == {1: 0.004, 2: 0.004, 4: 0.006}
    assert clamp_noise({1: 0.002, 2: 0.003, 4: 0.009}) == {1: 0.002, 2: 0.003, 4: 0.006}  # per sample
    with pytest.raises(UserError, match="BATCH:MS"):
        parse_comp_table("1=2")


def test_batch_sizes_to_measure():
    needed = [1024 / n for n in (1, 2, 4, 8, 1024)] + [96, 48]
    assert batch_sizes_to_measure(needed, 256) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256]
    assert batch_sizes_to_measure([12.0], 256) == [1, 2, 4, 8, 12]


def _overhead_profile(a: float, c: float, batch: int) -> ComputeProfile:
    # T_comp(b) = a + c b, tabulated at every power of two, where the strong-scaling local batches fall.
    return ComputeProfile({2**k: a + c * 2**k for k in range(int(math.log2(batch)) + 1)})


def test_n_peak_where_latency_overtakes_compute():
    # With S = 0, T_iter(n) = a + c B/n + 2 (n-1) alpha has its minimum at n* = sqrt(c B / (2 alpha)) = 64.
    batch, a, c = 1024, 0.01, 1e-3
    alpha = c * batch / (2 * 64**2)
    curve = predict_curve("ring", _overhead_profile(a, c, batch), 0.0, Network(1e9, alpha), batch)
    assert curve.n_peak == 64 and not curve.still_growing
    i = curve.n.index(64)
    assert curve.t_iter_s[i] == pytest.approx(a + c * 16 + 2 * 63 * alpha)
    assert curve.speedup[i] == pytest.approx((a + c * batch) / curve.t_iter_s[i])
    assert curve.efficiency[i] == pytest.approx(curve.speedup[i] / 64)


def test_still_growing_and_infeasible_worker_counts():
    curve = predict_curve("ring", ComputeProfile.per_sample(1.0), 0.0, Network(1e9, 0.0), 1024)
    assert curve.speedup == pytest.approx([float(n) for n in curve.n])
    assert curve.n_peak == 1024 and curve.still_growing
    small = predict_curve("ring", ComputeProfile.per_sample(1.0), 0.0, Network(1e9, 0.0), 256)
    assert small.speedup[-2:] == [None, None]  # n > B: less than one sample per worker
    assert small.n_peak == 256


def test_weak_scaling_and_overlap():
    net = Network(1e9, 0.0)
    curve = predict_curve("ps", ComputeProfile.per_sample(1.0), 1e6, net, 64, weak=True)
    i = curve.n.index(8)
    assert curve.t_iter_s[i] == pytest.approx(0.064 + 16e-3)
    assert curve.speedup[i] == pytest.approx(8 * 0.064 / 0.080)
    assert iteration_time_s(0.010, 0.004, 0.5) == pytest.approx(0.012)
    assert iteration_time_s(0.002, 0.004, 1.0) == pytest.approx(0.004)  # hides at most T_comp
    lapped = predict_curve("ring", ComputeProfile.per_sample(1.0), 1e6, net, 64, overlap=1.0)
    assert lapped.t_iter_s[1] == pytest.approx(max(0.032, 1e-3))


def test_network_from_probe():
    bw, lat = network_from_probe({"tiny_s": 2e-5, "probe_s": 1e-3 + 2e-5, "probe_bytes": 10**6})
    assert bw == pytest.approx(1e9) and lat == pytest.approx(1e-5)


def test_validation_errors_and_json():
    probe = {"tiny_s": 1e-4, "probe_s": 0.05, "probe_bytes": 10**8}
    v = Validation(
        64,
        {1: 0.100, 2: 0.080},
        {1: 0.110, 2: 0.060},
        2e9,
        5e-5,
        {1: 0.11, 2: 0.05},
        {1: 0.11, 2: 0.045},
        probe,
        1.5,
    )
    assert v.rel_error == pytest.approx({1: 0.1, 2: 0.25}) and v.max_rel_error == pytest.approx(0.25)
    j = v.as_json()
    assert j["validation_bandwidth_gbps"] == pytest.approx(16.0) and j["measured_step_ms"][
        "2"
    ] == pytest.approx(80)
    assert j["allreduce_probe"]["bytes"] == 10**8 and j["load_average_1m"] == 1.5


MLP = ["--model", "mlp", "--input-shape", "1,8,8"]  # 64-64-64-10: 8,970 parameters


def test_cli_json_matches_closed_forms(capsys, tmp_path):
    argv = ["predict", *MLP, "--comp-table", "1:1,1024:100", "--topology", "ring,ps", "--json"]
    assert main([*argv, "--bandwidth-gbps", "8", "--latency-us", "2", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)  # stdout is exactly one JSON object
    assert result["parameters"] == 8970 and result["message_bytes"] == 35880
    assert result["n"] == [2**k for k in range(11)]
    assert set(result["n_peak"]) == {"ring", "ps"} and set(result["still_growing"]) == {"ring", "ps"}
    ring = result["strong"]["topologies"]["ring"]
    for key in ("speedup", "efficiency", "t_iter_ms", "t_comp_ms", "t_comm_ms", "n_peak", "peak_speedup"):
        assert key in ring
    comp = ComputeProfile({1: 0.001, 1024: 0.1})
    t4 = comp.time_s(256) + 2 * 3 / 4 * 35880 / 1e9 + 2 * 3 * 2e-6
    assert ring["t_iter_ms"][2] == pytest.approx(t4 * 1e3)
    assert ring["speedup"][2] == pytest.approx(0.1 / t4)
    assert json.loads((tmp_path / "predict.json").read_text()) == result
    assert (tmp_path / "predict.png").stat().st_size > 10_000


def test_cli_measures_compute_and_prints_table(capsys):
    argv = [
        "predict",
        *MLP,
        "--global-batch",
        "8",
        "--max-workers",
        "8",
        "--scaling",
        "both",
        "--local-batch",
        "4",
    ]
    assert main([*argv, "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "strong scaling, global batch 8" in out and "weak scaling, 4 samples per worker" in out
    assert "n_peak" in out and "ps-sharded" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--topology", "mesh"], "--topology"),
        (["--overlap", "1.5"], "--overlap"),
        (["--comp-ms", "1", "--comp-table", "1:1"], "either --comp-ms or --comp-table"),
        (["--input-shape", "a,b"], "--input-shape"),
        (["--model", "nosuch"], "unknown model"),
        (["--measure-bandwidth", "--bandwidth-gbps", "1"], "--measure-bandwidth"),
        (["--global-batch", "0"], "--global-batch"),
        (["--comp-ms", "-1"], "--comp-ms"),
        (["--data", "text"], "drop --input-shape"),
    ],
)
def test_cli_bad_input_exits_2(capsys, extra, message):
    given = [] if any(a.startswith("--comp") for a in extra) else ["--comp-ms", "0.1"]  # skip measuring
    assert main(["predict", *MLP, *given, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("parambox: error:") and message in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_validate_and_measure_bandwidth_with_two_processes(capsys):
    argv = ["predict", *MLP, "--topology", "ring", "--measure-bandwidth", "--validate", "--json"]
    assert main([*argv, "--global-batch", "64", "--max-workers", "4", "--repeats", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    v = result["validation"]
    assert result["network"]["source"].startswith("measured") and result["network"]["bandwidth_gbps"] > 0
    assert set(v["measured_step_ms"]) == {"1", "2"} and min(v["measured_step_ms"].values()) > 0
    assert result["validation_max_rel_error"] == max(v["rel_error"].values())
    assert result["validation_bandwidth_gbps"] > 0
    # Sub-millisecond steps on a shared 2-core machine are noisy (latency dominates), so only gross errors
    # (units, a missing term) are caught here; the AlexNet figure is the real check.
    assert result["validation_max_rel_error"] < 2.0


TOKEN_MODEL = """
from torch import nn

def tokens():
    # Token ids in, logits per position out: float inputs would fail in the embedding.
    return nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 256))
"""


def test_cli_times_the_zoo_transformer_on_token_ids(capsys):
    """``gpt`` takes (B, T) byte ids of the text set, its default data: the timed steps feed those."""
    argv = ["predict", "--model", "gpt", "--topology", "ring", "--global-batch", "2", "--max-workers", "2"]
    assert main([*argv, "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["data"] == "text" and result["input_dtype"] == "int64"
    assert result["input_shape"] == [128] and result["num_classes"] == 256
    assert result["parameters"] == 1_040_768 and set(result["compute"]["ms_by_batch"]) == {"1", "2"}


def test_cli_times_a_users_sequence_model(capsys, tmp_path):
    """A user's factory (``file.py:fn``) on ``--data text``: built in the measuring process too."""
    (tmp_path / "mine.py").write_text(TOKEN_MODEL)
    argv = ["predict", "--model", f"{tmp_path}/mine.py:tokens", "--data", "text", "--topology", "ring"]
    argv += ["--global-batch", "2", "--max-workers", "2", "--repeats", "1", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["parameters"] == 256 * 8 + 8 * 256 + 256 and result["input_dtype"] == "int64"
    assert min(result["compute"]["ms_by_batch"].values()) > 0


def test_cli_names_what_a_model_that_cannot_take_the_items_was_fed(capsys, tmp_path):
    """The token model fed predict's default float images: one line here, no measuring process started."""
    (tmp_path / "mine.py").write_text(TOKEN_MODEL)
    assert main(["predict", "--model", f"{tmp_path}/mine.py:tokens", "--max-workers", "2"]) == 2
    err = capsys.readouterr().err
    assert "on float items of shape (3, 32, 32)" in err and "give the data set it reads with --data" in err
    assert len(err.strip().splitlines()) == 1


def test_sample_draws_batches_of_the_data_sets_kind():
    from parambox.data import Dataset
    from parambox.perfmodel.sample import Sample

    ids = torch.tensor([[3, 9, 5], [7, 4, 6]], dtype=torch.uint8)
    s = Sample.of_dataset(Dataset("t", ids, ids, ids[:1], ids[:1], num_classes=10, sequence=True))
    assert (s.shape, s.dtype, s.low, s.high, s.sequence) == ((3,), "uint8", 3, 9, True)
    torch.manual_seed(0)
    x, y = s.batch(500)
    assert x.dtype == torch.uint8 and int(x.min()) == 3 and int(x.max()) == 9 and y.shape == (500, 3)
    floats = Sample((1, 4, 4), 10)
    assert floats.batch(2)[0].dtype == torch.float32 and floats.batch(2)[1].shape == (2,)
