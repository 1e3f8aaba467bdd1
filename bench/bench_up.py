"""`motor up` to READY with simulated engines (1 prefill + 1 decode), with one engine per
instance and with two (`--dp 2`). Target: under 5 s."""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from bench.loadgen.harness import publish
from bench.loadgen.up import Up

RUNS = 5
TARGET_S = 5.0
RESULTS = Path(__file__).parent / "results" / "up.md"


SHAPES = (1, 2)  # --dp


def one_run(dp: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        up = Up(["--dp", str(dp)], Path(tmp))
        up.stop(20)
    return up.ready_s


def main() -> None:
    runs = {dp: [one_run(dp) for _ in range(RUNS)] for dp in SHAPES}
    rows = []
    for dp, times in runs.items():
        p50, worst = statistics.median(times), max(times)
        verdict = "met" if worst < TARGET_S else "**missed**"
        rows.append(
            f"| --dp {dp} ({2 * dp} engines) | {p50:.2f} | {worst:.2f} | {worst / TARGET_S:.2f} | {verdict} |"
        )
    table = "\n".join(
        [
            "# motor up → READY (simulated engines, 1 prefill + 1 decode)",
            "",
            f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, {RUNS} runs per shape",
            "",
            "| shape | median s | worst s | worst / 5 s target | target |",
            "|---|---|---|---|---|",
            *rows,
            "",
            *(f"Runs --dp {dp}: " + ", ".join(f"{t:.2f}" for t in times) for dp, times in runs.items()),
            "",
        ]
    )
    publish(RESULTS, table)


if __name__ == "__main__":
    main()
