"""Layout and shard arithmetic: plain tensors, one process."""

from __future__ import annotations

import pytest
import torch

from parambox.box import Layout, shard_of, shard_range


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def test_offsets_and_views_share_memory() -> None:
    lay = Layout.from_model(_model())
    assert lay.names == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert lay.offsets == (0, 12, 15, 21) and lay.numel == 23
    flat = torch.zeros(23)
    views = lay.views(flat)
    views["2.weight"].fill_(1.0)
    assert flat[15:21].eq(1).all() and flat.sum() == 6
    with pytest.raises(ValueError, match="needs"):
        lay.views(torch.zeros(22))


def test_params_and_grads_round_trip() -> None:
    model, other = _model(), _model()
    for p in other.parameters():
        p.data.zero_()
    lay = Layout.from_model(model)
    flat = lay.gather_params(model, torch.empty(lay.numel))
    assert torch.equal(flat, torch.nn.utils.parameters_to_vector(model.parameters()))
    lay.scatter_params(flat, other)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))

    model(torch.ones(2, 4)).sum().backward()
    model[2].bias.grad = None  # a parameter without a gradient contributes zeros
    grads = lay.gather_grads(model, torch.full((lay.numel,), 9.0))
    assert grads[21:].eq(0).all() and torch.equal(grads[:12], model[0].weight.grad.flatten())
    lay.scatter_grads(grads * 2, other)
    assert torch.equal(other[0].weight.grad, 2 * model[0].weight.grad) and other[2].bias.grad.eq(0).all()


def test_bind_params_makes_parameters_views() -> None:
    model = _model()
    lay = Layout.from_model(model)
    before = lay.gather_params(model, torch.empty(lay.numel))
    flat = torch.zeros(lay.numel)
    lay.bind_params_(model, flat, copy_values=True)
    assert torch.equal(flat, before)
    flat.add_(1.0)  # writing the buffer writes the model
    assert torch.equal(model[0].bias, before[12:15] + 1)


def test_fingerprint_tells_layouts_apart() -> None:
    a = Layout.from_shapes([("w", (2, 3)), ("b", (3,))])
    assert a.fingerprint() == Layout.from_shapes([("w", (2, 3)), ("b", (3,))]).fingerprint()
    assert a.fingerprint() != Layout.from_shapes([("w", (3, 2)), ("b", (3,))]).fingerprint()
    assert a.fingerprint() != Layout.from_shapes([("b", (3,)), ("w", (2, 3))]).fingerprint()


@pytest.mark.parametrize("numel", [1, 2, 7, 1000, 1001, 1002, 65_537])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7])
def test_shards_cover_everything_once(numel: int, num_shards: int) -> None:
    ranges = [shard_range(numel, k, num_shards) for k in range(num_shards)]
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    for k, (a, b) in enumerate(ranges):
        for i in {a, b - 1} if b > a else set():
            assert shard_of(numel, i, num_shards) == k


def test_shard_range_rejects_bad_shards() -> None:
    assert Layout.from_shapes([("x", (1001,))]).shard_range(2, 3) == (668, 1001)
    with pytest.raises(ValueError):
        shard_range(10, 3, 3)
    with pytest.raises(ValueError):
        shard_range(10, 0, 0)


def test_wait_all_polls_every_handle_until_each_is_done_and_names_what_it_waited_for():
    from parambox.box.base import Handle, wait_all
    from parambox.errors import CommTimeout

    class Later(Handle):
        def __init__(self, after: int):
            self.after, self.tests = after, 0

        def test(self) -> bool:
            self.tests += 1
            return self.tests > self.after

    handles = [Later(0), Later(3), Later(1)]
    wait_all(handles, 5.0, "sums")
    assert [h.tests for h in handles] == [1, 4, 2]  # a done handle is not asked again
    with pytest.raises(CommTimeout, match="sums: 1 transfer"):
        wait_all([Later(0), Later(10**9)], 0.05, "sums")
