"""Print the strategy × precision support table from the composition matrix test's own list.

``python -m tests.integration.composition_table`` writes markdown: one row per strategy, one
column per precision; a cell says "✓" when every memory option (none, activation checkpointing,
recompute attention) and both kernel backends are supported there (each checked against one
process by ``tests/integration/test_composition_matrix.py``), else why it is refused. Nothing is
typed by hand, so the table in docs/composing-strategies.md cannot drift from what the test
checks.
"""

from __future__ import annotations

from tests.integration.composition_cells import (
    AXES,
    CELLS,
    PAIRWISE,
    TOLERANCES,
    WHY_REFUSED,
)


def _summary(cells: list) -> str:
    refused = sorted({WHY_REFUSED[c.refused] for c in cells if c.refused})
    if not refused:
        return "✓"
    if len(refused) == 1 and all(c.refused for c in cells):
        return f"refused: {refused[0]}"
    return "partly refused: " + "; ".join(refused)


def table() -> str:
    strategies, precisions, memory, kernels = AXES
    lines = [
        "| strategy | " + " | ".join(f"`{p}`" for p in precisions) + " |",
        "|---|" + "---|" * len(precisions),
    ]
    for s in strategies:
        row = [_summary([c for c in CELLS if c.strategy == s and c.precision == p])
               for p in precisions]  # fmt: skip
        lines.append(f"| `{s}` | " + " | ".join(row) + " |")
    supported = sum(not c.refused for c in CELLS)
    tol = ", ".join(f"{p} {loss:g} / {norm:g}" for p, (loss, norm) in TOLERANCES.items())
    lines += [
        "",
        f"{len(CELLS)} cells ({len(strategies)} strategies × {len(precisions)} precisions × "
        f"memory {', '.join(memory)} × kernels {', '.join(kernels)}): {supported} supported, "
        f"{len(CELLS) - supported} refused by `validate_config` with the reason. "
        f"`make test` runs a pairwise-covering {len(PAIRWISE)} of them; `make test-all` all. "
        f"Relative tolerance against one process (loss / grad norms): {tol}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
