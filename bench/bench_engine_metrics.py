"""Engine metrics collection: its cost to requests with 64 engines scraped, and the signals it
gives autoscaling.

Part 1. A real Coordinator (no Controller: the table is written with SetInstances) holds 64
engine endpoints: two simulated engines (a vLLM-protocol prefill and decode, ttft 5 ms, 1 ms per
token) that serve the requests, and 62 metrics-only stand-ins (bench/loadgen/metrics_farm.py,
one process on 62 ports) exporting what a vLLM V1 engine exports, listed under a model no client
asks for: scraped, never routed to. A closed loop of clients (aiohttp, keep-alive) sends
non-streaming chat completions for a fixed time; the Coordinator is restarted for each run with
collection off (``engine_metrics_interval_s`` 0) or on (3 s, the default; and 1 s), the modes
alternating to spread drift over all. With ``workers`` 1 (the inference server shares the
management process's event loop with the collector: the worst case) and with the default
workers (one per core). Reported: requests/s, p50, p99 and max per mode, and on / off. Target:
p50 and p99 within 2%. Where the time goes: what parsing one stand-in's exposition and
aggregating 64 engines cost (measured in this process with the Coordinator's own functions), and
one more run under py-spy ``--gil`` (when installed): who holds the GIL while collection is on.

Part 2. Collection on (default 3 s), two simulated engines with a load-dependent latency model
(``--max-num-seqs`` slots: a request waits for a slot, and KV cache usage is running / slots).
The client concurrency steps up (streaming chat completions, so the clients measure time to the
first token and time per output token); per step, ``/metrics/engines?type=role`` is sampled every
second: prefill ``vllm:num_requests_waiting``, decode ``vllm:kv_cache_usage_perc`` and
``vllm:num_requests_waiting``, ``motor:prompt_tokens_per_second{role="prefill"}`` and
``motor:generation_tokens_per_second{role="decode"}``.

Writes bench/results/engine_metrics.md. About 6 minutes on 2 cores with the defaults.

    python -m bench.bench_engine_metrics [--clients 32] [--seconds 10] [--runs 3]
        [--steps 4,16,32,48,64,96,128] [--step-seconds 10] [--no-default-workers]
    python -m bench engine_metrics
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import itertools
import json
import math
import os
import pickle
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import metrics_farm, profile
from bench.loadgen.harness import (
    REPO,
    Proc,
    cpu_ns,
    entry,
    machine,
    percentile,
    publish,
    session_pids,
    system_cpu,
    wait_quiet,
)
from motor_mesh.coordinator.engine_metrics import exposition, parse
from motor_mesh.coordinator.engine_metrics.aggregate import aggregate
from motor_mesh.coordinator.engine_metrics.snapshot import Engine
from motor_mesh.gen.motor.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

RESULTS = Path(__file__).parent / "results" / "engine_metrics.md"
TARGET = 1.02
MODEL = "motor-sim"
FARM = 62  # metrics-only endpoints; with the two engines that serve: 64 scraped
WARMUP_S = 2.0
PART2_INTERVAL_S = 3.0  # the default engine_metrics_interval_s
STEP_WARMUP_S = 4.0  # longer than the 3 s interval: a round sees the step's load before sampling
JSON_CT = {"Content-Type": "application/json"}
KV = '{{"kv_connector":"NixlConnector","kv_role":"{}"}}'
# Part 1: the precision bench's engines (small fixed latency), 16 tokens.
BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "Say something short."}], "max_tokens": 16}
).encode()
LATENCY = ["--ttft-ms", "5", "--tpot-ms", "1"]
# Part 2: prefill 15 ms + 0.1 ms per prompt token not in the prefix cache, 8 slots; decode
# 5 ms KV transfer then 20 ms per token, 64 slots (its KV cache: 64 requests).
PREFILL_SLOTS, DECODE_SLOTS = 8, 64
PREFILL_MODEL = ["--ttft-ms", "15", "--prefill-ms-per-token", "0.1", "--max-num-seqs", str(PREFILL_SLOTS)]
DECODE_MODEL = ["--kv-transfer-ms", "5", "--tpot-ms", "20", "--max-num-seqs", str(DECODE_SLOTS)]
STREAM_TOKENS = (8, 24)  # max_tokens of a streamed request: spread, so clients do not move in step
SYSTEM = " ".join(f"rule{i}" for i in range(64))  # a shared system prompt: 64 tokens, 4 blocks
MODES = {"off": 0.0, "3 s": 3.0, "1 s": 1.0}
FRESH_RE = re.compile(r'^motor_coordinator_engine_metrics_endpoints\{state="fresh"\} (\S+)$', re.M)
FAILURES_RE = re.compile(r"^motor_coordinator_engine_metrics_scrape_failures_total (\S+)$", re.M)
FAILED_LOG_RE = re.compile(r'event=engine_metrics_failed .*?error="((?:[^"\\]|\\.)*)"')


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench_engine_metrics")
    p.add_argument("--clients", type=int, default=32, help="part 1: concurrent clients")
    p.add_argument("--seconds", type=float, default=10.0, help="part 1: measured time per run")
    p.add_argument("--runs", type=int, default=3, help="part 1: runs per mode (modes alternate)")
    p.add_argument(
        "--no-default-workers",
        action="store_true",
        help="part 1: only workers = 1 (skip the rows with one worker per core)",
    )
    p.add_argument("--steps", default="4,16,32,48,64,96,128", help="part 2: client concurrency per step")
    p.add_argument("--step-seconds", type=float, default=10.0, help="part 2: measured time per step")
    return p.parse_args(argv)


# -- processes ------------------------------------------------------------------------------


async def engine_pair(
    tmp: Path, prefill: list[str], decode: list[str], tag: str
) -> tuple[list[Proc], list[int]]:
    serve = ["-m", "motor_mesh.cli", "engine-sim", "serve", MODEL, "--port", "0"]
    procs = [
        await Proc.start(
            f"engine-{role}",
            [*serve, *flags, "--kv-transfer-config", KV.format(role)],
            tmp / f"engine-{tag}-{role}.log",
        )
        for role, flags in (("kv_producer", prefill), ("kv_consumer", decode))
    ]
    ports = [int((await p.listening())["http"].rsplit(":", 1)[1]) for p in procs]
    return procs, ports


def table(engine_ports: list[int], farm_ports: list[int]) -> coordinator_pb2.SetInstancesRequest:
    roles = (common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE)
    instances = [
        common_pb2.Instance(
            id=i + 1,
            role=role,
            job_name=f"bench-{i}",
            model_name=MODEL,
            engine_type=common_pb2.ENGINE_TYPE_SIM,
            endpoints=[common_pb2.Endpoint(host="127.0.0.1", port=port)],
        )
        for i, (role, port) in enumerate(zip(roles, engine_ports, strict=True))
    ]
    # The stand-ins: even ones prefill, odd ones decode (as the farm shapes their series).
    instances += [
        common_pb2.Instance(
            id=100 + i,
            role=roles[i % 2],
            job_name=f"farm-{i}",
            model_name=metrics_farm.MODEL,
            engine_type=common_pb2.ENGINE_TYPE_VLLM,
            endpoints=[common_pb2.Endpoint(host="127.0.0.1", port=port)],
        )
        for i, port in enumerate(farm_ports)
    ]
    return coordinator_pb2.SetInstancesRequest(instances=instances)


async def coordinator(tmp: Path, name: str, interval_s: float, workers: int) -> tuple[Proc, dict[str, str]]:
    cfg = tmp / f"{name}.json"
    cfg.write_text(
        json.dumps(
            {
                "port": 0,
                "http_port": 0,
                "workers": workers,
                "engine_metrics_interval_s": interval_s,
                # Healthy engines: nothing is ever reported, so nothing needs to listen here.
                "controller": "127.0.0.1:9",
            }
        )
    )
    coord = await Proc.start(
        "coordinator", ["-m", "motor_mesh.cli", "coordinator", "--config", str(cfg)], tmp / f"{name}.log"
    )
    try:
        return coord, await coord.listening()
    except BaseException:
        await coord.stop()
        raise


async def set_table(where: dict[str, str], req: coordinator_pb2.SetInstancesRequest) -> None:
    async with grpc.aio.insecure_channel(where["grpc"]) as ch:
        await coordinator_pb2_grpc.CoordinatorStub(ch).SetInstances(req, timeout=10)


SPY_RATE = 250  # samples per second


async def gil_profile(pid: int, seconds: float, out: Path) -> asyncio.subprocess.Process | None:
    """py-spy sampling ``pid``'s threads only while one holds the GIL (None without py-spy)."""
    spy = profile.py_spy()
    if spy is None:
        return None
    argv = ["record", "-p", str(pid), "-d", f"{max(1.0, seconds):g}", "-r", str(SPY_RATE), "-f", "raw",
            "--threads", "--gil", "--nonblocking", "-o", str(out)]  # fmt: skip
    quiet = asyncio.subprocess.DEVNULL
    return await asyncio.create_subprocess_exec(spy, *argv, stdout=quiet, stderr=quiet)


