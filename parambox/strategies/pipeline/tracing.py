"""Cutting any model into pipeline stages at module names, by ``torch.distributed.pipelining.pipeline``.

An ``nn.Sequential`` is cut by child index (``stages.py``); any other model is traced (torch.export)
on one micro-batch and split before each module named in ``split_at`` (``SplitPoint.BEGINNING``).
The stage modules hold the model's parameters and buffers under their usual names, so rank 0's whole
model receives the other stages' weights by name (a tied weight that two stages hold is a copy in
each: ``pipe.replicated_params``). Every rank traces the same model on
the same input and so gets the same cut.

>>> # parambox.train(model=make_model, strategy="pipeline", workers=2, options={"split_at": ["blocks.1"]})
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from parambox.errors import UserError


def check_split_at(strategy: str, model: nn.Module, options: Any, num_stages: int) -> None:
    """The module names must exist and make ``num_stages`` stages; a Sequential may use split_points."""
    names = options.split_at
    if names is None:
        raise UserError(
            f"strategy {strategy!r} cuts an nn.Sequential by itself; for a {type(model).__name__} give the "
            "module names where the stages after the first begin: options split_at=[...] "
            f'(--set {strategy}.split_at=["layer"]), e.g. one of {_examples(model)}'
        )
    if options.split_points is not None:
        raise UserError(f"{strategy}: give split_points (child indices) or split_at (module names), not both")
    if len(names) != num_stages - 1:
        raise UserError(
            f"{strategy}.split_at={names}: {num_stages} stages need {num_stages - 1} module names, got {len(names)}"
        )
    modules = dict(model.named_modules())
    for name in names:
        if not name or name not in modules:
            raise UserError(f"{strategy}.split_at: the model has no module {name!r}; e.g. {_examples(model)}")


def trace(strategy: str, model: nn.Module, split_at: list[str], probe: torch.Tensor):
    """The traced ``Pipe``; the model's modules are left as they were (unmarked) afterwards."""
    spec = dict.fromkeys(split_at, SplitPoint.BEGINNING)
    try:
        with warnings.catch_warnings():  # torch.export's deprecation chatter, on every rank
            warnings.simplefilter("ignore")
            pipe = pipeline(model, (probe,), split_spec=spec)
    except Exception as e:
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{strategy}: torch.distributed.pipelining cannot trace this model: {text}") from e
    finally:
        _unmark(model, split_at)
    if pipe.num_stages != len(split_at) + 1:
        raise UserError(
            f"{strategy}.split_at={split_at}: tracing found {pipe.num_stages} stages, not {len(split_at) + 1} "
            "(a module that forward() calls more than once or not at all?)"
        )
    late = _stages_reading_inputs(pipe)
    if late:
        raise UserError(
            f"{strategy}.split_at={split_at}: stage {late[0]} reads the model's input itself, but a pipeline "
            "hands the input to the first stage only; cut where the later stages need only what the "
            "earlier ones compute"
        )
    return pipe  # tied parameters in several stages: pipe.replicated_params (Pipeline.make_shared_groups)


def timed(stage: Any) -> Any:
    """``stage`` adding up its compute time in the phases ``forward`` and ``backward``, as TimedStage."""
    from parambox.strategies.base import PhaseTimers

    stage.compute = PhaseTimers()
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(*args: Any, **kwargs: Any):
        with stage.compute.phase("forward"):
            return forward(*args, **kwargs)

    def backward_one_chunk(*args: Any, **kwargs: Any):
        with stage.compute.phase("backward"):
            return backward(*args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    return stage


def _stages_reading_inputs(pipe: Any) -> list[int]:
    """Stages after the first whose call in the split graph takes one of the model's inputs."""
    late = []
    for node in pipe.split_gm.graph.nodes:
        if node.op != "call_module" or not str(node.target).startswith("submod_"):
            continue
        index = int(str(node.target).rsplit("_", 1)[-1])
        args = [*node.args, *node.kwargs.values()]
        if index > 0 and any(getattr(a, "op", None) == "placeholder" for a in args):
            late.append(index)
    return late


def _unmark(model: nn.Module, names: list[str]) -> None:
    # pipeline() wraps each named module's forward with a split marker; the whole model on rank 0
    # still runs eagerly for evaluation and export, so the wrappers go again.
    modules = dict(model.named_modules())
    for name in names:
        mod = modules.get(name)
        if mod is not None and hasattr(mod, "_orig_forward"):
            del mod.forward
            del mod._orig_forward


def _examples(model: nn.Module) -> str:
    names = [n for n, _ in model.named_children()][1:4]
    return ", ".join(repr(n) for n in names) or "(the model has no sub-modules)"
