"""KV-aware routing against the load policies, on a shared-prefix workload.

`motor up --prefill 2 --decode 1` with simulated engines whose prefill costs
``PREFILL_MS_PER_TOKEN`` per prompt token not already in their prefix cache, and whose caches
(``num_gpu_blocks_override``) hold about half of the working set each: 8 system prompts of 1,000
words, 32 conversations of 4 turns (bench/loadgen/kv_workload.py), turns interleaved at random.
Each policy gets a fresh cluster (cold caches) and the same requests; time to first token is
read from the streamed answers, the cache hit ratio from the prefill engines' own
``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``.

Then the cost of routing itself, on engines that cost nothing (no prefill time, no decode time),
one prefill and one decode (so both policies send each leg where the direct legs go): the same
requests through the Coordinator with ``kv_aware`` and ``least_load``, against the same
two legs sent straight to the engines by this client; the difference is the Coordinator's
overhead per request, beside the Coordinator's own CPU time per request. Once with caches
holding the working set, once with the churning ones of the TTFT runs (the event rate's worst
case); least_load twice, the second time as a control for what the measurement can tell apart.
Last, where the index lives (bench/loadgen/kv_index_cost.py).

Targets: mean TTFT with ``kv_aware`` at least 2x lower than with ``least_load``; routing overhead
at one client within 10% of ``least_load``'s.

    python -m bench kv_routing
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import kv_index_cost, kv_workload
from bench.loadgen.harness import cpu_ns, machine, percentile, publish, session_pids
from bench.loadgen.up import Up

RESULTS = Path(__file__).parent / "results" / "kv_routing.md"
POLICIES = ("kv_aware", "least_load", "round_robin")
ENGINE = 10000
PREFILL_MS_PER_TOKEN = 0.2
BLOCK = 16
CAPACITY_BLOCKS = 512  # each prefill engine: about half of the workload's ~1,000 distinct blocks
SPEEDUP_TARGET = 2.0
OVERHEAD_TARGET = 1.10
# Round medians of one configuration spread over 2x: 32 rounds left the ratio's 95% interval
# ±0.1x wide, as wide as the target's margin.
OVERHEAD_ROUNDS = 64
# The overhead runs' caches: one holding the whole working set (after the warm-up an engine
# publishes only the blocks of each new question), and the TTFT runs' half-size one, which
# churns: with engines that compute in no time, every request evicts and stores again most of its
# prompt, an event rate no real engine reaches (a real prefill of 1,000 tokens takes milliseconds).
OVERHEAD_CACHES = {"holding the working set": 65536, "churning, half the working set": CAPACITY_BLOCKS}
# Row -> policy. The control is least_load measured again, in rounds of its own: how far apart
# two identical configurations come out is what this measurement cannot tell apart.
CONTROL = "least_load, again"
OVERHEAD_ROWS = {"kv_aware": "kv_aware", "least_load": "least_load", CONTROL: "least_load"}
OVERHEAD_SEED = 16
# How far the ratio of medians could move with other rounds: the rounds of each row resampled
# (a cluster's round is the unit that varies most: its medians spread over 2x), RESAMPLES times.
RESAMPLES = 1000


@dataclass
class Run:
    policy: str
    clients: int
    ttft: list[float]
    hits: float
    queries: float
    seconds: float
    events: float

    @property
    def mean(self) -> float:
        return statistics.fmean(self.ttft)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def _config(tmp: Path, policy: str, costly: bool, capacity: int = CAPACITY_BLOCKS) -> Path:
    args: dict[str, object] = {"block_size": BLOCK, "num_gpu_blocks_override": capacity}
    if costly:
        args["prefill_ms_per_token"] = PREFILL_MS_PER_TOKEN
    path = tmp / f"{policy}-{'costly' if costly else 'free'}.json"
    path.write_text(json.dumps({"coordinator": {"prefill_policy": policy}, "engine": {"args": args}}))
    return path


async def _metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def _serving(up: Up, policy: str, prefills: int = 2) -> None:
    """Until the Coordinator follows every prefill engine's events (kv_aware) or at once."""
    if policy != "kv_aware":
        return
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            if await _metric(s, up.url, "motor_coordinator_kv_subscriptions") >= prefills:
                return
            await asyncio.sleep(0.1)
    raise RuntimeError("the Coordinator never subscribed to the engines' KV events")


