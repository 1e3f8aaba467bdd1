"""The simulated engine alone, every latency at zero: the floor every router benchmark sits on.

One engine process, one client process (aiohttp, keep-alive), non-streaming chat completions.
The engine's own CPU use is measured from /proc, so the table shows whether the engine or the
client was the bottleneck. Writes bench/results/engine.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.loadgen.harness import Proc, cpu_seconds, publish

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "engine.md"
DURATION_S = float(os.environ.get("BENCH_DURATION_S", "10"))
WARMUP_S = 1.0
MAX_REQUESTS = 1_000_000
BODY = json.dumps(
    {
        "model": "motor-sim",
        "messages": [{"role": "user", "content": "Summarise prefill/decode disaggregation in one line."}],
        "max_tokens": 16,
    }
).encode()


@dataclass
class Result:
    clients: int
    requests: int
    errors: int
    seconds: float
    latencies: list[float]
    engine_cpu_s: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def pct(self, q: float) -> float:
        lat = sorted(self.latencies)
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000 if lat else float("nan")


async def _load(url: str, clients: int, seconds: float, pid: int) -> Result:
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=clients, force_close=False)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            nonlocal errors
            async with session.post(url, data=BODY, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    errors += 1

        async def worker(stop_at: float, record: bool) -> None:
            while time.perf_counter() < stop_at and len(latencies) < MAX_REQUESTS:
                t = time.perf_counter()
                await one()
                if record:
                    latencies.append(time.perf_counter() - t)

        warm_until = time.perf_counter() + WARMUP_S
        await asyncio.gather(*(worker(warm_until, False) for _ in range(clients)))
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(worker(t0 + seconds, True) for _ in range(clients)))
        elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    return Result(clients, len(latencies), errors, elapsed, latencies, cpu)


def _machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"nproc {os.cpu_count()}, {cpu}, Python {platform.python_version()}, aiohttp {aiohttp.__version__}, "
        f"{platform.system()} {platform.release()}"
    )


def _report(results: list[Result], load_before: float) -> str:
    one = next(r for r in results if r.clients == 1)
    many = max(results, key=lambda r: r.clients)
    rows = [
        f"| {r.clients} | {r.requests:,} | {r.errors} | {r.rps:,.0f} | {r.pct(0.50):.2f} | {r.pct(0.99):.2f} "
        f"| {100 * r.engine_cpu_s / r.seconds:.0f}% | {1e6 * r.engine_cpu_s / max(1, r.requests):.0f} |"
        for r in results
    ]
    return "\n".join(
        [
            "# Simulated engine alone (all latencies zero)",
            "",
            f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ",
            f"Machine: {_machine()}  ",
            f"1-minute load average before the run: {load_before:.2f} "
            "(other work on the machine skews the results)  ",
            f"Load: one aiohttp client process, keep-alive, non-streaming chat completions "
            f"(max_tokens 16), {WARMUP_S:g} s warm-up, then measured for "
            + ", ".join(
                f"{r.seconds:.0f} s at {r.clients} client{'s' if r.clients > 1 else ''}" for r in results
            )
            + ".",
            "",
            "| clients | requests | errors | req/s | p50 ms | p99 ms | engine CPU | engine CPU us/req |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Ratio: {many.clients} clients give {many.rps / one.rps:.1f}x the throughput of 1 client; "
            f"p50 grows {many.pct(0.5) / one.pct(0.5):.1f}x.",
            "",
            "Engine CPU near 100% means the engine (one event loop) is the bottleneck; lower means the",
            "Python client is. Absolute numbers move between runs and machines; compare ratios from",
            "one run.",
            "",
        ]
    )


async def amain() -> int:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        engine = await Proc.start(
            "engine", ["-m", "motor_mesh.cli", "engine-sim", "--port", "0"], Path(tmp) / "engine.log"
        )
        try:
            url = f"http://{(await engine.listening(30))['http']}/v1/chat/completions"
            results = [
                await _load(url, 1, min(DURATION_S, 5.0), engine.pid),
                await _load(url, 32, DURATION_S, engine.pid),
            ]
        finally:
            await engine.stop()
    publish(RESULTS, _report(results, load_before))
    return 1 if any(r.errors for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(amain())


if __name__ == "__main__":
    sys.exit(main())
