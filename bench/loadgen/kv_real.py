"""KV-aware routing with a real tokenizer: the clusters and workloads of bench/bench_kv_routing.py.

Every cluster serves Llama 3's tokenizer as its model (``--model .tokenizers/llama3``, a
directory with ``tokenizer.json`` and ``tokenizer_config.json``; ``make tokenizers`` fetches it):
the simulated engines render the chat template and encode as vLLM does, the Coordinator
tokenizes each request the same way (services/coordinator/kv/prompt.py). ``--engine-type vllm``
runs the stand-in ``vllm`` of :mod:`.vllm_standin`, so the Coordinator treats the engines as
real ones.

The workloads are English-like text sized in Llama 3 tokens (:mod:`.kv_workload`): chats on
long shared system prompts, and single long prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import kv_workload, vllm_standin
from bench.loadgen.harness import cpu_ns, percentile, session_pids
from bench.loadgen.up import Up
from motor_mesh.common.tokenizer import HfTokenizer
from tests.tokenizers import llama3_path

ENGINE = 10000  # engine k serves on ENGINE + 2k (+ the offset): prefills first, then decodes
BLOCK = 16
# Engines that compute in no time: every latency of the simulated engine's model at zero (its
# defaults, said explicitly so a change of default does not change the bench).
FREE = {"ttft_ms": 0, "prefill_ms_per_token": 0, "tpot_ms": 0, "kv_transfer_ms": 0}
# The Coordinator's processes publish their counts once a second (and the one answering a
# scrape, its own first): a scrape this long after the last request has every process's.
SETTLE_S = 1.3
Labels = dict[str, str]


def model_dir() -> str:
    """The Llama 3 tokenizer's directory; the bench cannot run without it."""
    path = llama3_path()
    if path is None:
        raise SystemExit("no Llama 3 tokenizer in .tokenizers/llama3: run `make tokenizers` first")
    return path


class Counter:
    """Tokens of a text as the engine counts them (Llama 3, no special tokens): what the
    workloads are sized by."""

    def __init__(self, directory: str) -> None:
        self.tok = HfTokenizer(str(Path(directory) / "tokenizer.json"))

    def __call__(self, text: str) -> int:
        return len(self.tok.encode(text, special=False))

    def chat(self, messages: list[dict[str, str]]) -> int:
        """A chat's prompt tokens, its template rendered."""
        text = self.tok.chat_text(messages)
        assert text is not None
        return self(text)


@dataclass
class Cluster:
    """``motor up`` with Llama 3 as the model; :meth:`start` waits until kv_aware can route by
    cache (the Coordinator follows every prefill engine's events, every inference worker has
    loaded the tokenizer)."""

    workdir: Path
    prefill: int = 2
    decode: int = 1
    engine_type: str = "vllm"
    coordinator: dict[str, Any] = field(default_factory=dict)
    engine_args: dict[str, Any] = field(default_factory=lambda: dict(FREE))
    up: Up | None = None

    @property
    def model(self) -> str:
        return model_dir()

    def start(self) -> Cluster:
        cfg = self.workdir / "config.json"
        cfg.write_text(json.dumps({"coordinator": self.coordinator, "engine": {"args": self.engine_args}}))
        args = ["--prefill", str(self.prefill), "--decode", str(self.decode)]
        args += ["--engine-type", self.engine_type, "--model", self.model, "--config", str(cfg)]
        env = (
            vllm_standin.env(self.workdir / "bin") if self.engine_type == "vllm" else {"HF_HUB_OFFLINE": "1"}
        )
        self.up = Up(args, self.workdir, env=env)
        return self

    @property
    def kv_aware(self) -> bool:
        return "kv_aware" in (self.coordinator.get("prefill_policy"), self.coordinator.get("decode_policy"))

    async def ready(self) -> None:
        if not self.kv_aware:
            return
        up = self._up
        workers = await asyncio.to_thread(session_pids, up.pid, "motor_mesh.coordinator.worker")
        async with aiohttp.ClientSession() as s:
            for _ in range(600):
                subscribed = await metric(s, up.url, "motor_coordinator_kv_subscriptions")
                loaded = up.log.read_text(errors="replace").count("event=kv_tokenizer ")
                if subscribed >= self.prefill and loaded >= max(1, len(workers)):
                    return
                await asyncio.sleep(0.1)
        raise RuntimeError(f"kv_aware never ready (subscriptions, tokenizers); see {up.log}")

    @property
    def _up(self) -> Up:
        assert self.up is not None, "start() first"
        return self.up

    @property
    def url(self) -> str:
        return self._up.url

    def engine_url(self, k: int) -> str:
        return f"http://127.0.0.1:{ENGINE + 2 * k + self._up.offset}"

    @property
    def prefill_urls(self) -> list[str]:
        return [self.engine_url(k) for k in range(self.prefill)]

    def stop(self) -> None:
        if self.up is not None:
            self.up.stop()


