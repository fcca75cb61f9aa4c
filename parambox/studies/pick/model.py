"""How ``parambox pick`` predicts each strategy's time to a target accuracy from a short probe.

time to target = samples to target / samples per second

- **Samples per second** come from the probe itself: the mean time per step (evaluation pauses and
  the first steps excluded) and the global samples one step consumes, on the same launcher and
  cluster the user asked for. Split into communication (the strategy's own phase timers in
  ``metrics.jsonl``) and the rest ("compute"). For more workers than were probed, the scalability
  model (:mod:`parambox.perfmodel`) scales the communication by its topology's bandwidth term
  T_comm(N) / T_comm(n) and the samples per step by N / n; compute per step stays (weak scaling).
  A compressed exchange (``compression`` other than none and powersgd) is not summed on the way: its
  messages are all-gathered, so its bandwidth term is (n - 1) S_c, S_c one rank's encoded message
  (:class:`Exchange`), where a float32 ring allreduce's is 2 (n - 1) / n S. The probe measured the
  compressed exchange itself; going to N workers its share of the step grows as that term does (int8,
  S_c about S / 4, moves fewer bytes than float32 up to about 8 workers, more beyond).
- **Samples to target** come from one *reference* run (``allreduce``) trained until its test metric
  first reaches the target: it gives S_ref, the global samples that took, and its test loss against
  samples. A candidate's *probe* trains until its test loss has come all the way the reference's
  went (``STOP_PROGRESS``: first evaluation to target), or for as many steps as the reference
  took. Its *convergence per sample* relative to the reference is e = s_ref(L_c(h)) / h: the samples
  the reference needed to reach the loss the candidate reached in h samples, over h (both curves as
  running minima, linearly interpolated between evaluations), at every evaluation of the probe past
  ``MIN_PROGRESS`` (20 %) of that way (before it, on a plateau, a loss says little about samples);
  the median of the last three (the most progress) is the estimate, the smallest and largest of all
  give the band. A ratio that fell over the probe to under ``DRIFT_FLOOR`` of its first value while
  its loss made a new low at most evaluations (``STEADY_SHARE``) is taken to fall half as far again
  on the rest of the way (its estimate times the square root of that drift; the band's low end, all
  of it again); one that fell on plateaus is not (their samples are in it already). The candidate
  needs S_ref / e
  samples: the model assumes the ratio measured on the way holds to the target. That is its main
  uncertainty, and the output says so: the band, the samples the probe covered, and whether the top
  pick's band overlaps the runner-up's.

>>> ref = Curve([100, 200, 300, 400], [2.0, 1.0, 0.6, 0.4])
>>> samples_to_reach(ref, 1.0), samples_to_reach(ref, 0.8)
(200.0, 250.0)
>>> convergence_ratio(ref, Curve([100, 200], [1.0, 0.4])).estimate  # twice as fast per sample
2.0
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from parambox.perfmodel.topology import Network, comm_time_s
from parambox.workload.targets import Target

# A probe whose convergence ratio fell below this fraction of its first value had not found its pace:
# its estimate is lowered by half that fall again, its band's low end by all of it (docs/results/pick-validation.md).
DRIFT_FLOOR = 0.8
# ... unless its loss made a new low at under this share of its evaluations: a fall on plateaus, which
# its last points count already (docs/results/pick-validation.md).
STEADY_SHARE = 0.6
# A probe's evaluations count once its loss has come this far of the reference's way to the target; probes
# stop at all of it (a loss that falls fast and then stalls, DiLoCo's, is read whole; docs/results/pick-validation.md).
MIN_PROGRESS = 0.2
STOP_PROGRESS = 1.0
LAST_POINTS = 3  # the estimate: the median of the ratios nearest the target


@dataclass
class Curve:
    """A metric against global samples, at a run's evaluations (in order)."""

    samples: list[float]
    values: list[float]


def running_min(values: list[float]) -> list[float]:
    """The best value so far at each point: a noisy loss as a monotone curve."""
    out, best = [], math.inf
    for v in values:
        best = min(best, v)
        out.append(best)
    return out


