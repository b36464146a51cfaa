"""Print the composition matrix's support table from the matrix tests' own list of cells.

``python -m tests.integration.composition_table`` writes markdown: one row per layout (a
strategy; the N-D layouts once per ZeRO stage and implementation), one column per value of the
other axes that can be refused (precision, memory option, compile, sharded checkpoints). A
column says "✓" when every cell of the row with that value is supported (trained and compared
with one process by ``tests/integration/test_composition_matrix.py``), "✗ n" when every one is
refused for reason n, and "◐ n" when some are; the reasons follow the table. ``validate_config``
refuses exactly the listed cells (``test_composition_space.py``). Nothing is typed by hand, so
the table in docs/composing-strategies.md cannot drift from what the tests check.
"""

from __future__ import annotations

from tests.integration.composition_cells import (
    AXES,
    CELLS,
    REQUIRED,
    TOLERANCES,
    WHY_REFUSED,
    Cell,
    default_cells,
    pairwise_cells,
)

COLUMNS: list[tuple[str, str, str]] = [  # (axis, value, heading)
    *(("precision", p, f"`{p}`") for p in AXES["precision"]),
    ("memory", "activation_checkpointing", "act. ckpt"),
    ("memory", "recompute_attention", "recompute attn"),
    ("kernels", "triton", "`triton`"),
    ("compile", "compile", "`compile`"),
    ("checkpoint", "sharded", "sharded resume"),
]


def _rows() -> list[tuple[str, list[Cell]]]:
    rows: dict[str, list[Cell]] = {}
    for cell in CELLS:
        name = f"`{cell.strategy}`" + (f" {cell.zero}" if cell.layout.nd else "")
        rows.setdefault(name, []).append(cell)
    return list(rows.items())


def _summary(cells: list[Cell], reasons: list[str]) -> str:
    if not cells:
        return "—"
    refused = sorted({reasons.index(c.refused) + 1 for c in cells if c.refused})
    if not refused:
        return "✓"
    mark = "✗" if all(c.refused for c in cells) else "◐"
    return f"{mark} " + ",".join(map(str, refused))


def table() -> str:
    reasons = list(WHY_REFUSED)
    lines = [
        "| layout | " + " | ".join(h for _, _, h in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for name, cells in _rows():
        row = [_summary([c for c in cells if getattr(c, a) == v], reasons) for a, v, _ in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    supported = sum(not c.refused for c in CELLS)
    axes = " × ".join(f"{a} ({len(v)})" for a, v in AXES.items())
    tol = ", ".join(f"{p} {loss:g} / {norm:g}" for p, (loss, norm) in TOLERANCES.items())
    lines += [
        "",
        *(f"{i}. {WHY_REFUSED[r]}" for i, r in enumerate(reasons, 1)),
        "",
        f"{len(CELLS)} cells ({axes}; ZeRO and sharded checkpoints on the N-D layouts only): "
        f"{supported} supported, {len(CELLS) - supported} refused by `validate_config` with the "
        f"reason. `make test` runs {len(default_cells())}: the {len(REQUIRED)} cells issues 24 "
        f"and 41 name and a pairwise cover of the supported cells with the PyTorch kernels, "
        f"eager and consolidated checkpoints; `make test-all` a pairwise cover of all supported "
        f"cells ({len(pairwise_cells())}) and every supported cell. Relative tolerance against "
        f"one process (logged loss / grad norms): {tol}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
