"""Streams through decode engine kills, continuation (migration) off and on: the `streams` part of
bench/bench_failover.py.

`motor up --prefill 2 --decode 2` with simulated engines, relaunch on, every engine latency at
its default (zero) except the time per output token (``TPOT_MS``), without which an answer
leaves in one write and no kill could cut it. ``CLIENTS`` clients each stream greedy chat
completions of ``TOKENS`` tokens one after another, so that many streams are in flight at all
times, and one more client sends non-streamed requests back to back (bench/loadgen/
failover_load.py), while a decode engine's process group is SIGKILLed every ``KILL_EVERY_S``
for the run's duration, the two decode instances in turn (each is back, relaunched in place,
long before its next turn). Once with ``coordinator.migration_limit`` 0 (a stream on a killed
engine ends with an error event after its output) and once at its default (it continues on the
other decode instance: a prefill leg of the prompt and the output delivered, then a decode leg).

Before the kills each client's prompt is streamed once on the same cluster, fault-free: the
reference every answer of the run must equal token for token (the simulated engine's tokens are
a function of the whole context, so a greedy continuation elsewhere gives the same answer).

Measured per mode:

- streams lost: every stream that ended with an error, cut short, or not equal to its
  reference, counted against the kill before its end (median and worst over the kills);
- completed and equal: the fraction of the streams started that ended whole and equal to the
  reference (target ≥ 99.9 % with migration on);
- non-streamed failures (target 0);
- the token gap across a continuation, two ways: the Coordinator's
  ``motor_coordinator_migration_gap_seconds`` (last event before the break → first after it, as
  sent; p50 / p99 interpolated within its buckets as Prometheus's histogram_quantile does, and
  the exact share at or under its 1.5 s bucket), and as the clients saw it: for each kill, the
  longest inter-event gaps that span the kill instant, as many as the continuations the
  Coordinator counted for that kill (a stream cut by the kill waits longest). Target: p99 ≤
  1.5 s.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import signal
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen.failover_load import Load, UpCluster
from bench.loadgen.harness import percentile
from motor_mesh.common.config import DEFAULTS
from motor_mesh.gen.motor.v1 import common_pb2

TITLE = "Simulated engines: streams through decode engine SIGKILLs (motor up --prefill 2 --decode 2)"
CLIENTS = 200
TOKENS = 256
TPOT_MS = 50  # 20 tokens/s a stream: a 256-token answer lasts about 13 s
KILL_EVERY_S = 10.0
DURATION_S = 120.0
MIGRATION_LIMIT = int(DEFAULTS["coordinator"]["migration_limit"])
MIGRATION_DELAY_S = float(DEFAULTS["coordinator"]["migration_delay_s"])
COMPLETE_TARGET = 0.999
GAP_TARGET_S = 1.5
GAP = "motor_coordinator_migration_gap_seconds"
MIGRATIONS = "motor_coordinator_migrations_total"
ACTIVE = common_pb2.INSTANCE_STATUS_ACTIVE
DECODE = common_pb2.ROLE_DECODE
MODES = (("off", 0), ("on", MIGRATION_LIMIT))


def prompt_of(client: int) -> str:
    return f"client {client}: tell me a long story about disaggregated serving"


@dataclass
class Stream:
    """One streamed answer as its client saw it: each content event's text and arrival time
    (time.monotonic, the kills' clock)."""

    client: int
    started: float
    pieces: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    finish: str | None = None
    done: bool = False  # data: [DONE] came
    error: str | None = None
    ended: float = 0.0

    def whole(self, want: list[str]) -> bool:
        return self.error is None and self.done and self.finish == "length" and self.pieces == want


async def stream_once(session: aiohttp.ClientSession, url: str, client: int) -> Stream:
    body = {
        "model": "motor-sim",
        "messages": [{"role": "user", "content": prompt_of(client)}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "stream": True,
    }
    s = Stream(client, time.monotonic())
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(sock_read=60)) as r:
            if r.status != 200:
                s.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return s
            async for line in r.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    s.done = True
                    continue
                obj = orjson.loads(payload)
                if "error" in obj and not obj.get("choices"):
                    s.error = f"error event: {str(obj['error'])[:200]}"
                    continue
                for ch in obj.get("choices") or ():
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        s.pieces.append(piece)
                        s.times.append(time.monotonic())
                    if ch.get("finish_reason"):
                        s.finish = ch["finish_reason"]
        if not s.done and s.error is None:
            s.error = "the stream ended without [DONE]"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    finally:
        s.ended = time.monotonic()
    return s


@dataclass
class Histogram:
    """A Prometheus histogram's cumulative buckets, (upper bound, count), +Inf last."""

    buckets: list[tuple[float, float]]

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def minus(self, other: Histogram) -> Histogram:
        before = dict(other.buckets)
        return Histogram([(le, n - before.get(le, 0.0)) for le, n in self.buckets])

    def quantile(self, q: float) -> float:
        """histogram_quantile: linear within the bucket the rank falls in; the highest finite
        bound when it falls in +Inf."""
        total = self.count
        if not total:
            return float("nan")
        rank = q * total
        lower, below = 0.0, 0.0
        for le, n in self.buckets:
            if n >= rank:
                if le == float("inf"):
                    return lower
                return lower + (le - lower) * ((rank - below) / (n - below) if n > below else 1.0)
            lower, below = le, n
        return lower

    def share_within(self, bound: float) -> float:
        """The exact fraction at or under ``bound``, one of the bucket bounds."""
        return dict(self.buckets)[bound] / self.count if self.count else float("nan")


@dataclass
class Scrape:
    migrations: dict[tuple[str, str], float]
    gap: Histogram

    @property
    def continued(self) -> float:
        return sum(n for (_, outcome), n in self.migrations.items() if outcome == "continued")


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    migrations: dict[tuple[str, str], float] = {}
    buckets: list[tuple[float, float]] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == MIGRATIONS:
                migrations[(sample.labels["reason"], sample.labels["outcome"])] = sample.value
            elif sample.name == GAP + "_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
    return Scrape(migrations, Histogram(sorted(buckets)))


def running(port: int) -> float:
    """Requests the engine on ``port`` is serving (its ``vllm:num_requests_running``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_running":
                return sample.value
    return float("nan")


@dataclass
class Mode:
    """One run: migration off or on."""

    name: str
    limit: int
    kills: list[float] = field(default_factory=list)  # monotonic time of each SIGKILL
    on_victim: list[float] = field(default_factory=list)  # requests on the engine as it was killed
    continued_per_kill: list[float] = field(default_factory=list)
    streams: list[Stream] = field(default_factory=list)
    reference: dict[int, list[str]] = field(default_factory=dict)
    whole_ok: int = 0
    whole_failed: int = 0
    migrations: dict[tuple[str, str], float] = field(default_factory=dict)
    gap: Histogram = field(default_factory=lambda: Histogram([]))
    client_gaps: list[float] = field(default_factory=list)
    late_kills: list[float] = field(default_factory=list)  # waits for a victim still coming back

    # -- what the report says --------------------------------------------------------------
    def lost(self) -> list[Stream]:
        return [s for s in self.streams if not s.whole(self.reference[s.client])]

    def lost_per_kill(self) -> list[int]:
        """Streams lost, each counted against the last kill before it ended."""
        per = [0] * len(self.kills)
        for s in self.lost():
            k = sum(1 for t in self.kills if t <= s.ended) - 1
            per[max(k, 0)] += 1
        return per


class Cluster(UpCluster):
    """``motor up --prefill 2 --decode 2``, relaunch on, continuation at ``limit``."""

    def __init__(self, limit: int, tpot_ms: float) -> None:
        config = {
            "controller": {"enable_engine_relaunch": True},
            "coordinator": {"migration_limit": limit},
            "engine": {"args": {"tpot_ms": tpot_ms}},
        }
        super().__init__(["--prefill", "2", "--decode", "2"], config, 4)

    def decode(self, index: int, timeout: float = 60) -> common_pb2.Instance:
        """Decode instance ``index`` (by job name) once it is ACTIVE with an engine."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            decodes = sorted((i for i in self.instances() if i.role == DECODE), key=lambda i: i.job_name)
            if len(decodes) == 2 and decodes[index].status == ACTIVE and decodes[index].endpoints[0].pid:
                return decodes[index]
            time.sleep(0.05)
        raise RuntimeError(f"decode instance {index} not back within {timeout:g} s")


async def _run(c: Cluster, mode: Mode, duration_s: float, kill_every_s: float) -> None:
    url = f"{c.url}/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        ref = await asyncio.gather(*(stream_once(session, url, i) for i in range(CLIENTS)))
        for s in ref:
            if not (s.error is None and s.done and s.finish == "length" and len(s.pieces) == TOKENS):
                raise RuntimeError(f"the fault-free reference run failed: client {s.client}: {s}")
        mode.reference = {s.client: s.pieces for s in ref}
        before = await asyncio.to_thread(scrape, c.url)

        stop = asyncio.Event()

        async def client(i: int) -> None:
            while not stop.is_set():
                mode.streams.append(await stream_once(session, url, i))

        load = Load(c.url)
        plain = threading.Thread(target=load.run, daemon=True)
        plain.start()
        clients = [asyncio.ensure_future(client(i)) for i in range(CLIENTS)]
        start = time.monotonic()
        counted = [before.continued]
        try:
            for k in range(1, int(duration_s // kill_every_s) + 1):
                await asyncio.sleep(max(0.0, start + k * kill_every_s - time.monotonic()))
                asked = time.monotonic()
                victim = await asyncio.to_thread(c.decode, k % 2)
                if time.monotonic() - asked > 1.0:
                    mode.late_kills.append(time.monotonic() - asked)
                counted.append((await asyncio.to_thread(scrape, c.url)).continued)
                mode.on_victim.append(await asyncio.to_thread(running, victim.endpoints[0].port))
                os.killpg(victim.endpoints[0].pid, signal.SIGKILL)
                mode.kills.append(time.monotonic())
                print(f"  migration {mode.name}: kill {k} of decode {k % 2}", file=sys.stderr)
            stop.set()
            await asyncio.gather(*clients)
        finally:
            stop.set()
            load.stop.set()
            await asyncio.to_thread(plain.join, 60)
        after = await asyncio.to_thread(scrape, c.url)
        counted.append(after.continued)
        # counted[k] is the counter just before kill k (1-based); the last, at the end.
        mode.continued_per_kill = [counted[k + 1] - counted[k] for k in range(1, len(counted) - 1)]
        mode.migrations = {
            key: n - before.migrations.get(key, 0.0)
            for key, n in after.migrations.items()
            if n - before.migrations.get(key, 0.0)
        }
        mode.gap = after.gap.minus(before.gap)
        mode.whole_ok, mode.whole_failed = load.ok, load.failed
        mode.client_gaps = client_gaps(mode)


def client_gaps(mode: Mode) -> list[float]:
    """For each kill, the inter-event gaps that span its instant (streams with events on both
    sides), the longest as many as the continuations counted for that kill."""
    gaps: list[float] = []
    for kill, n in zip(mode.kills, mode.continued_per_kill, strict=True):
        spanning = []
        for s in mode.streams:
            if not s.times or s.times[0] > kill or s.times[-1] <= kill:
                continue
            i = bisect.bisect_right(s.times, kill)
            spanning.append(s.times[i] - s.times[i - 1])
        gaps += sorted(spanning, reverse=True)[: int(n)]
    return sorted(gaps)


def run(
    duration_s: float = DURATION_S, kill_every_s: float = KILL_EVERY_S, tpot_ms: float = TPOT_MS
) -> list[Mode]:
    out = []
    for name, limit in MODES:
        mode = Mode(name, limit)
        c = Cluster(limit, tpot_ms)
        try:
            c.all_active()
            asyncio.run(_run(c, mode, duration_s, kill_every_s))
        finally:
            c.close()
        lost = mode.lost()
        print(
            f"  migration {name}: {len(mode.streams)} streams, {len(lost)} lost, "
            f"{mode.whole_failed} non-streamed failed, continued per kill {mode.continued_per_kill}",
            file=sys.stderr,
        )
        out.append(mode)
    return out


# -- the report --------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %" if x == x else "—"


def _s(x: float) -> str:
    return f"{x:.2f}" if x == x else "—"


def row(m: Mode) -> str:
    n = len(m.streams)
    lost = m.lost()
    per_kill = m.lost_per_kill() or [0]
    equal = (n - len(lost)) / n if n else float("nan")
    if m.limit:
        server = f"{_s(m.gap.quantile(0.5))} / {_s(m.gap.quantile(0.99))}"
        g = m.client_gaps
        client = f"{_s(percentile(g, 50))} / {_s(percentile(g, 99))} / {_s(g[-1] if g else float('nan'))}"
    else:
        server = client = "—"
    continued = sum(n for (_, outcome), n in m.migrations.items() if outcome == "continued")
    cells = [
        f"{m.name} (migration_limit {m.limit})",
        str(len(m.kills)),
        str(n),
        f"{statistics.median(m.on_victim or [0]):g} / {max(m.on_victim or [0]):g}",
        f"{statistics.median(per_kill):g} / {max(per_kill)}",
        f"{n - len(lost)} ({_pct(equal)})",
        f"{m.whole_failed} of {m.whole_ok + m.whole_failed}",
        f"{continued:g}",
        server,
        client,
    ]
    return "| " + " | ".join(cells) + " |"


def verdicts(on: Mode) -> list[str]:
    n = len(on.streams)
    equal = (n - len(on.lost())) / n if n else 0.0
    share = on.gap.share_within(GAP_TARGET_S) if on.gap.count else float("nan")
    client_p99 = percentile(on.client_gaps, 99)
    met = "met" if equal >= COMPLETE_TARGET else "**missed**"
    out = [f"- completed and equal ≥ {100 * COMPLETE_TARGET:g} %: {met} ({_pct(equal)})"]
    met = "met" if on.whole_failed == 0 else "**missed**"
    out.append(f"- 0 failed non-streamed requests: {met} ({on.whole_failed})")
    ok = share >= 0.99 and client_p99 <= GAP_TARGET_S
    out.append(
        f"- token gap p99 ≤ {GAP_TARGET_S:g} s: {'met' if ok else '**missed**'} (Coordinator: "
        f"{_pct(share)} of {on.gap.count:g} gaps ≤ {GAP_TARGET_S:g} s, p99 ≈ {_s(on.gap.quantile(0.99))} s; "
        f"clients: p99 {_s(client_p99)} s)"
    )
    return out


def section(modes: list[Mode], tpot_ms: float = TPOT_MS, duration_s: float = DURATION_S) -> list[str]:
    off, on = modes
    same = off.reference == on.reference
    outcomes = ", ".join(
        f"{reason} {outcome} {n:g}" for (reason, outcome), n in sorted(on.migrations.items())
    )
    lost_kinds: dict[str, int] = {}
    for s in on.lost():
        kind = (s.error or "not equal to the reference").split(":")[0]
        lost_kinds[kind] = lost_kinds.get(kind, 0) + 1
    how = ", ".join(f"{k} {v}" for k, v in lost_kinds.items())
    late = [f"{t:.1f}" for m in modes for t in m.late_kills]
    return [
        f"## {TITLE}",
        "",
        f"{CLIENTS} clients each streaming greedy chat completions of {TOKENS} tokens one after another "
        f"({CLIENTS} streams in flight), one more client sending non-streamed requests back to back, a "
        f"decode engine's process group SIGKILLed every {KILL_EVERY_S:g} s for {duration_s:g} s (the two "
        "decode instances in turn, relaunched in place), once with `coordinator.migration_limit` 0 and once "
        f"at its default ({MIGRATION_LIMIT}, `migration_delay_s` {MIGRATION_DELAY_S:g} s). Engines: the "
        f"simulated engine, every latency at zero but {tpot_ms:g} ms per output token (an answer lasts "
        f"about {TOKENS * tpot_ms / 1000:.0f} s). Each client's prompt was streamed once fault-free on the "
        "same cluster first: every answer must equal it token for token "
        f"(the two modes' references are {'the same' if same else '**not the same**'}).",
        "",
        "On the killed engine: the requests it was serving just before its kill (its "
        "`vllm:num_requests_running`). Lost: a stream that ended with an error, cut short, or not equal "
        "to its reference, counted against the kill before its end. Lost streams start again at once, "
        "on the one decode instance left (as do continuations), so the next engine killed often serves "
        "nearly every stream in flight. Token gap across a continuation: the Coordinator's "
        "`motor_coordinator_migration_gap_seconds` (p50 / p99 interpolated within its buckets), and the "
        "clients' own: per kill, the longest inter-event gaps spanning the kill instant, as many as the "
        "continuations counted for that kill.",
        "",
        "| migration | kills | streams | on the killed engine p50 / max | lost per kill p50 / max"
        " | completed and equal"
        " | non-streamed failed | continuations | token gap p50 / p99 s (Coordinator)"
        " | token gap p50 / p99 / max s (clients) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(row(m) for m in modes),
        "",
        f"Migrations counted with migration on: {outcomes or 'none'}.",
        *([f"Streams lost with migration on, by how: {how}."] if how else []),
        *([f"Kills delayed waiting for the victim to be back: {', '.join(late)} s."] if late else []),
        "",
        f"Targets with migration on: ≥ {100 * COMPLETE_TARGET:g} % of streams completed and equal to the "
        f"fault-free run, 0 failed non-streamed requests, token gap p99 ≤ {GAP_TARGET_S:g} s.",
        "",
        *verdicts(on),
        "",
    ]
