"""``parambox pick --validate``: train candidates to the target and score the predictions.

The top pick is the ranking's first: after a confirmation race (``confirm``), the fastest of the
raced candidates to the target in *their own* runs; validation trains it again, so its hit is
scored on a fresh run, beside the model's own first (``predicted_top_pick_vs_best_measured``).

Each validated setup is trained to the target ``validate_runs`` times (default 3) and its measured
time is their median: one run's time to the target is noisy at the level the scores judge. The test
accuracy of these workloads wanders by about 0.01 from one evaluation to the next near the target, so
the first evaluation at it comes 140-210 steps in, for one asynchronous setup and seed (six runs of
downpour: 0.27-0.41 s; docs/results/pick-validation.md); a single run would score the prediction against that draw. The
runs' own spread is reported (``measurement_spread``).

Which candidates: every one ranked (``num_validated`` None: a faster strategy ranked low is measured
too), or the top K and K others drawn at random from the rest (seeded by the run's seed, so a repeat
draws the same), and always the reference (allreduce, whose run to the target is its measurement).
The scores (:mod:`~parambox.studies.pick.scores`) come with each seed's validation and, over seeds,
with ``run_pick_seeds``.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from typing import Any

from parambox.studies.pick import model as pm
from parambox.studies.pick import runs, scores
from parambox.studies.pick.budget import Budget, BudgetSpent
from parambox.studies.pick.candidates import Candidate

TARGETS = {
    "top_pick_vs_best_measured": 1.2,
    "top_pick_vs_allreduce_at_0.1_gbps": 0.6,
    "rank_correlation": 0.6,
}
TARGETS |= {"prediction_error_per_family": 0.25}


def choose(timed: list[str], k: int | None, seed: int) -> list[str]:
    """The setups to validate, in rank order: all of ``timed`` (k None), else its top ``k`` and ``k``
    others drawn at random.

    >>> choose(["a", "b", "c", "d", "e"], None, 0)
    ['a', 'b', 'c', 'd', 'e']
    >>> len(choose(["a", "b", "c", "d", "e"], 1, 0)), choose(["a", "b", "c", "d", "e"], 1, 0)[0]
    (2, 'a')
    """
    if k is None or 2 * k >= len(timed):
        return list(timed)
    others = random.Random(seed).sample(timed[k:], k)
    return [t for t in timed if t in timed[:k] or t in others]


def validate(
    s: Any,
    base: dict[str, Any],
    ranking: list[dict[str, Any]],
    entries: list[tuple[Candidate, runs.Measured, pm.Prediction]],
    ref: runs.Measured,
    reference: Candidate,
    say: Callable[[str], None],
    budget: Budget | None = None,
) -> dict[str, Any]:
    """Train the chosen setups and the reference to the target (the reference's run is its own
    measurement); measured against predicted times, with this seed's scores. A ``budget`` that runs
    out ends it with the setups measured so far (``unvalidated``: the others)."""
    from parambox.studies.pick.study import train_to_target

    by_label = {c.label: (c, p) for c, _, p in entries}
    ref_label = reference.label
    timed = [r["setup"] for r in ranking if r["predicted_s"] is not None]
    chosen = choose(timed, s.num_validated, int(base.get("seed") or 0))
    if ref_label not in chosen:
        chosen.append(ref_label)
    measured: dict[str, float | None] = {}
    details = []
    budget = budget or Budget(None)
    try:
        for i, label in enumerate(chosen, 1):
            cand, p = by_label.get(label, (reference, None))
            got = [ref] if label == ref_label else []  # the reference's run to the target is its first
            while len(got) < s.validate_runs:
                budget.check("validation")
                got.append(
                    train_to_target(s, base, cand, p, "validation", i, len(chosen), say, len(got) + 1, budget)
                )
            measured[label] = runs.median_time([m.reached_s for m in got])
            details.append(_validated(label, p, got))
    except BudgetSpent:
        if ref_label not in measured:  # its own run to the target is a measurement, at no cost
            measured[ref_label] = ref.reached_s
            details.append(_validated(ref_label, None, [ref]))
        say(f"the budget ran out in validation: {len(chosen) - len(measured)} setups not validated")
    top = timed[0] if timed else None  # None: no candidate had a prediction
    predicted = {label: by_label[label][1].seconds if label in by_label else None for label in measured}
    v = summarize_validation(measured, top, ref_label)
    # The model's own first, before any confirmation race put another first (scored too).
    by_prediction = min(
        (r for r in ranking if r["predicted_s"] is not None), key=lambda r: r["predicted_rank"]
    )
    alone = summarize_validation(measured, by_prediction["setup"], ref_label)
    v["predicted_top_pick"] = alone["top_pick"]
    v["predicted_top_pick_vs_best_measured"] = alone["top_pick_vs_best_measured"]
    seed_scores = scores.summarize_seeds(
        [{"predicted_s": predicted, "measured_s": measured, **v}], {r["setup"]: r["family"] for r in ranking}
    )
    spreads = [d["spread"] for d in details if d["spread"] is not None]
    return (
        v
        | {"predicted_s": predicted, "validate_runs": s.validate_runs}
        | {"measurement_spread": statistics.median(spreads) if spreads else None}
        | seed_scores
        | {"runs": details, "targets": TARGETS}
        | {"unvalidated": [label for label in chosen if label not in measured]}
    )


def spread(times: list[float | None]) -> float | None:
    """(slowest - fastest) / median of one setup's runs that reached the target (None: under two).

    >>> spread([0.2, 0.4, 0.25]), spread([0.2, None])
    (0.8, None)
    """
    got = [t for t in times if t is not None]
    return (max(got) - min(got)) / statistics.median(got) if len(got) >= 2 else None


def _validated(label: str, p: pm.Prediction | None, got: list[runs.Measured]) -> dict[str, Any]:
    times = [m.reached_s for m in got]
    t = runs.median_time(times)
    return {
        "setup": label,
        "measured_s": t,
        "measured_runs_s": times,
        "spread": spread(times),
        "measured_with_evaluations_s": runs.median_time([m.reached_wall_s for m in got]),
        "predicted_s": None if p is None else p.seconds,
        "measured_over_predicted": None if p is None or not p.seconds or t is None else t / p.seconds,
        "steps": [m.steps[-1]["step"] if m.steps else 0 for m in got],
        "error": next((m.error for m in got if m.error), None),
        "run_dirs": [str(m.run_dir) for m in got],
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