def _engine_url(up: Up, k: int) -> str:
    return f"http://127.0.0.1:{ENGINE + 2 * k + up.offset}"


async def one_run(policy: str, clients: int) -> Run:
    convs, order = kv_workload.build(kv_workload.Shape())
    with tempfile.TemporaryDirectory() as tmp:
        up = Up(
            ["--prefill", "2", "--decode", "1", "--config", str(_config(Path(tmp), policy, True))], Path(tmp)
        )
        try:
            await _serving(up, policy)
            t0 = time.perf_counter()
            results = await kv_workload.run(up.url, convs, order, clients)
            seconds = time.perf_counter() - t0
            async with aiohttp.ClientSession() as s:
                hits = queries = 0.0
                for k in (0, 1):
                    hits += await _metric(s, _engine_url(up, k), "vllm:prefix_cache_hits_total")
                    queries += await _metric(s, _engine_url(up, k), "vllm:prefix_cache_queries_total")
                events = await _metric(s, up.url, "motor_coordinator_kv_events_total")
        finally:
            up.stop()
    return Run(policy, clients, [r[0] for r in results], hits, queries, seconds, events)


async def _direct(
    session: aiohttp.ClientSession, prefill: str, decode: str, messages: list[dict[str, str]]
) -> float:
    """The two legs Motor sends for a vLLM-style PD request, sent straight to the engines."""
    started = time.perf_counter()
    kv = {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }  # fmt: skip
    body = {"model": "motor-sim", "messages": messages, "max_tokens": 1, "kv_transfer_params": kv}
    async with session.post(f"{prefill}/v1/chat/completions", json=body) as resp:
        answer = await resp.json()
    body = {
        "model": "motor-sim", "messages": messages, "max_tokens": 16, "stream": True,
        "kv_transfer_params": answer.get("kv_transfer_params"),
    }  # fmt: skip
    async with session.post(f"{decode}/v1/chat/completions", json=body) as resp:
        async for _ in resp.content:
            pass
    return time.perf_counter() - started


@dataclass
class Overhead:
    """One round of one policy: per request, seconds through the Coordinator less the direct
    legs; and the Coordinator's CPU per request, its inference workers' and its management
    process's."""

    diffs: list[float]
    worker_cpu_s: float
    management_cpu_s: float


