"""``parambox predict --nodes N``: parambox's setups ranked for a cluster of N nodes, from their simulated
curves (``perfmodel/simulate.py``): samples per second at n = N, fastest first.

A rate, not a time to a target: local SGD and the asynchronous setups reach a loss in a different number of
samples than a synchronous one (``parambox pick`` measures that on the workload); ``of_ceiling`` is the
share of the step that is compute (1.0: communication wholly hidden or absent).

>>> from parambox.perfmodel.scaling import ScalingCurve
>>> fast = ScalingCurve("sim:a", [1, 4], [0.10, 0.03], [0.10, 0.025], [0.0, 0.005], 0.10)
>>> slow = ScalingCurve("sim:b", [1, 4], [0.10, 0.05], [0.10, 0.025], [0.0, 0.025], 0.10)
>>> [(r["setup"], r["samples_per_s"], r["of_ceiling"]) for r in rank_setups([slow, fast], 4, 64, False)]
[('a', 2133.3333333333335, 0.8333333333333334), ('b', 1280.0, 0.5)]
"""

from __future__ import annotations

from typing import Any

from parambox.perfmodel.scaling import ScalingCurve

PREFIX = "sim:"  # the simulated curves' names


def rank_setups(
    curves: list[ScalingCurve], nodes: int, batch: int, weak: bool, workers_per_node: int = 1
) -> list[dict[str, Any]]:
    """The simulated setups among ``curves`` at n = ``nodes``, by samples per second (the global batch per
    step under strong scaling, ``batch`` per worker under weak), each with its step, compute and
    communication and its rate over the fastest's."""
    rows = []
    for c in curves:
        if not c.topology.startswith(PREFIX) or nodes not in c.n:
            continue
        i = c.n.index(nodes)
        step, comp = c.t_iter_s[i], c.t_comp_s[i]
        if step is None or comp is None:
            continue
        per_step = batch * nodes * workers_per_node if weak else batch
        rows.append(
            {
                "setup": c.topology.removeprefix(PREFIX),
                "step_ms": 1e3 * step,
                "compute_ms": 1e3 * comp,
                "comm_ms": 1e3 * max(step - comp, 0.0),
                "samples_per_s": per_step / step,
                "of_ceiling": min(comp / step, 1.0),
            }
        )
    rows.sort(key=lambda r: -r["samples_per_s"])
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank
        r["vs_fastest"] = r["samples_per_s"] / rows[0]["samples_per_s"]
    return rows
