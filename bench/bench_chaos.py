"""Chaos: the chaos suite (tests/chaos) run several times, its scenarios' numbers side by side.

Each run is `python -m pytest tests/chaos` in a subprocess with ``MOTOR_CHAOS_RESULTS`` naming a
file every scenario appends its result to (one JSON object per line: scenario, the fault in
words, what recovery is timed from, recovery_s, requests failed and sent while it ran, split
into non-streaming and streaming, whether its assertions held). The suite itself holds the
scenarios and their assertions; this module only runs it and renders
``bench/results/chaos.md`` (written whole): per scenario the median and worst recovery time
over the runs, and the requests that failed.

    python -m bench.bench_chaos [--runs 3]
    python -m bench chaos
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.loadgen.harness import machine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "chaos.md"
RESULTS_ENV = "MOTOR_CHAOS_RESULTS"
SUITE_TIMEOUT_S = 900


def run_suite(results: Path) -> tuple[int, float, str]:
    """One run of tests/chaos: (pytest's exit code, wall seconds, the tail of its output)."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/chaos", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env={**os.environ, RESULTS_ENV: str(results)},
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT_S,
        check=False,
    )
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
    return done.returncode, time.perf_counter() - start, tail


def read_results(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fmt_s(values: list[float], pick: str) -> str:
    if not values:
        return "-"
    return f"{(statistics.median(values) if pick == 'median' else max(values)):.2f}"


def row(name: str, recs: list[dict[str, Any]], runs: int) -> str:
    first = recs[0]
    recovery = [r["recovery_s"] for r in recs if r.get("recovery_s") is not None]
    failed = sum(r["failed"] for r in recs)
    total = sum(r["total"] for r in recs)
    plain = f"{sum(r['failed_nonstream'] for r in recs)}/{sum(r['total_nonstream'] for r in recs)}"
    streams = f"{sum(r['failed_stream'] for r in recs)}/{sum(r['total_stream'] for r in recs)}"
    worst = max(r["failed"] for r in recs)
    passed = sum(bool(r["ok"]) for r in recs)
    verdict = f"{passed}/{runs}" if passed == runs else f"**{passed}/{runs}**"
    return (
        f"| {name} | {first['what']} | {first['timed_from']} | {fmt_s(recovery, 'median')} | "
        f"{fmt_s(recovery, 'max')} | {failed}/{total} | {worst} | {plain} | {streams} | {verdict} |"
    )


def render(by_name: dict[str, list[dict[str, Any]]], runs: int, walls: list[float], rcs: list[int]) -> str:
    lines = [
        "# Chaos under load (tests/chaos, simulated engines)",
        "",
        f"{machine()}, {runs} run(s) of the whole suite; wall time per run "
        f"{min(walls):.0f} to {max(walls):.0f} s (pytest exit codes {', '.join(map(str, rcs))}).",
        "",
        "Two prefill/decode pairs: `motor up --prefill 2 --decode 2` for the kills and the full disk; "
        "`motor up --prefill 1 --decode 2` plus a second prefill NodeManager reaching the Controller "
        "through a loopback TCP proxy for the stream faults and the stopped Controller (heartbeat "
        "1 s, heartbeat timeout 4 s there). One client sends /v1/completions through the "
        "Coordinator throughout, one at a time, at most 20 a second, every fourth streaming; a "
        "scenario counts the requests sent from its fault until it ends (recovery, then 10 "
        "requests served). Non-streaming requests must not fail while another pair is healthy "
        "(every scenario but the Coordinator's own death); a stream flowing from an engine that "
        "dies cannot be saved, so streams are counted only.",
        "",
        "| scenario | fault | recovery timed from | recovery p50 s | recovery max s | failed/total "
        "(all runs) | worst run failed | non-streaming failed/total | streaming failed/total "
        "| runs passed |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(row(name, recs, runs) for name, recs in by_name.items()),
        "",
    ]
    notes = [
        f"- {name}: " + "; ".join(f"{k} = {v}" for k, v in recs[-1]["notes"].items())
        for name, recs in by_name.items()
        if recs[-1].get("notes")
    ]
    if notes:
        lines += ["Observed in the last run:", "", *notes, ""]
    failures = [
        f"- {name} (run {i + 1}): {r.get('error', '')}"
        for name, recs in by_name.items()
        for i, r in enumerate(recs)
        if not r["ok"]
    ]
    lines += ["Failed assertions:", "", *(failures or ["- none"]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_chaos")
    p.add_argument("--runs", type=int, default=3, help="runs of the whole chaos suite")
    args = p.parse_args(argv or [])  # `python -m bench chaos` runs the defaults
    by_name: dict[str, list[dict[str, Any]]] = {}
    walls: list[float] = []
    rcs: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.runs):
            path = Path(tmp) / f"run-{n}.jsonl"
            rc, wall, tail = run_suite(path)
            walls.append(wall)
            rcs.append(rc)
            recs = read_results(path)
            print(
                f"chaos run {n + 1}/{args.runs}: exit {rc}, {wall:.0f} s, {len(recs)} scenarios",
                file=sys.stderr,
            )
            if rc != 0:
                print(tail, file=sys.stderr)
            for rec in recs:
                by_name.setdefault(rec["scenario"], []).append(rec)
    if not by_name:
        print("the chaos suite reported no scenario", file=sys.stderr)
        return 1
    text = render(by_name, args.runs, walls, rcs)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