GIL_KINDS = {
    "parse": "a parse (`parse.parse`, prometheus_client's parser) in one of its threads",
    "pool": "a process pool's threads (texts out, parsed families back: pickling)",
    "loop_collector": "the event loop, in the collector's code (scrapes, rates)",
    "loop_other": "the event loop, everything else (serving requests)",
    "other": "other threads",
}


@dataclass
class GilProfile:
    seconds: float
    samples: dict[str, int]  # who held the GIL: parse threads, event loop (collector / rest), other

    @property
    def total(self) -> int:
        return sum(self.samples.values())


def gil_summary(out: Path, seconds: float) -> GilProfile | None:
    if not out.exists():
        return None
    samples = dict.fromkeys(GIL_KINDS, 0)
    for row in out.read_text().splitlines():
        stack, _, count = row.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        if "engine_metrics/parse.py" in stack:
            kind = "parse"  # a parse in one of the Coordinator's own threads
        elif "MainThread" in stack.split(";", 1)[0]:
            kind = "loop_collector" if "engine_metrics/" in stack else "loop_other"
        elif "concurrent/futures/process.py" in stack or "multiprocessing/" in stack:
            kind = "pool"  # a process pool's threads: sending texts, receiving parsed families
        else:
            kind = "other"
        samples[kind] += int(count)
    return GilProfile(seconds, samples)


def code_version() -> tuple[str, str]:
    """The Coordinator code measured: (the commit, and whether services/coordinator differs from
    it; a digest of its sources), ("", "") outside a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "services/coordinator")
        digest = git("hash-object", *sorted(str(p) for p in (REPO / "services/coordinator").rglob("*.py")))
    except (OSError, subprocess.SubprocessError):
        return "", ""
    note = ", with uncommitted changes in services/coordinator" if dirty else ""
    sources = hashlib.sha1(digest.encode()).hexdigest()[:8]
    return f"commit {head}{note} (sources {sources})", sources


def session_cpu_ns(leader: int) -> int:
    """CPU of every process in ``leader``'s session: the Coordinator and its inference workers."""
    return sum(cpu_ns(p) for p in session_pids(leader, ""))


# -- part 1 ---------------------------------------------------------------------------------


