"""``benchmarks/results/SUMMARY.md`` as ``make bench`` writes it: one section per benchmark with
its command, machine and date; a partial run keeps the other sections; no absolute path."""

from __future__ import annotations

import re

from benchmarks.run_all import REPO, Outcome, previous_sections, write_summary


def _outcome(name: str, value: float, notes: str = "") -> Outcome:
    row = {
        "name": "case one",
        "llmlab": value,
        "reference": 1.0,
        "reference_name": "ref",
        "unit": "s",
        "target": 1.0,
        "meets_target": value <= 1.0,
        "ratio": 1.0 / value,
    }
    result = {"benchmark": name, "skipped": None, "notes": notes, "rows": [row]}
    return Outcome(name, "ok", 12.0, [result])


def test_each_section_names_command_machine_and_date_once(tmp_path):
    path = write_summary([_outcome("comm", 0.5), _outcome("memory", 2.0)], tmp_path / "S.md")
    sections = previous_sections(path)
    assert list(sections) == ["comm", "memory"]
    for name, text in sections.items():
        assert len(re.findall(r"^Measured by ", text, re.M)) == 1
        header = re.search(
            r"^Measured by `(.+?)` .* on (\d{4}-\d\d-\d\d \d\d:\d\d UTC); machine: (.+)\.$",
            text,
            re.M,
        )
        assert header and "CPU cores" in header[3], text
        assert f"`python -m benchmarks.{name}`: ok, 12 s" in text
    assert "| case one | 0.5 s | 1 s (ref) | 2 | >= 1 | yes |" in sections["comm"]
    assert "| case one | 2 s | 1 s (ref) | 0.5 | >= 1 | **no** |" in sections["memory"]


def test_a_partial_run_replaces_only_its_own_sections(tmp_path):
    path = tmp_path / "S.md"
    write_summary([_outcome("comm", 0.5), _outcome("memory", 2.0)], path)
    before = previous_sections(path)
    write_summary(
        [_outcome("memory", 4.0)], path, command="python -m benchmarks.run_all --only memory"
    )
    after = previous_sections(path)
    assert after["comm"] == before["comm"]
    assert "| case one | 4 s |" in after["memory"] and "--only memory" in after["memory"]
    assert path.read_text().count("# Benchmark results") == 1
    text = path.read_text()
    write_summary([], path)  # kept sections are written back byte for byte
    assert path.read_text() == text


def test_paths_inside_the_repository_are_written_relative(tmp_path):
    notes = f"timelines: {REPO}/benchmarks/results/pipeline_timeline_1f1b_p4_m8.png"
    path = write_summary([_outcome("pipeline", 1.0, notes)], tmp_path / "S.md")
    text = path.read_text()
    assert str(REPO) not in text
    assert "timelines: benchmarks/results/pipeline_timeline_1f1b_p4_m8.png" in text


def test_the_committed_summary_has_no_absolute_path():
    text = (REPO / "benchmarks/results/SUMMARY.md").read_text(encoding="utf-8")
    assert not re.search(r"(?<![\w.])/(?:work|home|tmp|root|Users)/", text)
    assert str(REPO) not in text
    assert len(previous_sections(REPO / "benchmarks/results/SUMMARY.md")) >= 6


# ------------------------------------------------------------------ the kernels section's units
# Physical ceilings, far above any GPU of today (H200: ~4.8 TB/s of HBM, ~1 PFLOP/s dense bf16):
# a figure above one is a parse or unit error, not a fast kernel.
KERNEL_UNIT_CEILINGS = {"GB/s": 1e4, "TFLOP/s": 5e3, "GFLOP/s": 1e5}
_CELL = re.compile(r"^(?P<value>[-+0-9.eE]+|n/a) (?P<unit>\S+)(?: \((?P<ref>.+)\))?$")


def summary_rows(name: str) -> list[list[str]]:
    """The table rows of one section of the committed SUMMARY.md, as lists of cells."""
    section = previous_sections(REPO / "benchmarks/results/SUMMARY.md")[name]
    rows = []
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith(("| case |", "|---")):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def test_every_kernel_row_has_sane_units_and_a_consistent_ratio():
    rows = summary_rows("kernels")
    assert len(rows) >= 30, "the kernels section lost its table"
    problems = []
    for case, ours, ref, ratio, target, met in rows:
        mine, theirs = _CELL.match(ours), _CELL.match(ref)
        if not (mine and theirs and theirs["ref"]):
            problems.append(f"{case}: cells {ours!r} / {ref!r} are not 'value unit (reference)'")
            continue
        unit = mine["unit"]
        values = [float(mine["value"]), float(theirs["value"])]
        if unit not in KERNEL_UNIT_CEILINGS or theirs["unit"] != unit:
            problems.append(f"{case}: units {unit!r} / {theirs['unit']!r}")
            continue
        if not all(0 < v < KERNEL_UNIT_CEILINGS[unit] for v in values):
            problems.append(f"{case}: {values} {unit} outside (0, {KERNEL_UNIT_CEILINGS[unit]:g})")
        if re.search(r"\d", theirs["ref"].split()[0]):
            problems.append(f"{case}: reference name {theirs['ref']!r} starts with a number")
        if re.search(r"(?:^|\s)[-+]?\d+(?:\.\d+)?(?:\s|$)", case):
            problems.append(f"{case}: a bare number in the case name (reads as a rate)")
        r = float(ratio)
        if not (r == r and 0 < r < 1e3):
            problems.append(f"{case}: ratio {ratio}")
            continue
        # rates are rounded to 4 significant figures, ratios to 2 decimals where printed so
        if abs(r - values[0] / values[1]) > 0.006 + 0.01 * r:
            problems.append(f"{case}: ratio {ratio} but {values[0]} / {values[1]} {unit}")
        if target:
            want = "yes" if r >= float(target.removeprefix(">= ")) else "**no**"
            if met != want:
                problems.append(f"{case}: ratio {ratio} against {target} marked {met!r}")
    assert not problems, "\n".join(problems)
