"""The event simulator (``perfmodel/simulate.py``): each pattern against its closed form, the links'
max-min sharing, overlap and buckets, and ``parambox predict --simulate`` as a user runs it."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import simpy

from parambox.errors import UserError
from parambox.perfmodel.compute import ComputeProfile
from parambox.perfmodel.scaling import predict_curve
from parambox.perfmodel.simulate import (
    LINK_EFFICIENCY,
    PATTERNS,
    Fabric,
    Pattern,
    _Flow,
    simulate,
    simulate_curve,
)
from parambox.perfmodel.topology import Network, ring_allreduce_s
from tests.conftest import run_cli

S = 4.0e6  # bytes
NET = Network.from_gbps(1.0, latency_us=50.0)
RATE = NET.bandwidth * LINK_EFFICIENCY  # payload bytes/s a link moves
ALPHA = NET.latency


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_a_whole_model_allreduce_is_the_ring_closed_form(n):
    r = simulate("weight-avg", n, 0.1, S, NET, steps=8)  # two exchanges in the 8 measured steps
    ring = ring_allreduce_s(n, S, Network(RATE, ALPHA))
    assert r.phases_s["exchange"] * 8 / 2 == pytest.approx(ring, rel=1e-9)
    assert r.step_s == pytest.approx(0.1 + ring / 4, rel=1e-9)


@pytest.mark.parametrize("n", [2, 4, 7])
def test_ps_sync_gathers_and_broadcasts_through_one_link(n):
    r = simulate("ps-sync", n, 0.1, S, NET, average_bytes_per_s=2e9)
    one_link = ALPHA + (n - 1) * S / RATE  # n-1 copies share the server's downlink, then its uplink
    assert r.phases_s["gather"] == pytest.approx(one_link, rel=1e-9)
    assert r.phases_s["average"] == pytest.approx(n * S / 2e9, rel=1e-9)
    assert r.phases_s["broadcast"] == pytest.approx(one_link, rel=1e-9)
    assert r.step_s == pytest.approx(0.1 + 2 * one_link + n * S / 2e9, rel=1e-9)


@pytest.mark.parametrize("setup, ring", [("diloco-stream", True), ("diloco-async-stream", False)])
def test_streaming_diloco_sends_a_fragment_every_h_over_f_steps_behind_the_next_ones(setup, ring):
    """Streaming DiLoCo, H 16 in 4 fragments: a quarter of the model every 4 steps, each exchange behind
    the next 4 steps' compute; with 4 steps' compute longer than it, the step is the compute alone, and
    the link carries a quarter of diloco's every-16-steps bytes four times as often: the same bytes."""
    whole = PATTERNS["diloco-async" if not ring else "diloco"]
    r = simulate(setup, 2, 0.1, S, NET, steps=16)
    assert r.step_s == pytest.approx(0.1, rel=1e-9)
    assert r.link_bytes_per_step == pytest.approx(
        simulate(whole, 2, 0.1, S, NET).link_bytes_per_step, rel=1e-9
    )
    slow = simulate(setup, 2, 0.001, S, NET, steps=16)  # the link paces it: one fragment's exchange every 4
    one = 2 * ALPHA + S / 4 / RATE if ring else ALPHA + 2 * (S / 4 / 2) / RATE  # steps: ring, or push-pull
    assert slow.step_s == pytest.approx(one / 4, rel=0.05)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_a_compressed_collective_all_gathers_every_ranks_message(n):
    """wire < 1 (int8, int4, topk): each rank's message is that share of the float32 bytes and gloo's
    ring all-gather moves n-1 of them over each link, after n-1 latencies."""
    wire = 0.25
    r = simulate(Pattern("allreduce", period=4, wire=wire), n, 0.1, S, NET, steps=8)
    gather = (n - 1) * ALPHA + (n - 1) * wire * S / RATE
    assert r.phases_s["exchange"] * 8 / 2 == pytest.approx(gather, rel=1e-9)
    assert r.step_s == pytest.approx(0.1 + gather / 4, rel=1e-9)
    assert r.link_bytes_per_step == pytest.approx(2 * (n - 1) * wire * S / 4, rel=1e-9)  # sent + received


