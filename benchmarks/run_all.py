"""``make bench``: run every benchmark, collect its JSON, write ``results/SUMMARY.md``.

Each ``benchmarks/<name>.py`` (except ``common`` and this file) runs as
``python -m benchmarks.<name>`` in its own process, from the repo root, with a per-benchmark
timeout and a total budget, so one slow or broken benchmark cannot take the others down. A
benchmark reports through ``benchmarks.common.report``, which writes
``results/<benchmark>.json``; only files written during this run count, so a stale result of a
benchmark that failed today is never presented as today's figure.

``SUMMARY.md`` has one section per benchmark: the command, the machine and the date it was
measured with, then its table (case, llmlab, reference, ratio (> 1: llmlab better), target,
met?) and its notes; a benchmark that failed, timed out or was skipped (e.g. "skipped: no CUDA")
says so. ``--only`` rewrites only the sections of the benchmarks it ran and keeps the others, each
still dated by its own run. Paths inside the repository are written relative to it, so no
machine's absolute paths reach the committed file.

    python -m benchmarks.run_all [--only NAME ...] [--timeout S] [--budget S]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_ENV

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
# Not benchmarks: the plumbing, zero.py's workload (the ZeRO tests share it), speculative.py's
# rows, which benchmarks.serving reports, and decode.py's llama.cpp peer.
NOT_BENCHMARKS = {"__init__", "common", "peer_llama_cpp", "run_all", "speculative", "zero_workload"}
# benchmarks at the sizes users run (a 1B model decoding at a few tokens/s) need more than the
# default per-benchmark timeout: seconds each may take
LONG_RUNNING = {"decode": 2400, "finetune": 1800}


@dataclass
class Outcome:
    """How one benchmark module ran and which result files it wrote."""

    name: str
    status: str  # "ok", "failed (exit N)", "timed out after S s", "not run: ..."
    seconds: float
    results: list[dict[str, Any]] = field(default_factory=list)
    tail: str = ""


def discover(bench_dir: Path = BENCH_DIR) -> list[str]:
    """Module names of every benchmark script, sorted."""
    return sorted(p.stem for p in bench_dir.glob("*.py") if p.stem not in NOT_BENCHMARKS)


def _fresh_results(since: float, results_dir: Path) -> dict[Path, dict[str, Any]]:
    found = {}
    for path in sorted(results_dir.glob("*.json")):
        if path.stat().st_mtime >= since:
            try:
                found[path] = json.loads(path.read_text())
            except json.JSONDecodeError:
                continue
    return found


def owns(name: str, path: Path) -> bool:
    """Whether ``results/<file>.json`` is benchmark ``name``'s (``name.json``, ``name_*.json``).

    Matching by name, not just by "written while it ran", keeps a file that someone else's
    concurrent run of another benchmark rewrote from being credited to this one.
    """
    return path.stem == name or path.stem.startswith(name + "_")


def run_benchmark(name: str, timeout: float, results_dir: Path = RESULTS_DIR) -> Outcome:
    """Run ``python -m benchmarks.<name>``; collect every result JSON it (re)wrote."""
    start = time.time()
    before = {p: p.stat().st_mtime for p in results_dir.glob("*.json")}
    env = {k: v for k, v in os.environ.items() if k != RESULTS_ENV}  # results go to results_dir
    try:
        proc = subprocess.run(
            [sys.executable, "-m", f"benchmarks.{name}"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        tail = (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired as err:
        status = f"timed out after {timeout:.0f} s"
        out = err.stdout or b""
        tail = (out.decode(errors="replace") if isinstance(out, bytes) else out)[-2000:]
    fresh = _fresh_results(start, results_dir)
    written = [
        data
        for path, data in fresh.items()
        if before.get(path) != path.stat().st_mtime and owns(name, path)
    ]
    return Outcome(name, status, time.time() - start, written, tail)


def _num(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if value != value:  # nan
            return "n/a"
        return f"{value:.4g}"
    return str(value)


def summary_rows(outcome: Outcome) -> list[list[str]]:
    """Table rows of one benchmark: its cases, or one line saying why there are none."""
    if outcome.status != "ok" or not outcome.results:
        why = outcome.status if outcome.status != "ok" else "ok, but wrote no results JSON"
        return [[outcome.name, why, "", "", "", "", ""]]
    rows = []
    for result in outcome.results:
        bench = result.get("benchmark", outcome.name)
        if result.get("skipped"):
            rows.append([bench, f"skipped: {result['skipped']}", "", "", "", "", ""])
            continue
        for row in result.get("rows", []):
            unit = row.get("unit", "")
            target = row.get("target")
            met = {True: "yes", False: "**no**", None: ""}[row.get("meets_target")]
            rows.append(
                [
                    bench,
                    row["name"],
                    f"{_num(row['llmlab'])} {unit}".strip(),
                    f"{_num(row['reference'])} {unit} ({row.get('reference_name', '')})".strip(),
                    _num(row.get("ratio")),
                    "" if target is None else f">= {target:g}",
                    met,
                ]
            )
    return rows


SUMMARY_INTRO = """# Benchmark results