async def overhead_run(policy: str, capacity: int) -> Overhead:
    """Per request, seconds through the Coordinator less the same two legs sent straight to the
    engines (zero-cost engines, one client): each request goes both ways back to back, in
    alternating order, so drift of the machine cancels out. (The Coordinator's own duration
    metrics cannot say it: they read the event loop's clock, which stands still within one
    iteration of the loop, where tokenizing and choosing happen.)"""
    convs, order = kv_workload.build(kv_workload.Shape())
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(Path(tmp), policy, False, capacity)
        # One prefill: both policies must send it there, as the direct legs do, so the
        # difference is the Coordinator's work alone (kv_aware still tokenizes, hashes, matches).
        up = Up(["--prefill", "1", "--decode", "1", "--config", str(cfg)], Path(tmp))
        try:
            await _serving(up, policy, prefills=1)
            workers = await asyncio.to_thread(session_pids, up.pid, "motor_mesh.coordinator.worker")
            management = await asyncio.to_thread(session_pids, up.pid, "motor_mesh.cli coordinator")
            diffs = []
            async with aiohttp.ClientSession() as s:
                # Every answer known and every connection warm; over the measuring session's
                # own connection, so the worker that routes the measured requests has read
                # their conversations, as a chat client's connection brings each turn to the
                # worker that read the turns before. Twice: a worker routes by load until its
                # tokenizer is loaded, just after it starts.
                for _ in range(2):
                    await kv_workload.run(up.url, convs, order, session=s)
                cpu0 = await asyncio.to_thread(_cpu, workers, management)
                seen: dict[int, int] = {}
                for i, c in enumerate(order):
                    messages = convs[c].messages(seen.get(c, 0))
                    seen[c] = seen.get(c, 0) + 1
                    # A question not asked before, as in a live conversation: the warm-up sent
                    # the history through the Coordinator, but not this last message.
                    question = f"{messages[-1]['content']} (asked again, {i})"
                    messages[-1] = {"role": "user", "content": question}
                    if i % 2:
                        via = (await kv_workload.ask(s, up.url, messages))[1]
                        direct = await _direct(s, _engine_url(up, 0), _engine_url(up, 1), messages)
                    else:
                        direct = await _direct(s, _engine_url(up, 0), _engine_url(up, 1), messages)
                        via = (await kv_workload.ask(s, up.url, messages))[1]
                    diffs.append(via - direct)
            cpu1 = await asyncio.to_thread(_cpu, workers, management)
        finally:
            up.stop()
    n = len(order)
    return Overhead(diffs, (cpu1[0] - cpu0[0]) / 1e9 / n, (cpu1[1] - cpu0[1]) / 1e9 / n)


def _cpu(workers: list[int], management: list[int]) -> tuple[int, int]:
    return sum(map(cpu_ns, workers)), sum(map(cpu_ns, management))