def samples_to_reach(curve: Curve, level: float) -> float | None:
    """Samples at which the curve's running minimum first falls to ``level``, linearly interpolated
    between the two evaluations around it; the first evaluation's samples when the curve starts
    below ``level``; None when it never gets there."""
    env = running_min(curve.values)
    for i, (s, v) in enumerate(zip(curve.samples, env)):
        if v <= level:
            if i == 0 or env[i - 1] == v:
                return float(s)
            s0, v0 = curve.samples[i - 1], env[i - 1]
            return float(s0 + (s - s0) * (v0 - level) / (v0 - v))
    return None


def samples_to_target(samples: list[float], values: list[float], target: Target) -> float | None:
    """Samples at the first evaluation whose metric reaches ``target``, in its direction (None: never)."""
    hit = target.first(zip(samples, values))
    return None if hit is None else float(hit)


@dataclass
class Ratio:
    """Convergence per sample relative to the reference: ``estimate`` (median), ``low``..``high`` (band);
    ``censored`` when the candidate went below the reference's best loss (a lower bound then)."""

    estimate: float
    low: float
    high: float
    points: list[float] = field(default_factory=list)
    censored: bool = False
    steady: float = 1.0  # the share of the points at which the probe's loss made a new low

    @property
    def drift(self) -> float:
        """The last point over the first: how far the ratio fell (or rose) over the probe."""
        return self.points[-1] / self.points[0] if self.points else 1.0


def progress_level(reference: Curve, fraction: float) -> float:
    """The loss ``fraction`` of the way from the reference's first evaluation to its best (at the target).

    >>> progress_level(Curve([1, 2, 3], [2.0, 1.0, 0.5]), 0.2)
    1.7
    """
    first, best = reference.values[0], running_min(reference.values)[-1]
    return first - fraction * (first - best)


def convergence_ratio(reference: Curve, probe: Curve, min_progress: float = MIN_PROGRESS) -> Ratio | None:
    """e = s_ref(L_probe(h)) / h at each evaluation h of the probe whose loss (running minimum) has come
    ``min_progress`` of the way the reference went to the target. Before that a curve is often on a
    plateau, where the same loss is reached at very different sample counts: no information. None when
    no evaluation of the probe got that far (it learns too slowly to compare)."""
    if not probe.samples or not reference.samples:
        return None
    env = running_min(probe.values)
    level = progress_level(reference, min_progress)
    points, censored, new_lows = [], False, 0
    for i, (s, loss) in enumerate(zip(probe.samples, env)):
        if not math.isfinite(loss) or s <= 0 or loss > level:
            continue
        new_lows += i == 0 or loss < env[i - 1]
        s_ref = samples_to_reach(reference, loss)
        if s_ref is None:  # better than the reference ever got: at least its whole run
            s_ref, censored = float(reference.samples[-1]), True
        points.append(s_ref / s)
    if not points:
        return None
    # The ratio drifts on the way (Adagrad is quick early and slows down): the points with the most
    # progress speak for the rest of the way; all of them give the band.
    estimate, steady = statistics.median(points[-LAST_POINTS:]), new_lows / len(points)
    ratio = Ratio(estimate, min(points), max(points), points, censored, steady)
    # Still falling as it learns: half its fall again on the rest of the way, the band's low end all
    # of it. A fall on plateaus is in its last points already.
    if ratio.drift < DRIFT_FLOOR and ratio.steady >= STEADY_SHARE:
        ratio.estimate, ratio.low = estimate * math.sqrt(ratio.drift), min(ratio.low, estimate * ratio.drift)
    return ratio


@dataclass
class StepCost:
    """Seconds per step (all of it, and the communication part) and global samples per step."""

    step_s: float
    comm_s: float
    samples_per_step: float

    @property
    def compute_s(self) -> float:
        return max(self.step_s - self.comm_s, 0.0)

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_s


