"""Cutting an ``nn.Sequential`` into contiguous pipeline stages, balanced by a cost per child.

A cut is a list of *split points*: the index of the child each stage after the first starts at.
``[5]`` cuts a 12-child LeNet into children 0-4 and 5-11. The costs are the children's parameter
counts (the default: what each stage must store) or their measured forward + backward times (what
bounds the pipeline's throughput); the cut minimises the largest stage's cost.

>>> balanced_split([1.0, 1.0, 4.0, 1.0, 1.0], 3)
[2, 3]
>>> stage_bounds([2, 3], 5)
[(0, 2), (2, 3), (3, 5)]
"""

from __future__ import annotations

import time

import torch
from torch import nn

from parambox.errors import UserError


def balanced_split(costs: list[float], num_stages: int) -> list[int]:
    """Split points cutting ``costs`` into ``num_stages`` non-empty runs with the smallest maximum sum.

    Exact (linear partition by dynamic programming) and deterministic: the result depends on the
    costs alone, so every rank that computes it from the same costs gets the same cut.
    """
    n = len(costs)
    assert 1 <= num_stages <= n
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest max-stage cost of the first i children cut into k stages; cut[k][i]: last start.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12 * max(1.0, abs(value)):
                    best[k][i], cut[k][i] = value, j
    points, i = [], n
    for k in range(num_stages, 1, -1):
        i = cut[k][i]
        points.append(i)
    return sorted(points)


def stage_bounds(split_points: list[int], num_children: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` child ranges of each stage."""
    edges = [0, *split_points, num_children]
    return list(zip(edges[:-1], edges[1:]))


def check_split(split_points: list[int], num_children: int, num_stages: int) -> list[int]:
    """Validate explicit split points from the config; a bad cut is the user's error."""
    points = list(split_points)
    if len(points) != num_stages - 1:
        raise UserError(
            f"split_points {points}: {num_stages} stages need {num_stages - 1} split points, got {len(points)}"
        )
    if points != sorted(set(points)) or (points and (points[0] < 1 or points[-1] > num_children - 1)):
        raise UserError(
            f"split_points {points}: need strictly increasing child indices in 1..{num_children - 1} "
            f"(the model has {num_children} top-level children)"
        )
    return points


def shared_parameters(
    model: nn.Sequential, bounds: list[tuple[int, int]]
) -> list[tuple[str, tuple[int, ...]]]:
    """Each parameter that sits in more than one stage (tied weights: an embedding and its output
    layer), as its first name in the model and the stages that hold it, in the model's order.

    >>> emb, head = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)
    >>> head.weight = emb.weight
    >>> model = nn.Sequential(emb, nn.ReLU(), head)
    >>> shared_parameters(model, [(0, 2), (2, 3)]), shared_parameters(model, [(0, 3)])
    ([('0.weight', (0, 1))], [])
    """
    names: dict[int, str] = {}
    holders: dict[int, set[int]] = {}
    for s, (start, end) in enumerate(bounds):
        for i in range(start, end):
            for name, p in model[i].named_parameters():
                names.setdefault(id(p), f"{i}.{name}")
                holders.setdefault(id(p), set()).add(s)
    return [(names[k], tuple(sorted(v))) for k, v in holders.items() if len(v) > 1]


def parameter_costs(model: nn.Sequential) -> list[float]:
    """Parameters per child, plus a tiny cost per child so parameter-free layers spread evenly."""
    return [sum(p.numel() for p in child.parameters()) + 1e-3 for child in model]


def measured_costs(model: nn.Sequential, x: torch.Tensor, repeats: int = 3) -> list[float]:
    """Seconds of forward + backward per child on input ``x`` (the fastest of ``repeats``).

    Each child is timed on the previous child's output, detached, so only its own backward counts.
    Gradients and buffers (batch-norm statistics) are left as they were: timing must not change
    this rank's model.
    """
    saved = {name: b.clone() for name, b in model.named_buffers()}
    costs = []
    h = x.detach()
    for child in model:
        best = float("inf")
        for _ in range(repeats):
            inp = h.detach().requires_grad_(h.is_floating_point())
            t0 = time.perf_counter()
            out = child(inp)
            if out.requires_grad:
                out.sum().backward()
            best = min(best, time.perf_counter() - t0)
        costs.append(best)
        with torch.no_grad():
            h = child(h)
    for p in model.parameters():
        p.grad = None
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(saved[name])
    return costs


def stage_module(model: nn.Sequential, bounds: tuple[int, int]) -> nn.Sequential:
    """The stage's children as their own Sequential; modules (and so parameters) are shared, not copied."""
    start, end = bounds
    return nn.Sequential(*[model[i] for i in range(start, end)])


def stage_state_keys(model: nn.Sequential, bounds: tuple[int, int]) -> list[str]:
    """The whole model's state_dict names (``"7.weight"``) that belong to the stage, in order."""
    start, end = bounds
    return [k for k in model.state_dict() if start <= int(k.split(".", 1)[0]) < end]
