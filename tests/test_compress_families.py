"""The compression families (issue 51, item 2): topk, sign, int4 and int2, each with error feedback.

Tier (a): on plain tensors, what is not sent this round is sent later (the sum of the decoded messages
plus the error still owed is the sum of what was meant), each encoding's form, and its exact bytes.
Tier (b): two gloo workers on loopback (tests/test_exchange.py's constant gradients) end at the
closed form with each new encoding on the wire.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from parambox.strategies.compress import Compressor, pack_bits, topk_count, unpack_bits
from parambox.strategies.diloco import DilocoOptions
from tests import test_exchange as ex

MODES = ["topk", "sign", "int4", "int2"]

# -- tier (a) ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_what_is_not_sent_is_sent_later(mode):
    """Over R rounds: sum of decoded messages + the final error = sum of the x_t (the closed form of
    error feedback), and the decoded sum alone is off by no more than that one error."""
    torch.manual_seed(2)
    n, rounds = 1000, 60
    c = Compressor(mode, n, block=64, ratio=0.05)
    xs = [torch.randn(n) * torch.rand(n) for _ in range(rounds)]
    sent = torch.zeros(n)
    for x in xs:
        msg = c.encode(x, torch.tensor([1.0]))
        x_hat, tail = c.decode(msg)
        assert tail.tolist() == [1.0]
        sent += x_hat
    meant = torch.stack(xs).sum(0)
    assert c.error is not None and float(c.error.abs().max()) > 0  # something is owed: the test can fail
    assert torch.allclose(sent + c.error, meant, atol=1e-4, rtol=0)
    # without error feedback the encoding's bias is never paid back
    plain = Compressor(mode, n, block=64, ratio=0.05, error_feedback=False)
    sent_plain = sum(plain.round_trip(x) for x in xs)
    assert float((sent - meant).norm()) < float((sent_plain - meant).norm())


@pytest.mark.parametrize("mode", ["bf16", "int8", "int4", "int2", "sign", "topk", "none"])
@pytest.mark.parametrize("block", [7, 256])
def test_a_chunk_at_a_time_is_the_whole_tensor_at_once_bit_for_bit(monkeypatch, mode, block):
    """Encoding and decoding go a chunk at a time (no model-sized temporaries): the messages, the
    error carried on and the decoded sums are those of the whole tensor at once, exactly."""
    from parambox.strategies import compress

    torch.manual_seed(3)
    xs, tail, n = [torch.randn(1003) * 10 ** (k % 3) for k in range(3)], torch.tensor([2.0, 1.0]), 1003

    def run(chunk: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(compress, "CHUNK", chunk)
        c = Compressor(mode, n, block)
        msgs = [c.encode(x, tail).clone() for x in xs]
        total = torch.full((n,), float("nan"))
        tails = [c.decode_into(m, total, add=i > 0) for i, m in enumerate(msgs)]
        assert all(torch.equal(t, tail) for t in tails)
        assert torch.equal(c.decode(msgs[1])[0], Compressor(mode, n, block).decode(msgs[1])[0])
        return msgs, c.error if c.error is not None else torch.zeros(n), total

    (chunked, err_c, sum_c), (whole, err_w, sum_w) = run(8), run(1 << 30)
    assert len(compress.Compressor(mode, n, block)._chunks()) == 1  # (CHUNK is still 1 << 30 here)
    assert all(torch.equal(a, b) for a, b in zip(chunked, whole))
    assert torch.equal(err_c, err_w) and torch.equal(sum_c, sum_w)
    sent = sum(Compressor(mode, n, block).decode(m)[0].double() for m in whole)
    assert torch.allclose(sum_w.double(), sent, rtol=0, atol=1e-4)


def test_topk_sends_the_k_largest_entries_exactly():
    torch.manual_seed(3)
    n = 1000
    x = torch.randn(n)
    c = Compressor("topk", n, ratio=0.037, error_feedback=False)
    k = math.ceil(0.037 * n)
    y = c.round_trip(x)
    assert int((y != 0).sum()) == k == c.k
    largest = set(torch.argsort(x.abs(), descending=True)[:k].tolist())
    assert set(torch.nonzero(y).view(-1).tolist()) == largest
    assert torch.equal(y[list(largest)], x[list(largest)])  # values exact, float32


def test_topk_error_is_what_was_left():
    x = torch.tensor([0.1, -5.0, 0.3, 2.0, -0.2])
    c = Compressor("topk", 5, ratio=0.4)
    assert c.round_trip(x).tolist() == [0.0, -5.0, 0.0, 2.0, 0.0]
    assert torch.equal(c.error, torch.tensor([0.1, 0.0, 0.3, 0.0, -0.2]))
    # the next message carries the error: 0.1 + 0.1 and 0.3 + 0.3 now beat -0.2 + 0.05
    y = c.round_trip(torch.tensor([0.1, 0.0, 0.3, 0.0, 0.05]))
    assert torch.allclose(y, torch.tensor([0.2, 0.0, 0.6, 0.0, 0.0]))
    assert torch.allclose(c.error, torch.tensor([0.0, 0.0, 0.0, 0.0, -0.15]))


@pytest.mark.parametrize("block", [1, 7, 64])
def test_sign_is_plus_or_minus_the_mean_magnitude_of_each_block(block):
    torch.manual_seed(4)
    n = 1000
    x = torch.randn(n) * torch.logspace(-2, 1, n)
    y = Compressor("sign", n, block=block, error_feedback=False).round_trip(x)
    for start in range(0, n, block):
        xb, yb = x[start : start + block], y[start : start + block]
        scale = xb.abs().mean()  # the last block's own elements, not its padding
        assert torch.allclose(yb.abs(), scale.expand_as(yb), rtol=1e-6)
        assert torch.equal(torch.sign(yb), torch.sign(xb))


@pytest.mark.parametrize("mode,qmax", [("int4", 7), ("int2", 1)])
@pytest.mark.parametrize("block", [1, 7, 64])
def test_int4_int2_are_within_half_a_step_per_element(mode, qmax, block):
    torch.manual_seed(5)
    n = 1000
    x = torch.randn(n) * torch.logspace(-3, 2, n)
    y = Compressor(mode, n, block=block, error_feedback=False).round_trip(x)
    for start in range(0, n, block):
        xb, yb = x[start : start + block], y[start : start + block]
        scale = xb.abs().max() / qmax
        assert float((yb - xb).abs().max()) <= float(scale) / 2 * (1 + 1e-5)
        codes = torch.round(yb / scale)
        assert torch.allclose(yb, codes * scale, rtol=1e-6, atol=0)  # a multiple of the block's scale
        assert float(codes.abs().max()) <= qmax
    assert Compressor(mode, 5).round_trip(torch.zeros(5)).tolist() == [0.0] * 5


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 9, 1000])
def test_bit_packing_round_trips(bits, n):
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-n * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


N = 1_000_000
BLOCKS = -(-N // 256)


@pytest.mark.parametrize(
    "mode,payload,share",
    [
        ("topk", 8 * 10_000, 0.02),  # 1 %: an int32 index and a float32 value per kept element
        ("sign", N // 8 + 4 * BLOCKS, 1 / 32 + 1 / 256),  # 1 bit per element + a float32 per 256
        ("int4", N // 2 + 4 * BLOCKS, 1 / 8 + 1 / 256),
        ("int2", N // 4 + 4 * BLOCKS, 1 / 16 + 1 / 256),
    ],
)
def test_payload_bytes_at_the_stated_ratio(mode, payload, share):
    c = Compressor(mode, N, block=256, ratio=0.01)
    assert c.payload_bytes() == payload
    assert abs(payload / (4 * N) - share) < 1e-3
    msg = c.encode(torch.randn(N), torch.tensor([1.0, 2.0]))
    assert msg.dtype == torch.uint8 and msg.numel() == c.message_bytes(2) == payload + 8
    x_hat, tail = c.decode(msg)
    assert x_hat.shape == (N,) and tail.tolist() == [1.0, 2.0]


def test_topk_count_and_ratio_option():
    assert topk_count(0.01, 1_000_000) == 10_000
    assert topk_count(0.01, 150) == 2 and topk_count(1e-9, 10) == 1 and topk_count(1.0, 7) == 7
    assert DilocoOptions(compression="topk", compression_ratio=0.05).compression_ratio == 0.05
    assert DilocoOptions().compression_ratio == 0.01
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValidationError, match="compression_ratio"):
            DilocoOptions(compression="topk", compression_ratio=bad)
    for mode in MODES:
        assert DilocoOptions(compression=mode).compression == mode


# -- tier (b): two gloo workers, constant gradients ---------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["sign", "int4", "int2"])
def test_two_workers_reach_diloco_closed_form(tmp_path, mode):
    """The gradients' magnitudes are equal within a block, so each encoding carries a round's
    progress exactly: diloco ends at its closed form, and each message has the stated bytes."""
    res = ex.run_two(
        tmp_path, "diloco", {"inner_steps": ex.PERIOD, "compression": mode, "compression_block": 64}
    )
    w = torch.tensor(res[0]["w"])
    assert float((w - ex.diloco_closed_form(0.7, 0.9)).abs().max()) <= 1e-6
    assert torch.allclose(torch.tensor(res[1]["w"]), w, atol=1e-7)
    sent = [b for b in res[0]["bytes"] if b > 0]
    assert sent == [Compressor(mode, ex.DIM, block=64).message_bytes(2)] * (ex.STEPS // ex.PERIOD)


@pytest.mark.timeout(90)
def test_two_workers_topk_sum_the_decoded_messages(tmp_path, monkeypatch):
    """weight-avg with topk (the default 1 %): distinct gradient magnitudes, so the k kept entries
    are known; theta moves by the mean of each round's decoded messages, as two local encoders say."""
    torch.manual_seed(6)
    grads = [torch.sign(torch.randn(ex.DIM)) * (0.1 + torch.rand(ex.DIM)) for _ in range(2)]
    monkeypatch.setattr(ex, "GRADS", grads)  # the forked workers read it
    res = ex.run_two(tmp_path, "weight-avg", {"period": ex.PERIOD, "compression": "topk"})
    theta = ex.W0.clone()
    encoders = [Compressor("topk", ex.DIM) for _ in range(2)]
    for h in [ex.PERIOD] * (ex.STEPS // ex.PERIOD) + [ex.STEPS % ex.PERIOD]:
        deltas = []
        for g in grads:
            x = theta.clone()
            for _ in range(h):
                x.add_(g, alpha=-ex.LR)  # SGD's step
            deltas.append(theta - x)
        total = torch.stack([c.round_trip(d) for c, d in zip(encoders, deltas)]).sum(0)
        theta = theta - total / 2.0
    w = torch.tensor(res[0]["w"])
    assert float((w - theta).abs().max()) <= 1e-6
    assert float((w - ex.diloco_closed_form(1.0, 0.0)).abs().max()) > 0.1  # not everything was sent
    sent = [b for b in res[0]["bytes"] if b > 0]
    assert sent == [8 * 3 + 4 * 2] * (ex.STEPS // ex.PERIOD)  # k = 3 of 300, and two flags


@pytest.mark.timeout(90)
def test_the_ratio_option_reaches_the_wire(tmp_path):
    """compression_ratio=0.05 of 300 elements: 15 kept, each an int32 index and a float32 value."""
    res = ex.run_two(
        tmp_path, "diloco", {"inner_steps": ex.PERIOD, "compression": "topk", "compression_ratio": 0.05}
    )
    sent = [b for b in res[0]["bytes"] if b > 0]
    assert sent == [8 * 15 + 4 * 2] * (ex.STEPS // ex.PERIOD)