def step_cost(records: list[dict], eval_steps: set[int], warmup: int) -> StepCost | None:
    """Mean step time and communication per step from consecutive step records, leaving out the
    first ``warmup`` steps and every step that follows an evaluation (its time holds the evaluation).
    ``samples_per_step``: the global samples of the last record (samples/s x time) over its step."""
    durations, comms = [], []
    for prev, rec in zip(records, records[1:]):
        if rec["step"] != prev["step"] + 1 or rec["step"] <= warmup or prev["step"] in eval_steps:
            continue
        durations.append(rec["time"] - prev["time"])
        comms.append(sum((rec.get("comm") or {}).values()))
    if not durations:
        return None
    last = records[-1]
    samples = last["samples_per_s"] * last["time"] / last["step"]
    step_s = max(statistics.fmean(durations), 1e-9)
    return StepCost(step_s, min(statistics.fmean(comms), step_s), samples)


@dataclass(frozen=True)
class Exchange:
    """What one exchange of a candidate puts on the links: a message of ``message_bytes`` per rank (as
    encoded; None where the model's size is not known) over perfmodel's ``topology``, or, ``gathered``, an
    all-gather (compressed messages are not summed on the way: every rank receives the n - 1 others').
    Through the box a push of ``message_bytes`` is answered by a pull of ``pull_bytes`` (the float32
    center, whatever the push's encoding).

    >>> Exchange("ring", 4000.0).link_bytes(8), Exchange("ring", 1016.0, gathered=True).link_bytes(8)
    (7000.0, 7112.0)
    >>> Exchange("box", 1016.0, pull_bytes=4000.0).link_bytes(2) == Exchange("box", 2508.0).link_bytes(2)
    True
    """

    topology: str
    message_bytes: float | None = None
    gathered: bool = False
    pull_bytes: float | None = None

    def link_bytes(self, n: int, size: float | None = None) -> float | None:
        """The bandwidth term of one exchange among ``n`` workers in bytes (its seconds at 1 byte/s:
        what one worker's link carries each way; the box's adds the queue at the box), for a message of
        ``size`` bytes (default: its own, and its pull: perfmodel's box moves one message each way, so
        their mean)."""
        if size is None and self.message_bytes is not None and self.pull_bytes is not None:
            size = (self.message_bytes + self.pull_bytes) / 2
        size = self.message_bytes if size is None else size
        if size is None:
            return None
        if self.gathered:
            return (n - 1) * size
        return comm_time_s(self.topology, n, size, Network(1.0, 0.0))


def scale_cost(cost: StepCost, exchange: Exchange, probed: int, workers: int) -> StepCost:
    """The step at ``workers`` from the one probed at ``probed``: communication scaled by the exchange's
    bandwidth term (perfmodel's alpha-beta costs, latency left out; an all-gather's for a compressed
    one), samples per step by workers / probed, compute unchanged (each worker keeps its batch).

    >>> scale_cost(StepCost(0.010, 0.004, 64.0), Exchange("ring"), 2, 8).comm_s  # 2(n-1)/n: 1 -> 1.75
    0.007
    >>> scale_cost(StepCost(0.010, 0.004, 64.0), Exchange("ring", gathered=True), 2, 8).comm_s  # (n-1): 1 -> 7
    0.028
    """
    if workers == probed:
        return cost
    t_probed = exchange.link_bytes(probed, 1.0) or 0.0
    factor = (exchange.link_bytes(workers, 1.0) or 0.0) / t_probed if t_probed > 0 else 1.0
    comm = cost.comm_s * factor
    return StepCost(cost.compute_s + comm, comm, cost.samples_per_step * workers / probed)


@dataclass
class Prediction:
    """Predicted seconds to the target (estimate and band) and the parts it is made of."""

    seconds: float | None
    low_s: float | None
    high_s: float | None
    samples: float | None  # global samples to the target
    cost: StepCost
    ratio: Ratio | None
    exchange: Exchange | None = None  # its exchange's message (for the bytes it moves at N workers)


