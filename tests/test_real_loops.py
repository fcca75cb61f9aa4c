"""The loops users already have, through ``DistributedOptimizer``: clipping between backward and step,
``no_sync`` accumulation, AdamW with a schedule set through ``param_groups``, ``GradScaler``,
``opt.state_dict()`` checkpoints resumed in a fresh process, ``torch.save(model)``, and a model with a
``-inf`` mask buffer. Tier (a) in one process; tier (b) under torchrun with closed forms
(``tests/realloop_worker.py``)."""

from __future__ import annotations

import io
import json
import os
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
from tests.conftest import ROOT, run_cli
from tests.realloop_worker import batch, build, lr_at, reference

# Deterministic rules: a resumed run is its uninterrupted run bit for bit; the synchronous gradient
# averaging ones are one process (their .grad is averaged when backward() returns: clipping sees it).
SYNCHRONOUS = ("allreduce", "ps-sync", "box-sync")
DETERMINISTIC = ("allreduce", "ps-sync", "box-sync", "weight-avg", "easgd+sync", "diloco", "diloco+int8")
DETERMINISTIC += ("diloco+stream",)  # Streaming DiLoCo: two fragments, tau 1, alpha 0.5
# The rest (asynchronous: their interleaving is the machine's) finish, agree after close, and train.
ASYNCHRONOUS = ("downpour", "dynsgd", "hogwild", "dogwild", "easgd", "hybrid", "diloco+async")
ASYNCHRONOUS += ("downpour+int8", "easgd+int8")  # their pushes int8 with error feedback
ASYNCHRONOUS += ("diloco+astream",)  # Streaming DiLoCo, asynchronous over the box


def torchrun(
    n: int, *args: str, timeout: float = 300, restarts: int = 0, check: bool = True, **env: str
) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env)
    with tempfile.TemporaryDirectory(prefix="pb-torchrun-") as logs:
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--log-dir", logs]
        cmd += [
            "--max-restarts",
            str(restarts),
            "--nproc-per-node",
            str(n),
            "tests/realloop_worker.py",
            *args,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert not check or proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-4000:]}"
    )
    return proc


def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def finals(out: Path, name: str, n: int = 2) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"{name}-rank{r}.pt", weights_only=True) for r in range(n)]


