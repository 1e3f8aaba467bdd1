"""`motor up` to READY with simulated engines (1 prefill + 1 decode). Target: under 5 s."""

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


def one_run() -> float:
    off = free_offset(2)
    with tempfile.TemporaryDirectory() as state:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--port-offset", str(off), "--state-dir", state],
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
    times = [one_run() for _ in range(RUNS)]
    p50, worst = statistics.median(times), max(times)
    table = "\n".join(
        [
            "# motor up → READY (simulated engines, 1 prefill + 1 decode)",
            "",
            f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, {RUNS} runs",
            "",
            "| measure | seconds | ratio to 5 s target |",
            "|---|---|---|",
            f"| median | {p50:.2f} | {p50 / TARGET_S:.2f} |",
            f"| worst | {worst:.2f} | {worst / TARGET_S:.2f} |",
            "",
            "Runs: " + ", ".join(f"{t:.2f}" for t in times),
            "",
        ]
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
