"""Precision plugins for Lightning: loss scaling, fp32 master weights, bf16, fp8 (the precision
contract: docs/architecture.md#precision).

* :class:`DynamicLossScaler`: the loss-scale policy (growth window, backoff, hysteresis, floor).
* :class:`MasterWeights`: fp32 masters behind a low-precision model, plain PyTorch.
* :class:`FP16MasterPrecision` / :class:`BF16MasterPrecision`: Lightning plugins around it.
* :class:`FP8Precision` and :func:`convert_to_float8`: fp8 Linear layers (e4m3/e5m2).
"""

from llmlab.parallel.precision.fp8 import (
    Float8ColumnParallelLinear,
    Float8Linear,
    Float8Matmul,
    Float8RowParallelLinear,
    Fp8Filter,
    convert_to_float8,
)
from llmlab.parallel.precision.master import MasterWeights
from llmlab.parallel.precision.plugins import (
    BF16MasterPrecision,
    FP8Precision,
    FP16MasterPrecision,
    MasterWeightPrecision,
)
from llmlab.parallel.precision.scaler import DynamicLossScaler, LossScaleAtMinimumError

__all__ = [
    "BF16MasterPrecision",
    "DynamicLossScaler",
    "FP8Precision",
    "FP16MasterPrecision",
    "Float8ColumnParallelLinear",
    "Float8Linear",
    "Float8Matmul",
    "Float8RowParallelLinear",
    "Fp8Filter",
    "LossScaleAtMinimumError",
    "MasterWeightPrecision",
    "MasterWeights",
    "convert_to_float8",
]
