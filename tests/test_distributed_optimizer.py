"""``parambox.DistributedOptimizer``: errors and the loop in one process (tier a), every data-parallel
strategy on any module under torchrun with closed-form asserts (tier b), the user's script (tier c)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import parambox
from parambox.errors import UserError
from parambox.strategies import STRATEGIES, strategy_class
from tests.conftest import ROOT
from tests.distopt_worker import (
    ANYMODEL_STEPS,
    SYNC,
    AnyNet,
    TiedNet,
    bf16_run,
    build,
    global_batch,
    make_sgd,
    reference_anymodel,
    reference_numerics,
    snapshot,
    uses_aux,
)

# Every registered strategy whose step is local forward/backward + exchange: the registry says which.
DATA_PARALLEL = [
    name
    for name in STRATEGIES
    if not strategy_class(name).owns_forward_backward and strategy_class(name).max_workers != 1
]


def torchrun(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 ARGS`` as a user runs it, importing this tree."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # torchrun's logs in a folder of ours: without --log-dir it leaves a torchelastic_* folder in /tmp
    with tempfile.TemporaryDirectory(prefix="pb-torchrun-") as logs:
        torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--log-dir", logs]
        cmd = [*torchrun, "--nproc-per-node", "2", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def sgd_model(cls=TiedNet):
    model = build(cls, 0)
    return model, make_sgd(model)


# -- tier (a): one process ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy, options, words",
    [
        ("allreduse", None, ["unknown strategy", "allreduse"]),
        ("easgd", {"taux": 4}, ["easgd option", "taux"]),
        ("easgd", {"tau": 0}, ["easgd option", "tau"]),
        ("pipeline", None, ["pipeline", "parambox.train"]),
        ("sandblaster", None, ["sandblaster", "parambox.train"]),
    ],
)
def test_user_mistakes_are_one_line_user_errors(strategy, options, words):
    model, opt = sgd_model()
    with pytest.raises(UserError) as e:
        parambox.DistributedOptimizer(model, opt, strategy, options)
    text = str(e.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_wrong_objects_and_misuse_are_user_errors():
    model, opt = sgd_model()
    with pytest.raises(UserError, match="not the model's"):
        parambox.DistributedOptimizer(model, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(UserError, match="torch.optim.Optimizer"):
        parambox.DistributedOptimizer(model, "sgd")
    with pytest.raises(UserError, match="box 'backend'"):
        parambox.DistributedOptimizer(model, opt, box="nvme")
    dopt = parambox.DistributedOptimizer(model, opt)
    with pytest.raises(UserError, match="no forward pass"):
        dopt.step()
    dopt.close()
    with pytest.raises(UserError, match="after close"):
        dopt.zero_grad()


@pytest.mark.parametrize("strategy", ["allreduce", "easgd", "diloco", "dogwild"])
def test_a_model_moved_or_cast_after_wrapping_is_refused_not_trained_apart(strategy):
    """model.double() after wrapping gave every parameter new memory: the strategy stepped its own copy
    and the script trained another model, silently (allreduce ended at -0.038 where plain SGD gives
    -0.118). A no-op .to() is harmless; a cast is a one-line UserError at the next step."""
    model, opt = sgd_model()
    dopt = parambox.DistributedOptimizer(model, opt, strategy)
    model.to(torch.float32)  # where it already is: nothing moves
    dopt.zero_grad()
    model(torch.ones(2, model.enc.in_features)).square().mean().backward()
    dopt.step()
    model.double()
    with pytest.raises(
        UserError, match=r"moved, cast or replaced after it was wrapped.*before creating"
    ) as e:
        dopt.zero_grad()
    assert "\n" not in str(e.value) and dopt.closed


@pytest.mark.parametrize("strategy", ["allreduce", "easgd", "dogwild"])
@pytest.mark.parametrize("through", ["optimizer", "scaler"])
def test_the_wrapped_optimizer_stepped_directly_is_refused(strategy, through):
    """base.step() (or scaler.step(base)) in a script that wraps base skips the exchange: easgd then
    returned the untrained center at close(), silently. A step through the wrapper, a scheduler on the
    base and, after close(), the base itself work as before."""
    model, base = sgd_model()
    opt = parambox.DistributedOptimizer(model, base, strategy)
    sched = torch.optim.lr_scheduler.StepLR(base, 1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.ones(2, model.enc.in_features)
    for _ in range(2):
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    opt.zero_grad()
    model(x).square().mean().backward()
    with pytest.raises(UserError, match=r"SGD wrapped by DistributedOptimizer.*stepped directly") as e:
        base.step() if through == "optimizer" else scaler.step(base)
    assert "\n" not in str(e.value) and opt.closed
    base.step()  # released: a plain optimizer again


@pytest.mark.parametrize("strategy", DATA_PARALLEL)
def test_weights_loaded_after_wrapping_train_or_are_refused_never_lost(strategy):
    """model.load_state_dict() between wrapping and the first step: a rule that keeps no copy of the
    weights trains from them (lr 0: they are the result); one that keeps a copy (a center, the master's,
    DiLoCo's global weights) refuses in one line at the first step. Before, those ran and returned the
    weights they had copied at wrapping, the loaded ones lost."""
    torch.manual_seed(5)
    loaded = nn.Linear(4, 2).state_dict()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = parambox.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.0), strategy)
    model.load_state_dict(loaded)
    if strategy_class(strategy).copies_the_weights:
        with pytest.raises(
            UserError, match=rf"\('{strategy}'\): the model's weights changed between wrapping"
        ):
            opt.zero_grad()
        assert opt.closed
        return
    with opt:
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(model(torch.randn(8, 4)), torch.ones(8, 2)).backward()
            opt.step()
    assert max_diff(model.state_dict(), loaded) == 0.0


def _unfreezing(strategy: str | None, rewrap: bool) -> dict[str, torch.Tensor]:
    """The first layer frozen for 3 steps, then trained 3 more (progressive unfreezing)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = base if strategy is None else parambox.DistributedOptimizer(model, base, strategy)
    for step in range(6):
        if step == 3:
            model[0].requires_grad_(True)
            if rewrap:
                opt.close()
                opt = parambox.DistributedOptimizer(model, base, strategy)
        opt.zero_grad()
        F.mse_loss(model(torch.ones(3, 4) * step), torch.ones(3, 2)).backward()
        opt.step()
    if strategy is not None:
        opt.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy", DATA_PARALLEL)
def test_a_parameter_unfrozen_after_wrapping_is_refused_and_a_new_wrapper_takes_it(strategy):
    """requires_grad_(True) on a layer frozen at wrapping: the next step refuses it in one line (before,
    allreduce never averaged its gradient: two ranks trained it apart, 0.07 off one process). Closing
    and wrapping again, with the same torch optimizer, trains it; allreduce then equals plain PyTorch."""
    with pytest.raises(UserError, match=r"2 parameter\(s\) frozen when it was created now require grad"):
        _unfreezing(strategy, rewrap=False)
    got = _unfreezing(strategy, rewrap=True)
    assert all(torch.isfinite(v).all() for v in got.values())
    if strategy in ("allreduce", "ps-sync", "box-sync", "weight-avg", "single"):
        assert max_diff(got, _unfreezing(None, rewrap=False)) <= 1e-6


def _reverted(strategy: str | None, write: str) -> dict[str, torch.Tensor]:
    """6 steps; after step 3 the script writes the weights: ``load`` reverts to step 1's checkpoint with
    ``model.load_state_dict``, ``data`` clips them through ``p.data`` (WGAN's habit), ``copy`` loads
    other weights into a ``copy.deepcopy`` of the model to evaluate them."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = base if strategy is None else parambox.DistributedOptimizer(model, base, strategy)
    for step in range(6):
        if step == 1:
            saved = copy.deepcopy(model.state_dict())
        if step == 3 and write == "load":
            model.load_state_dict(saved)
        elif step == 3 and write == "data":
            for p in model.parameters():
                p.data.clamp_(-0.3, 0.3)
        elif step == 3:
            copy.deepcopy(model).load_state_dict(saved)
        opt.zero_grad()
        F.mse_loss(model(torch.ones(3, 4) * step), torch.ones(3, 2)).backward()
        opt.step()
    if strategy is not None:
        opt.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy", DATA_PARALLEL)
def test_weights_loaded_mid_run_are_trained_on_or_refused_where_the_rule_keeps_a_copy(strategy):
    """``model.load_state_dict()`` between steps (going back to a checkpoint): the rules whose model is
    their state train on from the loaded weights, as plain PyTorch does; the rules that keep a copy of
    the weights (a center, the master's, diloco's global weights) refuse it in one line at the next
    step. Before, downpour's next pull silently undid it and diloco fed it to its outer optimizer as
    a pseudo-gradient. A write through ``.data`` and a load into a copy of the model are not refused."""
    if strategy_class(strategy).copies_the_weights:
        with pytest.raises(
            UserError, match=rf"^DistributedOptimizer\('{strategy}'\): the model's weights were "
        ):
            _reverted(strategy, "load")
    else:
        assert max_diff(_reverted(strategy, "load"), _reverted(None, "load")) <= 1e-6
    for write in ("data", "copy"):
        assert all(torch.isfinite(v).all() for v in _reverted(strategy, write).values())


@pytest.mark.parametrize("strategy", DATA_PARALLEL)
def test_a_bfloat16_model_trains_or_is_refused_in_one_line(strategy):
    """model.to(torch.bfloat16): allreduce (bf16 buckets, as DDP), ps-sync and weight-avg train it as
    plain PyTorch does; the rules with float32 buffers or a float32 box refuse it naming the dtype.
    Before, each of those failed inside backward or the forward pass with a torch error."""
    if strategy_class(strategy).float32_weights:
        with pytest.raises(
            UserError, match=rf"^{strategy} keeps the weights in float32.*are bfloat16: .*autocast"
        ):
            bf16_run(strategy)
        return
    got = bf16_run(strategy)
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    assert max_diff(got, bf16_run(None)) == 0.0


def test_a_bfloat16_model_under_compressed_allreduce_is_refused():
    model = nn.Linear(4, 2).to(torch.bfloat16)
    with pytest.raises(UserError, match=r"^allreduce with compression=int8 keeps the weights in float32"):
        parambox.DistributedOptimizer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), options={"compression": "int8"}
        )


def test_a_bfloat16_model_under_allreduce_on_two_ranks_equals_one_process(tmp_path):
    """A bf16 allreduce of the halves' gradients: one process on the global batch, to bf16 rounding."""
    torchrun("tests/distopt_worker.py", "bf16", "allreduce", str(tmp_path))
    reference = bf16_run(None)
    for rank in range(2):
        assert max_diff(torch.load(tmp_path / f"bf16-allreduce-rank{rank}.pt"), reference) <= 4e-3


def _embedding_run(strategy: str, sparse: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 4, sparse=sparse), nn.Flatten(), nn.Linear(12, 2))
    g = torch.Generator().manual_seed(1)
    with parambox.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy) as opt:
        for _ in range(5):
            opt.zero_grad()
            F.mse_loss(model(torch.randint(0, 20, (8, 3), generator=g)), torch.ones(8, 2)).backward()
            opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


