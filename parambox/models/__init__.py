"""The model zoo. Every model is an ``nn.Sequential`` whose top-level children are the units a
pipeline may cut between, so stage ``k`` is a contiguous slice and parameter names stay the usual ones."""

from parambox.models.registry import MODELS, build_model, count_parameters

__all__ = ["MODELS", "build_model", "count_parameters"]