def predict(reference_samples: float, ratio: Ratio | None, cost: StepCost) -> Prediction:
    """S_ref / e samples at the measured samples per second; None without a ratio.

    >>> p = predict(1000.0, Ratio(0.5, 0.25, 1.0), StepCost(0.01, 0.0, 10.0))
    >>> p.samples, p.seconds, p.low_s, p.high_s
    (2000.0, 2.0, 1.0, 4.0)
    """
    if ratio is None or ratio.estimate <= 0:
        return Prediction(None, None, None, None, cost, ratio)
    rate = cost.samples_per_s
    samples = reference_samples / ratio.estimate
    return Prediction(
        samples / rate,
        reference_samples / ratio.high / rate,
        reference_samples / max(ratio.low, 1e-12) / rate,
        samples,
        cost,
        ratio,
    )


def rank_order(predictions: list[Prediction]) -> list[int]:
    """Indices by predicted time, the ones without a prediction last (in their given order)."""
    return sorted(
        range(len(predictions)), key=lambda i: (predictions[i].seconds is None, predictions[i].seconds or 0)
    )


# -- reasons -------------------------------------------------------------------------------------------


def attribution(p: Prediction, q: Prediction) -> dict[str, float]:
    """Why ``p`` takes longer (or less) than ``q``: ln(T_p / T_q) split into convergence per sample
    ln(S_p / S_q), and the step time's ln ratio shared between compute and communication in proportion
    to their differences (samples per step folded into compute: a step that does more work).

    >>> a = attribution(predict(100, Ratio(1, 1, 1), StepCost(0.02, 0.01, 10)),
    ...                 predict(100, Ratio(1, 1, 1), StepCost(0.01, 0.0, 10)))
    >>> round(a["communication"], 3), a["compute"], a["convergence"]
    (0.693, 0.0, 0.0)
    """
    conv = math.log(p.samples / q.samples)
    per_sample_p = p.cost.step_s / p.cost.samples_per_step
    per_sample_q = q.cost.step_s / q.cost.samples_per_step
    step = math.log(per_sample_p / per_sample_q)
    d_comp = p.cost.compute_s / p.cost.samples_per_step - q.cost.compute_s / q.cost.samples_per_step
    d_comm = p.cost.comm_s / p.cost.samples_per_step - q.cost.comm_s / q.cost.samples_per_step
    total = abs(d_comp) + abs(d_comm)
    share = 0.5 if total == 0 else abs(d_comp) / total
    return {"convergence": conv, "compute": step * share, "communication": step * (1 - share)}


def dominant(p: Prediction) -> str:
    """What most of a step is: communication or compute."""
    return "communication" if p.cost.comm_s > p.cost.compute_s else "compute"


def reason(p: Prediction, top: Prediction | None, top_label: str, staleness: float | None) -> str:
    """One line: what dominates this candidate's time and, below the top pick, what loses it its rank."""
    c = p.cost
    own = f"{1e3 * c.step_s:.1f} ms/step ({1e3 * c.comm_s:.1f} communication)"
    if p.seconds is None:
        return (
            "convergence per sample: its probe's test loss never fell below the reference's first "
            f"evaluation; {own}"
        )
    if top is None:
        conv = p.ratio.estimate if p.ratio else 1.0
        return (
            f"fastest: {dominant(p)} dominates its {own}; {conv:.2f}x the reference's convergence per sample"
        )
    parts = attribution(p, top)
    why = max(parts, key=lambda k: parts[k])
    slower = f"{math.exp(sum(parts.values())):.2f}x {top_label}'s time"  # top_label: "the top pick"
    if why == "convergence":
        what = "staleness" if staleness else "convergence per sample"
        extra = f", mean staleness {staleness:.2f}" if staleness else ""
        return f"{what}: needs {math.exp(parts['convergence']):.2f}x {top_label}'s samples{extra}; {slower}"
    top_part = top.cost.comm_s if why == "communication" else top.cost.compute_s
    mine = c.comm_s if why == "communication" else c.compute_s
    return (
        f"{why}: {1e3 * mine:.1f} ms/step against {1e3 * top_part:.1f} for {top_label} "
        f"(of {1e3 * c.step_s:.1f} and {1e3 * top.cost.step_s:.1f}); {slower}"
    )