class _Strided(nn.Module):
    """A ``channels_last`` convolution and a transposed parameter: no flat view of either."""

    def __init__(self, contiguous: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.t = nn.Parameter(torch.randn(5, 4).t())
        self.head = nn.Linear(5, 2)
        if contiguous:
            self.t.data = self.t.data.contiguous()
        else:
            self.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x).mean((2, 3)) @ self.t))


def _strided_run(
    strategy: str | None, contiguous: bool, options: dict | None = None
) -> dict[str, torch.Tensor]:
    model = _Strided(contiguous)
    base = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = base if strategy is None else parambox.DistributedOptimizer(model, base, strategy, options)
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 3, 6, 6, generator=g), torch.randn(4, 2, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    if strategy is not None:
        opt.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy", [*DATA_PARALLEL, "diloco+fragments"])
def test_channels_last_and_transposed_parameters_train_as_contiguous_ones(strategy):
    """A ``channels_last`` model (what cuDNN's tensor cores want) and a transposed parameter: every rule
    gives the contiguous model's weights. Before, ps-sync, weight-avg and diloco failed at wrapping
    inside torch's ``parameters_to_vector`` ("view size is not compatible with input tensor's size
    and stride"), and Streaming DiLoCo writing a fragment back would have too."""
    name, _, form = strategy.partition("+")
    options = {"inner_steps": 2, "fragments": 2} if form else None
    got = _strided_run(name, contiguous=False, options=options)
    assert max_diff(got, _strided_run(name, contiguous=True, options=options)) <= 1e-6


@pytest.mark.parametrize("strategy", DATA_PARALLEL)
def test_a_sparse_embedding_trains_as_the_dense_one(strategy):
    """``nn.Embedding(sparse=True)`` (sparse .grad) gives the dense embedding's model on every rule
    (before: ps-sync failed on reshaping the sparse gradient for its gather)."""
    assert max_diff(_embedding_run(strategy, True), _embedding_run(strategy, False)) <= 1e-6


def _eamsgd_alone(make_opt, steps: int = 4) -> dict[str, torch.Tensor]:
    """Synchronous eamsgd in one process, one exchange after ``steps`` local Nesterov steps: the result,
    the center, is ``x0 + alpha (x - x0)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    with parambox.DistributedOptimizer(
        model, make_opt(model), "eamsgd", {"sync": True, "tau": steps, "alpha": 0.5}
    ) as opt:
        for step in range(steps):
            opt.zero_grad()
            F.mse_loss(model(torch.ones(3, 4) * step), torch.ones(3, 2)).backward()
            opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _sgd_decay(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(_trainable(model), lr=0.1, weight_decay=0.5)


def _two_rates(model: nn.Module) -> torch.optim.Optimizer:
    ps = _trainable(model)
    return torch.optim.SGD([{"params": ps[:2], "lr": 0.01}, {"params": ps[2:]}], lr=0.1)


def _head_only(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model[2].parameters(), lr=0.1)


def test_eamsgd_applies_the_optimizers_weight_decay_and_refuses_what_its_step_cannot_take():
    """With momentum 0 eamsgd's local step is SGD's, weight decay included (before: ignored); a frozen
    parameter does not decay. Param groups its one Nesterov step cannot follow, and parameters the
    optimizer leaves out (which it trained anyway), are one-line errors."""
    got = _eamsgd_alone(_sgd_decay)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    x0 = {k: v.clone() for k, v in model.state_dict().items()}
    plain = _sgd_decay(model)
    for step in range(4):
        plain.zero_grad()
        F.mse_loss(model(torch.ones(3, 4) * step), torch.ones(3, 2)).backward()
        plain.step()
    center = {k: x0[k] + 0.5 * (v - x0[k]) for k, v in model.state_dict().items()}
    assert max_diff(got, center) <= 1e-6
    assert torch.equal(got["0.bias"], model[0].bias)  # frozen: not decayed
    with pytest.raises(UserError, match=r"one lr for the whole model.*0\.01, 0\.1.*use easgd"):
        _eamsgd_alone(_two_rates)
    with pytest.raises(UserError, match=r"the optimizer holds 2 of the model's 3.*requires_grad_\(False\)"):
        _eamsgd_alone(_head_only)


def test_a_scheduler_on_the_users_optimizer_reaches_dogwilds_master_copy():
    """dogwild's master steps a copy of the user's optimizer: a scheduler on the user's set rates the
    master never saw (its weights moved at the first rate throughout). One process: the master's
    update is plain SGD's, so the run equals torch's own loop with the same StepLR."""
    runs = []
    for wrap in (True, False):
        model, base = sgd_model()
        opt = parambox.DistributedOptimizer(model, base, "dogwild") if wrap else base
        sched = torch.optim.lr_scheduler.StepLR(base, 1, gamma=0.3)
        for step in range(4):
            opt.zero_grad()
            x, y = global_batch(step, 1)
            F.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
        if wrap:
            opt.close()
        runs.append(snapshot(model))
    assert max_diff(*runs) <= 1e-6


@pytest.mark.parametrize(("strategy", "key"), [("diloco", "averager"), ("easgd", None)])
def test_another_ranks_state_loads_without_its_error_feedback(strategy, key):
    """DDP's habit, rank 0 saves and every rank loads: rank 0's int8 error feedback loaded on rank 1 was
    rank 1's too, so the residual was sent twice. Loaded where it was saved it is kept; on another rank
    it starts afresh (the rest, the center or the outer momentum, is kept)."""
    options = (
        {"compression": "int8", "inner_steps": 2}
        if strategy == "diloco"
        else {"compression": "int8", "tau": 2}
    )

    def error_of(state):
        rule = state["parambox"]["rule"]
        return (rule[key] if key else rule).get("error")

    def trained():
        model = nn.Linear(4, 2)
        opt = parambox.DistributedOptimizer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), strategy, options
        )
        for step in range(4):
            opt.zero_grad()
            model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            opt.step()
        return model, opt

    model, opt = trained()
    saved = opt.state_dict()
    opt.close()
    assert saved["parambox"]["rank"] == 0 and float(error_of(saved).abs().sum()) > 0
    for rank, kept in ((0, True), (1, False)):
        state = {**saved, "parambox": {**saved["parambox"], "rank": rank}}
        fresh = nn.Linear(4, 2)
        again = parambox.DistributedOptimizer(
            fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), strategy, options
        )
        again.load_state_dict(state)
        error = error_of(again.state_dict())
        assert (error is not None and torch.equal(error, error_of(saved))) == kept, (rank, error)
        assert error is None or kept or not error.any()
        again.close()


def test_a_lazy_module_not_yet_initialised_is_refused_naming_its_parameters():
    model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 2))
    with pytest.raises(
        UserError, match=r"parameters 0.weight, 0.bias are not initialised yet.*one forward pass"
    ):
        parambox.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), "allreduce")
    model(torch.ones(1, 4))  # initialised: now it wraps
    parambox.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), "allreduce").close()


@pytest.mark.parametrize("nested", [False, True])
def test_a_model_in_a_torch_data_parallel_wrapper_is_refused(nested):
    """A script moving over kept its DDP (or DataParallel) wrapper: the wrapper averaged the gradients as
    well, and an easgd run became synchronous averaging plus the elastic rule, silently."""
    inner = nn.DataParallel(nn.Linear(4, 2))
    model = nn.Sequential(inner, nn.Tanh()) if nested else inner
    with pytest.raises(UserError, match=r"wrapped in DataParallel.*pass the plain module") as e:
        parambox.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), "easgd")
    assert "\n" not in str(e.value)


def test_users_optimizer_is_the_strategys_and_a_copy_gets_its_groups():
    model = build(TiedNet, 0)
    opt = torch.optim.SGD([{"params": [model.enc.weight], "lr": 0.5}, {"params": [model.enc.bias]}], lr=0.1)
    with parambox.DistributedOptimizer(model, opt, "allreduce") as dopt:
        assert dopt.strategy.optimizer is opt
    with parambox.DistributedOptimizer(model, opt, "dogwild") as dopt:  # the master's copy of the model
        master = dopt.strategy.master.optimizer
        assert type(master) is torch.optim.SGD and master is not opt
        assert [g["lr"] for g in master.param_groups] == [0.5, 0.1]
        assert sum(len(g["params"]) for g in master.param_groups) == 2


@pytest.mark.parametrize("drop", ["after_step", "before_backward"])
def test_torch_zero_grad_set_to_none_is_harmless(drop):
    """The user calls the torch optimizer's zero_grad(set_to_none=True), not ours, at either point:
    allreduce's .grad views are bound again (before the forward) or the gradient adopted (after);
    the one-process reference (unused branch skipped, weight decay and momentum) is met."""
    model, opt = sgd_model(AnyNet)
    dopt = parambox.DistributedOptimizer(model, opt, "allreduce")
    for step in range(ANYMODEL_STEPS):
        model.use_aux = uses_aux(step)
        x, y = global_batch(step, 1)
        out = model(x)
        if drop == "before_backward":
            opt.zero_grad(set_to_none=True)
        F.mse_loss(out, y).backward()
        dopt.step()
        if drop == "after_step":
            opt.zero_grad(set_to_none=True)
    dopt.close()
    assert max_diff(model.state_dict(), reference_anymodel("rank0", world_size=1)) <= 1e-6


def train_alone(strategy: str, torch_zero_grad: bool) -> dict[str, torch.Tensor]:
    model, opt = sgd_model(AnyNet)
    with parambox.DistributedOptimizer(model, opt, strategy) as dopt:
        for step in range(ANYMODEL_STEPS):
            model.use_aux = uses_aux(step)
            x, y = global_batch(step, 1)
            if not torch_zero_grad:
                dopt.zero_grad()
            F.mse_loss(model(x), y).backward()
            dopt.step()
            if torch_zero_grad:
                opt.zero_grad(set_to_none=True)
    return model.state_dict()


@pytest.mark.parametrize("strategy", DATA_PARALLEL)
def test_torch_zero_grad_after_step_changes_nothing(strategy):
    """Every strategy, one process: the torch optimizer's zero_grad(set_to_none=True) after step()
    gives what opt.zero_grad() gives (the .grad views are bound again before the next forward)."""
    assert max_diff(train_alone(strategy, True), train_alone(strategy, False)) == 0.0


def test_close_leaves_a_plain_model():
    """No hooks, no views into strategy buffers, no .grad: the model trains on as plain PyTorch."""
    model, opt = sgd_model(AnyNet)
    with parambox.DistributedOptimizer(model, opt, "easgd", {"tau": 1}) as dopt:
        dopt.zero_grad()
        F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 8)).backward()
        dopt.step()
    assert not model._forward_pre_hooks
    for p in model.parameters():
        assert p.grad is None and not getattr(p, "_post_accumulate_grad_hooks", None)
    F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 8)).backward()
    before = model.enc.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.enc.weight) and model.dec.weight is model.enc.weight


def test_steps_end_the_run_and_later_steps_do_nothing(capfd):
    model, opt = sgd_model()
    dopt = parambox.DistributedOptimizer(model, opt, "downpour", steps=2)
    for _ in range(3):
        dopt.zero_grad()
        model(torch.ones(2, 8)).sum().backward()
        dopt.step()
    assert dopt.should_stop() and dopt.step_count == 2
    assert "does nothing now" in capfd.readouterr().err
    dopt.close()


def test_an_error_in_the_loop_releases_without_waiting():
    model, opt = sgd_model()
    with pytest.raises(ZeroDivisionError), parambox.DistributedOptimizer(model, opt, "hogwild") as dopt:
        raise ZeroDivisionError("the user's loop failed")
    assert dopt.closed and all(p.grad is None for p in model.parameters())


def test_a_lost_box_is_boxlost_with_what_a_script_does_and_the_rank_keeps_its_weights(monkeypatch):
    """The box's server says which rank died (and the CLI's remedy); the loop gets parambox.BoxLost
    with the script's remedy, this rank released and its model holding the weights of its last step."""
    from parambox.errors import BoxLost

    model, opt = sgd_model()
    dopt = parambox.DistributedOptimizer(model, opt, "easgd", {"tau": 1})
    dopt.zero_grad()
    model(torch.ones(2, 8)).sum().backward()
    dopt.step()
    weights = [p.detach().clone() for p in model.parameters()]

    def lost(*args, **kwargs):
        raise BoxLost(
            "box 'center' push: rank 3 died, and the part of the box it held went with it", "--max-restarts"
        )

    monkeypatch.setattr(dopt.strategy, "end_step", lost)
    dopt.zero_grad()
    model(torch.ones(2, 8)).sum().backward()
    with pytest.raises(parambox.BoxLost) as caught:
        dopt.step()
    message = str(caught.value)
    assert message.startswith("box 'center' push: rank 3 died") and "--max-restarts" not in message
    assert "restart the job from your last checkpoint" in message and caught.value.lost in message
    assert dopt.closed and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    with pytest.raises(UserError, match="after close"):
        dopt.zero_grad()