@dataclass
class Run:
    workers: str  # "1" or "2 (default)"
    mode: str  # a key of MODES
    latencies_ms: list[float]
    seconds: float
    errors: int
    machine_pct: float  # whole machine busy time over the run (200% = both cores)
    coord_cpu_s: float  # the Coordinator's processes, over the run
    farm_cpu_s: float
    background_pct: float  # CPU of processes not in this bench (other users' jobs), 100% = a core
    rounds: int  # collection rounds seen by the farm during the run
    fetch_ms: list[float]  # per round: first to last of the 62 scrapes arriving at the farm
    fresh: float  # endpoints with fresh metrics at the end of the run (the Coordinator's gauge)
    failures: float
    why_failed: list[str] = field(default_factory=list)  # engine_metrics_failed errors in its log

    @property
    def rps(self) -> float:
        return len(self.latencies_ms) / self.seconds

    @property
    def coord_cpu_pct(self) -> float:
        return 100 * self.coord_cpu_s / self.seconds

    @property
    def farm_cpu_pct(self) -> float:
        return 100 * self.farm_cpu_s / self.seconds


async def client(
    http: aiohttp.ClientSession, url: str, until: float, out: list[float], errors: list[int]
) -> None:
    while (start := time.perf_counter()) < until:
        try:
            async with http.post(url, data=BODY, headers=JSON_CT) as resp:
                await resp.read()
                ok = resp.status == 200
        except aiohttp.ClientError:
            ok = False
        if ok:
            out.append((time.perf_counter() - start) * 1000)
        else:
            errors.append(1)


def rounds_of(times: list[float]) -> list[list[float]]:
    """Scrape arrival times grouped into collection rounds (a gap of 0.5 s starts a new one)."""
    groups: list[list[float]] = []
    for t in sorted(times):
        if groups and t - groups[-1][-1] < 0.5:
            groups[-1].append(t)
        else:
            groups.append([t])
    return groups


async def one_run(
    mode: str,
    workers: int,
    engine_ports: list[int],
    farm: Proc,
    farm_ports: list[int],
    others: list[int],
    args: argparse.Namespace,
    tmp: Path,
    n: int,
    spy_out: Path | None = None,
) -> Run:
    label = "1" if workers == 1 else "per core (default)"
    coord, where = await coordinator(tmp, f"c-w{workers}-{mode.replace(' ', '')}-{n}", MODES[mode], workers)
    try:
        await set_table(where, table(engine_ports, farm_ports))
        base = f"http://{where['http']}"
        stats_url = f"http://127.0.0.1:{farm_ports[0]}/farm/stats"
        connector = aiohttp.TCPConnector(limit=args.clients)
        async with aiohttp.ClientSession(connector=connector) as http:
            url = f"{base}/v1/chat/completions"
            warm_until = time.perf_counter() + WARMUP_S
            await asyncio.gather(*(client(http, url, warm_until, [], []) for _ in range(args.clients)))
            await wait_quiet([*session_pids(coord.pid, ""), farm.pid, *others], max_wait_s=10)
            async with http.get(stats_url) as resp:
                await resp.read()  # forget the scrapes so far
            lat: list[float] = []
            errors: list[int] = []
            spy = None if spy_out is None else await gil_profile(coord.pid, args.seconds - 1, spy_out)
            m0, c0, f0 = system_cpu()[0], session_cpu_ns(coord.pid), cpu_ns(farm.pid)
            o0, me0, t0 = sum(map(cpu_ns, others)), time.process_time(), time.perf_counter()
            until = t0 + args.seconds
            await asyncio.gather(*(client(http, url, until, lat, errors) for _ in range(args.clients)))
            elapsed = time.perf_counter() - t0
            busy, coord_s = system_cpu()[0] - m0, (session_cpu_ns(coord.pid) - c0) / 1e9
            farm_s = (cpu_ns(farm.pid) - f0) / 1e9
            mine = coord_s + farm_s + (sum(map(cpu_ns, others)) - o0) / 1e9 + time.process_time() - me0
            if spy is not None:
                await spy.wait()
            async with http.get(stats_url) as resp:
                times = (await resp.json())["times"]
            async with http.get(f"{base}/metrics") as resp:
                text = await resp.text()
        groups = [g for g in rounds_of(times) if len(g) > 1]
        fresh = FRESH_RE.search(text)
        failures = FAILURES_RE.search(text)
        run = Run(
            label,
            mode,
            sorted(lat),
            elapsed,
            len(errors),
            100 * busy / elapsed,
            coord_s,
            farm_s,
            100 * max(0.0, busy - mine) / elapsed,
            len(groups),
            [(g[-1] - g[0]) * 1000 for g in groups],
            float(fresh.group(1)) if fresh else math.nan,
            float(failures.group(1)) if failures else 0.0,
        )
    finally:
        await coord.stop()
    run.why_failed = FAILED_LOG_RE.findall(coord.log.read_text(errors="replace"))
    return run


async def part1(args: argparse.Namespace, tmp: Path) -> tuple[list[Run], GilProfile | None]:
    farm = await Proc.start(
        "metrics-farm", ["-m", "bench.loadgen.metrics_farm", "--count", str(FARM)], tmp / "farm.log"
    )
    procs, engine_ports = await engine_pair(tmp, LATENCY, LATENCY, "p1")
    runs: list[Run] = []
    gil: GilProfile | None = None
    try:
        farm_ports = [int(p) for p in (await farm.listening())["ports"].split(",")]
        others = [p.pid for p in procs]
        configs: list[tuple[int, list[str]]] = [(1, list(MODES))]
        if not args.no_default_workers:
            configs.append((0, ["off", "3 s"]))
        for workers, modes in configs:
            for n in range(args.runs):
                for mode in modes if n % 2 == 0 else modes[::-1]:
                    run = await one_run(mode, workers, engine_ports, farm, farm_ports, others, args, tmp, n)
                    print(
                        f"  workers {run.workers}, collection {mode}: {run.rps:.0f} req/s, "
                        f"p50 {percentile(run.latencies_ms, 50):.2f} ms, "
                        f"p99 {percentile(run.latencies_ms, 99):.2f} ms, rounds {run.rounds}",
                        file=sys.stderr,
                    )
                    runs.append(run)
        # One more run, not in the tables above: who holds the GIL while collection is on.
        spy_out = tmp / "gil.txt"
        await one_run("3 s", 1, engine_ports, farm, farm_ports, others, args, tmp, args.runs, spy_out)
        gil = gil_summary(spy_out, max(1.0, args.seconds - 1))
    finally:
        for p in [*procs, farm]:
            await p.stop()
    return runs, gil