def _ttft_table(runs: list[Run]) -> list[str]:
    lines = [
        "| policy | clients | mean TTFT | p50 | p90 | max | prefix cache hit ratio | vs least_load (mean) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = {r.clients: r.mean for r in runs if r.policy == "least_load"}
    for r in runs:
        s = sorted(r.ttft)
        ratio = base[r.clients] / r.mean if r.mean else float("nan")
        lines.append(
            f"| {r.policy} | {r.clients} | {r.mean * 1e3:.1f} ms | {percentile(s, 50) * 1e3:.1f} ms "
            f"| {percentile(s, 90) * 1e3:.1f} ms | {s[-1] * 1e3:.1f} ms | {r.hit_ratio:.1%} "
            f"| {ratio:.2f}x lower |"
        )
    return lines


Overheads = dict[str, dict[str, list[Overhead]]]  # cache -> policy -> rounds


async def amain() -> int:
    runs = [await one_run(policy, clients) for clients in (1, 4) for policy in POLICIES]
    overheads: Overheads = {cache: {row: [] for row in OVERHEAD_ROWS} for cache in OVERHEAD_CACHES}
    # Each round runs every (cache, row) once, in an order of its own: a configuration that
    # always came right after another's cluster stopped would take whatever that left behind.
    shuffle = random.Random(OVERHEAD_SEED).shuffle
    for _ in range(OVERHEAD_ROUNDS):
        order = [(cache, row) for cache in OVERHEAD_CACHES for row in OVERHEAD_ROWS]
        shuffle(order)
        for cache, row in order:
            overheads[cache][row].append(await overhead_run(OVERHEAD_ROWS[row], OVERHEAD_CACHES[cache]))
    costs = await asyncio.to_thread(kv_index_cost.measure)
    return publish(RESULTS, report(runs, overheads, costs))


def _verdict_on_placement(c: kv_index_cost.Costs) -> str:
    trip, shared = statistics.median(c.round_trip_us), statistics.median(c.shared_us)
    cold = statistics.median(c.shared_cold_us)
    verdict = (
        f"The round trip alone ({trip:.0f} µs) costs more than the whole decision against the "
        f"shared index ({shared:.0f} µs; {cold:.0f} µs with cold caches), on every request"
        if trip > shared
        else f"Here the round trip ({trip:.0f} µs) costs less than the decision against the shared "
        f"index ({shared:.0f} µs)"
    )
    return (
        f"{verdict}. The shared index costs the workers nothing per event, where an index per worker "
        f"would cost each of them {c.ingest_us:.0f} µs per batch, on their requests' critical path."
    )


def _overhead_section(cache: str, rounds: dict[str, list[Overhead]]) -> tuple[list[str], float]:
    pooled = {row: sorted(x for r in rs for x in r.diffs) for row, rs in rounds.items()}
    median = {row: statistics.median(v) for row, v in pooled.items()}
    kv_o, ll_o = median["kv_aware"], median["least_load"]
    ratio = kv_o / ll_o if ll_o > 0 else float("nan")
    control = median[CONTROL] / ll_o if ll_o > 0 else float("nan")
    worst = max(statistics.median(r.diffs) for r in rounds["kv_aware"])
    low, high = _ratio_interval(rounds["kv_aware"], rounds["least_load"])
    cpu = {
        row: (
            statistics.median(r.worker_cpu_s for r in rs),
            statistics.median(r.management_cpu_s for r in rs),
        )
        for row, rs in rounds.items()
    }
    lines = [
        f"Cache {cache}: {OVERHEAD_CACHES[cache]} blocks per engine.",
        "",
        "| policy | median | p90 | max | median of each round | CPU per request: workers, management |",
        "|---|---|---|---|---|---|",
        *(
            f"| {row} | {median[row] * 1e6:.0f} µs | {percentile(v, 90) * 1e6:.0f} µs "
            f"| {v[-1] * 1e6:.0f} µs | {_round_medians(rounds[row])} µs "
            f"| {cpu[row][0] * 1e6:.0f} µs, {cpu[row][1] * 1e6:.0f} µs |"
            for row, v in pooled.items()
        ),
        "",
        f"kv_aware against least_load: **{ratio:.2f}x** ({kv_o * 1e6:.0f} µs against {ll_o * 1e6:.0f} µs, "
        f"{(kv_o - ll_o) * 1e6:+.0f} µs; worst kv_aware round median {worst * 1e6:.0f} µs; with the rounds "
        f"resampled, 95% of ratios fall in {low:.2f}x to {high:.2f}x); the control "
        f"against least_load: {control:.2f}x ({(median[CONTROL] - ll_o) * 1e6:+.0f} µs). The workers' CPU "
        f"per request: {cpu['kv_aware'][0] * 1e6:.0f} µs with kv_aware, {cpu['least_load'][0] * 1e6:.0f} "
        f"and {cpu[CONTROL][0] * 1e6:.0f} µs with least_load.",
        "",
    ]
    return lines, ratio


def _ratio_interval(kv: list[Overhead], ll: list[Overhead]) -> tuple[float, float]:
    """The 95% interval of kv_aware's pooled median over least_load's, rounds resampled."""
    rnd = random.Random(OVERHEAD_SEED)
    ratios = []
    for _ in range(RESAMPLES):
        a = statistics.median(x for r in rnd.choices(kv, k=len(kv)) for x in r.diffs)
        b = statistics.median(x for r in rnd.choices(ll, k=len(ll)) for x in r.diffs)
        ratios.append(a / b if b > 0 else float("nan"))
    ratios.sort()
    return ratios[int(0.025 * RESAMPLES)], ratios[int(0.975 * RESAMPLES) - 1]


def _round_medians(rounds: list[Overhead]) -> str:
    return ", ".join(f"{statistics.median(r.diffs) * 1e6:.0f}" for r in rounds)


def report(runs: list[Run], overheads: Overheads, costs: kv_index_cost.Costs) -> str:
    one = {r.policy: r for r in runs if r.clients == 1}
    speedup = one["least_load"].mean / one["kv_aware"].mean
    kv_run = one["kv_aware"]
    many = {r.policy: r for r in runs if r.clients == 4}
    four = many["least_load"].mean / many["kv_aware"].mean
    sections = [_overhead_section(cache, rounds) for cache, rounds in overheads.items()]
    ratios = [ratio for _, ratio in sections]
    met = all(r <= OVERHEAD_TARGET for r in ratios)
    lines = [
        "# KV-aware routing",
        "",
        f"Generated by `python -m bench kv_routing` ({machine()}).",
        "",
        "`motor up --prefill 2 --decode 1`, simulated engines: prefill "
        f"{PREFILL_MS_PER_TOKEN} ms per uncached prompt token, block size {BLOCK}, "
        f"{CAPACITY_BLOCKS} blocks of cache per engine (about half of the working set). Workload: "
        "8 system prompts of 1,000 words, 32 conversations of 4 turns each resending their history "
        "(128 streamed chat requests), turns interleaved at random; a fresh cluster per row.",
        "",
        "## Time to first token",
        "",
        *_ttft_table(runs),
        "",
        f"Target: mean TTFT with kv_aware at least {SPEEDUP_TARGET:g}x lower than least_load at one "
        f"client: **{speedup:.2f}x**, {'met' if speedup >= SPEEDUP_TARGET else '**missed**'}. At 4 clients "
        f"the gain is {four:.2f}x (with requests in flight the load term sends some of them to an "
        "engine without their prefix; these simulated engines never queue, so there it only costs).",
        "",
        "## Routing overhead",
        "",
        "`motor up --prefill 1 --decode 1` (one prefill, so both policies send each leg where the "
        "direct legs go; the Coordinator has two inference workers), engines that compute in no "
        "time, one client, the same 128 requests, each sent through the Coordinator and as the same "
        "two legs straight to the engines by the same client, back to back in alternating order; "
        "the overhead is the difference per request. Each request's last question is new; a "
        "warm-up sent the rest of its conversation first, over the same connection (so to the "
        "same inference worker: each remembers the chats it has read, as a chat client's "
        "connection brings a conversation's turns to one worker). "
        f"{OVERHEAD_ROUNDS} rounds of 128 per policy and cache, a fresh cluster each, every "
        "round running each policy and cache once in a shuffled order; the control row "
        f"({CONTROL}) is least_load once more, in rounds of its own, "
        "for the spread between two identical configurations. The CPU columns are the median "
        "over rounds of the Coordinator's processes' "
        "own CPU time (the kernel's count) per request: its inference workers', and its "
        "management process's, which follows the engine's events, those of the direct legs' "
        "prefills included.",
        "",
        *(line for section, _ in sections for line in section),
        f"Target: kv_aware's overhead within {OVERHEAD_TARGET - 1:.0%} of least_load's (medians): "
        f"{' and '.join(f'{r:.2f}x' for r in ratios)}, {'met' if met else '**missed**'}. "
        "kv_aware's own work per request (read the chat, hash its new blocks, find the endpoint "
        f"holding the longest prefix) takes {statistics.median(costs.shared_us):.0f} µs in a tight "
        f"loop and {statistics.median(costs.shared_cold_us):.0f} µs once the other processes of a "
        "busy machine have evicted the CPU caches, as they do between two requests here (below; "
        f"{statistics.median(costs.shared_python_us):.0f} µs with warm caches in the Python the C "
        "extension replaces); least_load's choice is a few list items.",
        "",
        "## Where the index lives",
        "",
        "The management process follows the events, once, and keeps the index; the workers read "
        "which blocks each endpoint holds from tables it maps into memory they share. The "
        "alternatives: an index per worker, each fed by its own subscriptions, or one index asked "
        f"on every request. Measured in process (an index of {kv_index_cost.ENDPOINTS} endpoints x "
        "100,000 blocks):",
        "",
        *kv_index_cost.summary(costs),
        f"- The kv_aware TTFT run above received {kv_run.events:.0f} events in {kv_run.seconds:.1f} s "
        f"({kv_run.events / kv_run.seconds:.0f}/s).",
        "",
        _verdict_on_placement(costs),
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    return asyncio.run(amain())


if __name__ == "__main__":
    raise SystemExit(main())