# -- tier (b)/(c): under torchrun -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def numerics_runs(tmp_path_factory) -> Path:
    """allreduce, then easgd, in one torchrun job: each DistributedOptimizer starts the group itself."""
    out = tmp_path_factory.mktemp("numerics")
    torchrun("tests/distopt_worker.py", "numerics", "allreduce,easgd", str(out))
    return out


def final_states(out: Path, strategy: str) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"{strategy}-rank{r}.pt", weights_only=True) for r in (0, 1)]


@pytest.mark.timeout(240)
def test_allreduce_at_b_per_rank_equals_one_process_at_2b(numerics_runs):
    """Must show (issue 10): through DistributedOptimizer under torchrun, 20 SGD steps (momentum,
    weight decay) on a tied-weight non-Sequential model equal the plain loop on the 2b batch."""
    reference = reference_numerics()
    for state in final_states(numerics_runs, "allreduce"):
        assert max_diff(state, reference) <= 1e-5


@pytest.mark.timeout(240)
def test_easgd_every_rank_holds_the_same_model_after_close(numerics_runs):
    """Must show (issue 10); also: a second DistributedOptimizer starts the group again under torchrun."""
    a, b = final_states(numerics_runs, "easgd")
    assert max_diff(a, b) == 0.0
    assert max_diff(a, build(TiedNet, 0).state_dict()) > 1e-3  # it trained


