"""``parambox pick``: which strategy reaches a target accuracy first with N workers, here.

1. The *reference* (``allreduce``) trains until its test accuracy reaches the target: samples to the
   target S_ref and its test loss against samples (it is also ``allreduce``'s own probe).
2. Every other candidate (:mod:`parambox.studies.pick.candidates`) gets a *probe* on the same launcher
   and cluster, evaluated every few steps: until its test loss has come 70 % of the way the
   reference's went, or for as many steps as the reference took. Learning curves that sit on a plateau
   before they fall need that much; one that falls early stops early.
3. :mod:`parambox.studies.pick.model` turns each probe into a predicted time to the target (with a
   band), and the candidates are ranked, each with the reason for its rank.
4. ``validate``: the top three and the reference are trained to the target and their measured times
   compared (``top_pick_vs_best_measured``, ``top_pick_vs_allreduce``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parambox.errors import UserError
from parambox.studies.pick import model as pm
from parambox.studies.pick import runs
from parambox.studies.pick.candidates import Candidate, registry_candidates

REFERENCE = "allreduce"  # the baseline: validation always measures it
TARGETS = {"top_pick_vs_best_measured": 1.2, "top_pick_vs_allreduce_at_0.1_gbps": 0.6}
ASSUMPTIONS = [
    "convergence per sample relative to the reference, measured over the probe, holds to the target",
    "time per step is the probe's mean (evaluations and the first steps left out)",
    "more workers than probed: communication scaled by the topology's bandwidth term, samples per step "
    "by N/n, compute per step unchanged, convergence per sample as probed",
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
    num_validated: int = 3
    run_timeout_s: float = 900.0
    probe_timeout_s: float = 180.0  # a probe is a few dozen steps: one that hangs is given up soon
    fixed: set[str] = field(default_factory=set)  # run fields the user set: no preset overrides them

    @property
    def probe_workers(self) -> int:
        """Probe with N workers where the cores allow, else with as many as there are cores (at least 2,
        so that communication is measured); the scalability model goes from there to N."""
        return min(self.workers, max(os.cpu_count() or 1, 2))


Say = Callable[[str], None]


def run_pick(s: PickSettings, say: Say = print) -> dict[str, Any]:
    t0 = time.perf_counter()
    n = s.probe_workers
    base = _base(s, n)
    candidates = _with_user_options(registry_candidates(n, s.strategies, base), base, s)
    reference = Candidate(REFERENCE).overridden(base["options"].get(REFERENCE, {}), s.fixed)
    if not candidates:
        raise UserError(f"no registered strategy runs {s.workers} workers ({n} probed)")
    say(f"reference: {REFERENCE} x{n} until test accuracy {s.target:g}")
    ref = _reference(s, base, reference)
    s_ref = ref.samples_to(s.target)
    ref_curve = ref.curve("test_loss")
    probe_steps = s.probe_steps or max(2 * s.eval_every, math.ceil(s.probe_fraction * ref.steps[-1]["step"]))
    stop_loss = pm.progress_level(ref_curve, pm.STOP_PROGRESS)
    entries, excluded = [], []
    for i, cand in enumerate(candidates, 1):
        if cand == reference:
            measured, ratio = ref, pm.Ratio(1.0, 1.0, 1.0, [1.0])
        else:
            say(f"probe [{i}/{len(candidates)}] {cand.label}")
            cand, measured = _probe(s, base, cand, probe_steps, stop_loss)
            if measured.error:
                excluded.append({**_describe(cand), "reason": f"cannot run here: {measured.error}"})
                continue
            ratio = pm.convergence_ratio(ref_curve, measured.curve("test_loss"))
        cost = measured.cost(warmup=max(2, len(measured.steps) // 10))
        if cost is None:
            excluded.append({**_describe(cand), "reason": "too few steps in its probe to time one"})
            continue
        cost = pm.scale_cost(cost, _topology(cand), n, s.workers)
        entries.append((cand, measured, pm.predict(s_ref, ratio, cost)))
    if not entries:
        raise UserError("no candidate could be probed here; see the excluded list (--json)")
    ranking = _rank(entries)
    result = {
        "workers": s.workers,
        "probe_workers": n,
        "target_accuracy": s.target,
        "workload": {
            k: base.get(k) for k in ("model", "data", "loss", "batch_size", "lr", "optimizer", "momentum")
        },
        "cluster": base["cluster"] if (base.get("cluster") or {}).get("nodes") else None,
        "reference": {
            "strategy": REFERENCE,
            "samples_to_target": s_ref,
            "time_to_target_s": ref.reached_s,
            "time_to_target_with_evaluations_s": ref.reached_wall_s,
            "run_dir": str(ref.run_dir),
        },
        "model": {"time": "samples to target / samples per second", "assumptions": ASSUMPTIONS},
        "probe_steps": probe_steps,
        "probe_stop_test_loss": stop_loss,
        "eval_every": s.eval_every,
        "ranking": ranking,
        "excluded": excluded,
        "confident": _confident(ranking),
    }
    if s.validate:
        result["validation"] = validate(s, base, ranking, entries, ref, reference, say)
    result["wall_time_s"] = time.perf_counter() - t0
    return result


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


def _topology(c: Candidate) -> str:
    """perfmodel's topology of the strategy's exchange: a strategy may say (``comm_topology``); else the
    box for the asynchronous ones and a ring allreduce for the others."""
    from parambox.strategies import strategy_class

    cls = strategy_class(c.strategy, c.options)
    return cls.comm_topology or ("box" if cls.tolerates_worker_loss else "ring")


def _reference(s: PickSettings, base: dict[str, Any], reference: Candidate) -> runs.Measured:
    cfg = reference.config(base)
    ref = runs.run_to_target(cfg, s.out / "reference", s.target, s.run_timeout_s)
    if ref.error:
        raise UserError(
            f"the reference run ({REFERENCE}) failed: {ref.error} (log: {ref.run_dir / 'train.log'})"
        )
    if not any("test_accuracy" in e for e in ref.evals):
        raise UserError(
            "the workload's evaluations report no test accuracy: pick needs a classifier's accuracy"
        )
    if ref.samples_to(s.target) is None:
        best = max((e.get("test_accuracy", 0.0) for e in ref.evals), default=0.0)
        raise UserError(
            f"the reference run ({REFERENCE}) did not reach test accuracy {s.target:g} in {cfg['steps']} "
            f"steps (best {best:.3f}); lower --target-accuracy or raise --steps"
        )
    if len(ref.curve("test_loss").samples) < 2:
        raise UserError(
            "the reference run reached the target before its second evaluation; lower --eval-every"
        )
    return ref


def _probe(
    s: PickSettings, base: dict[str, Any], cand: Candidate, steps: int, stop_loss: float
) -> tuple[Candidate, runs.Measured]:
    """The probe; a strategy whose shm box cannot span the cluster's nodes is probed again on rma."""
    from parambox.config import merge

    def probe(c: Candidate) -> runs.Measured:
        cfg = merge(c.config(base), {"steps": steps})
        return runs.run_probe(cfg, s.out / "probes" / c.slug, s.probe_timeout_s, stop_loss)

    measured = probe(cand)
    if measured.error and "--box rma" in measured.error and cand.box is None:
        cand = cand.on_box("rma")
        measured = probe(cand)
    return cand, measured


