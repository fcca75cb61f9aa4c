"""``parambox pick --validate``: train candidates to the target and score the predictions.

The top pick is the ranking's first: after a confirmation race (``confirm``), the fastest of the
raced candidates to the target in *their own* runs; validation trains it again, so its hit is
scored on a fresh run, beside the model's own first (``predicted_top_pick_vs_best_measured``).

Which candidates: every one ranked (``num_validated`` None: a faster strategy ranked low is measured
too), or the top K and K others drawn at random from the rest (seeded by the run's seed, so a repeat
draws the same), and always the reference (allreduce, whose run to the target is its measurement).
The scores (:mod:`~parambox.studies.pick.scores`) come with each seed's validation and, over seeds,
with ``run_pick_seeds``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from parambox.studies.pick import model as pm
from parambox.studies.pick import runs, scores
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
) -> dict[str, Any]:
    """Train the chosen setups and the reference to the target (the reference's run is its own
    measurement); measured against predicted times, with this seed's scores."""
    from parambox.studies.pick.study import train_to_target

    by_label = {c.label: (c, p) for c, _, p in entries}
    ref_label = reference.label
    timed = [r["setup"] for r in ranking if r["predicted_s"] is not None]
    chosen = choose(timed, s.num_validated, int(base.get("seed") or 0))
    measured: dict[str, float | None] = {}
    details = []
    for i, label in enumerate(chosen, 1):
        cand, p = by_label[label]
        m = (
            ref
            if label == ref_label
            else train_to_target(s, base, cand, p, "validation", i, len(chosen), say)
        )
        measured[label] = m.reached_s
        details.append(_validated(label, p, m))
    if ref_label not in measured:
        measured[ref_label] = ref.reached_s
        details.append(_validated(ref_label, by_label.get(ref_label, (None, None))[1], ref))
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
    return v | {"predicted_s": predicted} | seed_scores | {"runs": details, "targets": TARGETS}


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