Written by `make bench` (`python -m benchmarks.run_all`). Every benchmark measures llmlab and its
reference in the same run, on the same machine: ratio = how many times better llmlab is (> 1:
llmlab wins; for times it is reference / llmlab). Compare ratios, not absolute figures: the
machines are shared. Each section names the command, the machine and the date of its own run
(`--only` refreshes some sections and keeps the others). Reproduce one benchmark with
`python -m benchmarks.<name>`."""
_SECTION = re.compile(r"<!-- benchmark: (?P<name>[\w.-]+) -->\n.*?<!-- end: (?P=name) -->\n", re.S)


def describe_machine() -> str:
    """CPU model and cores, accelerator, OS, Python and torch: what the figures depend on."""
    import torch

    from llmlab.train.telemetry import cpu_model

    cpu = cpu_model()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
    return (
        f"{os.cpu_count()} CPU cores ({cpu}), {gpu}, {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def relative_paths(text: str, repo: Path = REPO) -> str:
    """``text`` with every path inside the repository written relative to it."""
    return text.replace(str(repo) + os.sep, "").replace(str(repo), ".")


def render_section(outcome: Outcome, command: str, machine: str, when: str) -> str:
    """One benchmark's section, between markers that let a later ``--only`` run replace it."""
    rows = summary_rows(outcome)
    several = len({row[0] for row in rows}) > 1  # one module reporting several benchmarks
    lines = [
        f"<!-- benchmark: {outcome.name} -->",
        f"## {outcome.name}",
        "",
        f"Measured by `{command}` (`python -m benchmarks.{outcome.name}`: {outcome.status}, "
        f"{outcome.seconds:.0f} s) on {when}; machine: {machine}.",
        "",
        "| case | llmlab | reference | ratio | target | met? |",
        "|---|---|---|---|---|---|",
    ]
    for bench, *cells in rows:
        if several:
            cells[0] = f"{bench}: {cells[0]}"
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    for result in outcome.results:
        if result.get("notes"):
            lines += ["", "Notes: " + result["notes"].strip().replace("\n", "<br>")]
    lines.append(f"<!-- end: {outcome.name} -->")
    return relative_paths("\n".join(lines) + "\n")


def previous_sections(path: Path) -> dict[str, str]:
    """The sections of an existing ``SUMMARY.md``, by benchmark name."""
    if not path.is_file():
        return {}
    return {m["name"]: m.group() for m in _SECTION.finditer(path.read_text(encoding="utf-8"))}


def write_summary(
    outcomes: list[Outcome], path: Path, command: str = "python -m benchmarks.run_all"
) -> Path:
    """Replace the sections of ``outcomes``' benchmarks in ``path``; keep the other sections."""
    machine = describe_machine()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    sections = previous_sections(path)
    for outcome in outcomes:
        sections[outcome.name] = render_section(outcome, command, machine, when)
    order = [n for n in discover() if n in sections] + sorted(set(sections) - set(discover()))
    text = SUMMARY_INTRO + "\n\n" + "\n".join(sections[name] for name in order)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="benchmark module names to run")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per benchmark "
                        f"(more for those sized to real models: {LONG_RUNNING})")  # fmt: skip
    parser.add_argument("--budget", type=float, default=3600, help="seconds for all of them")
    args = parser.parse_args(argv)
    names = discover()
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            parser.error(f"unknown benchmark(s) {unknown}; available: {', '.join(names)}")
        names = [n for n in names if n in args.only]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    start = time.time()
    outcomes = []
    for name in names:
        left = args.budget - (time.time() - start)
        if left < 10:
            outcomes.append(Outcome(name, f"not run: total budget of {args.budget:.0f} s spent", 0))
            continue
        timeout = min(max(args.timeout, LONG_RUNNING.get(name, 0)), left)
        print(f"[bench] {name} (timeout {timeout:.0f} s)", flush=True)
        outcome = run_benchmark(name, timeout)
        print(f"[bench] {name}: {outcome.status} in {outcome.seconds:.0f} s", flush=True)
        if outcome.status != "ok":
            print(outcome.tail, flush=True)
        outcomes.append(outcome)
    command = "python -m benchmarks.run_all" + (" --only " + " ".join(names) if args.only else "")
    path = write_summary(outcomes, RESULTS_DIR / "SUMMARY.md", command)
    print(path.read_text())
    print(f"[bench] wrote {path}")
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