async def metric(session: aiohttp.ClientSession, url: str, name: str, labels: Labels | None = None) -> float:
    """The sum of ``name``'s samples (with ``labels``) at ``url``/metrics."""
    return (await metrics(session, url, {name: labels}))[name]


async def metrics(
    session: aiohttp.ClientSession, url: str, wanted: dict[str, Labels | None]
) -> dict[str, float]:
    """Several sums from one scrape: name -> the sum of its samples with the labels given."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                labels = wanted[s.name] or {}
                if all(s.labels.get(k) == v for k, v in labels.items()):
                    out[s.name] += s.value
    return out


async def engines_sum(session: aiohttp.ClientSession, urls: Iterable[str], name: str) -> float:
    return sum([await metric(session, u, name) for u in urls])


async def warm(session: aiohttp.ClientSession, url: str, model: str, n: int = 3) -> None:
    """A few short requests of no workload: connections opened, every lazy import done."""
    for i in range(n):
        await kv_workload.ask(session, url, [{"role": "user", "content": f"Warm up {i}, please."}], model)


# -- what a row reports ---------------------------------------------------------------------


@dataclass
class Times:
    """Per-request seconds of one row, pooled over its rounds (``rounds``: each round's own)."""

    rounds: list[list[float]] = field(default_factory=list)
    # CPU seconds per request of each round: the Coordinator's processes', the engines'
    coordinator_cpu: list[float] = field(default_factory=list)
    engines_cpu: list[float] = field(default_factory=list)

    def add(self, values: list[float]) -> None:
        self.rounds.append(values)

    @property
    def all(self) -> list[float]:
        return sorted(x for r in self.rounds for x in r)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.all)

    def pct(self, q: float) -> float:
        return percentile(self.all, q)

    @property
    def n(self) -> int:
        return sum(map(len, self.rounds))


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


# -- 1. router cost: zero-cost engines, one client ---------------------------------------------


@dataclass(frozen=True)
class CostLoad:
    """The router-cost workloads: chats (a) and single long prompts (b)."""

    convs: list[kv_workload.Conversation]
    order: list[int]
    singles: list[list[dict[str, str]]]


@dataclass
class CostRound:
    """One workload of one round: each request's seconds, and CPU seconds per request of the
    Coordinator's processes (its inference workers and management process) and of the engines."""

    times: list[float]
    coordinator_cpu_s: float
    engines_cpu_s: float


class _Cpu:
    """CPU time so far of a cluster's Coordinator processes and of its engines (the kernel's
    count per thread, exact)."""

    def __init__(self, cluster: Cluster) -> None:
        tree = descendants(cluster._up.pid)
        roles = ("motor_mesh.cli coordinator ", "motor_mesh.coordinator.worker ")
        self.coordinator = [p for p, argv in tree.items() if any(r in argv for r in roles)]
        self.engines = [p for p, argv in tree.items() if "motor_mesh.cli engine-sim " in argv]
        if not self.coordinator or not self.engines:
            raise RuntimeError("the Coordinator's or the engines' processes not found")

    def now(self) -> tuple[int, int]:
        return sum(map(cpu_ns, self.coordinator)), sum(map(cpu_ns, self.engines))