@pytest.fixture(scope="module")
def anymodel_runs(tmp_path_factory) -> Path:
    """Every data-parallel strategy in turn, in one torchrun job whose script owns the process group."""
    out = tmp_path_factory.mktemp("anymodel")
    runs = [*DATA_PARALLEL, "easgd+sync", "diloco+async"]
    torchrun("tests/distopt_worker.py", "anymodel", ",".join(runs), str(out), timeout=400)
    return out


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("strategy", [*DATA_PARALLEL, "easgd+sync", "diloco+async"])
def test_any_module_through_every_strategy(strategy, anymodel_runs):
    """AnyNet (BatchNorm, tied weight, frozen layer, a branch used every third step), SGD with momentum
    and weight decay: every rank ends with the same model, the frozen layer untouched, the tie kept,
    the buffers rank 0's (weight-avg: the mean of the ranks'); the synchronous strategies equal the
    one-process reference (gradients of the rank slices averaged, an unused branch skipped by the
    optimizer, rank 0's batch-norm statistics, or their mean for weight-avg)."""
    runs = [torch.load(anymodel_runs / f"{strategy}-rank{r}.pt", weights_only=True) for r in (0, 1)]
    init = torch.load(anymodel_runs / "init.pt", weights_only=True)
    state = runs[0]["state"]
    assert max_diff(state, runs[1]["state"]) == 0.0
    before = [run["buffers_before_close"] for run in runs]
    for name, value in before[0].items():
        mean = value.is_floating_point() and strategy in ("weight-avg", "diloco")  # averaged with the weights
        assert torch.allclose(state[name], (value + before[1][name]) / 2 if mean else value, atol=1e-7)
    assert all(run["tied"] for run in runs)
    assert all(torch.equal(state[k], init[k]) for k in init if k.startswith("frozen."))
    assert all(torch.isfinite(v.double()).all() for v in state.values())
    assert max_diff({k: state[k] for k in ("enc.weight",)}, {k: init[k] for k in ("enc.weight",)}) > 1e-3
    if strategy in SYNC:
        reference = reference_anymodel("mean" if strategy == "weight-avg" else "rank0")
        assert max_diff(state, reference) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_own_loop_example_under_torchrun():
    """Example (c): a plain PyTorch loop with DistributedOptimizer, as a user runs it."""
    proc = torchrun("examples/own_loop.py", "--strategy", "easgd")
    found = re.findall(r"rank (\d): easgd final loss [\d.]+, test accuracy ([\d.]+)", proc.stdout)
    assert sorted(rank for rank, _ in found) == ["0", "1"], proc.stdout
    accuracies = {accuracy for _, accuracy in found}
    assert len(accuracies) == 1  # every rank holds the same result model
    assert float(accuracies.pop()) > 0.85


