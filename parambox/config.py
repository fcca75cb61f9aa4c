"""The run's typed configuration: defaults, validation, TOML files and ``--set key=value`` overrides.

Precedence: preset < TOML file (``--config``) < flags < ``--set``. Strategy options live in a table
named after the strategy (``[easgd]`` in TOML, ``--set easgd.tau=4``) and are validated by that
strategy's own ``Options`` model; the box's in ``[box]`` (``--set box.num_shards=2``; ``--box rma``
sets its backend alone), validated by ``BoxConfig``; the emulated cluster's in ``[cluster]``
(``--emulate-nodes 2 --link-gbps 1`` = ``--set cluster.nodes=2 --set cluster.link_gbps=1``),
validated by ``ClusterConfig``.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from parambox.box.base import BoxConfig
from parambox.errors import UserError, unknown_hint, validation_message
from parambox.runtime.cluster import ClusterConfig

TABLES = ("box", "cluster")  # sub-configs of their own, merged key by key: [box], --set box.KEY=V


class RunConfig(BaseModel):
    """Everything one training run needs.

    >>> RunConfig(strategy="single", workers=1).global_batch_size
    32
    """

    # allow_inf_nan: --timeout inf would be accepted and overflow in the workers' waits.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    strategy: str = "allreduce"
    workers: int = Field(
        2,
        ge=1,
        le=4096,
        description="worker processes (local launcher); MIN:MAX: start_workers=MIN, workers=MAX",
    )
    start_workers: int | None = Field(
        None,
        ge=1,
        description="local launcher: the run starts with this many workers and the others, up to workers, "
        "join it once up (synchronous: at a step boundary, with on_failure=shrink; asynchronous: on the box)",
    )
    model: str = Field(
        "lenet", description="zoo model, or a model factory REF (module:function, file.py:function)"
    )
    data: str = Field(
        "digits",
        description="registered data set, or a data factory REF returning (train, test); "
        "not given: the zoo model's own (gpt: text), else digits",
    )
    loss: str | None = Field(None, description="loss(model, batch) REF; default: cross-entropy of (x, y)")
    metrics: str | None = Field(
        None, description="metrics(model, batch) -> dict REF; default: loss, accuracy"
    )
    collate: str | None = Field(
        None, description="collate(items) REF for a user's data; default: default_collate"
    )
    loader_workers: int = Field(
        2, ge=0, le=64, description="background loader processes per worker (user data)"
    )
    data_path: str | None = None
    steps: int = Field(600, ge=1, description="optimizer steps per worker")
    batch_size: int = Field(32, ge=1, description="per-worker batch size")
    lr: float = Field(0.03, gt=0)
    optimizer: Literal["sgd", "adam", "adamw", "adagrad"] = "sgd"
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(
        None,
        ge=0,
        description="clip the gradient's global L2 norm to this before each optimizer step (the averaged "
        "gradient in synchronous strategies, the local one in local-step strategies); 0 or none: off",
    )
    grad_accum: int = Field(
        1,
        ge=1,
        le=4096,
        description="micro-batches per optimizer step (gradient accumulation): each worker's batch_size "
        "is the batch of one step, split into this many equal micro-batches, one backward each",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="forward and loss under autocast: bf16, or fp16 with a loss scaler (on a GPU, or on "
        "a CPU, whose fp16 kernels are slower); weights, optimizer and every exchange stay fp32",
    )
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant",
        description="the learning rate over the steps: constant, or decaying to 0 at the last step along "
        "half a cosine or a line; applied to every optimizer the strategy makes",
    )
    warmup_steps: int = Field(
        0, ge=0, description="steps of linear warmup from 0 to lr before the schedule (0: none)"
    )
    seed: int = Field(0, ge=0)
    out: str | None = None
    checkpoint_every: int = Field(
        0,
        ge=0,
        description="a checkpoint every this many steps (0: none by step count; see checkpoint_interval_s)",
    )
    checkpoint_interval_s: float = Field(
        600.0,
        ge=0,
        description="a checkpoint once this many seconds of training have passed since the last one, at the "
        "next step where every rank can agree on it (0: none by time); the run's end always writes one",
    )
    resize: Literal["keep-global-batch", "scale-batch"] = Field(
        "keep-global-batch",
        description="when the workers change (a resume at another count, a worker that joins): keep the "
        "global batch (each worker's batch is the global batch over the workers, uneven slices weighted "
        "exactly on resume) or keep each worker's batch_size",
    )
    init_from: str | None = Field(
        None,
        description="start a new run from another run's weights: its run directory (checkpoints/last.pt) or a "
        "state_dict .pt file",
    )
    eval_every: int = Field(100, ge=0, description="0: only at the end")
    log_every: int = Field(1, ge=1)
    timeout: float = Field(300.0, gt=0, description="seconds any blocking wait may take")
    max_restarts: int = Field(
        0,
        ge=0,
        description="local launcher: replace dead workers (asynchronous) or restart all from the last "
        "checkpoint (synchronous), at most this many times",
    )
    on_failure: Literal["restart", "shrink"] = Field(
        "restart",
        description="local launcher, synchronous run: after a lost worker, restart all (with max_restarts) "
        "or go on in place as a smaller group (shrink: allreduce, ps-sync, weight-avg, box-sync, "
        "synchronous diloco and easgd)",
    )
    warm_spare: bool = Field(
        False,
        description="with max_restarts, an asynchronous run keeps one worker process warmed up (torch "
        "imported, data loaded) to replace the next dead worker at once; it pays off where cores are free",
    )
    threads: int | None = Field(None, ge=1, description="torch threads per worker; default cores / workers")
    augment: bool | None = Field(
        None, description="train-time augmentation; default: on where the data set has one"
    )
    box: BoxConfig = Field(default_factory=BoxConfig, description="the box: backend and its options")
    cluster: ClusterConfig = Field(
        default_factory=ClusterConfig, description="an emulated cluster for the local launcher's workers"
    )
    target_metric: str = Field(
        "accuracy",
        description="the test metric (a key of metrics()) that pick, report and the accuracy studies aim at",
    )
    tensorboard: bool = Field(False, description="also write TensorBoard events (OUT/tensorboard)")
    progress: bool = Field(
        True, description="a progress bar and, at the end, the summary table (false: quiet, for scripts)"
    )
    options: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per-strategy options")

    @field_validator("box", mode="before")
    @classmethod
    def _backend_alone(cls, v: Any) -> Any:
        return {"backend": v} if isinstance(v, str) else v  # --box rma

    @model_validator(mode="before")
    @classmethod
    def _workers_range(cls, data: Any) -> Any:
        """``workers = "MIN:MAX"`` (``--workers 2:4``): start with MIN, up to MAX join the running job."""
        value = data.get("workers") if isinstance(data, dict) else None
        low, colon, high = value.partition(":") if isinstance(value, str) else ("", "", "")
        if colon and low.strip().isdigit() and high.strip().isdigit():
            data = {**data, "workers": int(high), "start_workers": int(low)}
        return data  # anything else is the int field's to refuse

    @field_validator("start_workers")
    @classmethod
    def _start_within_workers(cls, v: int | None, info: Any) -> int | None:
        workers = info.data.get("workers")
        if v is not None and workers is not None and v > workers:
            raise ValueError(f"the run starts with {v} workers, more than workers = {workers}")
        return v

    @model_validator(mode="after")
    def _workers_fill_nodes(self) -> RunConfig:
        if self.cluster.enabled:
            self.cluster.ranks_per_node(self.workers)  # a UserError unless they spread evenly
        return self

    @field_validator("grad_clip", mode="before")
    @classmethod
    def _clip_off(cls, v: Any) -> Any:
        return None if isinstance(v, str) and v.strip().lower() in ("none", "off") else v  # --grad-clip none

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, v: str) -> str:
        from parambox.strategies import STRATEGIES

        if v not in STRATEGIES:
            raise ValueError(f"unknown strategy {v!r}; choose from {', '.join(sorted(STRATEGIES))}")
        return v

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str) -> str:
        from parambox.models.registry import MODELS, import_builders

        if ":" in v:  # a reference: resolved where it runs (parambox.workload.refs)
            return v
        import_builders()
        if v not in MODELS:
            raise ValueError(
                f"unknown model {v!r}; choose from {', '.join(sorted(MODELS))}, or give module:function "
                "or file.py:function"
            )
        return v

    @field_validator("data")
    @classmethod
    def _known_data(cls, v: str) -> str:
        from parambox.data.registry import DATASETS, _import_loaders

        if ":" in v:
            return v
        _import_loaders()
        if v not in DATASETS:
            raise ValueError(
                f"unknown data set {v!r}; choose from {', '.join(sorted(DATASETS))}, or give "
                "module:function or file.py:function"
            )
        return v

    @field_validator("loss", "metrics", "collate")
    @classmethod
    def _reference(cls, v: str | None) -> str | None:
        if v is not None and ":" not in v:
            raise ValueError(f"{v!r} is no reference: expected module:function or path/to/file.py:function")
        return v

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.workers

    def strategy_options(self, name: str | None = None):
        """The options of strategy ``name`` (default: this run's), validated by its ``Options`` model:
        the ``[name]`` table with every default filled in (:func:`strategy_options`: once per process).

        >>> RunConfig(options={"weight-avg": {"period": 4}}).strategy_options("weight-avg").period
        4
        """
        name = name or self.strategy
        return strategy_options(name, self.options.get(name, {}))

    def validate_options(self) -> None:
        from parambox.strategies import STRATEGIES

        for name in self.options:
            if name not in STRATEGIES:
                raise UserError(
                    f"config table [{name}] names no strategy; choose from {', '.join(sorted(STRATEGIES))}"
                )
            self.strategy_options(name)


# (strategy, its table as JSON) -> its validated Options: built once per process, however many times the
# launcher's checks and the worker's set-up ask (the run's recorded config carries the resolved table).
_OPTIONS: dict[tuple[str, str], Any] = {}
_OPTIONS_KEPT = 256


def strategy_options(name: str, table: dict[str, Any]):
    """Strategy ``name``'s ``Options`` from its ``[name]`` table, validated once per process and table (the
    same object each time after: read it, do not change it)."""
    from parambox.strategies import strategy_class

    key = (name, json.dumps(table, sort_keys=True, default=str))
    if key not in _OPTIONS:
        options = validated(strategy_class(name).Options, table, f"{name}.")
        if len(_OPTIONS) >= _OPTIONS_KEPT:  # a sweep's many configs: the oldest go
            del _OPTIONS[next(iter(_OPTIONS))]
        _OPTIONS[key] = options
    return _OPTIONS[key]


def validated(model: type[BaseModel], values: dict[str, Any], prefix: str = "") -> Any:
    """``model(**values)``; a misspelt key gets a ``UserError`` naming the keys there are and the closest."""
    from pydantic import ValidationError

    try:
        return model(**values)
    except ValidationError as e:
        raise UserError(validation_message(e, list(model.model_fields), prefix)) from None


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``update`` over ``base``; strategy tables, the box and the cluster tables merge key by key."""
    out = dict(base)
    for k, v in update.items():
        if k == "options":
            opts = {n: dict(o) for n, o in out.get("options", {}).items()}
            for name, o in _mapping(v, "options", "a table of strategy tables").items():
                opts.setdefault(name, {}).update(
                    _mapping(o, f"[{name}]", "a table of that strategy's options")
                )
            out["options"] = opts
        elif k in TABLES:
            out[k] = {**_table(out.get(k), k), **_table(v, k)}
        else:
            out[k] = v
    return out