def test_a_compressed_collectives_cpu_lies_outside_its_wait_on_the_link():
    """diloco-int8: encoding before the all-gather and decoding after are on the step's path, so the
    whole of the exchange's CPU lengthens the step (a plain collective's first fills its link wait)."""
    from parambox.perfmodel.simulate import _INT8, against_measured

    gather = ALPHA + _INT8 * S / RATE  # 2 nodes: one message each way
    step = 0.1 + 0.004 + gather / 16  # 2 ms of CPU a step at the ceiling's half a core: 4 ms
    rates = {"ceiling": 2 * 64 / 0.1, "diloco-int8": 2 * 64 / step}
    row = against_measured(rates, 2, 64, S, NET, {"ceiling": 50.0, "diloco-int8": 52.0})["diloco-int8"]
    assert row["simulated_ms"] == pytest.approx((0.1 + gather / 16) * 1e3, rel=1e-9)
    assert row["error_with_cpu"] == pytest.approx(0.0, abs=1e-9)


SHAPES = [
    (256, 4096),
    (256,),
    (10, 256),
    (10,),
]  # two layers: matrices PowerSGD compresses, biases sent whole


@pytest.mark.parametrize("n", [2, 3, 5])
def test_powersgd_is_two_ring_allreduces_of_its_own_message_sizes(n):
    """allreduce-powersgd: the P's (with the biases and the flags) reduced, then the Q's, one after the
    other, each gloo's ring; their sizes are those PowerSGD itself sends for the model's shapes."""
    import torch

    from parambox.strategies.powersgd import PowerSGD

    size = 4.0 * sum(math.prod(s) for s in SHAPES)
    first = 4.0 * (256 * 4 + 10 * 4 + 256 + 10 + len(SHAPES))  # P: rows x rank 4; biases; one flag each
    second = 4.0 * (4096 * 4 + 256 * 4)  # Q: columns x rank 4
    ps = PowerSGD([torch.Size(s) for s in SHAPES], rank=4)
    assert ps.message_bytes(tail=len(SHAPES)) == first + second  # what the strategy sends
    r = simulate("allreduce-powersgd", n, 0.1, size, NET, shapes=SHAPES)
    rings = ring_allreduce_s(n, first, Network(RATE, ALPHA)) + ring_allreduce_s(
        n, second, Network(RATE, ALPHA)
    )
    assert r.phases_s["exchange"] == pytest.approx(rings, rel=1e-9)
    assert r.step_s == pytest.approx(0.1 + rings, rel=1e-9)
    assert r.link_bytes_per_step == pytest.approx(2 * 2 * (n - 1) / n * (first + second), rel=1e-9)
    with pytest.raises(UserError, match="parameter shapes"):
        simulate("allreduce-powersgd", n, 0.1, size, NET)


