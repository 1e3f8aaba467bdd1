"""Does kv_aware predict the cache hits the engine then counts? Per request, against a cluster.

``motor up --prefill 2 --decode 1`` (``vllm`` stand-ins, kv_aware, Llama 3's tokenizer on both
sides), one client, requests one after another. After each, three scrapes:

- the Coordinator's ``motor_coordinator_kv_cached_prompt_tokens_total{role="prefill"}`` and
  ``motor_coordinator_kv_prompt_tokens_total{role="prefill"}``: the deltas are the tokens it
  predicted the chosen engine holds, and the prompt's tokens as it counted them (an estimate
  when it stopped encoding a long prompt no engine holds). Scraped over
  the connection the request came by, so answered by the inference worker that routed it (a
  worker publishes its counts before answering a scrape; the others' are older by up to a
  second): :class:`Agreement` counts the connections opened, 1 if so;
- every prefill engine's ``vllm:prefix_cache_hits_total`` and ``..._queries_total``: the hits
  the chosen engine counted, and the prompt's tokens as it counted them (which engine it was:
  the one whose queries moved).

Beside them the client keeps its own replay of the engines' caches: the prompt tokenized as the
Coordinator does (``Tokens``, Llama 3), its block keys added to the chosen engine's set after
each request (the engines' caches hold the whole working set: nothing is evicted), the hit it
expects the leading run of keys that engine already holds. When the engine's count differs from
the replay's too, the ids differ (a tokenization mismatch); when only the Coordinator's does,
its index had not learned the blocks yet (timing) or lost them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.loadgen import kv_workload
from bench.loadgen.kv_real import BLOCK, Cluster, metrics
from motor_mesh.common.tokenizer import HfTokenizer
from motor_mesh.coordinator.kv.prompt import Tokens

CACHED = "motor_coordinator_kv_cached_prompt_tokens_total"
PROMPT = "motor_coordinator_kv_prompt_tokens_total"
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
PREFILL = {"role": "prefill"}
# At least this long between a conversation's answer and its next turn (slept if the order
# brings it sooner): the Coordinator applies a batch of the engine's events as it comes after a
# quiet spell, later ones every 50 ms (subscriber.COALESCE_S).
TURN_GAP_S = 0.2


@dataclass
class Request:
    """One request's counts, in tokens."""

    conv: int
    turn: int
    predicted: int  # the Coordinator: cached on the engine it chose
    actual: int  # the engine: hits it counted
    replayed: int  # the client's replay of the engines' caches
    n_coordinator: int  # prompt tokens as each counted them
    n_engine: int
    n_client: int
    since_turn_s: float  # since this conversation's previous answer (inf: its first request)
    since_last_s: float  # since the previous request's answer (its scrapes in between)