def _describe(c: Candidate) -> dict[str, Any]:
    return {
        "strategy": c.strategy,
        "options": dict(c.options),
        "settings": dict(c.settings),
        "setup": c.label,
        "box": c.box,
    }


def _rank(entries: list[tuple[Candidate, runs.Measured, pm.Prediction]]) -> list[dict[str, Any]]:
    order = pm.rank_order([p for _, _, p in entries])
    _, _, top = entries[order[0]]
    out = []
    for rank, i in enumerate(order, 1):
        cand, measured, p = entries[i]
        first = rank == 1
        stale = measured.staleness()
        why = pm.reason(p, None if first else top, "the top pick", stale)
        r = p.ratio
        out.append(
            {
                **_describe(cand),
                "rank": rank,
                "predicted_s": p.seconds,
                "predicted_low_s": p.low_s,
                "predicted_high_s": p.high_s,
                "reason": why,
                "samples_to_target": p.samples,
                "convergence_vs_reference": None if r is None else r.estimate,
                "convergence_band": None if r is None else [r.low, r.high],
                "convergence_censored": bool(r and r.censored),
                "step_ms": 1e3 * p.cost.step_s,
                "comm_ms": 1e3 * p.cost.comm_s,
                "compute_ms": 1e3 * p.cost.compute_s,
                "samples_per_step": p.cost.samples_per_step,
                "samples_per_s": p.cost.samples_per_s,
                "staleness": stale,
                "probe_samples": (measured.curve("test_loss").samples or [None])[-1],
                "run_dir": str(measured.run_dir),
            }
        )
    return out


