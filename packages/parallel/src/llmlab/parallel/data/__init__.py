"""Data parallelism made visible: bucketed all-reduce with overlap, ZeRO-1/2/3 sharding, a
parameter server, and a callback that times the anatomy of a training step."""

from llmlab.parallel.data.anatomy import StepAnatomy, plot_anatomy
from llmlab.parallel.data.bucketed import BucketedDataParallelStrategy, GradientBucketer
from llmlab.parallel.data.comm_intervals import CommTimeline
from llmlab.parallel.data.parameter_server import ParameterServerStrategy
from llmlab.parallel.data.zero import ZeroEngine
from llmlab.parallel.data.zero_precision import ZeroMasterWeights

__all__ = [
    "BucketedDataParallelStrategy",
    "CommTimeline",
    "GradientBucketer",
    "ParameterServerStrategy",
    "StepAnatomy",
    "ZeroEngine",
    "ZeroMasterWeights",
    "plot_anatomy",
]
