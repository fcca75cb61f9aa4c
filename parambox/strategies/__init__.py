"""Update rules, one module each, registered by the name the CLI spells.

Adding a strategy: write its module (a ``Strategy`` subclass with an ``Options`` model; the facts the
launcher, the studies and ``pick`` need are its class attributes), add one line below, one preset in
``parambox.presets`` and one multi-process test. A strategy of a user's own, outside parambox:
``parambox.strategies.register("mine", "my_module:MyStrategy")`` (spawned workers inherit it).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from parambox.errors import UserError
from parambox.runtime import zygote
from parambox.strategies.base import Context, Options, StepResult, Strategy

# name -> "module:Class", imported on first use so that a run loads only its own strategy.
STRATEGIES: dict[str, str] = {
    "single": "parambox.strategies.single:Single",
    "allreduce": "parambox.strategies.allreduce:AllReduce",
    "ps-sync": "parambox.strategies.ps_sync:ParameterServerSync",
    "weight-avg": "parambox.strategies.weight_avg:WeightAveraging",
    "box-sync": "parambox.strategies.box_sync:BoxSync",
    "downpour": "parambox.strategies.downpour:Downpour",
    "easgd": "parambox.strategies.easgd:ElasticAveraging",
    "eamsgd": "parambox.strategies.easgd:ElasticMomentumAveraging",
    "dynsgd": "parambox.strategies.dynsgd:DynSGD",
    "hogwild": "parambox.strategies.hogwild:Hogwild",
    "dogwild": "parambox.strategies.dogwild:Dogwild",
    "hybrid": "parambox.strategies.hybrid:Hybrid",
    "diloco": "parambox.strategies.diloco:Diloco",
    "pipeline": "parambox.strategies.pipeline:Pipeline",
    "pipeline-dp": "parambox.strategies.pipeline:PipelineDataParallel",
    "sandblaster": "parambox.strategies.sandblaster:Sandblaster",
}


# A user's strategies, "name=module:Class" joined by ";": how register() reaches spawned workers.
USER_STRATEGIES_ENV = "PARAMBOX_STRATEGIES"


def register(name: str, reference: str) -> None:
    """Add strategy ``name``, the class at ``reference`` (``module:Class``, importable by the workers),
    for this process and the workers it starts.

    >>> # register("toy", "my_strategies:Toy"); parambox.train(strategy="toy", ...)
    """
    module, sep, attr = reference.partition(":")
    if not (sep and module and attr) or any(c in reference + name for c in ";="):
        raise UserError(f"register({name!r}, {reference!r}): expected a name and module:Class")
    STRATEGIES[name] = reference
    entries = dict(_user_entries())
    entries[name] = reference
    os.environ[USER_STRATEGIES_ENV] = ";".join(f"{k}={v}" for k, v in entries.items())


def _user_entries() -> list[tuple[str, str]]:
    text = os.environ.get(USER_STRATEGIES_ENV, "")
    return [tuple(e.split("=", 1)) for e in text.split(";") if "=" in e]  # type: ignore[misc]


def _read_user_entries() -> None:
    STRATEGIES.update(dict(_user_entries()))


def _import_all() -> None:
    for reference in STRATEGIES.values():
        importlib.import_module(reference.split(":")[0])


_read_user_entries()
zygote.when_warming(_import_all)  # a warm zygote holds every strategy's module
zygote.in_child(_read_user_entries)  # a child forked from it reads its own user strategies


def strategy_class(name: str, options: Options | dict[str, Any] | None = None) -> type[Strategy]:
    """The class registered as ``name``; given the run's ``options``, the class that really runs with
    them (``Strategy.resolve``: e.g. ``easgd`` with ``sync: true`` is the synchronous form)."""
    if name not in STRATEGIES:
        raise UserError(f"unknown strategy {name!r}; choose from {', '.join(sorted(STRATEGIES))}")
    module, attr = STRATEGIES[name].split(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(f"strategy {name!r}: cannot load {STRATEGIES[name]} ({e})") from None
    if options is None:
        return cls
    return cls.resolve(cls.Options(**options) if isinstance(options, dict) else options)


def accepts(name: str, options: dict[str, Any]) -> bool:
    """Strategy ``name`` takes these ``options``: they validate and the strategy resolves with them
    (diloco refuses powersgd in its asynchronous form, hybrid refuses compression)."""
    try:
        strategy_class(name, options)
    except (ValueError, UserError):  # pydantic's ValidationError is a ValueError
        return False
    return True


def build_strategy(name: str, ctx: Context, options: Options | dict[str, Any] | None = None) -> Strategy:
    """Strategy ``name`` for this context, with its options (an ``Options`` or the ``[name]`` table)."""
    cls = strategy_class(name)
    opts = options if isinstance(options, Options) else cls.Options(**(options or {}))
    return cls.resolve(opts)(ctx, opts)


__all__ = [
    "Context",
    "Options",
    "STRATEGIES",
    "StepResult",
    "Strategy",
    "accepts",
    "build_strategy",
    "register",
    "strategy_class",
]
