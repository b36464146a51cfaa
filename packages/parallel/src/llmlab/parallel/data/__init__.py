"""Data parallelism made visible: bucketed all-reduce with overlap, a parameter server, and a
callback that times the anatomy of a training step."""

from llmlab.parallel.data.anatomy import StepAnatomy, plot_anatomy
from llmlab.parallel.data.bucketed import BucketedDataParallelStrategy, GradientBucketer
from llmlab.parallel.data.parameter_server import ParameterServerStrategy
from llmlab.parallel.data.timeline import CommTimeline

__all__ = [
    "BucketedDataParallelStrategy",
    "CommTimeline",
    "GradientBucketer",
    "ParameterServerStrategy",
    "StepAnatomy",
    "plot_anatomy",
]
