"""The strategies ``parambox pick`` considers: the registry's, with the settings their presets give.

A candidate is a registered strategy that accepts the run's worker count, with one of the options
tables its presets use (every strategy has a preset: ``tests/test_registry.py``), or its defaults.
A strategy's own preset (named after it, e.g. ``digits-hogwild``) made for the workload being picked
for (same model and data) also lends the candidate its optimizer settings where they differ from
the base run's (``hogwild`` at half the learning rate, a strategy whose paper uses AdamW): that is
part of how the strategy is meant to run there; a study's base preset lends none. The
user's own flags win over both. Nothing here names a strategy: a strategy added to the registry
with a preset is a candidate. Whether it can run *here* (this model and data, this cluster, MPI) is
found out by its probe: one that fails is excluded with its error line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from parambox.errors import UserError

TUNED = ("optimizer", "lr", "momentum", "weight_decay")  # what a preset may lend a candidate


@dataclass(frozen=True)
class Candidate:
    """One strategy with its options, the run settings it brings (``settings``: optimizer fields) and
    the box backend its runs use (None: the base config's).

    >>> Candidate("weight-avg", {"period": 4}).label
    'weight-avg period=4'
    >>> Candidate("hogwild", settings={"lr": 0.015}).label
    'hogwild lr=0.015'
    """

    strategy: str
    options: dict[str, Any] = field(default_factory=dict, hash=False)
    settings: dict[str, Any] = field(default_factory=dict, hash=False)
    box: str | None = None

    @property
    def label(self) -> str:
        opts = [f"{k}={_text(v)}" for k, v in sorted(self.options.items())]
        opts += [f"{k}={_text(v)}" for k, v in self.settings.items()]
        return " ".join([self.strategy, *opts]) + (f" [{self.box} box]" if self.box else "")

    @property
    def slug(self) -> str:
        """A directory name for its runs."""
        return "".join(c if c.isalnum() or c in "-." else "_" for c in self.label.replace(" ", "_"))

    def config(self, base: dict[str, Any]) -> dict[str, Any]:
        """``base`` (a RunConfig dict) running this candidate."""
        from parambox.config import merge

        update: dict[str, Any] = {
            **self.settings,
            "strategy": self.strategy,
            "options": {self.strategy: dict(self.options)},
        }
        if self.box:
            update["box"] = {"backend": self.box}
            if self.box == "rma":  # every candidate on the same processes: pick measures speed, not
                update["box"]["memory_ranks"] = 0  # surviving a lost worker (AsyncStrategy.memory_ranks)
        return merge(base, update)

    def on_box(self, backend: str) -> Candidate:
        return Candidate(self.strategy, self.options, self.settings, backend)

    def overridden(self, options: dict[str, Any], fixed: set[str]) -> Candidate:
        """The user's ``options`` over this one's, and without the settings the user fixed."""
        settings = {k: v for k, v in self.settings.items() if k not in fixed}
        return Candidate(self.strategy, {**self.options, **options}, settings, self.box)


def _text(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def registry_candidates(
    workers: int, only: list[str] | None = None, base: dict[str, Any] | None = None
) -> list[Candidate]:
    """Every registered strategy that accepts ``workers`` (or those of ``only``), once per distinct
    (options, settings) its presets give it (its defaults when no preset sets any); settings from the
    presets of ``base``'s model and data, where they differ from ``base``."""
    from parambox.presets import PRESETS
    from parambox.strategies import STRATEGIES, strategy_class

    names = list(STRATEGIES)
    if only:
        unknown = [n for n in only if n not in STRATEGIES]
        if unknown:
            raise UserError(
                f"--strategies: unknown {', '.join(unknown)}; choose from {', '.join(sorted(STRATEGIES))}"
            )
        names = [n for n in names if n in only]
    out: list[Candidate] = []
    for name in names:
        if not strategy_class(name).accepts_workers(workers):
            continue
        found = [_from_preset(key, make(), base) for key, make in PRESETS.items()]
        found = [c for c in found if c.strategy == name] or [Candidate(name)]
        out += [c for i, c in enumerate(found) if c not in found[:i]]
    return out


def _from_preset(key: str, cfg: dict[str, Any], base: dict[str, Any] | None) -> Candidate:
    name = cfg.get("strategy", "")
    options = dict(cfg.get("options", {}).get(name, {}))
    settings = {}
    own = name in key  # the strategy's own preset, not a study's base that happens to run it
    if own and base is not None and all(cfg.get(k) == base.get(k) for k in ("model", "data")):
        settings = {k: cfg[k] for k in TUNED if k in cfg and cfg[k] != base.get(k)}
    return Candidate(name, options, settings)
