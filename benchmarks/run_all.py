"""``make bench``: run every benchmark, collect its JSON, write ``results/SUMMARY.md``.

Each ``benchmarks/<name>.py`` (except ``common`` and this file) runs as
``python -m benchmarks.<name>`` in its own process, from the repo root, with a per-benchmark
timeout and a total budget, so one slow or broken benchmark cannot take the others down. A
benchmark reports through ``benchmarks.common.report``, which writes
``results/<benchmark>.json``; only files written during this run count, so a stale result of a
benchmark that failed today is never presented as today's figure. ``SUMMARY.md`` is one table:
benchmark, case, llmlab, reference, ratio (> 1: llmlab better), target, met?; a benchmark that
failed, timed out or was skipped (e.g. "skipped: no CUDA") is listed as such.

    python -m benchmarks.run_all [--only NAME ...] [--timeout S] [--budget S]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
NOT_BENCHMARKS = {"__init__", "common", "run_all"}


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
    try:
        proc = subprocess.run(
            [sys.executable, "-m", f"benchmarks.{name}"],
            cwd=REPO,
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


def write_summary(outcomes: list[Outcome], path: Path, total_seconds: float) -> Path:
    import torch

    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
    lines = [
        "# Benchmark summary",
        "",
        f"Written by `make bench` (`python -m benchmarks.run_all`) on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {os.cpu_count()} CPU cores, "
        f"{cuda}, Python {platform.python_version()}, torch {torch.__version__}; "
        f"total {total_seconds / 60:.1f} min.",
        "",
        "Ratio = how many times better llmlab is than the reference measured in the same run "
        "(> 1: llmlab wins; for times it is reference/llmlab). Reproduce with `make bench`; "
        "one benchmark alone with `python -m benchmarks.<name>`.",
        "",
        "| benchmark | case | llmlab | reference | ratio | target | met? |",
        "|---|---|---|---|---|---|---|",
    ]
    for outcome in outcomes:
        for row in summary_rows(outcome):
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    lines += ["", "| benchmark | status | seconds |", "|---|---|---|"]
    lines += [f"| {o.name} | {o.status} | {o.seconds:.0f} |" for o in outcomes]
    notes = [
        f"- **{r.get('benchmark', o.name)}**: " + r["notes"].strip().replace("\n", "<br>")
        for o in outcomes
        for r in o.results
        if r.get("notes")
    ]
    if notes:
        lines += ["", "Notes", "", *notes]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="benchmark module names to run")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per benchmark")
    parser.add_argument("--budget", type=float, default=1800, help="seconds for all of them")
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
        print(f"[bench] {name} (timeout {min(args.timeout, left):.0f} s)", flush=True)
        outcome = run_benchmark(name, min(args.timeout, left))
        print(f"[bench] {name}: {outcome.status} in {outcome.seconds:.0f} s", flush=True)
        if outcome.status != "ok":
            print(outcome.tail, flush=True)
        outcomes.append(outcome)
    path = write_summary(outcomes, RESULTS_DIR / "SUMMARY.md", time.time() - start)
    print(path.read_text())
    print(f"[bench] wrote {path}")
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
