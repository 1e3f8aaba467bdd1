"""Fair admission: a tenant far over its share against one within it, the split of tokens
between two backlogged tenants, and what admission costs per request.

1. Isolation. ``motor up --prefill 1 --decode 1`` (simulated engines: TTFT_MS to the first
   token, TPOT_MS per token after it, MAX_TOKENS tokens an answer), the Coordinator's
   ``max_concurrent_requests`` set to CONCURRENCY so its queue is where requests wait, a tenants
   file with A and B (weight 1 each). B sends at its share (half of what the slots serve, open
   loop, Poisson) alone, then with A sending ten times its share. Target: B's TTFT p99 with A
   within 1.2x of B alone.
2. Split. A and B both send twice what the slots serve (both backlogged), weights 1:1 and then
   1:3. Target: each tenant's share of the completion tokens served within +-10 % of its
   weight's share, over the middle of the run.
3. Cost (bench/loadgen/admission_cost.py, in process). Target: at most 10 us per request added
   by 1,000 tenants with rate limits, at the median.
4. A wrong key's 401, by how close the key is to a valid one (the same file): equal times.

``MOTOR_BENCH_QUICK=1`` shortens every run (a check that it all runs; its numbers mean nothing).

    python -m bench admission
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from bench.loadgen import admission_cost, admission_load
from bench.loadgen.admission_load import Tenant
from bench.loadgen.harness import machine, percentile, publish
from bench.loadgen.up import Up

RESULTS = Path(__file__).parent / "results" / "admission.md"
QUICK = os.environ.get("MOTOR_BENCH_QUICK", "") not in ("", "0")

TTFT_MS = 100
TPOT_MS = 400
MAX_TOKENS = 40
CONCURRENCY = 128
SERVICE_S = (TTFT_MS + TPOT_MS * MAX_TOKENS) / 1000  # one request's time on its slot, about
CAPACITY = CONCURRENCY / SERVICE_S  # requests per second the slots serve
SECONDS = 8.0 if QUICK else 90.0
# The split runs longer: the slots turn over in waves (every answer takes the same time), and
# which tenant a wave's grants fall to moves a short run's count by several per cent.
SPLIT_SECONDS = 8.0 if QUICK else 240.0
SKIP_S = 2.0 if QUICK else 1.2 * SERVICE_S  # until every slot has turned over once: left out
CAPACITY_S = 8.0 if QUICK else 50.0
ISOLATION_TARGET = 1.2
SPLIT_TOLERANCE = 0.10
COST_TARGET_US = 10.0
PROMPT = "Tell me a story about a lighthouse keeper and the sea. " * 8
KEYS = {"A": "sk-bench-tenant-a-0001", "B": "sk-bench-tenant-b-0002"}


def _cluster(workdir: Path, weights: tuple[float, float]) -> Up:
    workdir.mkdir(parents=True, exist_ok=True)
    tenants = workdir / "tenants.json"
    tenants.write_text(
        json.dumps([{"name": n, "keys": [KEYS[n]], "weight": w} for n, w in zip("AB", weights, strict=True)])
    )
    tenants.chmod(0o600)
    cfg = workdir / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "coordinator": {
                    "tenants_file": str(tenants),
                    "max_concurrent_requests": CONCURRENCY,
                    "max_queued_requests": CONCURRENCY,
                    "queue_timeout_s": 30,
                },
                "engine": {"args": {"ttft_ms": TTFT_MS, "tpot_ms": TPOT_MS, "kv_transfer_ms": 0}},
            }
        )
    )
    return Up(["--prefill", "1", "--decode", "1", "--config", str(cfg)], workdir)


def _ttft(tenant: Tenant) -> list[float]:
    """Times to first token of the requests sent once the run is steady (for B with A: while A
    floods, from its first request on)."""
    return sorted(a.ttft_s for a in tenant.answers if a.status == 200 and a.ttft_s and a.sent >= SKIP_S)


async def _capacity(url: str) -> float:
    """Requests per second the cluster serves with its slots full (one tenant at 2x the
    estimate): what "a share" is measured against."""
    flood = Tenant("A", KEYS["A"], 2 * CAPACITY, stream=False)
    await admission_load.run(url, "motor-sim", [flood], CAPACITY_S, PROMPT, MAX_TOKENS, seed=4)
    since = min(1.2 * SERVICE_S, CAPACITY_S / 2)  # once every slot has turned over
    done = [x for x in flood.answers if x.status == 200 and since <= x.ended <= CAPACITY_S]
    return len(done) / (CAPACITY_S - since)


async def _isolation(workdir: Path) -> tuple[float, list[str]]:
    up = _cluster(workdir, (1, 1))
    try:
        url = up.url
        capacity = await _capacity(url)
        alone = Tenant("B", KEYS["B"], capacity / 2)
        await admission_load.run(url, "motor-sim", [alone], SECONDS, PROMPT, MAX_TOKENS)
        b = Tenant("B", KEYS["B"], capacity / 2)
        a = Tenant("A", KEYS["A"], 10 * capacity / 2, stream=False, start_s=SKIP_S)
        await admission_load.run(url, "motor-sim", [a, b], SECONDS, PROMPT, MAX_TOKENS, seed=2)
    finally:
        up.stop()
    rows = []
    base = _ttft(alone)
    loaded = _ttft(b)
    for name, t, times in (("B alone", alone, base), ("B with A at 10x", b, loaded)):
        sent = [x for x in t.answers if x.sent >= SKIP_S]
        ok = sum(1 for x in sent if x.status == 200)
        rows.append(
            f"| {name} | {len(sent)} | {ok} | {len(sent) - ok} | {percentile(times, 50) * 1000:.0f} | "
            f"{percentile(times, 99) * 1000:.0f} | {max(times) * 1000:.0f} |"
        )
    a_ok = sum(1 for x in a.answers if x.status == 200)
    rows.append(f"| A (at 10x) | {len(a.answers)} | {a_ok} | {len(a.answers) - a_ok} | | | |")
    ratio = percentile(loaded, 99) / percentile(base, 99)
    verdict = "met" if ratio <= ISOLATION_TARGET else "MISSED"
    return capacity, [
        "| tenant | sent | 200 | refused | TTFT p50 ms | TTFT p99 ms | worst ms |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"B's TTFT p99 with A / alone: **{ratio:.2f}x** (target <= {ISOLATION_TARGET}x: {verdict}). "
        f"B's p50 ratio: {percentile(loaded, 50) / percentile(base, 50):.2f}x.",
    ]


async def _split(workdir: Path, weights: tuple[float, float]) -> tuple[str, bool]:
    up = _cluster(workdir, weights)
    try:
        a = Tenant("A", KEYS["A"], 2 * CAPACITY, stream=False)
        b = Tenant("B", KEYS["B"], 2 * CAPACITY, stream=False)
        await admission_load.run(up.url, "motor-sim", [a, b], SPLIT_SECONDS, PROMPT, MAX_TOKENS, seed=3)
    finally:
        up.stop()

    def served(t: Tenant) -> int:  # tokens of the answers sent once every slot has turned over
        return sum(x.tokens for x in t.answers if x.status == 200 and x.sent >= SKIP_S)

    ta, tb = served(a), served(b)
    want = weights[0] / sum(weights)
    got = ta / (ta + tb) if ta + tb else float("nan")
    ok = abs(got - want) <= SPLIT_TOLERANCE * want
    refused = sum(1 for t in (a, b) for x in t.answers if x.status != 200)
    row = (
        f"| {weights[0]:g} : {weights[1]:g} | {ta} | {tb} | {got:.3f} | {want:.3f} | "
        f"{(got - want) / want * 100:+.1f} % | {refused} | {'met' if ok else 'MISSED'} |"
    )
    return row, ok


async def amain() -> int:
    # In process, first: on a machine not yet stirred by the clusters' processes (a cluster's
    # children still exiting after it stopped doubled both rows of an earlier run).
    none, many = await admission_cost.measure(batches=20 if QUICK else 200)
    wrong = admission_cost.wrong_keys()
    out = [
        "# Fair admission",
        "",
        f"Generated by `python -m bench admission` ({machine()}).",
        "",
        f"`motor up --prefill 1 --decode 1`, simulated engines: {TTFT_MS} ms to the first token, "
        f"{TPOT_MS} ms per token after it, {MAX_TOKENS} tokens an answer (B's streamed, A's whole). "
        f"Coordinator: `max_concurrent_requests` {CONCURRENCY}, `max_queued_requests` "
        f"{CONCURRENCY}, `queue_timeout_s` 30 (a full queue drains within it), its default "
        f"inference workers. Open-loop Poisson clients, each tenant a client with its own "
        f"connections, {SECONDS:g} s a run ({SPLIT_SECONDS:g} s in part 2); requests sent in the "
        f"first {SKIP_S:.0f} s (until every slot has turned over once) are left out.",
        "",
        "## 1. A tenant at 10x its share against one at its share",
        "",
    ]
    with tempfile.TemporaryDirectory() as d:
        capacity, rows = await _isolation(Path(d) / "iso")
        out += [
            f"Measured first: the cluster serves **{capacity:.1f} requests/s** with every slot busy "
            f"(one tenant at twice that, {CAPACITY_S:g} s). B sends half of it "
            f"({capacity / 2:.1f}/s) from the start, A five times it from {SKIP_S:.0f} s on (once "
            "every slot has turned over); B's times are those of its requests sent from then on.",
            "",
            *rows,
        ]
        out += [
            "",
            "## 2. Tokens served while both tenants are backlogged (each at 2x what the slots serve)",
            "",
            "| weights A : B | A tokens | B tokens | A's share | weight share | off by | refused | "
            "target +-10 % |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for i, weights in enumerate(((1.0, 1.0), (1.0, 3.0))):
            row, _ = await _split(Path(d) / f"split{i}", weights)
            out.append(row)
    added = many.median_us - none.median_us
    out += [
        "",
        "## 3. What admission costs per request (in process)",
        "",
        "| configuration | median us | worst batch us |",
        "|---|---|---|",
        f"| no tenant, no limit | {none.median_us:.2f} | {none.worst_us:.2f} |",
        f"| 1,000 tenants, each with requests and tokens per minute | {many.median_us:.2f} | "
        f"{many.worst_us:.2f} |",
        "",
        f"Added by the tenants: **{added:.2f} us** per request at the median (target <= "
        f"{COST_TARGET_US:g} us: {'met' if added <= COST_TARGET_US else 'MISSED'}).",
        "",
        "## 4. Refusing a wrong key (in process, 1,000 tenants)",
        "",
        "The key is hashed before any comparison, so how much of a valid key a guess gets right",
        "does not show in the time its 401 takes:",
        "",
        "| wrong key | median us per 401 |",
        "|---|---|",
        *(f"| {name} | {us:.2f} |" for name, us in wrong.items()),
        "",
    ]
    return publish(RESULTS, "\n".join(out))


def main() -> int:
    return asyncio.run(amain())


if __name__ == "__main__":
    sys.exit(main())
