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

Compression is a dimension of the candidates (``with_compression``): a candidate whose exchange takes
``compression`` (its options have the field: allreduce's gradients, weight-avg, easgd and diloco in
either form, downpour's pushes) is considered once per listed encoding it accepts (``pick --compression
none,int8``), labelled with it (``allreduce compression=int8``). One whose options refuse an encoding
(powersgd is for allreduce and synchronous diloco only) does not get that variant; one whose compression
the user or its preset set keeps it. An asynchronous form's pushes cross the link encoded where the rma
box's memory server decodes them (``box.server``, the box's default across nodes); its pulls bring the
float32 center back (``message_bytes``, ``pull_bytes``). On one machine its box is shared memory, with
no link to save bytes on: there it gets no compressed variant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from parambox.errors import UserError

TUNED = ("optimizer", "lr", "momentum", "weight_decay")  # what a preset may lend a candidate
# pick's default --compression: float32 and int8 (a quarter of the bytes, error feedback: close to float32's
# convergence), one more probe for each candidate whose exchange takes it.
DEFAULT_COMPRESSIONS = ("none", "int8")


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


# -- compression: a dimension of the candidates -------------------------------------------------------


def compression_of(c: Candidate) -> str:
    """The encoding of the candidate's exchange (``none``: float32).

    >>> compression_of(Candidate("allreduce", {"compression": "int8"})), compression_of(Candidate("hogwild"))
    ('int8', 'none')
    """
    return str(c.options.get("compression", "none"))


def parse_compressions(text: str) -> list[str]:
    """``--compression``'s comma list, in its order, once each; a UserError naming the unknown ones.

    >>> parse_compressions("none, int8,int8,topk")
    ['none', 'int8', 'topk']
    """
    from typing import get_args

    from parambox.strategies.compress import Compression

    known = get_args(Compression)
    names = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UserError(f"--compression {text!r}: a comma list of {', '.join(known)}")
    return names


def takes_compression(c: Candidate) -> bool:
    """Whether the candidate's exchange takes ``compression``: its options have the field (a
    collective's messages, or an asynchronous form's pushes to the box)."""
    from parambox.strategies import strategy_class

    return "compression" in strategy_class(c.strategy, c.options).Options.model_fields


def topology(c: Candidate) -> str:
    """perfmodel's topology of the candidate's exchange: a strategy may say (``comm_topology``); else the
    box for the asynchronous ones and a ring allreduce for the others."""
    from parambox.strategies import strategy_class

    cls = strategy_class(c.strategy, c.options)
    return cls.comm_topology or ("box" if cls.tolerates_worker_loss else "ring")


def with_compression(
    candidates: list[Candidate], modes: list[str] | tuple[str, ...], across_nodes: bool = True
) -> list[Candidate]:
    """Every candidate whose exchange takes compression (``takes_compression``) and does not set it
    already, once per encoding of ``modes`` its options accept (``none``: as it is), each next to the
    others of its candidate; the rest as they are. A candidate that accepts none of ``modes`` is
    left out. Not ``across_nodes`` (one machine: the shm box, no link), an exchange through the box is
    left as it is: its encoded pushes would cost encoding and save nothing."""
    from parambox.strategies import accepts

    out: list[Candidate] = []
    for c in candidates:
        boxed = not across_nodes and topology(c) == "box"
        if "compression" in c.options or not takes_compression(c) or boxed:
            out.append(c)
            continue
        for mode in modes:
            variant = (
                c
                if mode == "none"
                else Candidate(c.strategy, {**c.options, "compression": mode}, c.settings, c.box)
            )
            if mode == "none" or accepts(variant.strategy, variant.options):
                out.append(variant)
    return out


def message_bytes(c: Candidate, shapes: list[Any]) -> int:
    """One rank's message of one exchange (an asynchronous form's push), for a model of parameters of
    ``shapes``, as :mod:`parambox.strategies.compress` (or PowerSGD) encodes it: float32 where it is
    not compressed."""
    from parambox.strategies import strategy_class
    from parambox.strategies.compress import Compressor
    from parambox.strategies.powersgd import PowerSGD

    numel = sum(int(s.numel()) for s in shapes)
    mode = compression_of(c)
    if mode == "none":
        return Compressor("none", numel, error_feedback=False).payload_bytes()
    opts = strategy_class(c.strategy).Options(**c.options)
    if mode == "powersgd":
        return PowerSGD(shapes, opts.powersgd_rank).message_bytes(tail=0)
    return Compressor(
        mode, numel, opts.compression_block, error_feedback=False, ratio=opts.compression_ratio
    ).payload_bytes()


def pull_bytes(c: Candidate, shapes: list[Any]) -> int | None:
    """What one pull of an asynchronous form brings back, for a model of parameters of ``shapes``: the
    box's float32 center whatever its pushes' encoding; None for a collective (its reply is its message's
    size: ``message_bytes``)."""
    if topology(c) != "box":
        return None
    return 4 * sum(int(s.numel()) for s in shapes)