# -- where the time goes (in this process) ---------------------------------------------------


@dataclass
class Cost:
    size: int  # bytes of one stand-in exposition
    samples: int  # engine samples kept from it
    parse_ms: float  # parse.parse() of one exposition, its series already met
    first_ms: float  # the same with nothing met before (a fresh parse.Parser), when there is one
    unpickle_ms: float  # one parse result crossing back from a parse process (pickle.loads)
    rates_ms: float
    aggregate_ms: dict[str, float] = field(default_factory=dict)  # view -> aggregate + render, 64 engines


def _median_ms(fn: Callable[[], object], n: int) -> float:
    """Median CPU time of ``fn`` in this thread (not wall time: other jobs on the machine do not count)."""
    times = []
    for _ in range(n):
        t0 = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - t0)
    return statistics.median(times) / 1e6


def collector_cost() -> Cost:
    """The collector's CPU per engine and per answer, measured here with the Coordinator's own code
    on the farm's exposition (what each of its threads does for one scrape)."""
    stand_ins = [metrics_farm.Engine(i, random.Random(i), time.time()) for i in range(64)]
    texts = [e.scrape().decode() for e in stand_ins]
    time.sleep(0.2)
    texts2 = [e.scrape().decode() for e in stand_ins]
    families = [parse.parse(t) for t in texts]
    families2 = [parse.parse(t) for t in texts2]
    text = texts2[0]
    engines = [
        Engine(i + 1, ("prefill", "decode")[i % 2], "127.0.0.1", 20000 + i, 0, time.time(), "", f2,
               parse.rates(f2, f1, 0.2))
        for i, (f1, f2) in enumerate(zip(families, families2, strict=True))
    ]  # fmt: skip
    fresh: Callable[[], object] | None = None
    if callable(getattr(parse, "Parser", None)):  # a parser that remembers the series it has met

        def fresh() -> object:
            return parse.Parser().parse(text)

    steady = _median_ms(lambda: parse.parse(text), 15)
    cost = Cost(
        size=len(text.encode()),
        samples=sum(len(f.samples) for f in families2[0]),
        parse_ms=steady,
        first_ms=_median_ms(fresh, 5) if fresh is not None else steady,
        unpickle_ms=_median_ms(functools.partial(pickle.loads, pickle.dumps(families2[0])), 30),
        rates_ms=_median_ms(lambda: parse.rates(families2[0], families[0], 0.2), 50),
    )

    def answer(view: str) -> bytes:
        return exposition.prometheus(aggregate(engines, view))

    for view in ("full", "role", "instance"):
        cost.aggregate_ms[view] = _median_ms(functools.partial(answer, view), 5)
    return cost


# -- part 2 ---------------------------------------------------------------------------------

SIGNALS = {
    "prefill_waiting": ("vllm:num_requests_waiting", "prefill"),
    "prefill_running": ("vllm:num_requests_running", "prefill"),
    "decode_kv": ("vllm:kv_cache_usage_perc", "decode"),
    "decode_waiting": ("vllm:num_requests_waiting", "decode"),
    "prompt_tps": ("motor:prompt_tokens_per_second", "prefill"),
    "gen_tps": ("motor:generation_tokens_per_second", "decode"),
    "hit_rate": ("motor:prefix_cache_hit_rate", "prefill"),
}


@dataclass
class Step:
    clients: int
    seconds: float
    requests: int
    errors: int
    tokens: int  # content tokens the clients received
    ttft_ms: list[float]
    tpot_ms: list[float]
    signals: dict[str, list[float]]  # name -> one value per sample
    failed_scrapes: float = 0.0  # the Coordinator's failed engine scrapes during the step

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds


def signal_values(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    wanted = {(name, role): key for key, (name, role) in SIGNALS.items()}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = wanted.get((s.name, s.labels.get("role", "")))
            if key is not None:
                out[key] = float(s.value)
    return out


def stream_body(seq: int) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"question {seq}: say something about item {seq * 7919 % 10007}"},
            ],
            "max_tokens": STREAM_TOKENS[0] + seq * 7919 % (STREAM_TOKENS[1] - STREAM_TOKENS[0] + 1),
            "stream": True,
        }
    ).encode()


async def stream_client(
    http: aiohttp.ClientSession,
    url: str,
    seq: itertools.count[int],
    since: float,
    until: float,
    out: list[tuple[float, float, int]],
    errors: list[int],
) -> None:
    """Streams chat completions until ``until``: per request started from ``since`` on, the time to
    the first content token and the mean time per output token after it (the client's view,
    through the Coordinator)."""
    while (start := time.perf_counter()) < until:
        first = last = 0.0
        tokens = 0
        try:
            async with http.post(url, data=stream_body(next(seq)), headers=JSON_CT) as resp:
                if resp.status != 200:
                    await resp.read()
                    errors.append(1)
                    continue
                async for chunk in resp.content.iter_any():
                    k = chunk.count(b'"content":"') - chunk.count(b'"content":""')
                    if k > 0:
                        last = time.perf_counter()
                        first = first or last
                        tokens += k
        except aiohttp.ClientError:
            errors.append(1 if start >= since else 0)
            continue
        if start < since:
            continue  # warm-up
        if tokens == 0:
            errors.append(1)
            continue
        tpot = (last - first) / (tokens - 1) if tokens > 1 else math.nan
        out.append(((first - start) * 1000, tpot * 1000, tokens))


