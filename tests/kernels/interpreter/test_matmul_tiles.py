"""Every tile shape of the sweep (``llmlab.kernels.matmul.TILE_SWEEP``) computes the right
product under the interpreter, launched exactly as ``benchmarks/matmul_tiles.py`` launches it on
a GPU (tile sizes, stages, warps). The interpreter ignores stages and warps: what it checks is
the indexing for each (BLOCK_M, BLOCK_N, BLOCK_K), on a shape with two tiles along M and N (the
second one partial) and three steps along K (the last one partial). Times are GPU-only.

Oracle and tolerances: tests/helpers/matmul.py (fp32 accumulation, one rounding to the
output dtype).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.matmul_tiles import launch_config
from llmlab.kernels.matmul import TILE_SWEEP
from tests.helpers.matmul import TOL, oracle


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", TILE_SWEEP, ids=lambda c: "x".join(map(str, c[:3])))
def test_every_swept_tile_shape_is_correct(config, dtype):
    bm, bn, bk = config[:3]
    M, N, K = bm + 3, bn + 5, 2 * bk + 7
    a, b = torch.randn(M, K, dtype=dtype), torch.randn(K, N, dtype=dtype)
    out, _ = launch_config(a, b, config)
    torch.testing.assert_close(out, oracle(a, b), **TOL[dtype])