# -- tier (b): under torchrun ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.long
def test_the_user_loop_on_every_strategy_resumes_where_it_stopped(tmp_path):
    """Must show (issue 48): K = 2 micro-steps with no_sync, clip_grad_norm_ between backward and step,
    AdamW with warmup + cosine through param_groups, on 2 ranks. allreduce, ps-sync and box-sync equal
    one process on the global batch; a run stopped at step 5 (opt.state_dict() + model.state_dict()) and resumed in a fresh
    torchrun job ends bit for bit where the uninterrupted run ends, for every deterministic rule; the
    asynchronous ones finish with every rank holding the same trained model."""
    full, half = tmp_path / "full", tmp_path / "resumed"
    full.mkdir(), half.mkdir()
    deterministic = ",".join(DETERMINISTIC)
    torchrun(2, f"{deterministic},{','.join(ASYNCHRONOUS)}", str(full), "2", "0", "10")
    torchrun(2, deterministic, str(half), "2", "0", "5")
    torchrun(2, deterministic, str(half), "2", "5", "10")
    one_process = reference(2, 2)
    for name in SYNCHRONOUS:
        for state in finals(full, name):
            assert diff(state, one_process) <= 1e-5, name
    for name in DETERMINISTIC:
        a, b = finals(full, name), finals(half, name)
        assert diff(a[0], a[1]) == 0.0, name
        assert diff(a[0], b[0]) <= 1e-6 and diff(a[1], b[1]) <= 1e-6, name
    init = build()[0].state_dict()
    for name in ASYNCHRONOUS:
        a = finals(full, name)
        assert diff(a[0], a[1]) == 0.0, name
        assert all(torch.isfinite(v).all() for v in a[0].values()), name
        assert diff(a[0], init) > 1e-3, name


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_synchronous_rules_on_three_ranks_with_four_micro_steps_equal_one_process(tmp_path):
    torchrun(3, ",".join(SYNCHRONOUS), str(tmp_path), "4", "0", "10")
    one_process = reference(4, 3)
    for name in SYNCHRONOUS:
        for state in finals(tmp_path, name, 3):
            assert diff(state, one_process) <= 1e-5, name


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("grown", [pytest.param(2, marks=pytest.mark.long), 3])
def test_a_torch_distributed_checkpoint_resumes_the_synchronous_rules_where_they_stopped(tmp_path, grown):
    """torchtitan's checkpoint: ``get_state_dict(model, opt)`` and ``dcp.save``, on 2 ranks at step 3,
    then a fresh torchrun job (on 2 ranks, or on 3 as an elastic job that grew) ``dcp.load``s and
    ``set_state_dict``s into a fresh wrap (torch's state initialisation steps it once: it counts no
    step), saves again at step 6, and 2 ranks finish: each step equals the one-process run on its
    global batch. (ps-sync's optimizer state is its server's alone: its workers offer none, so the
    one copy of each tensor the checkpoint writes is the server's, also after a resume.)"""
    names, folder = ",".join(SYNCHRONOUS), str(tmp_path)
    torchrun(2, names, folder, "2", "0", "3", "dcp")
    torchrun(grown, names, folder, "2", "3", "6", "dcp")
    torchrun(2, names, folder, "2", "6", "10", "dcp")
    assert not list(tmp_path.glob("*-ckpt-rank*.pt"))  # nothing went through opt.state_dict() files
    one_process = reference(2, 2, resized={3: grown, 6: 2})
    for name in SYNCHRONOUS:
        for state in finals(tmp_path, name):
            assert diff(state, one_process) <= 1e-5, name


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(400)
def test_every_rule_takes_a_torch_distributed_checkpoint_in_the_order_that_keeps_its_copy(tmp_path):
    """tests/dcp_worker.py on 2 ranks, every data-parallel rule: the model loaded before wrapping, the
    optimizer's state after; the run goes on (no refusal, no hang) and every rank ends with one finite,
    trained model."""
    rules = [n for n in ONE_PROCESS if strategy_class(n).max_workers != 1] + [
        "diloco+stream",
        "diloco+astream",
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory(prefix="pb-torchrun-") as logs:
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--log-dir", logs]
        cmd += ["--nproc-per-node", "2", "tests/dcp_worker.py", ",".join(rules), str(tmp_path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=380, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    from tests.dcp_worker import build

    init = build()[0].state_dict()
    for name in rules:
        a, b = finals(tmp_path, name)
        assert diff(a, b) == 0.0, name
        assert all(torch.isfinite(v).all() for v in a.values()), name
        assert diff(a, init) > 1e-3, name


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name", [SYNCHRONOUS[0], *(pytest.param(n, marks=pytest.mark.long) for n in SYNCHRONOUS[1:])]
)
def test_a_job_torchrun_restarts_after_a_death_resumes_from_the_loops_last_checkpoint(tmp_path, name):
    """torchrun --max-restarts 1, rank 1 SIGKILLed at step 5 of 10, the loop checkpointing every 2 steps:
    the restarted job resumes at step 4 and ends at one process's weights on the global batch. Before,
    the restarted ranks read the dead life's addresses in the store torchrun's agents keep across
    restarts: a 30 s connect timeout, then a failure."""
    proc = torchrun(
        2, name, str(tmp_path), "1", "0", "10", "restart", restarts=1, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"
    )
    assert "exitcode: -9" in proc.stderr  # the first life lost rank 1
    for state in finals(tmp_path, name):
        assert diff(state, reference(1, 2)) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_torchrun_restart_over_the_agents_shared_store_is_refused_in_one_line(tmp_path):
    """The store torchrun's agents keep across restarts (torch's default; a DDP script whose ranks
    arrive a second apart fails on it too, torch issue 135712): the restarted DistributedOptimizer
    says to set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, at once, instead of timing out."""
    shared = torchrun(2, "allreduce", str(tmp_path), "1", "0", "10", "restart", restarts=1, check=False)
    assert shared.returncode != 0
    assert "share one store across restarts" in shared.stderr
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_horovod_style_loop_on_three_ranks_equals_one_process(tmp_path):
    """horovod's idiom: backward_passes_per_step=4 and four plain backward passes, opt.synchronize(),
    the clip, ``with opt.skip_synchronize(): opt.step()``; the synchronous rules equal one process."""
    torchrun(3, ",".join(SYNCHRONOUS), str(tmp_path), "4", "0", "10", "horovod")
    one_process = reference(4, 3)
    for name in SYNCHRONOUS:
        for state in finals(tmp_path, name, 3):
            assert diff(state, one_process) <= 1e-5, name


# -- tier (a): one process ------------------------------------------------------------------------------


def _scaled_run(wrap: bool, strategy: str = "allreduce") -> tuple[dict[str, torch.Tensor], float, int]:
    """AdamW + a torch scheduler + GradScaler (unscale_ on odd steps, clip), an inf at step 2."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    base = torch.optim.AdamW(model.parameters(), lr=0.1)
    opt = parambox.DistributedOptimizer(model, base, strategy) if wrap else base
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(5):
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(torch.ones(3, 4) * step), torch.zeros(3, 2))).backward()
        if step == 2:
            model.weight.grad[0, 0] = float("inf")
        if step % 2:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()
    steps = opt.step_count if wrap else 4
    if wrap:
        opt.close()
    return {k: v.clone() for k, v in model.state_dict().items()}, scaler.get_scale(), steps


@pytest.mark.parametrize("strategy", ["allreduce", "easgd"])
def test_grad_scaler_and_a_scheduler_work_as_with_the_torch_optimizer(strategy):
    """scaler.step(opt) skips the step with an inf (the step count stays), unscales otherwise; a torch
    LRScheduler takes the wrapper (it is a torch.optim.Optimizer)."""
    plain, plain_scale, _ = _scaled_run(False)
    wrapped, scale, steps = _scaled_run(True, strategy)
    assert scale == plain_scale == 512.0
    assert steps == 4  # five steps, one skipped
    if strategy == "allreduce":
        assert diff(plain, wrapped) == 0.0


def test_the_model_stays_picklable_and_plain():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    keys = list(model.state_dict())
    opt = parambox.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), "allreduce")
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    torch.save(model, io.BytesIO())  # during the run
    assert not model._forward_pre_hooks and list(model.state_dict()) == keys
    opt.close()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert isinstance(torch.load(buf, weights_only=False), nn.Sequential)


def test_state_dict_round_trip_and_misuse():
    model = nn.Linear(3, 1)
    opt = parambox.DistributedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=0.01), "diloco")
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    state = opt.state_dict()
    assert state["parambox"]["step"] == 3 and "outer" in state["parambox"]["rule"]
    with pytest.raises(UserError, match="before the first"):
        opt.load_state_dict(state)
    with pytest.raises(UserError, match="add_param_group"):
        opt.add_param_group({"params": []})
    opt.close()
    fresh = nn.Linear(3, 1)
    other = parambox.DistributedOptimizer(fresh, torch.optim.AdamW(fresh.parameters(), lr=0.01), "easgd")
    with pytest.raises(UserError, match="saved by strategy 'diloco'.*drop the state's 'parambox' entry"):
        other.load_state_dict(state)
    plain = {k: v for k, v in state.items() if k != "parambox"}  # torch's layout: the optimizer's alone
    other.load_state_dict(plain)
    other.close()
    # and the other way: a plain torch optimizer takes a DistributedOptimizer's state (fine-tuning on
    # one device after a parambox run), its own moments in it
    alone = torch.optim.AdamW(nn.Linear(3, 1).parameters(), lr=0.01)
    alone.load_state_dict(state)
    assert alone.state_dict()["state"][0]["step"] == 3


def _dcp_run(
    strategy: str, steps: range, folder: Path, muon: bool
) -> tuple[dict, parambox.DistributedOptimizer]:
    """realloop_worker's loop in one process: a fresh wrap that loads ``folder`` (a torch.distributed
    checkpoint: ``get_state_dict`` of the fresh objects as the template, ``dcp.load``, ``set_state_dict``)
    if ``steps`` does not start at 0, and saves one there after its last step if it stops before 10."""
    from torch.distributed import checkpoint
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, adamw = build()
    vectors = [p for p in model.parameters() if p.ndim == 1]
    muon_adamw = [torch.optim.Muon([model.enc.weight, model.mid.weight], lr=0.02), torch.optim.AdamW(vectors)]
    optimizer = muon_adamw if muon else adamw
    opt = parambox.DistributedOptimizer(model, optimizer, strategy)
    try:
        if steps.start:
            model_state, optim_state = get_state_dict(model, opt)
            assert all(p.grad is None for p in model.parameters())  # as torch leaves a fresh model
            state = {"model": model_state, "optim": optim_state}
            checkpoint.load(state, checkpoint_id=folder)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            assert opt.step_count == 0
        for step in steps:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            x, y = batch(step, 0, 1)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if steps.stop < 10:
            model_state, optim_state = get_state_dict(model, opt)
            names = {n for n, p in model.named_parameters()}  # the tie's dec.weight is enc.weight
            assert set(optim_state["state"]) == names, optim_state["state"].keys()
            checkpoint.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    except BaseException:
        opt.abort()
        raise
    opt.close()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, opt


@pytest.mark.parametrize("muon", [False, True], ids=["adamw", "muon+adamw"])
@pytest.mark.parametrize("strategy", SYNCHRONOUS)
def test_torch_distributed_checkpoint_resumes_a_wrapped_optimizer_where_it_stopped(tmp_path, strategy, muon):
    """torchtitan's checkpoint in one process: ``get_state_dict(model, opt)`` keys the optimizer's state
    by parameter name (two optimizers merged as torch merges a list), ``dcp.save`` at step 4, and a fresh
    wrap loading it ends where the uninterrupted 10 steps end."""
    whole, _ = _dcp_run(strategy, range(10), tmp_path / "unused", muon)
    _dcp_run(strategy, range(4), tmp_path / "ckpt", muon)
    resumed, _ = _dcp_run(strategy, range(4, 10), tmp_path / "ckpt", muon)
    assert diff(resumed, whole) == 0.0


@pytest.mark.parametrize("strategy", [*SYNCHRONOUS, "diloco", "easgd", "eamsgd", "dogwild"])
def test_get_state_dict_every_step_changes_nothing_in_the_run(strategy):
    """A checkpointer calling ``get_state_dict(model, opt)`` every step, with a stateless SGD (so torch
    steps the optimizer at rate 0 to create its state whenever the gradients are unset): the run ends
    where the run without it ends, and counts the same steps."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def run(look: bool) -> tuple[dict, int]:
        model = build()[0]
        opt = parambox.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), strategy)
        with opt:
            for step in range(6):
                opt.zero_grad()
                if look:
                    get_state_dict(model, opt)
                x, y = batch(step, 0, 1)
                F.mse_loss(model(x), y).backward()
                opt.step()
                if look:
                    get_state_dict(model, opt)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, opt.step_count

    (looked, steps), (plain, _) = run(True), run(False)
    assert diff(looked, plain) == 0.0 and steps == 6


