"""The tile-sweep model (``llmlab.kernels.matmul.tile_costs``) and the README table built from it.

The interpreter checks every swept shape's result (interpreter/test_matmul_tiles.py); this file
checks the arithmetic kernels/README.md shows next to them, against a hand computation.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.matmul_tiles import sweep_table
from llmlab.kernels.matmul import TILE_SWEEP, tile_costs

README = Path(__file__).resolve().parents[2] / "kernels/README.md"


def test_tile_costs_by_hand():
    # 128x128x64 bf16, 3 stages, 8 warps: (128*64 + 64*128) * 2 B = 32 KiB per stage.
    c = tile_costs(128, 128, 64, 3, 8, dtype_bytes=2)
    assert c["stage_bytes"] == 32768 and c["smem_bytes"] == 98304
    assert c["acc_regs_per_thread"] == 128 * 128 / 256 == 64
    assert c["flops_per_byte"] == 2 * 128 * 128 * 64 / 32768 == 64
    assert c["programs_per_sm_smem_A100"] == 1 and c["programs_per_sm_smem_H100"] == 2
    assert c["programs_per_sm_regs"] == 65536 // (256 * 64) == 4
    # 256x256 over 8 warps: 256 accumulator registers per thread, past the 255 limit.
    assert tile_costs(256, 256, 64, 3, 8)["programs_per_sm_regs"] == 0
    # 384 KiB of stages fits neither GPU.
    big = tile_costs(256, 256, 128, 3, 8)
    assert big["smem_bytes"] == 384 * 1024
    assert big["programs_per_sm_smem_A100"] == big["programs_per_sm_smem_H100"] == 0


def test_the_sweep_runs_from_fitting_everywhere_to_fitting_nowhere():
    fits = [tile_costs(*c)["programs_per_sm_smem_H100"] for c in TILE_SWEEP]
    assert fits[0] > 1 and fits[-1] == 0


def test_readme_shows_the_computed_sweep():
    assert sweep_table() in README.read_text(encoding="utf-8")
