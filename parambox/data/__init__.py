"""Workloads' data: in-memory data sets, registered by name, and the sharding sampler."""

from parambox.data.base import Augment, BatchSource, Dataset, GlobalBatchSampler
from parambox.data.registry import DATASETS, load_dataset

__all__ = ["Augment", "BatchSource", "DATASETS", "Dataset", "GlobalBatchSampler", "load_dataset"]