def test_torch_distributed_checkpoint_of_weights_loaded_after_wrapping_is_refused_naming_the_order(tmp_path):
    """DiLoCo keeps global weights it copied at wrapping: a ``set_state_dict`` of the model after wrapping
    is refused at the first step naming the order that works, and that order works."""
    _dcp_run("diloco", range(4), tmp_path / "ckpt", muon=False)
    with pytest.raises(UserError, match="set_model_state_dict before, set_optimizer_state_dict after"):
        _dcp_run("diloco", range(4, 10), tmp_path / "ckpt", muon=False)
    # the order it names: the model loaded before wrapping, the optimizer's state after
    from torch.distributed import checkpoint
    from torch.distributed.checkpoint import state_dict as dsd

    model, adamw = build()
    state = {"model": dsd.get_model_state_dict(model)}
    checkpoint.load(state, checkpoint_id=tmp_path / "ckpt")
    dsd.set_model_state_dict(model, state["model"])
    with parambox.DistributedOptimizer(model, adamw, "diloco") as opt:
        state = {"optim": dsd.get_optimizer_state_dict(model, opt)}
        checkpoint.load(state, checkpoint_id=tmp_path / "ckpt")
        dsd.set_optimizer_state_dict(model, opt, state["optim"])
        assert float(adamw.state[model.enc.weight]["step"]) == 4  # AdamW's moments of the 4 steps
        F.mse_loss(model(batch(4, 0, 1)[0]), batch(4, 0, 1)[1]).backward()
        opt.step()