async def sampler(
    http: aiohttp.ClientSession, url: str, since: float, until: float, out: dict[str, list[float]]
) -> None:
    await asyncio.sleep(max(0.0, since - time.perf_counter()))
    while time.perf_counter() < until:
        async with http.get(url) as resp:
            text = await resp.text()
        for k, v in signal_values(text).items():
            out.setdefault(k, []).append(v)
        await asyncio.sleep(1.0)


async def part2(args: argparse.Namespace, tmp: Path) -> list[Step]:
    steps = [int(s) for s in args.steps.split(",") if s]
    procs, ports = await engine_pair(tmp, PREFILL_MODEL, DECODE_MODEL, "p2")
    out: list[Step] = []
    try:
        coord, where = await coordinator(tmp, "c-signals", PART2_INTERVAL_S, 1)
        try:
            await set_table(where, table(ports, []))
            # Two rounds before the first step: from then on each engine has a previous scrape,
            # so the tokens/s are rates from the first sample on.
            await asyncio.sleep(2 * PART2_INTERVAL_S)
            base = f"http://{where['http']}"
            url = f"{base}/v1/chat/completions"
            seq = itertools.count()
            failures = 0.0
            for c in steps:
                connector = aiohttp.TCPConnector(limit=c + 2)
                async with aiohttp.ClientSession(connector=connector) as http:
                    # The clients run through warm-up and measurement alike: no lull between them
                    # for a collection round to land in.
                    res: list[tuple[float, float, int]] = []
                    errors: list[int] = []
                    signals: dict[str, list[float]] = {}
                    t0 = time.perf_counter() + STEP_WARMUP_S
                    until = t0 + args.step_seconds
                    await asyncio.gather(
                        sampler(http, f"{base}/metrics/engines?type=role", t0, until, signals),
                        *(stream_client(http, url, seq, t0, until, res, errors) for _ in range(c)),
                    )
                    elapsed = until - t0
                    async with http.get(f"{base}/metrics") as resp:
                        found = FAILURES_RE.search(await resp.text())
                    now_failed = float(found.group(1)) if found else 0.0
                    failed, failures = now_failed - failures, now_failed
                step = Step(
                    c,
                    elapsed,
                    len(res),
                    sum(errors),
                    sum(r[2] for r in res),
                    sorted(r[0] for r in res),
                    sorted(r[1] for r in res if not math.isnan(r[1])),
                    signals,
                    failed,
                )
                print(
                    f"  {c} clients: {step.rps:.0f} req/s, ttft p50 {percentile(step.ttft_ms, 50):.0f} ms, "
                    f"kv {statistics.mean(signals.get('decode_kv', [math.nan])):.2f}",
                    file=sys.stderr,
                )
                out.append(step)
        finally:
            await coord.stop()
    finally:
        for p in procs:
            await p.stop()
    return out


# -- report ---------------------------------------------------------------------------------


def _group(runs: list[Run], workers: str, mode: str) -> list[Run]:
    return [r for r in runs if r.workers == workers and r.mode == mode]


def _pcts(runs: list[Run]) -> tuple[list[float], float, float]:
    lat = sorted(x for r in runs for x in r.latencies_ms)
    return lat, percentile(lat, 50), percentile(lat, 99)


def _configs(runs: list[Run]) -> list[str]:
    return list(dict.fromkeys(r.workers for r in runs))


def _spread(runs: list[Run], q: float) -> float:
    """max / min over the runs of their own ``q`` percentile: how much runs of one mode differ."""
    values = [percentile(r.latencies_ms, q) for r in runs]
    return max(values) / min(values) if values else 1.0


