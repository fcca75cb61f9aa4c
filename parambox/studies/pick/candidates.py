"""The strategies ``parambox pick`` considers: the registry's, with the settings their presets give.

A candidate is a registered strategy that accepts the run's worker count, with one of the options
tables its presets use (every strategy has a preset: ``tests/test_registry.py``), or its defaults.
Nothing here names a strategy: a strategy added to the registry with a preset is a candidate.
Whether it can run *here* (this model and data, this cluster, MPI) is found out by its probe: one that
fails is excluded with its error line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from parambox.errors import UserError


@dataclass(frozen=True)
class Candidate:
    """One strategy with its options (``box``: the backend its runs use).

    >>> Candidate("weight-avg", {"period": 4}).label
    'weight-avg period=4'
    """

    strategy: str
    options: dict[str, Any] = field(default_factory=dict, hash=False)
    box: str | None = None  # None: the base config's

    @property
    def label(self) -> str:
        opts = " ".join(f"{k}={_text(v)}" for k, v in sorted(self.options.items()))
        return f"{self.strategy} {opts}".strip() + (f" [{self.box} box]" if self.box else "")

    @property
    def slug(self) -> str:
        """A directory name for its runs."""
        return "".join(c if c.isalnum() or c in "-." else "_" for c in self.label.replace(" ", "_"))

    def config(self, base: dict[str, Any]) -> dict[str, Any]:
        """``base`` (a RunConfig dict) running this candidate; the user's own ``[strategy]`` table wins."""
        from parambox.config import merge

        own = base.get("options", {}).get(self.strategy, {})
        update: dict[str, Any] = {
            "strategy": self.strategy,
            "options": {self.strategy: {**self.options, **own}},
        }
        if self.box:
            update["box"] = {"backend": self.box}
        return merge(base, update)

    def on_box(self, backend: str) -> Candidate:
        return Candidate(self.strategy, self.options, backend)


def _text(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def registry_candidates(workers: int, only: list[str] | None = None) -> list[Candidate]:
    """Every registered strategy that accepts ``workers`` (or those of ``only``), once per distinct
    options table its presets give it (its defaults when no preset sets any)."""
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
    out = []
    for name in names:
        if not strategy_class(name).accepts_workers(workers):
            continue
        variants: list[dict[str, Any]] = []
        for make in PRESETS.values():
            cfg = make()
            if cfg.get("strategy") == name:
                opts = dict(cfg.get("options", {}).get(name, {}))
                if opts not in variants:
                    variants.append(opts)
        out += [Candidate(name, opts) for opts in variants or [{}]]
    return out