def _table(value: Any, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str) and name == "box":  # --box rma: the backend alone
        return {"backend": value}
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_defaults=True)
    return dict(_mapping(value, name, f"a table, e.g. --set {name}.KEY=VALUE or [{name}] in TOML"))


def _mapping(value: Any, name: str, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UserError(f"config field {name!r}: expected {what}, got {value!r}")
    return value


def load_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file -> config dict; tables named after strategies become strategy options, ``[box]``
    the box's."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise UserError(f"config file {p} does not exist") from None
    except IsADirectoryError:
        raise UserError(f"config file {p} is a directory, not a TOML file") from None
    except OSError as e:
        raise UserError(f"config file {p} cannot be read: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"config file {p} is not valid TOML: {e}") from None
    return split_tables(raw, f"config file {p}")


def split_tables(raw: dict[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in raw.items():
        if k in TABLES and isinstance(v, dict):
            out[k] = v
        elif isinstance(v, dict):
            out.setdefault("options", {})[k] = v
        elif k.replace("-", "_") not in RunConfig.model_fields:
            raise UserError(f"{where}: unknown key {k!r}{unknown_hint(k, list(RunConfig.model_fields))}")
        else:
            out[k.replace("-", "_")] = v
    return out


def parse_set(items: list[str], strategy: str | None = None) -> dict[str, Any]:
    """``["lr=0.1", "easgd.tau=4", "box.num_shards=2"]`` -> ``{"lr": 0.1, "options": {"easgd": {"tau": 4}},
    "box": {"num_shards": 2}}``. A strategy's option given bare (``tau=4``) is refused with the table it
    belongs in (``strategy``'s where it has it)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set {item!r}: expected key=value")
        value = _parse_value(text)
        if "." in key:
            table, field = key.split(".", 1)
            if table in TABLES:
                out.setdefault(table, {})[field] = value
            else:
                out.setdefault("options", {}).setdefault(table, {})[field] = value
        elif key.replace("-", "_") in RunConfig.model_fields:
            out[key.replace("-", "_")] = value
        else:
            owners = _option_owners(key.replace("-", "_"))
            if owners:  # a strategy's option given bare: name the table it lives in
                mine = strategy if strategy in owners else owners[0]
                raise UserError(
                    f"--set {item!r}: {key!r} is a strategy's option; give it as STRATEGY.{key}, e.g. "
                    f"--set {mine}.{key}={text} (strategies with it: {', '.join(owners)})"
                )
            raise UserError(
                f"--set {item!r}: unknown key {key!r}{unknown_hint(key, list(RunConfig.model_fields))}"
            )
    return out


def _option_owners(key: str) -> list[str]:
    """The registered strategies whose options have a field ``key``, by name."""
    from parambox.strategies import STRATEGIES, strategy_class

    owners = []
    for name in sorted(STRATEGIES):
        try:
            if key in strategy_class(name).Options.model_fields:
                owners.append(name)
        except UserError:  # a user strategy that cannot load: its own error comes where it is used
            continue
    return owners


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: a string


def build_config(*layers: dict[str, Any]) -> RunConfig:
    merged: dict[str, Any] = {}
    for layer in layers:
        merged = merge(merged, {k: v for k, v in layer.items() if v is not None})
    if "data" not in merged and "model" in merged:
        merged["data"] = model_data(str(merged["model"]))
    cfg = validated(RunConfig, merged)
    cfg.validate_options()
    own = strategy_defaults(cfg, merged)
    if own:
        cfg = validated(RunConfig, merge(own, merged))
    check_loop_features(cfg)
    return cfg


def model_data(model: str) -> str:
    """The data set of a run that names ``model`` and no data: the one a zoo model is meant for
    (``gpt``: ``text``), else the default."""
    from parambox.models.registry import data_for

    return data_for(model) or RunConfig.model_fields["data"].default


def check_loop_features(cfg: RunConfig) -> None:
    """A ``UserError`` where the micro-batches do not split the batch, or naming the strategy and the
    field where the run's strategy cannot take a training feature of the loop: pipeline parallelism
    and L-BFGS own forward and backward (their own micro-batches, no clipping or autocast in their
    schedule), and L-BFGS has no learning rate to schedule (its step length is ``sandblaster.lr``)."""
    from parambox.strategies import strategy_class

    if cfg.batch_size % cfg.grad_accum:
        raise UserError(
            f"batch_size {cfg.batch_size} does not split into grad_accum {cfg.grad_accum} equal "
            "micro-batches: make batch_size a multiple of grad_accum"
        )
    cls = strategy_class(cfg.strategy, cfg.strategy_options())
    if not cls.owns_forward_backward:
        return
    why = "it runs forward and backward itself"
    refused = {
        "grad_accum": (cfg.grad_accum != 1, why),
        "grad_clip": (bool(cfg.grad_clip), why),
        "precision": (cfg.precision != "fp32", why),
    }
    if "lr" in cls.Options.model_fields:  # a step length of its own: no optimizer of the run's to schedule
        why = f"its step length is {cfg.strategy}.lr"
        refused |= {
            "lr_schedule": (cfg.lr_schedule != "constant", why),
            "warmup_steps": (cfg.warmup_steps > 0, why),
        }
    for field, (given, reason) in refused.items():
        if given:
            raise UserError(
                f"strategy {cfg.strategy!r} does not take {field} = {getattr(cfg, field)!r} ({reason}); "
                f"leave {field} at its default"
            )


OPTIMIZER_CHOICE = ("optimizer", "lr")  # either one set by the user: the strategy's optimizer stands aside


def strategy_defaults(cfg: RunConfig, given: dict[str, Any]) -> dict[str, Any]:
    """The fields the run's strategy brings (``Strategy.default_optimizer``, ``default_run``,
    ``default_options``) that the user's layers ``given`` leave unset."""
    from parambox.strategies import strategy_class

    # the table as the run will have it (the strategy's default options under the user's), so that the
    # options built here are the ones every later check and the worker's set-up find built
    mine = given.get("options", {}).get(cfg.strategy, {})
    table = {**strategy_class(cfg.strategy).default_options, **cfg.options.get(cfg.strategy, {})}
    built = strategy_options(cfg.strategy, table)
    cls = strategy_class(cfg.strategy, built)
    own: dict[str, Any] = {}
    if not any(k in given for k in OPTIMIZER_CHOICE):
        own.update({k: v for k, v in cls.default_optimizer.items() if k not in given})
    from parambox.data.registry import is_sequence

    run = {**cls.default_run, **(cls.default_run_sequence if is_sequence(cfg.data) else {})}
    own.update({k: v for k, v in run.items() if k not in given})
    options = {k: v for k, v in cls.options_defaults(built).items() if k not in mine}
    if options:
        own["options"] = {cfg.strategy: options}
    return own