def render_part1(runs: list[Run]) -> list[str]:
    lines = [
        "| workers | collection | requests | req/s (mean of runs) | p50 ms | p99 ms | max ms | "
        "p50 on / off | p99 on / off | errors | Coordinator CPU | farm CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts: dict[str, list[str]] = {mode: [] for mode in MODES}
    spreads: list[str] = []
    for workers in _configs(runs):
        off = _group(runs, workers, "off")
        _, p50_off, p99_off = _pcts(off)
        for mode in MODES:
            group = _group(runs, workers, mode)
            if not group:
                continue
            lat, p50, p99 = _pcts(group)
            rps = statistics.mean(r.rps for r in group)
            ratios = "—", "—"
            spreads.append(f"{workers} / {mode}: p50 {_spread(group, 50):.3f}, p99 {_spread(group, 99):.3f}")
            if mode != "off":
                r50, r99 = p50 / p50_off, p99 / p99_off
                ratios = f"{r50:.3f}", f"{r99:.3f}"
                noise50 = max(_spread(off, 50), _spread(group, 50))
                noise99 = max(_spread(off, 99), _spread(group, 99))
                if r50 <= TARGET and r99 <= TARGET:
                    verdict = f"target met (p50 {r50:.3f}, p99 {r99:.3f} of off)."
                else:
                    verdict = f"**target missed: p50 {r50:.3f}, p99 {r99:.3f} of off**"
                    missed = [
                        (n, v, z) for n, v, z in (("p50", r50, noise50), ("p99", r99, noise99)) if v > TARGET
                    ]
                    if all(v <= z for _, v, z in missed):
                        verdict += (
                            " (by less than runs of one mode differ among themselves: "
                            + ", ".join(f"{n} up to {z:.3f}" for n, _, z in missed)
                            + "; not resolvable on this machine)."
                        )
                    else:
                        verdict += "."
                verdicts[mode].append(f"- workers {workers}, every {mode}: {verdict}")
            cpu = statistics.mean(r.coord_cpu_pct for r in group)
            farm = statistics.mean(r.farm_cpu_pct for r in group)
            errors = sum(r.errors for r in group)
            lines.append(
                f"| {workers} | {mode} | {len(lat):,} | {rps:,.0f} | {p50:.2f} | {p99:.2f} | {lat[-1]:.2f} | "
                f"{ratios[0]} | {ratios[1]} | {errors} | {cpu:.0f}% | {farm:.1f}% |"
            )
    default = [m for m, v in MODES.items() if v == 3.0]
    others = [m for m in MODES if m != "off" and m not in default]
    return [
        *lines,
        "",
        "At the default interval (3 s), the requirement:",
        "",
        *(v for m in default for v in verdicts[m]),
        "",
        "More often (the trend):",
        "",
        *(v for m in others for v in verdicts[m]),
        "",
        "How much runs of one mode differ (max / min of the runs' own percentiles; workers / "
        "collection): " + "; ".join(spreads) + ".",
    ]  # fmt: skip


def _request_cpu_s(runs: list[Run], workers: str) -> float:
    """The Coordinator's CPU per request with collection off (its cost of serving alone)."""
    off = _group(runs, workers, "off")
    requests = sum(len(r.latencies_ms) for r in off)
    return sum(r.coord_cpu_s for r in off) / requests if requests else math.nan


def render_rounds(runs: list[Run]) -> list[str]:
    lines = [
        "| workers | collection | rounds per run | 62 stand-ins fetched within, median / max ms | "
        "fresh endpoints at the end | failed scrapes | Coordinator CPU not spent on requests | per round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workers in _configs(runs):
        per_request = _request_cpu_s(runs, workers)
        for mode in MODES:
            group = _group(runs, workers, mode)
            if not group or mode == "off":
                continue
            fetch = sorted(x for r in group for x in r.fetch_ms)
            rounds = sum(r.rounds for r in group)
            seconds = sum(r.seconds for r in group)
            extra = sum(r.coord_cpu_s - len(r.latencies_ms) * per_request for r in group)
            lines.append(
                f"| {workers} | {mode} | {rounds / len(group):.1f} | "
                f"{percentile(fetch, 50):,.0f} / {fetch[-1] if fetch else math.nan:,.0f} | "
                f"{min(r.fresh for r in group):.0f} to {max(r.fresh for r in group):.0f} | "
                f"{sum(r.failures for r in group):.0f} | {100 * extra / seconds:.0f}% of a core | "
                f"{1000 * extra / rounds if rounds else math.nan:,.0f} ms |"
            )
    return lines


def render_failures(runs: list[Run]) -> list[str]:
    reasons: dict[str, int] = {}
    for r in runs:
        for why in r.why_failed:
            # The same cause with different text cut points counts once.
            key = re.sub(r"'.*", "'...'", why)
            reasons[key] = reasons.get(key, 0) + 1
    if not reasons:
        return []
    top = sorted(reasons.items(), key=lambda kv: -kv[1])[:5]
    return [
        "",
        "Why scrapes failed (the first failure of an engine in a row, from the Coordinator's log):",
        "",
        *(f"- {n} times: `{why}`" for why, n in top),
    ]


def render_runs(runs: list[Run]) -> list[str]:
    lines = [
        "| run | workers | collection | req/s | p50 ms | p99 ms | max ms | errors | rounds | "
        "Coordinator CPU | machine CPU | of which other users' |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs):
        lines.append(
            f"| {i + 1} | {r.workers} | {r.mode} | {r.rps:,.0f} | {percentile(r.latencies_ms, 50):.2f} | "
            f"{percentile(r.latencies_ms, 99):.2f} | {r.latencies_ms[-1]:.2f} | {r.errors} | {r.rounds} | "
            f"{r.coord_cpu_pct:.0f}% | {r.machine_pct:.0f}% | {r.background_pct:.0f}% |"
        )
    return lines


def render_cost(cost: Cost) -> list[str]:
    per_round = cost.parse_ms * 64
    first = (
        f" ({cost.first_ms:.1f} ms the first time: the parser reads a series' name and labels once, "
        "then only its value)"
        if cost.first_ms > 1.5 * cost.parse_ms
        else ""
    )
    return [
        f"- One stand-in's exposition: **{cost.size:,} bytes**, of which the parse keeps {cost.samples} "
        "samples (the `vllm:*` ones but `*_created`).",
        f"- `parse.parse()` of it: **{cost.parse_ms:.2f} ms** of CPU (median; the thread's CPU time)"
        f"{first}. 64 such engines: **{per_round:,.0f} ms of CPU per round**, "
        f"{per_round / 3000:.1%} of a core at the 3 s default, {per_round / 1000:.1%} at 1 s.",
        f"- `parse.rates()`: {cost.rates_ms:.3f} ms per engine and round; a parse result pickled back "
        f"from another process (`pickle.loads`, were the parse in one): {cost.unpickle_ms:.2f} ms.",
        "- An answer to `/metrics/engines` over 64 such engines (aggregate + Prometheus text, CPU; "
        "the Coordinator computes it once per round and query, when asked): "
        + ", ".join(f"`type={v}` {ms:,.0f} ms" for v, ms in cost.aggregate_ms.items())
        + ".",
    ]


def render_gil(gil: GilProfile | None) -> list[str]:
    if gil is None or not gil.total:
        why = "py-spy not found (`pip install -e '.[bench]'`)" if profile.py_spy() is None else "no samples"
        return [f"(No GIL profile: {why}.)"]
    wall = gil.seconds * SPY_RATE
    rows = [f"| {what} | {gil.samples[kind] / wall:.0%} |" for kind, what in GIL_KINDS.items()]
    parse_share = gil.samples["parse"] / wall
    if gil.samples["parse"]:
        how = (
            "The collector parses in the Coordinator's own threads (`asyncio.to_thread`): that keeps "
            "the call off the event loop, not off the GIL. While a parse runs, the loop serving "
            "requests waits for the interpreter (up to the 5 ms switch interval at each turn of the "
            f"loop); here the parses held it {parse_share:.1%} of the time."
        )
    else:
        how = (
            "No parse runs in the Coordinator's own threads: the collector parses in a process of its "
            "own, so the parse costs CPU (another core's, where there is one) but not the interpreter "
            "the event loop needs. What is left in the Coordinator is fetching the expositions on the "
            "event loop, and each parse result crossing back (the process pool's thread unpickles "
            "it, holding the GIL)."
        )
    return [
        f"py-spy (`--gil`, {SPY_RATE} samples/s, {gil.seconds:g} s of one more run with `workers` 1 "
        "and collection every 3 s) sampled the Coordinator's process only while one of its threads "
        "held the GIL. Share of the wall-clock time each held it:",
        "",
        "| GIL held by | share of the time |",
        "|---|---|",
        *rows,
        "",
        how,
    ]


def _mm(values: list[float], fmt: str) -> str:
    if not values:
        return "—"
    return f"{format(statistics.mean(values), fmt)} / {format(max(values), fmt)}"


def _mean(values: list[float]) -> float:
    return statistics.mean(values) if values else math.nan


def render_part2(steps: list[Step]) -> list[str]:
    lines = [
        "| clients | req/s | prefill waiting (mean / max) | prefill running (mean) | "
        "decode KV usage (mean / max) | decode waiting (mean / max) | prefill prompt tok/s | "
        "decode gen tok/s | client tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | errors | "
        "failed scrapes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in steps:
        sig = s.signals
        lines.append(
            f"| {s.clients} | {s.rps:,.0f} | {_mm(sig.get('prefill_waiting', []), '.1f')} | "
            f"{_mean(sig.get('prefill_running', [])):.1f} | "
            f"{_mm(sig.get('decode_kv', []), '.2f')} | {_mm(sig.get('decode_waiting', []), '.1f')} | "
            f"{_mean(sig.get('prompt_tps', [])):,.0f} | {_mean(sig.get('gen_tps', [])):,.0f} | "
            f"{s.tps:,.0f} | "
            f"{percentile(s.ttft_ms, 50):.0f} / {percentile(s.ttft_ms, 99):.0f} | "
            f"{percentile(s.tpot_ms, 50):.1f} / {percentile(s.tpot_ms, 99):.1f} | {s.errors} | "
            f"{s.failed_scrapes:.0f} |"
        )
    return [*lines, "", *_reading(steps)]


def _reading(steps: list[Step]) -> list[str]:
    """What the table says, from its numbers."""
    waits = [_mean(s.signals.get("decode_waiting", [])) for s in steps]
    knee = next((i for i, w in enumerate(waits) if w >= 1.0), None)
    if knee is None or knee == 0:
        where = (
            "no step had requests waiting for decode" if knee is None else "decode queued from the first step"
        )
        return [f"Reading it: {where}; rerun with other `--steps` to find where the decode pool fills."]
    before, at = steps[knee - 1], steps[knee]
    kv_before = before.signals.get("decode_kv", [math.nan])
    kv_at = at.signals.get("decode_kv", [math.nan])
    p99_before, p99_at = percentile(before.ttft_ms, 99), percentile(at.ttft_ms, 99)
    tpots = [percentile(s.tpot_ms, 99) for s in steps]
    p99_first = percentile(steps[0].ttft_ms, 99)
    prefill_wait = max(max(s.signals.get("prefill_waiting", [0.0]), default=0.0) for s in steps)
    prefill_mean = max(_mean(s.signals.get("prefill_waiting", [0.0])) for s in steps)
    return [
        f"Reading it: up to {before.clients} clients, decode KV usage averages {_mean(kv_before):.2f} "
        f"(highest sample {max(kv_before):.2f}) with nothing waiting, and TTFT p99 is "
        + (
            f"{p99_before:.0f} ms, as at {steps[0].clients} clients ({p99_first:.0f} ms). At "
            if p99_before <= 1.25 * p99_first
            else f"{p99_before:.0f} ms (from {p99_first:.0f} ms at {steps[0].clients} clients, with no "
            "queue in any sample: the tail grows with the work the processes share, one Coordinator "
            f"process, the sims and the clients on {os.cpu_count()} cores, and with bursts shorter "
            "than a round). At "
        )
        + f"{at.clients} clients KV usage reaches "
        f"{max(kv_at):.2f} (mean {_mean(kv_at):.2f}), {waits[knee]:.0f} requests wait for a decode "
        "slot on average, and TTFT "
        f"p99 rises to {p99_at:.0f} ms (the wait for a slot), while req/s grows from "
        f"{before.rps:,.0f} to only {at.rps:,.0f}: the decode pool is full, and more clients only "
        "queue. That is the point to have scaled decode before, and `vllm:kv_cache_usage_perc` "
        "(with `vllm:num_requests_waiting` on decode) is the signal that shows it coming. "
        "In the sim the cost of a token does not depend on the batch, so TPOT p99 stays between "
        f"{min(tpots):.1f} and {max(tpots):.1f} ms at every step; on a "
        "real vLLM engine TPOT also rises with the batch and preemptions begin near full KV usage. "
        "So put decode's scale-up threshold at or below the KV usage of the last step with nothing "
        f"waiting (here {_mean(kv_before):.2f}), lowered by what the load can grow while a new "
        "instance starts. Prefill "
        f"({PREFILL_SLOTS} slots of about 16 ms: some {PREFILL_SLOTS / 0.016:,.0f} requests/s) has "
        f"over twice decode's capacity ({DECODE_SLOTS} slots of about 305 ms: some "
        f"{DECODE_SLOTS / 0.305:,.0f}/s), so its queue "
        + (
            "stays empty in every sample"
            if prefill_wait == 0
            else f"comes only in short bursts (mean at most {prefill_mean:.1f}, highest sample "
            f"{prefill_wait:.0f}: clients whose requests end together send their next ones together)"
        )
        + ". It is not the signal to scale on here; it becomes one where long prompts make prefill "
        "the bottleneck.",
    ]


def render(
    runs: list[Run],
    cost: Cost,
    gil: GilProfile | None,
    steps: list[Step],
    args: argparse.Namespace,
    code: str,
) -> str:
    workers_note = (
        ""
        if args.no_default_workers
        else " and with `workers` 0 (one inference worker per core, here 2: the collector then runs "
        "in the management process, which serves no HTTP)"
    )
    return "\n".join(
        [
            "# Engine metrics collection: its cost to requests, and the signals it gives autoscaling",
            "",
            machine(),
            "",
            "Generated by `python -m bench.bench_engine_metrics` (bench/bench_engine_metrics.py); "
            "not edited by hand." + (f" Coordinator code measured: {code}." if code else ""),
            "",
            "## Part 1: request latency while 64 engines are scraped",
            "",
            "A real Coordinator (no Controller; the table written with `SetInstances`) holds 64 engine "
            "endpoints. Two simulated engines (vLLM protocol, prefill + decode; ttft 5 ms, 1 ms per token, "
            "16 tokens) serve the requests. The other 62 are metrics-only stand-ins "
            "(bench/loadgen/metrics_farm.py, one process listening on 62 ports) under another model name, "
            "so no request is routed to them, but every one is scraped: each answers `/metrics` with what "
            "a vLLM V1 engine exports for one model (every `vllm:*` family of `PrometheusStatLogger` with "
            "vLLM's bucket bounds, the NixlConnector's `vllm:nixl_*`, the API server's `http_*` and "
            f"prometheus_client's `process_*`/`python_*`: {cost.size:,} bytes), its counters and "
            "histograms advancing between scrapes. "
            f"{args.clients} clients in a closed loop (aiohttp, keep-alive) send non-streaming chat "
            f"completions for {args.seconds:g} s per run after {WARMUP_S:g} s of warm-up; {args.runs} runs "
            "per mode, the modes alternating, the Coordinator restarted for each with "
            "`engine_metrics_interval_s` 0 (off), 3 (the default) or 1. With `workers` 1 (the inference "
            "server in the management process, sharing its event loop with the collector: the worst "
            f"case){workers_note}. Target: p50 and p99 with collection on within 2% of off. CPU: the "
            "Coordinator's processes and the farm's, over the run (100% = one core; the machine has "
            f"{os.cpu_count()}, shared with the engines and the clients).",
            "",
            *render_part1(runs),
            "",
            "### What the collector did during the runs",
            "",
            "Rounds: collection rounds that landed in the measured time, as the farm saw them (a round's "
            "62 scrapes arriving together). Fetched within: from the first to the last of a round's 62 "
            "scrapes arriving at the farm (at most 32 at once; a slow event loop stretches it). Fresh: "
            'the Coordinator\'s `motor_coordinator_engine_metrics_endpoints{state="fresh"}` at the end of '
            "each run (64 = every endpoint in the aggregate). Failed scrapes: the Coordinator's "
            "`motor_coordinator_engine_metrics_scrape_failures_total` at the end of each run, summed "
            "(the farm answers every scrape with a whole exposition, so a failure is the collector's; "
            "its log says why, `event=engine_metrics_failed`). CPU not spent on requests: the "
            "Coordinator's CPU over the run minus its requests at the CPU per request it took with "
            "collection off; per round: that over the rounds.",
            "",
            *render_rounds(runs),
            *render_failures(runs),
            "",
            "### Where the collector's time goes",
            "",
            "Measured in the bench process with the Coordinator's own functions "
            "(`motor_mesh.coordinator.engine_metrics`) on the stand-ins' exposition:",
            "",
            *render_cost(cost),
            "",
            *render_gil(gil),
            "",
            "Per run (machine CPU: the whole machine's busy time, 100% per core; of which other users': "
            "what no process of this bench used, other jobs on a shared machine):",
            "",
            *render_runs(runs),
            "",
            "## Part 2: signals for autoscaling",
            "",
            "Collection on (3 s, the default), `workers` 1, the table holding only two simulated engines "
            "with a load-dependent model: prefill 15 ms + 0.1 ms per prompt token not in its prefix cache, "
            f"{PREFILL_SLOTS} slots (`--max-num-seqs`); decode 5 ms KV transfer then 20 ms per token, "
            f"{DECODE_SLOTS} slots. The sim's "
            "`vllm:kv_cache_usage_perc` is running / slots, and a request waits for a free slot (counted in "
            "`vllm:num_requests_waiting`, and in its time to first token). Clients stream chat completions "
            f"({STREAM_TOKENS[0]} to {STREAM_TOKENS[1]} tokens, 16 on average; a 64-token system prompt "
            "shared by all, then a question of their own): "
            f"per step, {STEP_WARMUP_S:g} s of warm-up (more than one collection round) going straight "
            "on into "
            f"{args.step_seconds:g} s measured, sampling `/metrics/engines?type=role` every second. "
            "TTFT: the client's time to the first content token (through the Coordinator: prefill leg, "
            "KV hand-off, decode's first token); TPOT: the mean time between that token and the last. "
            "Signals: the mean and highest of the samples (the values change once per round); tok/s are "
            'the Coordinator\'s `motor:prompt_tokens_per_second{role="prefill"}` and '
            '`motor:generation_tokens_per_second{role="decode"}`, beside what the clients received.',
            "",
            *render_part2(steps),
            "",
        ]
    )


async def amain(args: argparse.Namespace) -> int:
    # SIGTERM (`timeout`, a killed job) unwinds like Ctrl-C: every process started is stopped.
    task = asyncio.current_task()
    if task is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    code, sources = code_version()
    cost = collector_cost()
    print(f"  exposition {cost.size} bytes, parse {cost.parse_ms:.1f} ms", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-engine-metrics-") as d:
        tmp = Path(d)
        runs, gil = await part1(args, tmp)
        steps = await part2(args, tmp)
    after, sources_after = code_version()
    if sources_after != sources:  # another commit alone (docs, tests) changes nothing measured
        code = f"{code}, then {after}: **the code changed during the run**"
    return publish(RESULTS, render(runs, cost, gil, steps, args, code))


main = entry(amain, parse_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
