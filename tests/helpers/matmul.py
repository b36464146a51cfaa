"""The matmul kernels' oracle and tolerances, shared by the tiled, naive and tile-sweep tests.

Tolerances: the kernels accumulate in fp32 and round once to the output dtype, so they may
differ from the float64 product rounded to that dtype by ~1 ulp of the output plus fp32
summation-order noise: fp32 atol 1e-4 / rtol 1e-5, fp16 atol 1e-3 / rtol 2e-3 (2 eps), bf16
atol 1e-2 / rtol 1.6e-2 (2 eps), fp64 atol 1e-12 / rtol 1e-12.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
    torch.float64: {"atol": 1e-12, "rtol": 1e-12},
}


def oracle(a, b, bias=None, activation=None):
    """torch in float64, then one rounding to the input dtype."""
    out = a.double() @ b.double()
    if bias is not None:
        out = out + bias.double()
    if activation == "gelu":
        out = F.gelu(out, approximate="tanh")
    elif activation == "relu":
        out = out.relu()
    return out.to(a.dtype)