def vllm_rule(tokens: int, n: int) -> int:
    """A hit as vLLM counts one: never the prompt's last token (a prompt cached whole
    recomputes it), so at most the full blocks of ``n - 1`` tokens."""
    return min(tokens, (n - 1) // BLOCK * BLOCK)


@dataclass
class Agreement:
    requests: list[Request] = field(default_factory=list)
    connections: int = 0  # to the Coordinator: 1 if every scrape met the routing worker
    conversations: int = 0
    turns: int = 0
    gap: int = 0

    @property
    def n(self) -> int:
        return len(self.requests)

    def share(self, rule: bool = False) -> float:
        agree = sum(1 for r in self.requests if _pair(r, rule)[0] == _pair(r, rule)[1])
        return agree / self.n

    def split(self) -> tuple[list[Request], list[Request]]:
        """The disagreements: (over-predicted, under-predicted)."""
        over = [r for r in self.requests if r.predicted > r.actual]
        under = [r for r in self.requests if r.predicted < r.actual]
        return over, under

    @property
    def token_mismatches(self) -> int:
        """Requests whose prompt the engine and the client's replay (the Coordinator's code)
        counted differently: a tokenization mismatch."""
        return sum(1 for r in self.requests if r.n_engine != r.n_client)

    @property
    def estimated(self) -> int:
        """Requests whose length the Coordinator counted otherwise than the engine: it stopped
        encoding a long prompt where no engine held the blocks so far, and estimated the rest
        (prompt.py, "a chunk at a time")."""
        return sum(1 for r in self.requests if r.n_coordinator != r.n_engine)

    @property
    def replay_mismatches(self) -> int:
        """Requests whose engine hit differs from the client's replay."""
        return sum(1 for r in self.requests if r.replayed != r.actual)


def _pair(r: Request, rule: bool) -> tuple[int, int]:
    if not rule:
        return r.predicted, r.actual
    return vllm_rule(r.predicted, r.n_engine), vllm_rule(r.actual, r.n_engine)


class _Replay:
    """The client's own model of the prefill engines' caches (block keys, never evicted)."""

    def __init__(self, directory: str, engines: int) -> None:
        self.tokens = Tokens(HfTokenizer(str(Path(directory) / "tokenizer.json")), sim=False)
        self.held: list[set[int]] = [set() for _ in range(engines)]

    def prompt(self, messages: list[dict[str, str]]) -> tuple[int, Sequence[int]]:
        prompt = self.tokens.read({"messages": messages}, True)
        assert prompt is not None
        return prompt.n, prompt.hashes(BLOCK)

    def hit(self, engine: int, n: int, hashes: Sequence[int]) -> int:
        held = self.held[engine]
        run = 0
        for h in hashes:
            if h not in held:
                break
            run += 1
        held.update(hashes)
        return min(run * BLOCK, n)


async def run(workdir: Path, convs: list[kv_workload.Conversation], order: list[int], gap: int) -> Agreement:
    cluster = Cluster(workdir, coordinator={"prefill_policy": "kv_aware"}).start()
    out = Agreement(conversations=len(convs), turns=len(order) // max(1, len(convs)), gap=gap)
    replay = _Replay(cluster.model, cluster.prefill)

    async def opened(*_: object) -> None:
        out.connections += 1

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(opened)
    timeout = aiohttp.ClientTimeout(total=120)
    try:
        await cluster.ready()
        async with (
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1), trace_configs=[trace], timeout=timeout
            ) as coord,
            aiohttp.ClientSession(timeout=timeout) as engines,
        ):
            for conv in convs:
                conv.answers.clear()
            before = await _counts(coord, engines, cluster)
            ended: dict[int, float] = {}
            last = time.perf_counter()
            for c in order:
                conv = convs[c]
                turn = len(conv.answers)
                messages = conv.messages(turn)
                n_client, hashes = replay.prompt(messages)
                wait = ended.get(c, -float("inf")) + TURN_GAP_S - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                started = time.perf_counter()
                since_turn, since_last = started - ended.get(c, -float("inf")), started - last
                _, _, answer = await kv_workload.ask(coord, cluster.url, messages, cluster.model)
                last = ended[c] = time.perf_counter()
                conv.answers.append(answer)
                after = await _counts(coord, engines, cluster)
                moved = [k for k in range(cluster.prefill) if after[2][k] != before[2][k]]
                assert len(moved) == 1, f"one prefill engine per request, not {moved}"
                engine = moved[0]
                out.requests.append(
                    Request(
                        c,
                        turn,
                        predicted=int(after[0] - before[0]),
                        actual=int(sum(after[3]) - sum(before[3])),
                        replayed=replay.hit(engine, n_client, hashes),
                        n_coordinator=int(after[1] - before[1]),
                        n_engine=int(after[2][engine] - before[2][engine]),
                        n_client=n_client,
                        since_turn_s=since_turn,
                        since_last_s=since_last,
                    )
                )
                before = after
    finally:
        cluster.stop()
    return out


async def _counts(
    coord: aiohttp.ClientSession, engines: aiohttp.ClientSession, cluster: Cluster
) -> tuple[float, float, list[float], list[float]]:
    """(Coordinator cached, Coordinator prompt tokens, queries per prefill engine, hits per
    prefill engine)."""
    ours = await metrics(coord, cluster.url, {CACHED: PREFILL, PROMPT: PREFILL})
    theirs = [await metrics(engines, u, {QUERIES: None, HITS: None}) for u in cluster.prefill_urls]
    return ours[CACHED], ours[PROMPT], [e[QUERIES] for e in theirs], [e[HITS] for e in theirs]
