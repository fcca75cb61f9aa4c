"""Name -> builder ``(input_shape, num_classes) -> nn.Sequential``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from parambox.errors import UserError

MODELS: dict[str, Callable[[tuple[int, ...], int], nn.Sequential]] = {}
# The data set a model is meant for where it cannot take the default images (``gpt``: ``text``), so
# the benchmarks can be pointed at a model alone.
MODEL_DATA: dict[str, str] = {}


def register(name: str, data: str | None = None):
    def deco(fn):
        MODELS[name] = fn
        if data is not None:
            MODEL_DATA[name] = data
        return fn

    return deco


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    import_builders()
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}; choose from {', '.join(sorted(MODELS))}")
    return MODELS[name](tuple(input_shape), num_classes)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def data_for(name: str) -> str | None:
    """The data set model ``name`` is meant for, or None where any fitting one will do."""
    import_builders()
    return MODEL_DATA.get(name)


def import_builders() -> None:
    # Builders register themselves on import; imported lazily so `parambox info` stays fast.
    from parambox.models import cnn, dense, gpt, resnet, vgg  # noqa: F401
