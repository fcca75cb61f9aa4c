"""``parambox pick``: which strategy reaches a target accuracy first with N workers, here.

1. The *reference* (``allreduce``) trains until its test metric reaches the target: samples to the
   target S_ref and its test loss against samples (it is also ``allreduce``'s own probe).
2. Every other candidate (:mod:`parambox.studies.pick.candidates`; each encoding of ``compressions``
   its exchange takes is a candidate of its own) gets a *probe* on the same launcher
   and cluster, evaluated every few steps: until its test loss has come all the way the reference's
   went, or for as many steps as the reference took. Learning curves that sit on a plateau before
   they fall, or stall after a fast start (DiLoCo), need that much; one that gets there early stops
   early.
3. :mod:`parambox.studies.pick.model` turns each probe into a predicted time to the target (with a
   band), and the candidates are ranked, each with the reason for its rank.
3a. ``confirm`` K (default 5): the top K predictions are trained to the target and put first in the
   order they reached it; the rest keep their predicted order. A probe's convergence ratio is read
   over the first part of the way and is often optimistic (local SGD's and Adagrad's early pace), so
   a race among the few the model puts ahead costs K runs and catches a top pick that only looked
   fast. Five, not three: with the predictions 15-25 % off, the fastest setups are at times predicted
   4th or 5th (docs/results/pick-validation.md).
   The leader then runs again (one run's time to the target spreads by 10-40 %: the race's fastest
   single run is often a lucky draw), a new leader too, and the race goes on past K while a
   candidate not yet raced is predicted faster than the leader's time, allowing for the model's
   error as the race measured it (two deviations of it; up to 2K entries): the model's order is not
   trusted past the leader's measured time and its own error, and a prediction within them could
   still win (docs/results/pick-validation.md).
   ``predicted_rank`` keeps the model's own order, and validation scores both.
4. ``validate``: every candidate ranked (``num_validated`` None), or the top K and K others drawn at
   random, and the reference are trained to the target, ``validate_runs`` times each (the median is
   the measurement); their measured times against the predicted
   ones give the scores of :mod:`~parambox.studies.pick.scores` (Kendall's tau, the top pick's hit,
   the prediction error per setup and family). ``seeds`` repeats probes and validations with seeds
   ``seed, seed + 1, ...`` (``run_pick_seeds``).

After every run the ranking so far is in ``out/pick.json`` (``partial``), and ``budget_s`` bounds the
whole pick: :mod:`parambox.studies.pick.budget` (the order of the probes, one per strategy first, is its).

The target is the user's metric (``target_metric``, ``test_<name>`` in the evaluations; accuracy by
default), reached at or above ``target``, or at or under it where ``lower_is_better`` (perplexity, bits per
byte, a loss: ``parambox.workload.targets``). Asynchronous candidates count every rank's samples on the aligned clocks (``runs.read_ranks``):
their ranks do not keep rank 0's pace, nor pause while it evaluates (``Measured.training_rate``).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from parambox.errors import RunFailed, UserError
from parambox.studies.pick import model as pm
from parambox.studies.pick import runs, scores
from parambox.studies.pick.budget import Budget, BudgetSpent, breadth_first, write_json
from parambox.studies.pick.candidates import (
    DEFAULT_COMPRESSIONS,
    Candidate,
    compression_of,
    message_bytes,
    pull_bytes,
    registry_candidates,
    with_compression,
)
from parambox.studies.pick.candidates import (
    topology as candidate_topology,
)
from parambox.workload.targets import Target

REFERENCE = "allreduce"  # the baseline: validation always measures it
# A top pick whose convergence ratio fell below this fraction of its first value is not confident: such
# picks measured up to 1.6x the best (docs/results/pick-validation.md).
DRIFT_FLOOR = pm.DRIFT_FLOOR
# A raced candidate within this factor of the leader's time is a draw with it (one setup's runs spread
# by 7-14 %), and runs a second time before the race ends (docs/results/pick-validation.md).
CLOSE_RACE = 1.15
# An unraced candidate races while its prediction is within this many deviations of the race's own measured
# error (RMS of log(predicted / measured)) of the leader's time: two caught the best more often than one
# at a few runs more, three no more than two (docs/results/pick-validation.md).
RACE_DEVIATIONS = 2.0
ASSUMPTIONS = [
    "convergence per sample relative to the reference, measured over the probe, holds to the target; "
    f"one that fell under {pm.DRIFT_FLOOR:g} of its first value over the probe, its loss at a new low at "
    f"{pm.STEADY_SHARE:.0%} or more of its evaluations, falls half as far again",
    "time per step is the probe's mean (evaluations and the first steps left out)",
    "more workers than probed: communication scaled by the topology's bandwidth term (a compressed "
    "exchange's: an all-gather's, (N-1)/(n-1)), samples per step by N/n, compute per step unchanged, "
    "convergence per sample as probed",
]


@dataclass
class PickSettings:
    """What one ``pick`` does; ``base`` is a RunConfig dict (the workload, launcher and cluster)."""

    workers: int
    target: float
    base: dict[str, Any]
    out: Path
    probe_steps: int | None = None  # None: probe_fraction of the reference's steps to the target
    probe_fraction: float = 1.0
    eval_every: int = 4
    strategies: list[str] | None = None
    validate: bool = False
    num_validated: int | None = None  # None: every candidate ranked; K: the top K and K others at random
    validate_runs: int = 3  # runs to the target per validated setup; its measured time is their median
    seeds: int = 1
    target_metric: str = "accuracy"  # the evaluations' test_<target_metric> reaches ``target``
    lower_is_better: bool = False  # reaching is falling to ``target`` (perplexity), not rising to it
    run_timeout_s: float = 900.0
    probe_timeout_s: float = 180.0  # a probe is a few dozen steps: one that hangs is given up soon
    fixed: set[str] = field(default_factory=set)  # run fields the user set: no preset overrides them
    confirm: int = 5  # the top K predictions trained to the target, first in their measured order (0: off)
    budget_s: float | None = None  # the whole pick's time limit (None: none; ``budget``)
    compressions: tuple[str, ...] = DEFAULT_COMPRESSIONS  # the encodings tried on exchanges that take one

    def __post_init__(self) -> None:
        n = self.probe_workers
        if self.validate and n < self.workers:
            raise UserError(
                f"--validate scores the predictions for {self.workers} workers by training {self.workers}, but "
                f"this machine runs {n} at a time (its cores): validate on the cluster, or pick for --workers {n}"
            )

    @property
    def probe_workers(self) -> int:
        """Probe with N workers where the cores allow, else with as many as there are cores (at least 2,
        so that communication is measured); the scalability model goes from there to N."""
        return min(self.workers, max(os.cpu_count() or 1, 2))

    @property
    def metric(self) -> str:
        return f"test_{self.target_metric}"

    @property
    def goal(self) -> Target:
        return Target(self.target_metric, self.target, self.lower_is_better)


Say = Callable[[str], None]


def run_pick(s: PickSettings, say: Say = print) -> dict[str, Any]:
    """The pick; the ranking so far is in ``s.out/pick.json`` after every measurement (``partial``:
    true until the end), and ``s.budget_s`` bounds the whole (``parambox.studies.pick.budget``)."""
    t0 = time.perf_counter()
    budget = Budget(s.budget_s)
    n = s.probe_workers
    base = _base(s, n)
    plain = _with_user_options(registry_candidates(n, s.strategies, base), base, s)
    across_nodes = int((base.get("cluster") or {}).get("nodes") or 1) > 1
    candidates = with_compression(plain, s.compressions, across_nodes)
    reference = Candidate(REFERENCE).overridden(base["options"].get(REFERENCE, {}), s.fixed)
    if not plain:
        raise UserError(f"no registered strategy runs {s.workers} workers ({n} probed)")
    if not candidates:
        raise UserError(
            f"--compression {','.join(s.compressions)}: no candidate's exchange takes it (add none to "
            "consider them uncompressed)"
        )
    candidates = _probe_order(candidates, reference)
    shapes = _parameter_shapes(base)
    st = _State(s, n, base, reference, budget, t0, candidates)
    st.write()
    say(f"reference: {REFERENCE} x{n} until test {s.goal}")
    ref = _reference(s, base, reference, budget)
    st.ref = ref
    s_ref = ref.samples_to(s.target)
    ref_curve = ref.curve("test_loss")
    st.probe_steps = s.probe_steps or max(
        2 * s.eval_every, math.ceil(s.probe_fraction * ref.steps[-1]["step"])
    )
    st.stop_loss = pm.progress_level(ref_curve, pm.STOP_PROGRESS)
    entries, excluded = st.entries, st.excluded
    try:
        for i, cand in enumerate(candidates, 1):
            if cand == reference:
                measured, ratio = ref, pm.Ratio(1.0, 1.0, 1.0, [1.0])
            else:
                budget.check("probes")
                say(f"probe [{i}/{len(candidates)}] {cand.label}")
                cand, measured = _probe(s, base, cand, st.probe_steps, st.stop_loss, budget)
                ratio = (
                    None if measured.error else pm.convergence_ratio(ref_curve, measured.curve("test_loss"))
                )
            st.done(candidates[i - 1])
            cost = None if measured.error else measured.cost()  # its warmup steps left out
            if measured.error:
                excluded.append({**_describe(cand), "reason": f"cannot run here: {measured.error}"})
            elif cost is None:
                excluded.append({**_describe(cand), "reason": "too few steps in its probe to time one"})
            else:
                exchange = _exchange(cand, shapes)
                cost = pm.scale_cost(cost, exchange, n, s.workers)
                entries.append((cand, measured, replace(pm.predict(s_ref, ratio, cost), exchange=exchange)))
                st.order = pm.rank_order([p for _, _, p in entries])
            st.write()
    except BudgetSpent:
        say(f"the budget ran out in the probes: {len(st.unmeasured)} candidates not measured")
    if not entries:
        if budget.spent_in:
            raise UserError("the budget ran out before any candidate was probed: raise --budget")
        raise UserError("no candidate could be probed here; see the excluded list (--json)")
    st.order = pm.rank_order([p for _, _, p in entries])
    if s.confirm and n < s.workers:
        st.race = (
            f"not raced: a race trains {s.workers} workers and this machine runs {n} at a time, so the "
            f"ranking is the model's, from probes of {n} scaled to {s.workers}; race it where {s.workers} run"
        )
        say(st.race)
    elif s.confirm and not budget.spent_in:
        st.order, st.confirmed = _confirm(s, base, entries, st.order, ref, reference, say, st)
    result = st.result()
    if s.validate and not budget.spent_in:
        from parambox.studies.pick.validation import validate

        result["validation"] = validate(s, base, result["ranking"], entries, ref, reference, say, budget)
    result["budget"] = budget.as_json()
    result["partial"] = budget.spent_in is not None
    result["wall_time_s"] = time.perf_counter() - t0
    return result


@dataclass
class _State:
    """What a pick has measured so far, and its result as it stands (``write``: to ``out/pick.json``)."""

    s: PickSettings
    n: int
    base: dict[str, Any]
    reference: Candidate
    budget: Budget
    t0: float
    candidates: list[Candidate]
    ref: runs.Measured | None = None
    probe_steps: int | None = None
    stop_loss: float | None = None
    entries: list[tuple[Candidate, runs.Measured, pm.Prediction]] = field(default_factory=list)
    excluded: list[dict[str, Any]] = field(default_factory=list)
    order: list[int] = field(default_factory=list)
    confirmed: dict[int, list[runs.Measured]] = field(default_factory=dict)
    measured: list[Candidate] = field(default_factory=list)
    race: str | None = None  # why the top predictions were not raced, where they were not

    @property
    def unmeasured(self) -> list[Candidate]:
        return [c for c in self.candidates if c not in self.measured]

    def done(self, cand: Candidate) -> None:
        self.measured.append(cand)

    def result(self) -> dict[str, Any]:
        s, base, ref = self.s, self.base, self.ref
        ranking = _rank(self.entries, self.order, self.confirmed, s.workers) if self.entries else []
        by_prediction = sorted(ranking, key=lambda r: r["predicted_rank"])
        return {
            "workers": s.workers,
            "probe_workers": self.n,
            "target_accuracy": None if s.lower_is_better else s.target,  # the value, where it rises to it
            "target_metric": s.target_metric,
            "target": s.goal.as_json(),
            "seed": base.get("seed"),
            "workload": {
                k: base.get(k) for k in ("model", "data", "loss", "batch_size", "lr", "optimizer", "momentum")
            },
            "cluster": base["cluster"] if (base.get("cluster") or {}).get("nodes") else None,
            "reference": None
            if ref is None
            else {
                "strategy": REFERENCE,
                "samples_to_target": ref.samples_to(s.target),
                "time_to_target_s": ref.reached_s,
                "time_to_target_with_evaluations_s": ref.reached_wall_s,
                "run_dir": str(ref.run_dir),
            },
            "model": {"time": "samples to target / samples per second", "assumptions": ASSUMPTIONS},
            "probe_steps": self.probe_steps,
            "probe_stop_test_loss": self.stop_loss,
            "eval_every": s.eval_every,
            "compressions": list(s.compressions),
            "ranking": ranking,
            "excluded": self.excluded,
            "unmeasured": [_describe(c) for c in self.unmeasured],
            "confirmed": len(self.confirmed),
            "race": self.race,
            "confident": bool(ranking)
            and _confident(by_prediction, self.reference.label)
            and ranking[0]["predicted_rank"] == 1,
        }

    def write(self) -> None:
        """The result so far, marked ``partial``, to ``out/pick.json`` (atomically)."""
        result = self.result() | {"budget": self.budget.as_json(), "partial": True}
        self.s.out.mkdir(parents=True, exist_ok=True)
        write_json(self.s.out / "pick.json", result | {"wall_time_s": time.perf_counter() - self.t0})


def _base(s: PickSettings, n: int) -> dict[str, Any]:
    from parambox.config import merge
    from parambox.studies.runs import validate as check

    base = merge(
        s.base,
        {"workers": n, "eval_every": s.eval_every, "log_every": 1, "checkpoint_every": 0, "progress": False},
    )
    base.pop("out", None)
    check(base)  # a bad field fails here, before anything runs
    return base


def _with_user_options(candidates: list[Candidate], base: dict[str, Any], s: PickSettings) -> list[Candidate]:
    """The candidates that accept N workers too, with the user's own ``[strategy]`` table over each
    preset's (``--set easgd.tau=8``) and the user's run fields over theirs (``--lr``), once each."""
    from parambox.strategies import strategy_class

    out: list[Candidate] = []
    for c in candidates:
        c = c.overridden(base.get("options", {}).get(c.strategy, {}), s.fixed)
        if strategy_class(c.strategy).accepts_workers(s.workers) and c not in out:
            out.append(c)
    return out


def _probe_order(candidates: list[Candidate], reference: Candidate) -> list[Candidate]:
    """The reference first (measured already), then one probe per strategy, then its other variants;
    the compressed ones after all float32 ones, in the same order (``budget``: the strategies first)."""
    rest = [c for c in candidates if c != reference]
    plain = [c for c in rest if compression_of(c) == "none"]
    packed = [c for c in rest if compression_of(c) != "none"]
    out = [c for c in candidates if c == reference]
    for group in (plain, packed):
        out += [group[i] for i in breadth_first([(c.strategy, c.label) for c in group])]
    return out


def _parameter_shapes(base: dict[str, Any]) -> list[Any] | None:
    """The shapes of the workload's trainable parameters (its model built here once), for the bytes
    each candidate's exchange moves; None where it cannot be built in this process (the runs can:
    the bytes are then not reported, and the predictions do not need them)."""
    import torch

    from parambox.studies.runs import validate
    from parambox.workload import build_workload

    try:
        torch.manual_seed(0)
        model = build_workload(validate(base)).build_model()
    except Exception:  # a user's factory that needs the workers' setting (a device, a launcher)
        return None
    return [p.shape for p in model.parameters() if p.requires_grad]


def _exchange(c: Candidate, shapes: list[Any] | None) -> pm.Exchange:
    """The candidate's exchange for the performance model: its topology, one rank's message as encoded
    (and, through the box, the float32 pull that answers it), and whether the messages are all-gathered
    (a collective's compressed ones, not powersgd's: its two allreduces sum; the box sums what it
    receives)."""
    topology = candidate_topology(c)
    size = None if shapes is None else float(message_bytes(c, shapes))
    pull = None if shapes is None else pull_bytes(c, shapes)
    gathered = compression_of(c) not in ("none", "powersgd") and topology != "box"
    return pm.Exchange(topology, size, gathered, None if pull is None else float(pull))


def _reference(s: PickSettings, base: dict[str, Any], reference: Candidate, budget: Budget) -> runs.Measured:
    cfg = reference.config(base)
    ref = runs.run_to_target(cfg, s.out / "reference", s.goal, budget.timeout(s.run_timeout_s))
    if ref.error and budget.left() <= 0:
        raise UserError(
            f"the budget ran out before the reference run ({REFERENCE}) reached test {s.goal} (best "
            f"{_best(s, ref)}): ease the target or raise --budget"
        )
    if ref.error:  # the user's input refused (exit 2), or a run that failed (exit 1)
        log = "" if "(log: " in ref.error else f" (log: {ref.run_dir / 'train.log'})"
        raise (UserError if ref.user_error else RunFailed)(
            f"the reference run ({REFERENCE}) failed: {ref.error}{log}"
        )
    reported = sorted({k.removeprefix("test_") for e in ref.evals for k in e if k.startswith("test_")})
    like = [m for m in reported if "acc" in m.lower()]
    if s.target_metric == "accuracy" and "accuracy" not in reported and len(like) == 1:
        s.target_metric = like[0]  # the user's own accuracy under another name (acc, top1_acc)
        ref.metric = s.metric
        ref.reached_s, ref.reached_wall_s = ref.time_to(s.target) or (None, None)
    if not any(s.metric in e for e in ref.evals):
        raise UserError(
            f"the workload's evaluations report no {s.target_metric!r} (they report {reported}): "
            "name the metric to reach with --target-metric"
        )
    if ref.samples_to(s.target) is None:
        raise UserError(
            f"the reference run ({REFERENCE}) did not reach test {s.goal} in {cfg['steps']} steps (best "
            f"{_best(s, ref)}); ease the target or raise --steps"
        )
    if len(ref.curve("test_loss").samples) < 2:
        raise UserError(
            "the reference run reached the target before its second evaluation; lower --eval-every"
        )
    return ref


def _best(s: PickSettings, ref: runs.Measured) -> str:
    """The reference's best evaluation of the target's metric so far, as text."""
    best = s.goal.best(e.get(s.metric) for e in ref.evals)
    return "none" if best is None else format(best, ".3f")


def _probe(
    s: PickSettings, base: dict[str, Any], cand: Candidate, steps: int, stop_loss: float, budget: Budget
) -> tuple[Candidate, runs.Measured]:
    """The probe; a strategy whose shm box cannot span the cluster's nodes is probed again on rma.
    ``BudgetSpent`` where the budget cut it short."""
    from parambox.config import merge

    def probe(c: Candidate) -> runs.Measured:
        cfg = merge(c.config(base), {"steps": steps})
        timeout = budget.timeout(s.probe_timeout_s)
        got = runs.run_probe(cfg, s.out / "probes" / c.slug, timeout, stop_loss, _is_async(c))
        budget.cut(got.error, "probes")
        return got

    measured = probe(cand)
    if measured.error and "--box rma" in measured.error and cand.box is None:
        cand = cand.on_box("rma")
        measured = probe(cand)
    return cand, measured


def _is_async(c: Candidate) -> bool:
    from parambox.strategies import strategy_class

    return bool(strategy_class(c.strategy, c.options).tolerates_worker_loss)


def _describe(c: Candidate) -> dict[str, Any]:
    from parambox.strategies import strategy_class

    cls = strategy_class(c.strategy, c.options)
    return {
        "family": scores.family(bool(cls.tolerates_worker_loss), bool(cls.period_options)),
        "strategy": c.strategy,
        "options": dict(c.options),
        "settings": dict(c.settings),
        "setup": c.label,
        "box": c.box,
        "compression": compression_of(c),
    }


def _confirm(
    s: PickSettings,
    base: dict[str, Any],
    entries: list[tuple[Candidate, runs.Measured, pm.Prediction]],
    order: list[int],
    ref: runs.Measured,
    reference: Candidate,
    say: Say,
    st: _State | None = None,
) -> tuple[list[int], dict[int, list[runs.Measured]]]:
    """The race: the top ``s.confirm`` predictions trained to the target (the reference's run is its
    own); then, until the leader (the least median time of its runs) has run twice, so has every raced
    candidate within ``CLOSE_RACE`` of its time, and no candidate not yet raced is predicted faster
    than it, the leader runs again, or the closest such candidate, or the unraced one. "Faster"
    allows for the model's error as the race itself measured it (``RACE_DEVIATIONS`` times the RMS
    of log(predicted / measured) over the raced setups that reached the target) while the race has
    under 2K entries: a prediction that far over the leader's time may still beat it. The new
    order (those that reached the target, fastest first; then those that did not; then the rest as
    predicted) and the runs by entry index. ``st``: its order after every run is written there; a
    budget that runs out ends the race with the runs it has."""
    timed = [i for i in order if entries[i][2].seconds is not None]
    got: dict[int, list[runs.Measured]] = {}

    def race(i: int) -> None:
        cand, _, p = entries[i]
        mine = got.get(i, [])
        if cand == reference and not mine:
            got[i] = [ref]
            return
        k = (list(got).index(i) if i in got else len(got)) + 1  # its place in the race, a second run too
        budget = st.budget if st is not None else Budget(None)
        budget.check("confirm")
        m = train_to_target(s, base, cand, p, "confirm", k, len(timed), say, len(mine) + 1, budget)
        got[i] = [*mine, m]
        if st is not None:
            st.order, st.confirmed = _race_order(timed, got, order, time_of), got
            st.write()

    def time_of(i: int) -> float | None:
        return runs.median_time([m.reached_s for m in got[i]])

    try:
        _race(s, entries, timed, got, race, time_of)
    except BudgetSpent:
        say("the budget ran out in the race: its runs so far rank first")
    return _race_order(timed, got, order, time_of), got


def _race(
    s: PickSettings,
    entries: list[tuple[Candidate, runs.Measured, pm.Prediction]],
    timed: list[int],
    got: dict[int, list[runs.Measured]],
    race: Callable[[int], None],
    time_of: Callable[[int], float | None],
) -> None:
    """The race's choice of the next run (``_confirm``'s rules)."""
    for i in timed[: s.confirm]:
        race(i)
    while True:
        reached = [i for i in got if time_of(i) is not None]
        if not reached:
            break
        leader = min(reached, key=lambda i: (time_of(i), timed.index(i)))
        if len(got[leader]) < 2:
            race(leader)
            continue
        close = [i for i in reached if len(got[i]) < 2 and time_of(i) <= CLOSE_RACE * time_of(leader)]
        if close:
            race(min(close, key=time_of))
            continue
        bound = time_of(leader)
        if len(got) < 2 * s.confirm:  # within the model's own error, as this race measured it
            errors = [math.log(entries[i][2].seconds / time_of(i)) ** 2 for i in reached]
            bound *= math.exp(RACE_DEVIATIONS * math.sqrt(statistics.fmean(errors)))
        faster = [i for i in timed if i not in got and entries[i][2].seconds < bound]
        if not faster:
            break
        race(faster[0])


def _race_order(
    timed: list[int], got: dict[int, Any], order: list[int], time_of: Callable[[int], float | None]
) -> list[int]:
    """Those raced that reached the target, fastest first; then those that did not; then the rest as
    predicted."""
    raced = [i for i in timed if i in got]
    first = sorted(raced, key=lambda i: (time_of(i) is None, time_of(i) or 0.0, raced.index(i)))
    return first + [i for i in order if i not in got]


def train_to_target(
    s: PickSettings,
    base: dict[str, Any],
    cand: Candidate,
    p: pm.Prediction | None,
    folder: str,
    k: int,
    of: int,
    say: Say,
    run: int = 1,
    budget: Budget | None = None,
) -> runs.Measured:
    """``cand`` trained to the target in ``s.out/folder`` (a race's or a validation's run, the
    ``k``-th of ``of``; its ``run``-th there), with room for twice its prediction's upper end;
    ``BudgetSpent`` where ``budget`` cut it short."""
    from parambox.config import merge

    steps = base["steps"] if p is None else runs.step_cap(base["steps"], p)
    verb = "validate" if folder == "validation" else folder
    again = f" (run {run})" if run > 1 else ""
    say(f"{verb} [{k}/{of}] {cand.label}{again} to {s.goal} (at most {steps} steps)")
    cfg = merge(cand.config(base), {"steps": steps})
    name = cand.slug if run == 1 else f"{cand.slug}.run{run}"
    budget = budget or Budget(None)
    timeout = budget.timeout(s.run_timeout_s)
    got = runs.run_to_target(cfg, s.out / folder / name, s.goal, timeout, _is_async(cand))
    budget.cut(got.error, folder)
    return got


def _rank(
    entries: list[tuple[Candidate, runs.Measured, pm.Prediction]],
    order: list[int],
    confirmed: dict[int, list[runs.Measured]] | None = None,
    workers: int | None = None,
) -> list[dict[str, Any]]:
    """The rows in ``order``, each with its reason against the first; ``confirmed``: the race's runs
    to the target of the raced candidates (by entry index; its time, their median); ``workers``: the
    count the bytes of each exchange are for."""
    confirmed = confirmed or {}
    predicted_rank = {i: k for k, i in enumerate(pm.rank_order([p for _, _, p in entries]), 1)}
    _, _, top = entries[order[0]]
    out = []
    for rank, i in enumerate(order, 1):
        cand, measured, p = entries[i]
        first = rank == 1
        stale = measured.staleness()
        why = pm.reason(p, None if first else top, "the top pick", stale)
        raced = confirmed.get(i)
        confirmed_s = None if raced is None else runs.median_time([m.reached_s for m in raced])
        if raced is not None:
            got = (
                "did not reach the target"
                if confirmed_s is None
                else f"reached the target in {confirmed_s:.2f} s"
            )
            again = f", median of {len(raced)} runs" if len(raced) > 1 else ""
            why += f"; confirmed: {got}{again} (predicted #{predicted_rank[i]})"
        r = p.ratio
        out.append(
            {
                **_describe(cand),
                "rank": rank,
                "predicted_rank": predicted_rank[i],
                "confirmed_s": confirmed_s,
                "confirmed_runs_s": None if raced is None else [m.reached_s for m in raced],
                "predicted_s": p.seconds,
                "predicted_low_s": p.low_s,
                "predicted_high_s": p.high_s,
                "reason": why,
                "samples_to_target": p.samples,
                "convergence_vs_reference": None if r is None else r.estimate,
                "convergence_band": None if r is None else [r.low, r.high],
                "convergence_points": None if r is None else len(r.points),
                "convergence_censored": bool(r and r.censored),
                "convergence_drift": None if r is None else r.drift,
                "convergence_steady": None if r is None else r.steady,
                "step_ms": 1e3 * p.cost.step_s,
                "comm_ms": 1e3 * p.cost.comm_s,
                "compute_ms": 1e3 * p.cost.compute_s,
                "samples_per_step": p.cost.samples_per_step,
                "samples_per_s": p.cost.samples_per_s,
                "message_bytes": None if p.exchange is None else p.exchange.message_bytes,
                "pull_bytes": None if p.exchange is None else p.exchange.pull_bytes,
                "link_bytes_per_exchange": None
                if p.exchange is None or workers is None
                else p.exchange.link_bytes(workers),
                "staleness": stale,
                "probe_samples": (measured.curve("test_loss").samples or [None])[-1],
                "run_dir": str(measured.run_dir),
                "confirm_run_dir": None if raced is None else str(raced[0].run_dir),
            }
        )
    return out


def _confident(ranking: list[dict[str, Any]], reference: str | None = None) -> bool:
    """The probe's own error estimate supports the margin: the top pick's band lies wholly below the
    runner-up's, and the top pick has a band at all (two or more points of its convergence ratio,
    none past the reference's best: one point or a censored ratio says nothing of its error), nor a
    ratio still falling over the probe (its last point under ``DRIFT_FLOOR`` of its first: the probe
    had not found the candidate's pace, and the band does not say how far the fall goes on). The
    reference needs no ratio: it is its own."""
    timed = [r for r in ranking if r["predicted_s"] is not None]
    if len(timed) < 2:
        return True
    top = timed[0]
    is_reference = reference is not None and top.get("setup") == reference
    if not is_reference and (top.get("convergence_censored") or (top.get("convergence_points") or 2) < 2):
        return False
    if not is_reference and (top.get("convergence_drift") or 1.0) < DRIFT_FLOOR:
        return False
    return top["predicted_high_s"] < timed[1]["predicted_low_s"]


# -- seeds --------------------------------------------------------------------------------------------


def run_pick_seeds(s: PickSettings, say: Say = print) -> dict[str, Any]:
    """``run_pick`` once per seed (``seed``, ``seed + 1``, ...; each in ``out/seed-K``); with one seed,
    its result as it is. Over several: the ranking by the median prediction, ``confident`` only where
    every seed was and picked the same, and the validation's scores over the seeds."""
    if s.seeds == 1:
        return run_pick(s, say)
    first = int(s.base.get("seed") or 0)
    results = []
    for k in range(s.seeds):
        seed = first + k
        say(f"seed {seed} ({k + 1} of {s.seeds})")
        results.append(run_pick(replace(s, base={**s.base, "seed": seed}, out=s.out / f"seed-{seed}"), say))
    return merge_seeds(results)


def merge_seeds(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several seeds' (each a ``run_pick`` result)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        for row in r["ranking"]:
            rows.setdefault(row["setup"], []).append(row)

    def median(values: list[float | None]) -> float | None:
        got = [v for v in values if v is not None]
        return statistics.median(got) if got else None

    ranking = []
    for per_seed in rows.values():
        row = dict(per_seed[0])
        for key in ("predicted_s", "predicted_low_s", "predicted_high_s"):
            row[key] = median([x[key] for x in per_seed])
        row["predicted_s_per_seed"] = [x["predicted_s"] for x in per_seed]
        row["confirmed_s_per_seed"] = [x.get("confirmed_s") for x in per_seed]
        row["confirmed_s"] = median(row["confirmed_s_per_seed"])
        ranking.append(row)

    def predicted_key(x: dict[str, Any]) -> tuple[bool, float]:
        return x["predicted_s"] is None, x["predicted_s"] or 0.0

    # First the setups every seed confirmed to reach the target, by their median time to it; then the
    # rest by the median prediction.
    def settled(x: dict[str, Any]) -> bool:
        times = x["confirmed_s_per_seed"]
        return len(times) == len(results) and all(t is not None for t in times)

    for rank, row in enumerate(sorted(ranking, key=predicted_key), 1):
        row["predicted_rank"] = rank
    ranking.sort(
        key=lambda x: (not settled(x), x["confirmed_s"] or 0.0 if settled(x) else 0.0, *predicted_key(x))
    )
    for rank, row in enumerate(ranking, 1):
        row["rank"] = rank
    tops = {r["ranking"][0]["setup"] for r in results if r["ranking"]}
    head = {k: v for k, v in results[0].items() if k not in ("ranking", "validation", "seed", "wall_time_s")}
    out = head | {
        "seeds": [r["seed"] for r in results],
        "ranking": ranking,
        "confident": all(r["confident"] for r in results) and len(tops) == 1,
        "per_seed": results,
        "wall_time_s": sum(r["wall_time_s"] for r in results),
    }
    if all("validation" in r for r in results):
        from parambox.studies.pick.validation import TARGETS

        families = {row["setup"]: row["family"] for row in ranking}
        seeds = [r["validation"] for r in results]
        spreads = [v["measurement_spread"] for v in seeds if v.get("measurement_spread") is not None]
        out["validation"] = scores.summarize_seeds(seeds, families) | {
            "validate_runs": seeds[0].get("validate_runs", 1),
            "measurement_spread": statistics.median(spreads) if spreads else None,
            "targets": TARGETS,
        }
    return out