def _confident(ranking: list[dict[str, Any]]) -> bool:
    """The top pick's band lies wholly below the runner-up's."""
    timed = [r for r in ranking if r["predicted_s"] is not None]
    return len(timed) < 2 or timed[0]["predicted_high_s"] < timed[1]["predicted_low_s"]


# -- validation ---------------------------------------------------------------------------------------


def validate(
    s: PickSettings,
    base: dict[str, Any],
    ranking: list[dict[str, Any]],
    entries: list[tuple[Candidate, runs.Measured, pm.Prediction]],
    ref: runs.Measured,
    reference: Candidate,
    say: Say,
) -> dict[str, Any]:
    """Train the top ``num_validated`` and the reference to the target; the reference's run to the target
    (step 1) is its measurement."""
    from parambox.config import merge

    by_label = {c.label: (c, p) for c, _, p in entries}
    ref_label = reference.label
    chosen = [r["setup"] for r in ranking if r["predicted_s"] is not None][: s.num_validated]
    measured: dict[str, float | None] = {}
    details = []
    for i, label in enumerate(chosen, 1):
        cand, p = by_label[label]
        if label == ref_label:
            m = ref
        else:
            steps = _step_cap(base["steps"], p)
            say(f"validate [{i}/{len(chosen)}] {label} to accuracy {s.target:g} (at most {steps} steps)")
            cfg = merge(cand.config(base), {"steps": steps})
            m = runs.run_to_target(cfg, s.out / "validation" / cand.slug, s.target, s.run_timeout_s)
        measured[label] = m.reached_s
        details.append(_validated(label, p, m))
    if ref_label not in measured:
        measured[ref_label] = ref.reached_s
        details.append(_validated(ref_label, by_label.get(ref_label, (None, None))[1], ref))
    top = chosen[0] if chosen else None  # None: no candidate had a prediction
    return summarize_validation(measured, top, ref_label) | {"runs": details, "targets": TARGETS}


def _step_cap(base_steps: int, p: pm.Prediction) -> int:
    """Room for the prediction's upper end twice over, at least the base run's steps, at most 10x those."""
    if p.high_s is None:
        return base_steps
    steps = math.ceil(2 * p.high_s * p.cost.samples_per_s / p.cost.samples_per_step)
    return int(min(max(steps, base_steps), 10 * base_steps))


def _validated(label: str, p: pm.Prediction | None, m: runs.Measured) -> dict[str, Any]:
    return {
        "setup": label,
        "measured_s": m.reached_s,
        "measured_with_evaluations_s": m.reached_wall_s,
        "predicted_s": None if p is None else p.seconds,
        "measured_over_predicted": None
        if p is None or not p.seconds or m.reached_s is None
        else m.reached_s / p.seconds,
        "steps": m.steps[-1]["step"] if m.steps else 0,
        "error": m.error,
        "run_dir": str(m.run_dir),
    }


def summarize_validation(
    measured: dict[str, float | None], top: str | None, reference: str
) -> dict[str, Any]:
    """``measured_s`` per setup and the two ratios (None where a run did not reach the target).

    >>> v = summarize_validation({"a": 6.0, "b": 5.0, "allreduce": 12.0}, "a", "allreduce")
    >>> v["top_pick_vs_best_measured"], v["top_pick_vs_allreduce"]
    (1.2, 0.5)
    """
    reached = [t for t in measured.values() if t is not None]
    t_top, t_ref = measured.get(top), measured.get(reference)
    return {
        "top_pick": top,
        "measured_s": measured,
        "best_measured": min(
            (k for k, v in measured.items() if v is not None), key=lambda k: measured[k], default=None
        ),
        "top_pick_vs_best_measured": None if t_top is None or not reached else t_top / min(reached),
        "top_pick_vs_allreduce": None if t_top is None or not t_ref else t_top / t_ref,
    }
