"""KV-aware routing with a real tokenizer (Llama 3's), against the load policies.

Every cluster serves Llama 3's tokenizer as its model (``.tokenizers/llama3``; ``make
tokenizers`` fetches it): the simulated engines render the chat template and encode as vLLM
does, and the Coordinator's kv_aware tokenizes every request the same way, in Python (the
tokenizers library), a chat encoded incrementally (services/coordinator/kv/prompt.py). Texts are
English-like sentences from a fixed word list, sized in Llama 3 tokens
(bench/loadgen/kv_workload.py). Sections (bench/loadgen/kv_real.py and the modules named):

1. Router cost: ``motor up --prefill 2 --decode 1 --engine-type vllm`` with a stand-in ``vllm``
   that runs the simulated engine (bench/loadgen/vllm_standin.py), engines that compute in no
   time; one client, sequential requests, each request's whole time through the Coordinator
   (and the CPU the Coordinator and the engines spent per request), kv_aware against
   least_load, fresh clusters in interleaved rounds. Chats of 10 turns on
   ~4,000-token system prompts; single ~8,000-token prompts. Target: kv_aware within 1.10x of
   least_load, mean and p99.
2. The event loop's longest stall on kv_aware's request path, in process (kv_stall.py), less
   the time the loop's thread waited for a CPU. Target: none over 1 ms.
3. Time to first token with costly prefill and caches of half the working set (the simulated
   engine, Llama 3's tokenizer), 1 and 4 clients. Target: mean TTFT with kv_aware at least 2x
   lower than least_load at one client.
4. Agreement between the tokens kv_aware predicts cached and the hits the chosen engine counts,
   per request (kv_agreement.py). Target: 99% of requests.
5. Short prompts straight to decode (``coordinator.pd_min_prompt_tokens``) against through the
   prefill leg, at a fixed request rate (kv_short.py). Target: TTFT p50 at least 20% lower at
   equal throughput.

Then where the index lives (bench/loadgen/kv_index_cost.py). ``MOTOR_BENCH_QUICK=1`` shrinks
every size (a check that it all runs; its numbers mean nothing).

    python -m bench kv_routing
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from bench.loadgen import kv_agreement, kv_index_cost, kv_real, kv_short, kv_stall, kv_workload
from bench.loadgen.harness import machine, percentile, publish
from bench.loadgen.kv_real import BLOCK, Times, TtftRun, ms

T = TypeVar("T")
RESULTS = Path(__file__).parent / "results" / "kv_routing.md"
QUICK = os.environ.get("MOTOR_BENCH_QUICK", "") not in ("", "0")

COST_TARGET = 1.10
STALL_TARGET_S = 0.001
SPEEDUP_TARGET = 2.0
AGREEMENT_TARGET = 0.99
SHORT_TARGET = 0.20
PREFILL_MS_PER_TOKEN = 0.2
SHORT_THRESHOLD = 2048  # pd_min_prompt_tokens above every short length
TTFT_POLICIES = ("kv_aware", "least_load", "round_robin")


@dataclass(frozen=True)
class Sizes:
    """Every size of the bench (:data:`FULL`, or :data:`SMALL` under MOTOR_BENCH_QUICK)."""

    cost_rounds: int  # per policy
    cost_chats: kv_workload.ProseShape
    cost_singles: int
    single_tokens: int
    ttft_chats: kv_workload.ProseShape
    ttft_clients: tuple[int, ...]
    agree_chats: kv_workload.ProseShape
    agree_gap: int
    short_lengths: tuple[int, ...]
    short_requests: int  # per length and round
    short_rounds: int  # per threshold
    short_rate: float  # requests per second


FULL = Sizes(
    cost_rounds=6,
    cost_chats=kv_workload.ProseShape(systems=2, system_tokens=4000, conversations=8, turns=10),
    cost_singles=40,
    single_tokens=8000,
    ttft_chats=kv_workload.ProseShape(systems=8, system_tokens=2000, conversations=32, turns=4),
    ttft_clients=(1, 4),
    agree_chats=kv_workload.ProseShape(
        systems=10, system_tokens=1000, conversations=100, turns=10, question_tokens=30
    ),
    agree_gap=10,
    short_lengths=(64, 256, 1024),
    short_requests=150,
    short_rounds=2,
    short_rate=20.0,
)
SMALL = Sizes(
    cost_rounds=1,
    cost_chats=kv_workload.ProseShape(systems=1, system_tokens=4000, conversations=2, turns=3),
    cost_singles=3,
    single_tokens=8000,
    ttft_chats=kv_workload.ProseShape(systems=2, system_tokens=2000, conversations=4, turns=2),
    ttft_clients=(1,),
    agree_chats=kv_workload.ProseShape(
        systems=2, system_tokens=1000, conversations=6, turns=3, question_tokens=30
    ),
    agree_gap=2,
    short_lengths=(64, 1024),
    short_requests=10,
    short_rounds=1,
    short_rate=20.0,
)


def log(what: str) -> None:
    print(f"[kv_routing {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


async def timed(name: str, seconds: dict[str, float], run: Callable[[], Awaitable[T]]) -> T:
    """``run()``, its wall time kept under ``name``."""
    log(f"{name} ...")
    t0 = time.perf_counter()
    out = await run()
    seconds[name] = time.perf_counter() - t0
    log(f"{name}: {seconds[name]:.0f} s")
    return out


async def in_tmp(run: Callable[[Path], Awaitable[T]]) -> T:
    with tempfile.TemporaryDirectory(prefix="kv_routing-") as tmp:
        return await run(Path(tmp))


# -- 1. router cost ------------------------------------------------------------------------------


Cost = dict[str, dict[str, Times]]  # workload -> policy -> times


async def router_cost(sizes: Sizes, load: kv_real.CostLoad) -> Cost:
    """Fresh clusters, the policies in alternating order round after round."""
    out: Cost = {w: {p: Times() for p in ("kv_aware", "least_load")} for w in ("chats", "singles")}
    for r in range(sizes.cost_rounds):
        for policy in ("kv_aware", "least_load") if r % 2 == 0 else ("least_load", "kv_aware"):
            got = await in_tmp(lambda tmp, p=policy: kv_real.router_cost_round(tmp, p, load))  # type: ignore[misc]
            for workload, one in got.items():
                row = out[workload][policy]
                row.add(one.times)
                row.coordinator_cpu.append(one.coordinator_cpu_s)
                row.engines_cpu.append(one.engines_cpu_s)
    return out


WORKLOADS = {"chats": "(a) chats", "singles": "(b) single long prompts"}


def cost_section(cost: Cost, sizes: Sizes, tokens: dict[str, list[int]]) -> list[str]:
    shape = sizes.cost_chats
    lines = [
        "## Router cost on the real tokenizer path",
        "",
        "`motor up --prefill 2 --decode 1 --engine-type vllm --model .tokenizers/llama3`, where "
        "`vllm` is a stand-in that runs the simulated engine with the flags the NodeManager gives "
        "vLLM (bench/loadgen/vllm_standin.py), so the Coordinator treats the engines as real ones; "
        "engines that compute in no time (no TTFT, prefill, per-token or KV transfer time). One "
        "client, one request at a time over one connection (so one inference worker, which "
        "remembers the chats it has read), each streamed to its end (16 tokens); the time is the "
        "client's, from sending to the last byte. Workloads: (a) "
        f"{shape.conversations} conversations of {shape.turns} turns under {shape.systems} "
        f"system prompts of about {shape.system_tokens:,} tokens, each turn resending the "
        f"history (the engine's answers), turns interleaved at random: prompts of about "
        f"{min(tokens['chats']):,} to {max(tokens['chats']):,} tokens; (b) {sizes.cost_singles} "
        f"chats of one distinct user message each, {min(tokens['singles']):,} to "
        f"{max(tokens['singles']):,} tokens. {sizes.cost_rounds} rounds per policy, a fresh "
        "cluster each, the policies alternating which goes first; each row pools its rounds. The "
        "CPU columns are the median over rounds of the CPU time (the kernel's count) of the "
        "Coordinator's processes (inference workers and management process, which follows the "
        "engines' events under kv_aware) and of the engines, per request. Engines that compute "
        "in no time still keep their prefix cache (hash each prompt's blocks, store the new "
        "ones, publish them as KV events): a request sent where its prefix is cached costs its "
        "engine less, so the time through the Coordinator is not the Coordinator's cost alone; "
        "on this 2-core machine every process's CPU is everyone's latency.",
        "",
        "| workload | policy | requests | mean | p50 | p99 | mean of each round "
        "| CPU per request: Coordinator, engines |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for workload, rows in cost.items():
        for policy, t in rows.items():
            each = ", ".join(f"{statistics.fmean(r) * 1e3:.1f}" for r in t.rounds)
            lines.append(
                f"| {WORKLOADS[workload]} | {policy} | {t.n} | {ms(t.mean)} | {ms(t.pct(50))} "
                f"| {ms(t.pct(99))} | {each} ms | {ms(statistics.median(t.coordinator_cpu))}, "
                f"{ms(statistics.median(t.engines_cpu))} |"
            )
        kv, ll = rows["kv_aware"], rows["least_load"]
        mean_ratio, p99_ratio = kv.mean / ll.mean, kv.pct(99) / ll.pct(99)
        met = mean_ratio <= COST_TARGET and p99_ratio <= COST_TARGET
        coordinator = statistics.median(kv.coordinator_cpu) - statistics.median(ll.coordinator_cpu)
        engines = statistics.median(kv.engines_cpu) - statistics.median(ll.engines_cpu)
        ratios.append(
            f"{WORKLOADS[workload]}: kv_aware/least_load **{mean_ratio:.2f}x** mean, **{p99_ratio:.2f}x** "
            f"p99; kv_aware adds {(kv.mean - ll.mean) * 1e3:+.1f} ms on the mean, "
            f"{(kv.pct(50) - ll.pct(50)) * 1e3:+.1f} ms at p50, {(kv.pct(99) - ll.pct(99)) * 1e3:+.1f} ms "
            f"at p99: {'met' if met else '**missed**'}. Its Coordinator spends {coordinator * 1e3:+.2f} ms "
            f"of CPU per request, its engines {engines * 1e3:+.2f} ms."
        )
    lines += ["", f"Target: kv_aware within {COST_TARGET:.2f}x of least_load, mean and p99."]
    lines += ["", *(f"- {r}" for r in ratios), ""]
    return lines


# -- 2. stall ------------------------------------------------------------------------------------


def stall_section(stalls: dict[str, kv_stall.Stall]) -> list[str]:
    lines = [
        "## The event loop's longest stall",
        "",
        "In process, no cluster: the two workloads' request bodies (the chats' answers a fixed "
        "sentence) through kv_aware's request path on an asyncio loop, one after another: "
        "`await Tokens.prompt(body, chat, held)` (Llama 3; the memo of rendered chat prefixes "
        "starts empty, as in a new worker; a text over 2,048 characters is encoded in a thread, "
        "a long prompt a chunk at a time while some endpoint holds every block so far), "
        "`prompt.hashes(16)`, the lookup in a `KvIndex` of two endpoints (`holder`); after each "
        "request the blocks of its whole prompt are stored on the endpoint it went to (the "
        "engine's and the management process's work: not counted). A ticker task on the same "
        "loop (`await asyncio.sleep(0)` in a loop) keeps the longest time between two of its "
        "wake-ups, split by what the loop's thread did meanwhile: ran, waited for a CPU (the "
        "kernel's count, `/proc/<tid>/schedstat`: other processes' turns on this 2-core "
        "machine, the ticker being always runnable), or was blocked (waiting for the GIL, held "
        "by the encoding thread). The stall kv_aware causes is the gap less its wait for a CPU "
        "(last column).",
        "",
        "| workload | requests | prompt tokens | path p50 | path p99 | path max "
        "| longest gap: ran / waited for a CPU / blocked "
        "| longest gap less its wait for a CPU: ran / blocked |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workload, s in stalls.items():
        paths = sorted(s.paths)
        g, h = s.longest, s.longest_held
        lines.append(
            f"| {WORKLOADS[workload]} | {len(paths)} | {min(s.tokens):,} to {max(s.tokens):,} "
            f"| {ms(percentile(paths, 50))} | {ms(s.p99)} | {ms(paths[-1])} "
            f"| {_ms2(g.wall)}: {_ms2(g.running)} / {_ms2(g.waiting_for_cpu)} / {_ms2(g.blocked)} "
            f"| **{_ms2(h.held)}**: {_ms2(h.running)} / {_ms2(h.blocked)} |"
        )
    worst = max(s.longest_held.held for s in stalls.values())
    raw = max(s.longest.wall for s in stalls.values())
    met = worst <= STALL_TARGET_S
    quiet = max(s.background_pct for s in stalls.values())
    lines += [
        "",
        f"Target: no stall over {STALL_TARGET_S * 1e3:g} ms: the longest the path held the loop "
        f"is {_ms2(worst)}, {'met' if met else '**missed**'} (the longest gap as the ticker saw "
        f"it, waits for a CPU included, was {_ms2(raw)}; other processes used up to "
        f"{quiet:.0f}% of a core the second before each workload). The path's own time is "
        "mostly spent awaiting the encoding thread, while the loop serves other requests.",
        "",
    ]
    return lines


def _ms2(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


# -- 3. TTFT -------------------------------------------------------------------------------------


async def ttft_runs(
    sizes: Sizes, convs: list[kv_workload.Conversation], order: list[int], capacity: int
) -> list[TtftRun]:
    args = {
        "block_size": BLOCK,
        "num_gpu_blocks_override": capacity,
        "prefill_ms_per_token": PREFILL_MS_PER_TOKEN,
    }
    policies = TTFT_POLICIES if not QUICK else TTFT_POLICIES[:2]
    runs = []
    for clients in sizes.ttft_clients:
        for policy in policies:
            runs.append(
                await in_tmp(lambda tmp, p=policy, c=clients: kv_real.ttft_run(tmp, p, c, convs, order, args))  # type: ignore[misc]
            )
    return runs


def ttft_section(
    runs: list[TtftRun], sizes: Sizes, capacity: int, working: int, tokens: tuple[int, int]
) -> list[str]:
    shape = sizes.ttft_chats
    n = len(runs[0].ttft)
    lines = [
        "## Time to first token",
        "",
        "`motor up --prefill 2 --decode 1 --engine-type sim --model .tokenizers/llama3`: simulated "
        f"engines that prefill in {PREFILL_MS_PER_TOKEN} ms per prompt token not in their prefix "
        f"cache, block size {BLOCK}, {capacity} blocks of cache each (about half of the workload's "
        f"~{working:,} distinct blocks). Workload: {shape.conversations} conversations of "
        f"{shape.turns} turns under {shape.systems} system prompts of about "
        f"{shape.system_tokens:,} Llama 3 tokens ({tokens[0]:,} to {tokens[1]:,} tokens a prompt), "
        f"each turn resending the history, turns interleaved at random: {n} streamed requests "
        "per row, a fresh cluster (cold caches) per row. The hit ratio is the prefill engines' "
        "own `vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`.",
        "",
        "| policy | clients | requests | mean TTFT | p50 | p90 | max | prefix cache hit ratio "
        "| vs least_load (mean) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r.clients: r.mean for r in runs if r.policy == "least_load"}
    for r in runs:
        s = sorted(r.ttft)
        lines.append(
            f"| {r.policy} | {r.clients} | {len(s)} | {ms(r.mean)} | {ms(percentile(s, 50))} "
            f"| {ms(percentile(s, 90))} | {ms(s[-1])} | {r.hit_ratio:.1%} "
            f"| {base[r.clients] / r.mean:.2f}x lower |"
        )
    one = {r.policy: r for r in runs if r.clients == 1}
    speedup = one["least_load"].mean / one["kv_aware"].mean
    lines += [
        "",
        f"Target: mean TTFT with kv_aware at least {SPEEDUP_TARGET:g}x lower than least_load at one "
        f"client: **{speedup:.2f}x**, {'met' if speedup >= SPEEDUP_TARGET else '**missed**'}.",
    ]
    many = {r.policy: r for r in runs if r.clients > 1}
    if "kv_aware" in many and "least_load" in many:
        gain = many["least_load"].mean / many["kv_aware"].mean
        clients = many["kv_aware"].clients
        lines[-1] += (
            f" At {clients} clients the gain is {gain:.2f}x (with requests in flight the load term "
            "and the load gate send some to an engine without their prefix; these simulated "
            "engines never queue, so there it only costs)."
        )
    return [*lines, ""]


# -- 4. agreement --------------------------------------------------------------------------------


def agreement_section(a: kv_agreement.Agreement, shape: kv_workload.ProseShape) -> list[str]:
    over, under = a.split()
    share, ruled = a.share(), a.share(rule=True)
    wrong = over + under
    lines = [
        "## Agreement with the engine's own blocks",
        "",
        "`motor up --prefill 2 --decode 1 --engine-type vllm` (the stand-in: the simulated "
        "engine with Llama 3's tokenizer), kv_aware, engines that compute in no time and cache "
        f"the whole working set. {a.conversations} conversations of {a.turns} turns under "
        f"{shape.systems} system prompts of about {shape.system_tokens:,} tokens, turns "
        f"interleaved at random, {a.gap} or more other requests between two turns of one "
        f"conversation (but for the last few) and never less than {kv_agreement.TURN_GAP_S * 1e3:.0f} "
        "ms (the Coordinator applies the engines' event batches as they come after a quiet "
        "spell, then every 50 ms: so each turn's blocks have landed before the next turn "
        f"comes): {a.n} requests, one client, one at a time. After each, the delta of the "
        'Coordinator\'s `motor_coordinator_kv_cached_prompt_tokens_total{role="prefill"}` (the '
        "tokens it predicted the chosen engine holds; scraped over the request's own "
        f"connection, so from the worker that routed it: {a.connections} connection(s) in all) "
        "against the delta of the prefill engines' `vllm:prefix_cache_hits_total` (the hits the "
        "engine counted). The simulated engine counts a hit as every full block of the prompt "
        "already cached, the last one included (services/simengine/prefix_cache.py), and the "
        "Coordinator predicts the same way (full blocks held, at most the prompt), so the two "
        "are compared as they are; vLLM's own rule, that the last prompt token is never a hit "
        "(a prompt cached whole recomputes its last block), applied to both (each capped at the "
        "full blocks of `prompt_tokens - 1`), is the second column. The client also replays "
        "the engines' caches itself (each prompt tokenized by the Coordinator's code, its block "
        "keys added to the chosen engine's set): where the engine agrees with the replay but "
        "not with the Coordinator, the index had not yet learned (or had lost) blocks; where "
        "it disagrees with the replay too, the token ids differ. The last column counts the "
        "requests whose length the Coordinator only estimated (it stops encoding a long "
        "prompt at a chunk no engine holds all of), which costs no prediction.",
        "",
        "| requests | predicted = counted | the same, vLLM's last-token rule on both "
        "| over-predicted | under-predicted | engine's hits ≠ client's replay "
        "| prompt tokens: engine ≠ client | Coordinator's count ≠ engine's |",
        "|---|---|---|---|---|---|---|---|",
        f"| {a.n} | **{share:.1%}** | {ruled:.1%} | {len(over)} | {len(under)} "
        f"| {a.replay_mismatches} | {a.token_mismatches} | {a.estimated} |",
        "",
    ]
    verdict = f"Target: at least {AGREEMENT_TARGET:.0%} of requests agree: {share:.1%}, " + (
        "met." if share >= AGREEMENT_TARGET else "**missed**."
    )
    if wrong:
        timing = sum(1 for r in wrong if r.replayed == r.actual)
        soonest = min(min(r.since_turn_s, r.since_last_s) for r in wrong)
        verdict += (
            f" Of the {len(wrong)} disagreements, {timing} have the engine matching the client's "
            f"replay (the index behind or ahead of the engine), {len(wrong) - timing} do not "
            f"(token ids differ); the soonest came {ms(soonest)} after the request before it."
        )
    return [*lines, verdict, ""]


# -- 5. short prompts ----------------------------------------------------------------------------


Shorts = dict[int, dict[int, kv_short.Short]]  # threshold -> length -> row


async def short_runs(sizes: Sizes, prompts: dict[int, list[list[dict[str, str]]]]) -> Shorts:
    out: Shorts = {SHORT_THRESHOLD: {}, 0: {}}
    for r in range(sizes.short_rounds):
        for threshold in (SHORT_THRESHOLD, 0) if r % 2 == 0 else (0, SHORT_THRESHOLD):
            await in_tmp(
                lambda tmp, t=threshold: kv_short.short_round(tmp, t, prompts, sizes.short_rate, out[t])  # type: ignore[misc]
            )
    return out


def short_section(shorts: Shorts, sizes: Sizes, tokens: dict[int, float]) -> list[str]:
    lines = [
        "## Short prompts skip the prefill leg",
        "",
        "`motor up --prefill 1 --decode 1 --engine-type sim --model .tokenizers/llama3`, the "
        "simulated engines' default latencies (services/simengine/config.py: no TTFT, prefill, "
        "per-token or KV transfer time, so what a prefill leg costs here is its round trip "
        "through the prefill engine and the hand-off's bookkeeping), prefill_policy least_load. "
        f"Each length's prompts (distinct chats of one user message) at a fixed "
        f"{sizes.short_rate:g} requests/s (open loop), streamed (16 tokens), "
        f"{sizes.short_requests} per length and round, {sizes.short_rounds} round(s) per "
        f"setting on fresh clusters, the settings alternating: `pd_min_prompt_tokens` "
        f"{SHORT_THRESHOLD} (every prompt here under it: straight to decode) against 0 (every "
        "prompt through the prefill leg). The route column is the Coordinator's own count "
        "(`motor_coordinator_routed_total`); throughput is requests over the time from the first "
        "send to the last answer.",
        "",
        "| prompt tokens | pd_min_prompt_tokens | requests | routed decode_only / vllm_pd "
        "| TTFT p50 | p99 | mean | throughput |",
        "|---|---|---|---|---|---|---|---|",
    ]
    verdicts, met = [], []
    for length in sizes.short_lengths:
        rows = {t: shorts[t][length] for t in (SHORT_THRESHOLD, 0)}
        for t, row in rows.items():
            lines.append(
                f"| {tokens[length]:.0f} | {t} | {row.ttft.n} | {row.decode_only} / {row.vllm_pd} "
                f"| {ms(row.ttft.pct(50))} | {ms(row.ttft.pct(99))} | {ms(row.ttft.mean)} "
                f"| {row.throughput:.1f}/s |"
            )
        d, p = rows[SHORT_THRESHOLD], rows[0]
        lower = 1 - d.ttft.pct(50) / p.ttft.pct(50)
        equal = abs(d.throughput / p.throughput - 1) <= 0.05
        met.append(lower >= SHORT_TARGET and equal)
        verdicts.append(
            f"about {tokens[length]:.0f} tokens: p50 {lower:.0%} lower straight to decode "
            f"(p99 {1 - d.ttft.pct(99) / p.ttft.pct(99):.0%}), throughput "
            f"{d.throughput:.1f} against {p.throughput:.1f}/s: {'met' if met[-1] else '**missed**'}"
        )
    # The longest length up to which every length tested met the target.
    supported = 0
    for length, ok in zip(sizes.short_lengths, met, strict=True):
        if not ok:
            break
        supported = length
    lines += [
        "",
        f"Target: TTFT p50 at least {SHORT_TARGET:.0%} lower for prompts under the threshold, at "
        "equal throughput (within 5%): " + "; ".join(verdicts) + ".",
        "",
        _threshold_verdict(supported, sizes),
        "",
    ]
    return lines


def _threshold_verdict(supported: int, sizes: Sizes) -> str:
    caveat = (
        "The simulated engine does not model what bounds the threshold on a real engine: a "
        "prompt prefilled on a decode engine slows the decodes running beside it (its prefill "
        "takes the batch's compute for its length), so the longer the prompts sent there, the "
        "more every other stream's time per output token suffers; that cost, measured on the "
        "real engine, sets the default."
    )
    if not supported:
        return (
            "The numbers support no threshold as a default: even the shortest prompts gained too "
            f"little. {caveat}"
        )
    longest = supported == sizes.short_lengths[-1]
    return (
        f"The numbers support a default of {supported:,} tokens (the gain holds at every length "
        f"tested up to it{'; longer ones were not tested' if longest else ', not beyond'}); here it "
        f"is the prefill leg's round trip that is saved, whatever the length. {caveat}"
    )


# -- the whole bench -----------------------------------------------------------------------------


@dataclass
class Results:
    cost: Cost
    cost_tokens: dict[str, list[int]]
    stalls: dict[str, kv_stall.Stall]
    ttft: list[TtftRun]
    ttft_capacity: int
    ttft_working: int
    ttft_tokens: tuple[int, int]
    agreement: kv_agreement.Agreement
    shorts: Shorts
    short_tokens: dict[int, float]
    costs: kv_index_cost.Costs
    seconds: dict[str, float]


async def amain() -> int:
    sizes = SMALL if QUICK else FULL
    directory = kv_real.model_dir()
    count = kv_real.Counter(directory)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    log("building the workloads")
    convs, order = kv_workload.build_prose(sizes.cost_chats, count)
    singles = kv_workload.singles(sizes.cost_singles, sizes.single_tokens, count)
    load = kv_real.CostLoad(convs, order, singles)
    bodies = {"chats": kv_stall.chat_bodies(convs, order), "singles": [{"messages": m} for m in singles]}
    ttft_convs, ttft_order = kv_workload.build_prose(sizes.ttft_chats, count)
    working = kv_real.working_set_blocks(ttft_convs, count, answer=16)
    agree = sizes.agree_chats
    agree_convs, _ = kv_workload.build_prose(agree, count)
    agree_order = kv_workload.spaced(agree.conversations, agree.turns, sizes.agree_gap, agree.seed)
    short_prompts = {
        n: kv_workload.singles(sizes.short_requests, n - 10, count, seed=n) for n in sizes.short_lengths
    }
    short_tokens = {n: statistics.fmean(count.chat(m) for m in ps) for n, ps in short_prompts.items()}
    seconds["workloads"] = time.perf_counter() - t0

    # In process and quick: first, so that a failure shows before the clusters' long runs.
    costs = await timed("index placement", seconds, lambda: asyncio.to_thread(kv_index_cost.measure))
    cost = await timed("router cost", seconds, lambda: router_cost(sizes, load))
    stalls = await timed("stall", seconds, lambda: asyncio.to_thread(kv_stall.measure, directory, bodies))
    capacity = max(64, working // 2)
    ttft = await timed("ttft", seconds, lambda: ttft_runs(sizes, ttft_convs, ttft_order, capacity))
    agreement = await timed(
        "agreement",
        seconds,
        lambda: in_tmp(lambda tmp: kv_agreement.run(tmp, agree_convs, agree_order, sizes.agree_gap)),
    )
    shorts = await timed("short prompts", seconds, lambda: short_runs(sizes, short_prompts))
    seconds["total"] = time.perf_counter() - t0
    tokens = {w: s.tokens for w, s in stalls.items()}
    ttft_tokens = _chat_tokens(ttft_convs, count)
    results = Results(
        cost,
        tokens,
        stalls,
        ttft,
        capacity,
        working,
        ttft_tokens,
        agreement,
        shorts,
        short_tokens,
        costs,
        seconds,
    )
    return publish(RESULTS, report(results, sizes))


def _chat_tokens(convs: list[kv_workload.Conversation], count: kv_real.Counter) -> tuple[int, int]:
    """The shortest and longest prompt of a chat workload (answers as the run left them)."""
    sizes = [count.chat(c.messages(t)) for c in convs for t in range(len(c.answers))]
    return (min(sizes), max(sizes)) if sizes else (0, 0)


def report(r: Results, sizes: Sizes) -> str:
    kv_run = next(x for x in r.ttft if x.policy == "kv_aware" and x.clients == 1)
    took = ", ".join(f"{k} {v:.0f} s" for k, v in r.seconds.items() if k != "total")
    lines = [
        "# KV-aware routing",
        "",
        f"Generated by `python -m bench kv_routing` ({machine()}; the whole bench took "
        f"{r.seconds['total'] / 60:.1f} min: {took}).",
        "",
        "Every cluster serves Llama 3's tokenizer as its model (`.tokenizers/llama3`, `make "
        "tokenizers`): the simulated engines render its chat template and encode as vLLM does, "
        "and kv_aware tokenizes each request the same way in the Coordinator (Python, the "
        "`tokenizers` library; a chat encoded incrementally, a long text in a thread). Texts are "
        "English-like sentences from a fixed word list, sized in Llama 3 tokens. Prompt lengths "
        "are the engine's count (Llama 3 tokens, chat template included).",
        "",
        *cost_section(r.cost, sizes, r.cost_tokens),
        *stall_section(r.stalls),
        *ttft_section(r.ttft, sizes, r.ttft_capacity, r.ttft_working, r.ttft_tokens),
        *agreement_section(r.agreement, sizes.agree_chats),
        *short_section(r.shorts, sizes, r.short_tokens),
        "## Where the index lives",
        "",
        "The management process follows the events, once, and keeps the index; the workers read "
        "which blocks each endpoint holds from tables it maps into memory they share. The "
        "alternatives: an index per worker, each fed by its own subscriptions, or one index asked "
        f"on every request. Measured in process (an index of {kv_index_cost.ENDPOINTS} endpoints x "
        "100,000 blocks):",
        "",
        *kv_index_cost.summary(r.costs),
        f"- The kv_aware TTFT run above (one client) received {kv_run.events:.0f} events in "
        f"{kv_run.seconds:.1f} s ({kv_run.events / kv_run.seconds:.0f}/s).",
        "",
        _verdict_on_placement(r.costs),
        "",
    ]
    return "\n".join(lines)


def _verdict_on_placement(c: kv_index_cost.Costs) -> str:
    trip, shared = statistics.median(c.round_trip_us), statistics.median(c.shared_us)
    cold = statistics.median(c.shared_cold_us)
    return (
        f"An index in another process would add its round trip ({trip:.0f} µs) to every request, "
        "on top of reading and hashing the prompt, which a worker does either way; against the "
        f"shared index the whole decision takes {shared:.0f} µs ({cold:.0f} µs with cold "
        "caches). The shared index costs the workers nothing per event, where an index per "
        f"worker would cost each of them {c.ingest_us:.0f} µs per batch, on their requests' "
        "critical path."
    )


def main() -> int:
    return asyncio.run(amain())


if __name__ == "__main__":
    raise SystemExit(main())