FT_LOOP = """
import json, os, sys
import torch, torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
import parambox

x, y = load_digits(return_X_y=True)
x, y = torch.tensor(x / 16, dtype=torch.float32), torch.tensor(y)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
opt = parambox.DistributedOptimizer(
    model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5), "easgd", steps=300,
    box=os.environ["BOX"], timeout=20,
)
g = torch.Generator().manual_seed(opt.rank)
for step in range(300 if opt.trains else 0):
    if opt.rank == 1 and step == 100:
        os.kill(os.getpid(), 9)
    i = torch.randint(0, 1400, (32,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x[i]), y[i]).backward()
    opt.step()
opt.close()
accuracy = float((model(x[1400:]).argmax(1) == y[1400:]).float().mean())
print(json.dumps({"rank": opt.rank, "accuracy": accuracy, "weights": float(sum(p.sum() for p in model.parameters()))}))
"""


@pytest.mark.solo  # failure detection under load
@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(200)
@pytest.mark.parametrize("box", ["rma", "shm"])
def test_a_worker_killed_in_a_users_loop_under_ulfm_the_others_close_with_one_model(tmp_path, box):
    """``mpiexec --with-ft ulfm -n 3``, EASGD in a user's loop, rank 1 SIGKILLed at step 100 of 300 (rma:
    ranks 0 and 1 train, rank 2 holds the box; shm: three workers). The strategy finishes without it,
    and close() no longer fails: its broadcast of the result went over the process group, which the
    death broke (before: CommTimeout "result weights broadcast ... timed out" and a traceback on every
    survivor). Every survivor reads the center from the box and ends with the same model."""
    from parambox.runtime import spawn
    from tests.conftest import MPI_ENV

    if spawn.find_mpiexec() is None:
        pytest.skip("no mpiexec found")
    script = tmp_path / "loop.py"
    script.write_text(FT_LOOP)
    env = {**os.environ, **MPI_ENV, "OMP_NUM_THREADS": "1", "BOX": box}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(script)]
    proc = spawn.start_mpi(
        cmd, 3, env, fault_tolerant=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        spawn.stop([proc])
    assert proc.returncode == 0, stderr[-3000:]
    lines = sorted((json.loads(s) for s in stdout.splitlines() if s.startswith("{")), key=lambda x: x["rank"])
    assert [line["rank"] for line in lines] == [0, 2], stdout
    assert lines[0]["weights"] == lines[1]["weights"] and lines[0]["accuracy"] > 0.85, lines
    assert "worker rank 1 is lost" in stderr and "read the run's result from the box" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]