class MaskedNet(nn.Module):
    """A causal mask registered as a buffer of -inf, as many transformer scripts do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.triu(torch.full((4, 4), float("-inf")), diagonal=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x).unsqueeze(1) + self.mask).softmax(-1).sum(1)


# Every strategy a loop can take that runs in one process (hybrid needs two: the CLI test).
ONE_PROCESS = [
    n
    for n in STRATEGIES
    if not strategy_class(n).owns_forward_backward and strategy_class(n).accepts_workers(1)
]


@pytest.mark.parametrize("strategy", ONE_PROCESS)
def test_a_minus_inf_mask_buffer_is_not_a_diverged_round(strategy):
    torch.manual_seed(0)
    model = MaskedNet()
    start = model.lin.weight.detach().clone()
    options = (
        {"inner_steps": 2} if strategy == "diloco" else {"period": 2} if strategy == "weight-avg" else {}
    )
    with parambox.DistributedOptimizer(
        model, torch.optim.SGD(model.parameters(), lr=0.5), strategy, options
    ) as opt:
        for _ in range(6):
            opt.zero_grad()
            F.mse_loss(model(torch.randn(8, 4)), torch.ones(8, 4)).backward()
            opt.step()
    assert torch.isfinite(model.lin.weight).all() and (model.lin.weight - start).abs().max() > 1e-3
    assert torch.equal(model.mask, MaskedNet().mask)


def test_a_run_whose_every_round_is_rejected_fails_loudly():
    model = nn.Linear(3, 1)
    opt = parambox.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), "diloco")
    for _ in range(4):
        opt.zero_grad()
        (model(torch.ones(2, 3)).sum() * float("nan")).backward()
        opt.step()
    with pytest.raises(UserError, match="every one of the .* outer steps was rejected"):
        opt.close()


@pytest.mark.parametrize("strategy", ["allreduce", "easgd"])
def test_a_compiled_model_trains_as_the_plain_one(strategy, recwarn):
    """torch.compile(model) before wrapping (dynamo with the eager backend: no C++ toolchain needed)."""
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        run = torch.compile(model, backend="eager") if compiled else model
        with parambox.DistributedOptimizer(run, torch.optim.SGD(run.parameters(), lr=0.1), strategy) as opt:
            for step in range(4):
                opt.zero_grad()
                F.mse_loss(run(torch.ones(3, 4) * step), torch.zeros(3, 2)).backward()
                opt.step()
        results.append({k.removeprefix("_orig_mod."): v for k, v in run.state_dict().items()})
    assert diff(*results) <= 1e-6
    assert not [w for w in recwarn if "global hooks" in str(w.message)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["diloco", "hybrid"])
def test_the_gpt_with_a_mask_buffer_trains_from_the_cli(tmp_path, strategy):
    """Must show (issue 48): a transformer whose causal mask is a -inf buffer trains (bits per byte fall
    from the untrained model's 7.7) and its checkpoint is written: nothing reads the mask as a divergence."""
    args = ["train", "--strategy", strategy, "--workers", "2", "--steps", "12", "--batch-size", "4"]
    args += ["--data", "text", "--out", str(tmp_path / "run"), "--no-progress"]
    args += ["--model", "parambox.models.gpt:gpt_with_mask_buffer"]
    proc = run_cli(*args, check=False)  # in this process: its workers fork warm from the session's zygote
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "not finite" not in proc.stderr and "non-finite" not in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_test_bits_per_byte"] < 7.0
    assert (tmp_path / "run" / "checkpoints" / "last.pt").exists()