def test_powersgds_cpu_lies_outside_its_wait_on_the_link():
    """Its products and orthogonalization run between and around its allreduces: all of its CPU
    lengthens the step, as a compressed collective's does."""
    from parambox.perfmodel.simulate import against_measured

    size = 4.0 * sum(math.prod(s) for s in SHAPES)
    alone = simulate("allreduce-powersgd", 2, 0.1, size, NET, shapes=SHAPES).step_s
    step = alone + 0.004  # 2 ms of CPU a step at the ceiling's half a core: 4 ms
    rates = {"ceiling": 2 * 64 / 0.1, "allreduce-powersgd": 2 * 64 / step}
    cpu = {"ceiling": 50.0, "allreduce-powersgd": 52.0}
    row = against_measured(rates, 2, 64, size, NET, cpu, shapes=SHAPES)["allreduce-powersgd"]
    assert row["simulated_ms"] == pytest.approx(alone * 1e3, rel=1e-9)
    assert row["error_with_cpu"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("n", [2, 3, 6])
def test_the_box_moves_each_shard_once_each_way(n):
    piece_phase = ALPHA + (n - 1) * (S / n) / RATE  # n-1 pieces in and out of every link at once
    sync = simulate(Pattern("box-sync"), n, 0.1, S, NET)  # push after backward, barrier, pull
    assert sync.phases_s["exchange"] == pytest.approx(2 * piece_phase + ALPHA, rel=1e-9)  # + the barrier
    # Fused: pushes and pulls at once, so every link carries its node's pushes and the pulls it serves.
    fused = simulate(Pattern("box"), n, 0.1, S, NET)
    assert fused.phases_s["exchange"] == pytest.approx(ALPHA + 2 * (n - 1) * (S / n) / RATE, rel=1e-9)
    # Sent + received per node per step: every piece out and in, each way (n = 2: 2 S, bench's "need").
    assert fused.link_bytes_per_step == pytest.approx(4 * (n - 1) / n * S, rel=1e-9)


@pytest.mark.parametrize("n", [2, 4])
def test_hybrid_one_worker_a_node_is_its_leaders_fused_exchange_every_tau_steps(n):
    """bench cluster's hybrid (groups = nodes, one worker each): no group allreduce, and every 4 steps
    the leader's EASGD exchange, one fused push-pull against every shard (the memory server's ELASTIC)."""
    r = simulate("hybrid", n, 0.1, S, NET, steps=8)
    exchange = ALPHA + 2 * (n - 1) * (S / n) / RATE
    assert r.phases_s["exchange"] * 8 / 2 == pytest.approx(exchange, rel=1e-9)
    assert r.step_s == pytest.approx(0.1 + exchange / 4, rel=1e-9)


def test_every_bench_cluster_setup_has_a_pattern():
    """The simulator answers for every setup bench cluster measures (and ps-sync, which it does not)."""
    from parambox.bench.cluster import SETUPS
    from parambox.perfmodel.simulate import PATTERNS

    assert set(PATTERNS) - set(SETUPS) == {"ps-sync"} and set(SETUPS) <= set(PATTERNS)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_an_encoded_push_to_the_box_lands_then_its_float32_answer_comes_back(n):
    """wire < 1 on the box (downpour's, easgd's, asynchronous diloco's compression): the codes to every
    shard, decoded once landed, then the float32 values back: two phases, one after the other."""
    wire, piece = 0.25, S / n
    r = simulate(Pattern("box", wire=wire), n, 0.1, S, NET)
    assert r.phases_s["exchange"] == pytest.approx(2 * ALPHA + (n - 1) * (1 + wire) * piece / RATE, rel=1e-9)
    assert r.link_bytes_per_step == pytest.approx(
        2 * (n - 1) * (1 + wire) * piece, rel=1e-9
    )  # sent + received


def test_flows_share_links_max_min_fairly():
    fabric = Fabric(simpy.Environment(), 5, 90.0, 0.0)
    env = fabric.env
    a, b, c, d = (_Flow(s, t, 1.0, env.event()) for s, t in [(0, 1), (0, 2), (3, 2), (4, 2)])
    fabric.flows = [a, b, c, d]
    fabric._share()
    # node 2's downlink is the bottleneck of b, c, d (30 each); a takes what is left of node 0's uplink
    assert [f.rate for f in (b, c, d)] == pytest.approx([30.0] * 3) and a.rate == pytest.approx(60.0)


def test_a_flow_finishes_when_its_bytes_have_gone_at_the_shared_rate():
    env = simpy.Environment()
    fabric = Fabric(env, 3, 100.0, 0.5)
    first, second = fabric.send(0, 1, 100.0), fabric.send(2, 1, 300.0)
    env.run()
    # both share node 1's downlink at 50 until the first ends at 0.5 + 2; the second then has 200 left
    assert first.ok and second.ok
    assert env.now == pytest.approx(0.5 + 2.0 + 2.0)


def test_overlap_hides_an_exchange_shorter_than_the_compute_between():
    plain = simulate("downpour", 2, 0.1, S, NET)
    hidden = simulate("downpour-overlap", 2, 0.1, S, NET)
    assert plain.step_s > 0.1 and hidden.step_s == pytest.approx(0.1, rel=1e-9)
    slow = simulate("downpour-overlap", 2, 0.001, S, NET)  # the link bounds the step instead
    assert slow.step_s == pytest.approx(ALPHA + 2 * (S / 2) / RATE, rel=1e-6)  # as the fused exchange


def test_buckets_start_during_backward():
    size = 2 * 2**20  # two buckets of 1 MiB: the first ready half way through backward
    compute = 0.3
    r = simulate("allreduce", 2, compute, size, NET)
    bucket = ring_allreduce_s(2, 2**20, Network(RATE, ALPHA))
    assert bucket < compute * (2 / 3) / 2  # the first bucket is done before backward ends
    assert r.step_s == pytest.approx(compute + bucket, rel=1e-9)


def test_downpour_push_pulls_each_bucket_as_backward_finishes_it():
    size, compute = 2 * 2**20, 0.3  # two buckets of 1 MiB: the first ready half way through backward
    r = simulate("downpour", 2, compute, size, NET)
    bucket = ALPHA + 2**20 / RATE  # both nodes' pushes and the answers, each link's two directions
    assert bucket < compute * (2 / 3) / 2  # the first bucket's exchange is over before backward ends
    assert r.step_s == pytest.approx(compute + bucket, rel=1e-9)
    assert r.link_bytes_per_step == pytest.approx(
        simulate(Pattern("box"), 2, compute, size, NET).link_bytes_per_step
    )


def test_jitter_keeps_the_mean_and_a_seed_repeats_it():
    runs = [simulate("ceiling", 1, 0.1, S, NET, steps=400, jitter=0.2, seed=s).step_s for s in (0, 1)]
    assert runs[0] == pytest.approx(0.1, rel=0.05) and runs[0] != runs[1]
    assert (
        simulate("ceiling", 1, 0.1, S, NET, steps=40, jitter=0.2, seed=0).step_s
        == simulate("ceiling", 1, 0.1, S, NET, steps=40, jitter=0.2, seed=0).step_s
    )


def test_the_simulated_ring_curve_matches_the_analytic_one_without_buckets_to_hide():
    compute = ComputeProfile({1: 0.001, 1024: 0.4})
    net = Network(RATE, ALPHA)  # the analytic model at the rate the simulator moves payload
    small = 4e5  # under the first bucket: nothing to overlap, so the two models are the same ring
    sim = simulate_curve("allreduce", compute, small, NET, 1024, worker_counts=[1, 2, 4, 16, 64])
    ana = predict_curve("ring", compute, small, net, 1024, worker_counts=[1, 2, 4, 16, 64])
    assert sim.t_iter_s == pytest.approx(ana.t_iter_s, rel=1e-9) and sim.n_peak == ana.n_peak


def test_a_wrong_setup_or_size_names_the_problem():
    with pytest.raises(UserError, match="choose from"):
        simulate("allgather", 2, 0.1, S, NET)
    with pytest.raises(UserError, match="nodes >= 1"):
        simulate("allreduce", 0, 0.1, S, NET)


def test_predict_simulate_adds_simulated_curves(tmp_path):
    out = run_cli(
        "predict", "--comp-table", "1:1,64:20,1024:300", "--bandwidth-gbps", "1", "--topology", "ring",
        "--simulate", "allreduce,ps-sync", "--max-workers", "16", "--json",
    )  # fmt: skip
    result = json.loads(out.stdout)
    curves = result["strong"]["topologies"]
    assert set(curves) == {"ring", "sim:allreduce", "sim:ps-sync"}
    assert set(result["n_peak"]) == set(curves)
    assert all(math.isfinite(s) for s in curves["sim:ps-sync"]["speedup"])
    bad = run_cli("predict", "--simulate", "allgather", check=False)
    assert bad.returncode == 2 and "choose from" in bad.stderr and "Traceback" not in bad.stderr


def test_predict_simulates_powersgd_from_the_users_models_shapes():
    args = ["predict", "--comp-table", "1:1,64:20", "--bandwidth-gbps", "0.1", "--topology", "ring"]
    out = run_cli(*args, "--simulate", "allreduce,allreduce-powersgd", "--max-workers", "4", "--json")
    curves = json.loads(out.stdout)["strong"]["topologies"]
    full, low = curves["sim:allreduce"]["t_comm_ms"][-1], curves["sim:allreduce-powersgd"]["t_comm_ms"][-1]
    assert 0 < low < full / 50  # alexnet (the default model) at rank 4, against its whole gradient
    bad = run_cli(*args, "--simulate", "allreduce-powersgd", "--parameters", "1000000", check=False)
    assert bad.returncode == 2 and "drop --parameters" in bad.stderr and "Traceback" not in bad.stderr
    ranked = run_cli(*args, "--parameters", "1000000", "--nodes", "4", "--json")  # every other setup
    setups = {r["setup"] for r in json.loads(ranked.stdout)["setups"]["ranking"]}
    assert "allreduce" in setups and "easgd-tau4-int8" in setups
    assert (
        not {"allreduce-powersgd", "ddp", "post-local-sgd", "ceiling"} & setups
    )  # no shapes; not parambox's


# -- reproduce's simulated claims (studies/simulated.py) ------------------------------------------


def test_box_sync_pushes_each_bucket_during_backward_and_pulls_it_once_every_node_has():
    size, compute = 2 * 2**20, 0.3  # two buckets of 1 MiB: the first ready half way through backward
    r = simulate("box-sync", 2, compute, size, NET)
    # the last bucket after backward: its pieces out (both directions of the link at once), the gate
    # (every node's push of it landed: one latency), the sums back
    last = (ALPHA + 2**19 / RATE) + ALPHA + (ALPHA + 2**19 / RATE)
    assert last < compute * (2 / 3) / 2  # so the first bucket's exchange is over before backward ends
    assert r.step_s == pytest.approx(compute + last, rel=1e-9)
    after = simulate(Pattern("box-sync"), 2, compute, size, NET)  # the whole push after backward
    assert after.step_s == pytest.approx(compute + 3 * ALPHA + 2 * 2**20 / RATE, rel=1e-9)
    assert r.link_bytes_per_step == pytest.approx(after.link_bytes_per_step)


def test_the_boxs_exchange_cpu_lengthens_the_compute_at_the_ceilings_share_of_a_core():
    from parambox.perfmodel.simulate import against_measured

    # the ceiling's 50 ms of CPU in a 100 ms step: half a core each; downpour's exchange adds 10 ms of
    # CPU (the memory server's, serving the other worker's buckets during this one's backward): 20 ms
    # of compute at that share
    measured = simulate("downpour", 2, 0.12, S, NET).step_s
    rates = {"ceiling": 2 * 64 / 0.1, "downpour": 2 * 64 / measured}
    row = against_measured(rates, 2, 64, S, NET, {"ceiling": 50.0, "downpour": 60.0})["downpour"]
    assert row["exchange_cpu_ms"] == pytest.approx(10.0)
    assert row["error_with_cpu"] == pytest.approx(0.0, abs=1e-9) and row["error"] < -0.1
    assert "error_with_cpu" not in against_measured(rates, 2, 64, S, NET)["downpour"]


def test_a_periodic_box_exchanges_cpu_first_fills_the_workers_wait_on_the_link():
    """easgd every 4 steps: the workers exchange in step, so the server's CPU for the other's request
    runs while this worker waits on its own exchange; only what outlasts that wait lengthens the step."""
    from parambox.perfmodel.simulate import against_measured

    alone = simulate("easgd-tau4", 2, 0.1, S, NET).step_s
    wait = alone - 0.1  # a step's share of the exchange's wait on the link
    assert 0.004 < wait < 0.05
    for taken, step in ((wait / 2, alone), (wait + 0.004, simulate("easgd-tau4", 2, 0.104, S, NET).step_s)):
        rates = {"ceiling": 2 * 64 / 0.1, "easgd-tau4": 2 * 64 / step}  # taken: compute s at half a core
        cpu = {"ceiling": 50.0, "easgd-tau4": 50.0 + taken * 1e3 / 2}
        row = against_measured(rates, 2, 64, S, NET, cpu)["easgd-tau4"]
        assert row["error_with_cpu"] == pytest.approx(0.0, abs=1e-9), (taken, row)


def test_a_collectives_exchange_cpu_first_fills_the_workers_wait_on_the_link():
    from parambox.perfmodel.simulate import against_measured

    wait = ring_allreduce_s(2, S, Network(RATE, NET.latency)) / 4  # weight-avg: a ring every 4 steps
    assert 0.004 < wait < 0.02
    for cpu_ms, step in ((60.0, 0.12), (52.0, 0.1 + wait)):  # 20 ms of compute, then 4 ms: the longer
        rates = {"ceiling": 2 * 64 / 0.1, "weight-avg": 2 * 64 / step}
        row = against_measured(rates, 2, 64, S, NET, {"ceiling": 50.0, "weight-avg": cpu_ms})["weight-avg"]
        assert row["simulated_with_cpu_ms"] == pytest.approx(step * 1e3, rel=1e-9)
        assert row["error_with_cpu"] == pytest.approx(0.0, abs=1e-9)


def test_an_overlapped_exchanges_cpu_lies_on_its_path_as_well_as_the_computes():
    """downpour-overlap with the link the bottleneck: the exchange behind the compute waits for its own
    CPU too (the bytes wait for the core that moves them), so the step is the link's time plus it;
    counted against the compute alone, the overlap would hide it."""
    from parambox.perfmodel.simulate import against_measured

    link = ALPHA + 2 * (S / 2) / RATE  # the fused push-pull over both directions of each link
    r = simulate("downpour-overlap", 2, 0.001, S, NET, exchange_cpu_s=0.01)
    assert r.step_s == pytest.approx(link + 0.01, rel=1e-6)
    compute = link / 4  # the ceiling: half a core (its 1/8 link of CPU in a 1/4 link step)
    rates = {"ceiling": 2 * 64 / compute, "downpour-overlap": 2 * 64 / (link + 0.01)}
    cpu = {"ceiling": compute * 1e3 / 2, "downpour-overlap": compute * 1e3 / 2 + 5.0}  # 10 ms at that share
    row = against_measured(rates, 2, 64, S, NET, cpu)["downpour-overlap"]
    assert row["error_with_cpu"] == pytest.approx(0.0, abs=1e-6)
    assert row["simulated_ms"] == pytest.approx(link * 1e3, rel=1e-6)  # over the links alone: hidden


def _bench(step_s: dict[str, float], compute_s: float) -> dict:
    rates = {name: 2 * 64 / s for name, s in step_s.items()} | {"ceiling": 2 * 64 / compute_s}
    return {"nodes": 2, "workers": 2, "batch_per_worker": 64, "by_gbps": {"1": {"samples_per_s": rates}}}


def test_the_validation_compares_each_setup_with_its_simulation_on_the_run_s_own_compute():
    from parambox.studies import simulated

    size = simulated.cnn_bytes()
    ring = ring_allreduce_s(2, size, Network(RATE, NET.latency / 5))  # the validation's 10 us latency
    # weight-avg as the closed form says; ddp twice as slow as any simulation of it could be
    bench = _bench({"weight-avg": 0.1 + ring / 4, "ddp": 2 * (0.1 + ring)}, compute_s=0.1)
    rows = {r["setup"]: r for r in simulated.validation_rows(bench)}
    assert set(rows) == {"weight-avg", "ddp"} and rows["weight-avg"]["compute_ms"] == pytest.approx(100.0)
    assert rows["weight-avg"]["error"] == pytest.approx(0.0, abs=1e-9)
    assert rows["ddp"]["error"] < -0.4
    m = {"rows": list(rows.values()), **simulated.error_summary(list(rows.values()))}
    verdict, why = simulated.verdict_simulator(m)
    assert verdict == "not reproduced" and "1 of 2 step times within 15%" in why and "worst ddp" in why


@pytest.mark.parametrize("errors, verdict", [([0.1, -0.05], "reproduced"), ([0.1, 0.05, 0.3], "partly")])
def test_verdict_simulator(errors, verdict):
    from parambox.studies import simulated

    rows = [{"nodes": 2, "gbps": 1.0, "setup": f"s{i}", "error": e} for i, e in enumerate(errors)]
    assert simulated.verdict_simulator({"rows": rows, **simulated.error_summary(rows)})[0] == verdict


@pytest.mark.parametrize(
    "n_peak, verdict", [(32, "reproduced"), (256, "not reproduced"), (4, "not reproduced")]
)
def test_verdict_keuper_sim(n_peak, verdict):
    from parambox.studies import simulated

    m = {"n_peak": {"sim:allreduce": n_peak, "ring": 64}, "link_gbps": 1.0, "model": "alexnet"}
    m |= {"global_batch": 1024, "max_step_difference_vs_analytic": 0.04}
    got, why = simulated.verdict_keuper_sim(m)
    assert got == verdict and why.startswith("simulated:")


def test_step_statistics_leave_out_the_start_and_resist_a_burst(tmp_path):
    from parambox.studies.simulated import step_statistics

    times = [0.5 * i for i in range(6)] + [2.5 + 0.1 * i for i in range(1, 41)]
    times[20:] = [t + 3.0 for t in times[20:]]  # one burst of foreign load: one long step
    lines = [json.dumps({"kind": "world"})] + [json.dumps({"kind": "step", "time": t}) for t in times]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    median, cv = step_statistics(tmp_path)
    assert median == pytest.approx(0.1) and cv == pytest.approx(0.0, abs=1e-6)


def test_the_tau_h_table_times_measured_steps_by_the_simulated_step():
    from parambox.studies import simulated

    runs = {
        f"{m}-{t}": {"final_test_accuracy": 0.98, "steps_to_target": None if t == 4 else 100 * t}
        for m in simulated.TAU_H_METHODS
        for t in (1, 4)
    }
    rows = {(r["method"], r["tau"]): r for r in simulated.tau_h_rows(runs, (1, 4), 0.01, S, workers=2)}
    assert len(rows) == 8 and rows["diloco", 4]["seconds_to_target"] == {"1": None, "0.1": None}
    for g in ("1", "0.1"):
        net = Network(float(g) * 1e9 / 8 * LINK_EFFICIENCY, 10e-6)
        ring = ring_allreduce_s(2, S, net)  # diloco every step: the whole-model ring
        assert rows["diloco", 1]["seconds_to_target"][g] == pytest.approx(100 * (0.01 + ring), rel=1e-9)
        box = 10e-6 + 2 * (S / 2) / net.bandwidth  # easgd every step: the fused push-pull
        assert rows["easgd", 1]["seconds_to_target"][g] == pytest.approx(100 * (0.01 + box), rel=1e-9)


# -- several workers a node ----------------------------------------------------------------------------


@pytest.mark.parametrize("n, w", [(2, 2), (3, 2), (2, 4)])
def test_with_several_workers_a_node_the_ring_runs_over_every_worker(n, w):
    """gloo's ring over R = n w workers, node by node: 2(R-1) rounds of S/R, one hop of each crossing a
    node's link, so each link carries 2(R-1)/R S after 2(R-1) latencies (R = 4 on 2 nodes: the 12.9 MB a
    step a node that bench cluster measured for the CNN's 4.3 MB, against 8.6 MB for one worker a node)."""
    r_ = n * w
    r = simulate("weight-avg", n, 0.1, S, NET, steps=8, workers_per_node=w)
    ring = 2 * (r_ - 1) * ALPHA + 2 * (r_ - 1) / r_ * S / RATE
    assert r.phases_s["exchange"] * 8 / 2 == pytest.approx(ring, rel=1e-9)
    assert r.link_bytes_per_step == pytest.approx(2 * 2 * (r_ - 1) / r_ * S / 4, rel=1e-9)
    assert r.samples_per_s == pytest.approx(n * w * 64 / r.step_s, rel=1e-12)
    gathered = simulate(
        Pattern("allreduce", period=4, wire=0.25), n, 0.1, S, NET, steps=8, workers_per_node=w
    )
    assert gathered.phases_s["exchange"] * 8 / 2 == pytest.approx(
        (r_ - 1) * ALPHA + (r_ - 1) * 0.25 * S / RATE, rel=1e-9
    )


@pytest.mark.parametrize("setup", ["box-sync", "hybrid"])
def test_two_levels_and_hybrids_leader_cross_the_link_once_a_node(setup):
    """box-sync's two levels (the node's sum, pushed by its leader once backward is done) and hybrid's
    group leader: a node's link carries what one worker a node would (box-sync then not in buckets)."""
    one = simulate(dataclasses.replace(PATTERNS[setup], bucketed=False), 2, 0.1, S, NET, steps=8)
    two = simulate(setup, 2, 0.1, S, NET, steps=8, workers_per_node=2)
    assert two.step_s == pytest.approx(one.step_s, rel=1e-12)
    assert two.link_bytes_per_step == pytest.approx(one.link_bytes_per_step, rel=1e-12)
    assert two.samples_per_s == pytest.approx(2 * one.samples_per_s, rel=1e-12)


def test_through_a_node_cache_the_worker_that_syncs_waits_and_syncs_skip_while_one_is_in_flight():
    """easgd every 4 steps through the node cache (``box/node_cache.py``): the exchanges end in the
    node's shm box, and every w-th of the node syncs it inline (a fused push-pull, float32 even where
    the pushes are encoded) unless a sync is under way. Two workers in step: the second to arrive
    syncs, waits for it, and stays behind, so it is the one that syncs each period (its step, the
    slowest: the compute plus a quarter of a sync) while the other never waits; until the other is a
    period ahead, and they come to share the syncs (the default run, 64 steps)."""
    sync = ALPHA + 2 * (S / 2) / RATE  # both nodes at once: their halves cross each link both ways
    per_sync = 4 * (S / 2)  # sent + received a node: its push and pull, the other node's served
    r = simulate("easgd-tau4-int8", 2, 0.1, S, NET, steps=8, workers_per_node=2)
    assert sync < 0.4 and r.step_s == pytest.approx(0.1 + sync / 4, rel=1e-9)
    assert r.link_bytes_per_step == pytest.approx(per_sync / 4, rel=1e-9)
    shared = simulate("easgd-tau4", 2, 0.1, S, NET, workers_per_node=2)
    assert 0.1 < shared.step_s < 0.1 + sync / 4 - 1e-4  # the slowest worker no longer takes them all
    assert shared.link_bytes_per_step == pytest.approx(per_sync / 4, rel=1e-9)  # one sync a period
    # downpour's every step, on a link slower than the compute: the node's pushes that come while a
    # sync is under way leave their update to the next, so fewer syncs than steps cross it (one a step
    # would be per_sync), one after the other, and no worker's step waits for more than one
    slow = simulate("downpour", 2, sync / 4, S, NET, workers_per_node=2)
    assert slow.link_bytes_per_step < 0.6 * per_sync
    assert sync / 4 < slow.step_s < sync / 4 + sync


def test_every_worker_of_a_node_pushes_its_own_where_nothing_caches_the_center():
    """Asynchronous diloco (no node cache): each of a node's w workers push-pulls the whole model against
    the shards over every rank, so the node's link carries w times one worker's exchange."""
    one = ALPHA + 2 * (S / 2) / RATE
    r = simulate("diloco-async", 2, 0.1, S, NET, steps=32, workers_per_node=3)
    assert r.phases_s["exchange"] * 32 / 2 == pytest.approx(ALPHA + 3 * 2 * (S / 2) / RATE, rel=1e-9)
    assert r.phases_s["exchange"] * 32 / 2 > 2.9 * (one - ALPHA)


def test_ps_sync_with_several_workers_a_node_is_not_simulated():
    with pytest.raises(UserError, match="ps-sync is simulated with one worker a node only"):
        simulate("ps-sync", 2, 0.1, S, NET, workers_per_node=2)


def test_the_validation_with_several_workers_a_node_takes_the_cluster_s_samples_over_every_worker():
    from parambox.perfmodel.simulate import against_measured

    step = simulate("weight-avg", 2, 0.1, S, NET, workers_per_node=2).step_s
    rates = {"ceiling": 4 * 64 / 0.1, "weight-avg": 4 * 64 / step, "ps-sync": 1.0}
    rows = against_measured(rates, 2, 64, S, NET, workers_per_node=2)
    assert set(rows) == {"weight-avg"} and rows["weight-avg"]["compute_ms"] == pytest.approx(100.0)
    assert rows["weight-avg"]["error"] == pytest.approx(0.0, abs=1e-9)