SAMPLER_LOOP = """
import json
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
import parambox

data = TensorDataset(torch.arange(100), torch.randn(100, 4))
model = torch.nn.Linear(4, 1)
opt = parambox.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), "easgd",
                                    box="rma", steps=5, timeout=30)
seen = []
if opt.trains:
    sampler = DistributedSampler(data, num_replicas=opt.workers, rank=opt.rank, seed=0)
    for index, x in DataLoader(data, batch_size=10, sampler=sampler):
        seen += index.tolist()
        opt.zero_grad()
        F.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
opt.close()
print(json.dumps({"rank": opt.rank, "workers": opt.workers, "trains": opt.trains, "seen": seen}))
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_distributed_sampler_over_opt_workers_covers_the_data_once_with_a_memory_rank(tmp_path):
    """``mpiexec -n 3``, the rma box on its memory rank (rank 2): ``opt.workers`` is 2 on every rank, so
    a ``DistributedSampler`` over it gives the two workers every sample of the epoch once. Over
    ``world_size`` (3) a third of the data would sit on the rank that trains nothing."""
    from parambox.runtime import spawn
    from tests.conftest import MPI_ENV

    if spawn.find_mpiexec() is None:
        pytest.skip("no mpiexec found")
    script = tmp_path / "sampler.py"
    script.write_text(SAMPLER_LOOP)
    env = {**os.environ, **MPI_ENV, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = spawn.start_mpi(
        [sys.executable, str(script)], 3, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        spawn.stop([proc])
    assert proc.returncode == 0, stderr[-3000:]
    lines = sorted((json.loads(s) for s in stdout.splitlines() if s.startswith("{")), key=lambda x: x["rank"])
    assert [(line["workers"], line["trains"]) for line in lines] == [(2, True), (2, True), (2, False)], lines
    assert sorted(lines[0]["seen"] + lines[1]["seen"]) == list(range(100))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_own_loop_example_under_mpiexec_on_the_rma_box():
    """Example (c) across nodes' way: ``mpiexec -n 3 ... --strategy easgd --box rma``. Rank 2 holds the
    box (``opt.trains`` False: it skips the loop), the two others train, and all three end with the
    same model."""
    from parambox.runtime import spawn
    from tests.conftest import MPI_ENV

    if spawn.find_mpiexec() is None:
        pytest.skip("no mpiexec found")
    env = {**os.environ, **MPI_ENV, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(ROOT / "examples/own_loop.py"), "--strategy", "easgd", "--box", "rma"]
    proc = spawn.start_mpi(cmd, 3, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        spawn.stop([proc])
    assert proc.returncode == 0, stderr[-3000:]
    lines = re.findall(r"rank (\d): easgd (final loss [\d.]+|held the box), test accuracy ([\d.]+)", stdout)
    done = {rank: what for rank, what, _ in lines}
    assert sorted(done) == ["0", "1", "2"], stdout
    assert done["2"] == "held the box" and done["0"].startswith("final loss"), stdout
    accuracies = {accuracy for _, _, accuracy in lines}
    assert len(accuracies) == 1 and float(accuracies.pop()) > 0.85, stdout


@pytest.mark.timeout(240)
def test_uneven_step_counts_are_refused_on_every_rank(tmp_path):
    """Before: rank 0's close() met rank 1's gradient allreduce; rank 0 exited 0 with a chance-level
    model and rank 1 timed out naming "step -1". Now both ranks get a UserError at once."""
    torchrun("tests/distopt_worker.py", "uneven", "allreduce", str(tmp_path), timeout=200)
    told = [(tmp_path / f"uneven-rank{r}.txt").read_text() for r in (0, 1)]
    assert all("same number of steps" in t for t in told), told
    assert "closing" in told[0] and "stepping" in told[1] and "at step 3" in told[1]


def test_a_forgotten_close_is_warned_at_exit():
    """One interpreter (its start is most of the test): an optimizer closed, then one left open. Exactly
    one warning at exit, naming the one left open: a closed optimizer warns nothing."""
    script = (
        "import torch, parambox\n"
        "for strategy in ('weight-avg', 'allreduce'):\n"
        "    m = torch.nn.Linear(2, 1)\n"
        "    opt = parambox.DistributedOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.1), strategy)\n"
        "    opt.zero_grad(); m(torch.ones(4, 2)).sum().backward(); opt.step()\n"
        "    if strategy == 'weight-avg':\n"
        "        opt.close()\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0 and proc.stderr.count("was never closed") == 1, proc.stderr
    assert "DistributedOptimizer('allreduce') was never closed" in proc.stderr, proc.stderr


RMA_LOOP = """
import json, os, sys, warnings
import torch, torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
import parambox

