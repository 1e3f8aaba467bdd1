"""`motor up` to READY with simulated engines (1 prefill + 1 decode), with one engine per
instance and with two (`--dp 2`). Target: under 5 s."""

from __future__ import annotations

import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.e2e.cluster import free_offset

RUNS = 5
TARGET_S = 5.0
RESULTS = Path(__file__).parent / "results" / "up.md"


SHAPES = (1, 2)  # --dp


def one_run(dp: int) -> float:
    off = free_offset(2, dp)
    with tempfile.TemporaryDirectory() as state:
        start = time.perf_counter()
        argv = ["up", "--dp", str(dp), "--port-offset", str(off), "--state-dir", state]
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            elapsed = time.perf_counter() - start
            if not line.startswith("READY "):
                raise RuntimeError(f"motor up did not get ready: {line!r}")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return elapsed


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
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