def descendants(root: int) -> dict[int, str]:
    """Every process under ``root`` (the engines run in sessions of their own, under their
    NodeManagers): pid -> its command line."""
    parents: dict[int, int] = {}
    argv: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(entry.path, "stat").read_text()
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
            argv[int(entry.name)] = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode()
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                found[child] = argv.get(child, "")
                frontier.append(child)
    return found


async def router_cost_round(workdir: Path, policy: str, load: CostLoad) -> dict[str, CostRound]:
    """One round of one policy on a fresh cluster (2 prefill, 1 decode, zero-cost engines,
    ``vllm`` stand-ins): each request's whole time through the Coordinator (streamed to its
    end, 16 tokens), one client, requests one after another, over one connection (so one
    inference worker, which remembers the chats it has read); and the CPU the Coordinator and
    the engines spent per request."""
    cluster = Cluster(workdir, coordinator={"prefill_policy": policy}).start()
    out: dict[str, CostRound] = {}
    try:
        await cluster.ready()
        cpu = await asyncio.to_thread(_Cpu, cluster)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            await warm(s, cluster.url, cluster.model)
            before = cpu.now()
            chats = await kv_workload.run(cluster.url, load.convs, load.order, session=s, model=cluster.model)
            out["chats"] = _round([total for _, total in chats], before, cpu.now())
            before = cpu.now()
            singles = []
            for messages in load.singles:
                singles.append((await kv_workload.ask(s, cluster.url, messages, cluster.model))[1])
            out["singles"] = _round(singles, before, cpu.now())
    finally:
        cluster.stop()
    return out


def _round(times: list[float], before: tuple[int, int], after: tuple[int, int]) -> CostRound:
    n = len(times)
    return CostRound(times, (after[0] - before[0]) / 1e9 / n, (after[1] - before[1]) / 1e9 / n)


# -- 3. TTFT: costly prefill, caches holding half the working set --------------------------------


@dataclass
class TtftRun:
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


async def ttft_run(
    workdir: Path,
    policy: str,
    clients: int,
    convs: list[kv_workload.Conversation],
    order: list[int],
    engine_args: dict[str, Any],
) -> TtftRun:
    """One policy at ``clients`` on a fresh cluster of simulated engines (cold caches)."""
    cluster = Cluster(
        workdir, engine_type="sim", coordinator={"prefill_policy": policy}, engine_args=engine_args
    )
    cluster.start()
    try:
        await cluster.ready()
        t0 = time.perf_counter()
        results = await kv_workload.run(cluster.url, convs, order, clients, model=cluster.model)
        seconds = time.perf_counter() - t0
        await asyncio.sleep(SETTLE_S)
        async with aiohttp.ClientSession() as s:
            hits = await engines_sum(s, cluster.prefill_urls, "vllm:prefix_cache_hits_total")
            queries = await engines_sum(s, cluster.prefill_urls, "vllm:prefix_cache_queries_total")
            events = await metric(s, cluster.url, "motor_coordinator_kv_events_total")
    finally:
        cluster.stop()
    return TtftRun(policy, clients, [r[0] for r in results], hits, queries, seconds, events)


def working_set_blocks(
    convs: list[kv_workload.Conversation], count: Callable[[str], int], answer: int
) -> int:
    """Distinct blocks of a chat workload, about: its system prompts, and every conversation's
    questions and (``answer`` tokens each) answers."""
    systems = {c.system for c in convs}
    tokens = sum(map(count, systems))
    tokens += sum(count(q) + answer for c in convs for q in c.questions)
    return tokens // BLOCK