warnings.simplefilter("error", UserWarning)  # torch's "lr_scheduler.step() before optimizer.step()"
x, y = load_digits(return_X_y=True)
x, y = torch.tensor(x / 16, dtype=torch.float32), torch.tensor(y)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
schedule = torch.optim.lr_scheduler.StepLR(optimizer, 100, gamma=0.5)
opt = parambox.DistributedOptimizer(model, optimizer, "easgd", steps=200, box="rma")
g = torch.Generator().manual_seed(opt.rank)
if opt.trains or not os.environ.get("SKIP"):
    for _ in range(200):
        i = torch.randint(0, 1400, (32,), generator=g)
        loss = F.cross_entropy(model(x[i]), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
opt.close()
accuracy = float((model(x[1400:]).argmax(1) == y[1400:]).float().mean())
print(json.dumps({"rank": opt.rank, "trains": opt.trains, "accuracy": accuracy, "lr": schedule.get_last_lr()[0]}))
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("skip", [pytest.param(False, marks=pytest.mark.long), True])
def test_rma_box_memory_rank_in_a_users_loop_says_so_and_serves(tmp_path, skip):
    """``mpiexec -n 3`` on the rma box: rank 2 holds EASGD's center and trains nothing. Where its loop
    runs, its first step says so once, naming ``opt.trains`` and ``memory_ranks=0`` (before: "easgd has
    ended this worker's run", and torch's scheduler warned that the optimizer never stepped); where the
    loop is skipped, nothing is said. Either way every rank ends with the same trained model."""
    from tests.conftest import MPI_ENV, run_mpi_script

    script = tmp_path / "loop.py"
    script.write_text(RMA_LOOP)
    env = {**os.environ, **MPI_ENV, "OMP_NUM_THREADS": "1", "SKIP": "1" if skip else ""}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    stdout, stderr, code = run_mpi_script(str(script), 3, env, timeout=200)
    assert code == 0, stderr[-3000:]
    lines = sorted((json.loads(s) for s in stdout.splitlines() if s.startswith("{")), key=lambda x: x["rank"])
    assert [line["trains"] for line in lines] == [True, True, False]
    assert len({line["accuracy"] for line in lines}) == 1 and lines[0]["accuracy"] > 0.85
    assert [line["lr"] for line in lines[:2]] == [0.05, 0.05]
    told = [line for line in stderr.splitlines() if "parambox: warning" in line]
    if skip:
        assert told == [], stderr[-3000:]
        return
    assert len(told) == 1 and "rank 2 holds easgd's box and trains nothing" in told[0], stderr[-3000:]
    assert "opt.trains" in told[0] and "'memory_ranks': 0" in told[0]
