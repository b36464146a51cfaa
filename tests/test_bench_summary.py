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
