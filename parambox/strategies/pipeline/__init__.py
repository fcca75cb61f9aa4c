"""Pipeline parallelism: ``pipeline`` (GPipe / 1F1B over all ranks) and ``pipeline-dp`` (pipelines
inside a node, data parallel between them), with the cutting of a model into stages (``stages``)."""

from parambox.strategies.pipeline.strategy import Pipeline, PipelineLayout, PipelineOptions  # isort: skip
from parambox.strategies.pipeline.data_parallel import PipelineDataParallel, PipelineDPOptions

__all__ = ["Pipeline", "PipelineDPOptions", "PipelineDataParallel", "PipelineLayout", "PipelineOptions"]
