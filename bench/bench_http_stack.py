"""The HTTP stack of the inference port: aiohttp against asyncio protocols + httptools, each with
and without uvloop, and with orjson, all doing the same job.

Each stack is a mode of bench/loadgen/stack_proxy.py, a minimal vLLM-style PD proxy (parse the
request, a prefill leg, splice the prefill's kv_transfer_params into the client's bytes, a decode
leg over a pooled keep-alive connection, relay the answer), run as its own process in front of
one zero-latency prefill sim engine (kv_producer) and one decode sim engine (kv_consumer). Only
the stack differs, so the proxy's CPU per request is the stack's cost. Load: wrk (2 threads, 1
at one connection, keep-alive) POSTing a chat completion (max_tokens 16), non-streaming and
streaming, at 1, 32 and 128 connections; a warm-up run, then the measured one, every run on fresh
processes. Plus a `direct to decode` row (the floor). The machine's speed drifts (other jobs, a
virtual machine's neighbours), so the targets take turns: several rounds, each measuring every
target once per row in a rotating order, and each row reports the median round. Writes
bench/results/http_stack.md whole.

    python -m bench.bench_http_stack [--seconds 5] [--warmup 1] [--connections 1,32,128] [--rounds 3]
    make bench ARGS=http_stack
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import aiohttp

from bench.bench_router import body
from bench.loadgen import peers, wrk
from bench.loadgen.harness import CLK_TCK, Proc, entry, machine, system_cpu, wait_quiet
from bench.loadgen.stack_proxy import STACKS

RESULTS = Path(__file__).parent / "results" / "http_stack.md"
KV = '{{"kv_connector":"NixlConnector","kv_role":"{}"}}'
PATH = "/v1/chat/completions"
DIRECT = "direct to decode"
BASELINE = "aiohttp"
CHOSEN = "protocols-uvloop-orjson"
HOW = {
    "aiohttp": "aiohttp.web server + one shared aiohttp.ClientSession (TCPConnector limit=0), "
    "stdlib json, default asyncio loop (Motor's inference port before)",
    "aiohttp-uvloop": "the same on uvloop",
    "protocols": "services/common/httpserver.py HttpServer + services/common/httpclient.py Pool "
    "(asyncio protocols, httptools), stdlib json, default asyncio loop",
    "protocols-uvloop": "the same on uvloop (`asyncio.Runner(loop_factory=uvloop.new_event_loop)`)",
    "protocols-uvloop-orjson": "the same with orjson (what Motor runs)",
}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench_http_stack")
    p.add_argument("--seconds", type=float, default=5.0, help="measured time per run")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up wrk run before each measured run")
    p.add_argument("--connections", default="1,32,128")
    p.add_argument(
        "--rounds", type=int, default=3, help="runs per row, targets taking turns; the median is shown"
    )
    p.add_argument(
        "--max-other",
        type=float,
        default=25.0,
        help="re-measure a run whose 'other CPU' (other jobs + steal) passed this %% of a core",
    )
    p.add_argument("--retries", type=int, default=1, help="re-measurements per run at most")
    p.add_argument(
        "--only",
        default="",
        help=f"comma list of direct,{','.join(STACKS)}: a quick partial run, printed and not written "
        "to bench/results (the results file only ever holds a whole run)",
    )
    args = p.parse_args(argv)
    if any(x < 1 or x != int(x) for x in (args.seconds, args.warmup)):
        p.error("--seconds and --warmup must be whole seconds >= 1 (wrk takes no fractions)")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


@dataclass
class Cell:
    """One measured run."""

    stream: bool
    conns: int
    r: wrk.WrkResult
    cpu: dict[str, float]  # % of one core over the run: prefill, decode, proxy, wrk, other
    legs: tuple[float, float]  # PD legs per request seen by the prefill and the decode engine
    attempts: int = 1  # runs made for this one (re-runs when other jobs took CPU)

    @property
    def proxied(self) -> bool:
        return "proxy" in self.cpu

    @property
    def per_cpu(self) -> float:
        """Answered requests per CPU-second of the proxy (0 without a proxy)."""
        pct = self.cpu.get("proxy", 0.0)
        return self.r.rps / (pct / 100) if pct > 0 else 0.0

    @property
    def score(self) -> float:
        """What picks the median round: req/s per proxy CPU-second, or req/s without a proxy."""
        return self.per_cpu if self.proxied else self.r.rps


@dataclass
class Target:
    name: str
    how: str
    stack: str | None
    runs: dict[tuple[bool, int], list[Cell]] = field(default_factory=dict)
    error: str | None = None

    def all(self, stream: bool, conns: int) -> list[Cell]:
        return self.runs.get((stream, conns), [])

    def cell(self, stream: bool, conns: int) -> Cell | None:
        """The median run of a row by score (the lower middle one for an even count)."""
        runs = sorted(self.all(stream, conns), key=lambda c: c.score)
        return runs[(len(runs) - 1) // 2] if runs else None


async def legs(base: str, side: str) -> float:
    """``motor_sim_pd_legs_total{side=...}`` of one sim engine, all protocols."""
    async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as r:
        text = await r.text()
    mark = f'side="{side}"'
    return sum(
        float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if ln.startswith("motor_sim_pd_legs_total") and mark in ln
    )


class EngineDied(RuntimeError):
    """A sim engine exited during a run (its log's end is the message)."""


class Setup:
    """One run's processes: a fresh prefill and decode sim engine and, for a stack, a fresh
    proxy in front of them. Fresh for every measured run, so no run inherits another's state
    (pooled connections, the prefill engine's ticket store, a grown heap)."""

    count = 0

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = tmp / "model"
        self.model.mkdir(exist_ok=True)
        self.procs: dict[str, Proc] = {}
        self.pf = self.de = ""

    async def start(self, stack: str | None) -> str:
        """Start everything; the URL to load."""
        Setup.count += 1
        n = Setup.count
        for role, side in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            proc, base, _ = await peers.engine(
                f"{role}-{n}", self.model, self.tmp, ["--kv-transfer-config", KV.format(side)]
            )
            self.procs[role] = proc
            if role == "prefill":
                self.pf = base
            else:
                self.de = base
        if stack is None:
            return f"{self.de}{PATH}"
        self.procs["proxy"], url = await start_stack(stack, self.pf, self.de, self.tmp, n)
        return url

    def check(self) -> None:
        for role in ("prefill", "decode"):
            p = self.procs.get(role)
            if p is not None and p.proc.returncode is not None:
                lines = p.log.read_text(errors="replace").splitlines()
                tail = [ln.strip() for ln in lines if ln.strip()][-3:]
                raise EngineDied(
                    f"{role} engine exited (rc {p.proc.returncode}); its log ends: {' / '.join(tail)}"
                )

    async def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            await p.stop()
        self.procs = {}


async def start_stack(
    stack: str, pf: str, de: str, tmp: Path, n: int, timeout_s: float = 20.0
) -> tuple[Proc, str]:
    argv = [
        "-m",
        "bench.loadgen.stack_proxy",
        "--stack",
        stack,
        "--port",
        "0",
        "--prefill",
        pf,
        "--decode",
        de,
    ]
    proc = await Proc.start(stack, argv, tmp / f"{stack}-{n}.log")
    try:
        port = (await proc.log_match(r"LISTENING port=(\d+)", timeout_s)).group(1)
        url = f"http://127.0.0.1:{port}{PATH}"
        await peers.wait_serving(proc, url, json.dumps(body(False)).encode())
    except BaseException:
        await proc.stop()
        raise
    return proc, url


def _task_cpu() -> float:
    """user + nice + system CPU seconds of the whole machine so far: busy time charged to some
    process (interrupt and softirq time, e.g. loopback networking, is left out)."""
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return (int(f[0]) + int(f[1]) + int(f[2])) / CLK_TCK


def _children_cpu() -> float:
    """CPU seconds of this process's reaped children (wrk, once it has exited)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


async def _run(
    stack: str | None, stream: bool, c: int, script: Path, args: argparse.Namespace, tmp: Path
) -> Cell:
    """Fresh engines (and proxy), a warm-up run, a quiet machine, then one measured wrk run."""
    setup = Setup(tmp)
    try:
        url = await setup.start(stack)
        procs, pf, de = setup.procs, setup.pf, setup.de
        await wrk.run(url, script, c, args.warmup)
        await wait_quiet([p.pid for p in procs.values()], max_wait_s=15)
        setup.check()
        legs0 = (await legs(pf, "prefill"), await legs(de, "decode"))
        cpu0 = {k: peers.group_cpu(p.pid) for k, p in procs.items()}
        m0, st0, me0, w0 = _task_cpu(), system_cpu()[1], time.process_time(), _children_cpu()
        t0 = time.perf_counter()
        r = await wrk.run(url, script, c, args.seconds)
        elapsed = time.perf_counter() - t0
        m1, st1, me1, w1 = _task_cpu(), system_cpu()[1], time.process_time(), _children_cpu()
        cpu = {k: 100 * (peers.group_cpu(p.pid) - cpu0[k]) / elapsed for k, p in procs.items()}
        setup.check()
        legs1 = (await legs(pf, "prefill"), await legs(de, "decode"))
    finally:
        await setup.stop()
    cpu["wrk"] = 100 * (w1 - w0) / elapsed  # the only child reaped during the run
    known = sum(cpu.values()) + 100 * (me1 - me0) / elapsed
    cpu["other"] = max(0.0, 100 * (m1 - m0) / elapsed - known) + 100 * (st1 - st0) / elapsed
    n = max(1, r.requests)
    return Cell(stream, c, r, cpu, ((legs1[0] - legs0[0]) / n, (legs1[1] - legs0[1]) / n))


async def measure_row(
    target: Target, stream: bool, c: int, script: Path, args: argparse.Namespace, tmp: Path, deaths: list[str]
) -> Cell:
    """One round of one row: re-run while other jobs took CPU (keeping the run with the least
    other CPU), and once more if an engine died."""
    best: Cell | None = None
    tries = died = 0
    while tries < 1 + args.retries:
        try:
            cell = await _run(target.stack, stream, c, script, args, tmp)
        except EngineDied as exc:
            where = f"{target.name} ({'streaming' if stream else 'non-streaming'}, {c} conn)"
            deaths.append(f"{exc} (while measuring {where})")
            print(f"  {target.name}: {exc}", file=sys.stderr)
            died += 1
            if died > 1:
                raise
            continue
        tries += 1
        if best is None or cell.cpu["other"] < best.cpu["other"]:
            best = cell
        best.attempts = tries
        if best.cpu["other"] <= args.max_other:
            break
    assert best is not None
    return best


async def measure(targets: list[Target], args: argparse.Namespace, tmp: Path, deaths: list[str]) -> None:
    conns = [int(c) for c in args.connections.split(",")]
    scripts = {s: wrk.write_script(tmp, f"chat-{int(s)}", body(s)) for s in (False, True)}
    for rnd in range(args.rounds):
        k = rnd % len(targets)
        order = targets[k:] + targets[:k]
        for stream in (False, True):
            for c in conns:
                for t in order:
                    if t.error:
                        continue
                    try:
                        cell = await measure_row(t, stream, c, scripts[stream], args, tmp, deaths)
                    except Exception as exc:  # recorded in the results; the run goes on
                        t.error = f"{type(exc).__name__}: {exc}".strip()
                        print(f"  {t.name}: {t.error}", file=sys.stderr)
                        continue
                    t.runs.setdefault((stream, c), []).append(cell)
                    r = cell.r
                    print(
                        f"  round {rnd + 1} {t.name} {'stream' if stream else 'plain'} c={c}: "
                        f"{r.rps:,.0f} req/s, p50 {r.p50_ms:.2f} ms, proxy CPU "
                        f"{cell.cpu.get('proxy', 0):.0f}%, {cell.per_cpu:,.0f} req/CPU-s, other CPU "
                        f"{cell.cpu['other']:.0f}%, non-2xx {r.non2xx}, errors {r.socket_errors}",
                        file=sys.stderr,
                    )


async def amain(args: argparse.Namespace) -> int:
    only = set(filter(None, args.only.split(",")))
    if not wrk.available():
        if not only:  # a partial run never writes bench/results, not even to say it did not run
            not_run = "Not run: `wrk` is not on PATH (`make bench-deps`)."
            RESULTS.write_text(f"# HTTP stack benchmark\n\n{not_run}\n")
        print("wrk not found; run `make bench-deps` as root", file=sys.stderr)
        return 1
    unknown = only - {"direct", *STACKS}
    if unknown:
        print(f"unknown --only entries: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    targets = [Target(DIRECT, "the decode sim engine itself, no proxy (the floor)", None)]
    targets += [Target(s, HOW[s], s) for s in STACKS]
    targets = [t for t in targets if not only or (t.stack or "direct") in only]
    deaths: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-http-stack-") as d:
        await measure(targets, args, Path(d), deaths)
    text = render(targets, args, deaths)
    if not only:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(text)
    print(text)
    return 0


# -- the report ---------------------------------------------------------------------------------


def _versions() -> str:
    out = []
    for pkg in ("aiohttp", "httptools", "uvloop", "orjson"):
        try:
            out.append(f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            out.append(f"{pkg} (not installed)")
    return ", ".join(out)


def _row(t: Target, c: Cell, base: Cell | None) -> str:
    r = c.r
    scores = [x.score for x in t.all(c.stream, c.conns)]
    spread = f"{min(scores):,.0f} to {max(scores):,.0f}" if len(scores) > 1 else "—"
    vs = f"{c.per_cpu / base.per_cpu:.2f}x" if c.proxied and base and base.per_cpu else "—"
    pct = f"{c.cpu['proxy']:.0f}%" if c.proxied else "—"
    per = f"**{c.per_cpu:,.0f}**" if c.proxied else "—"
    return (
        f"| {t.name} | {r.rps:,.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | {r.max_ms:.1f} "
        f"| {r.non2xx} | {r.socket_errors} | {pct} | {per} | {spread} | {vs} "
        f"| {c.cpu['prefill']:.0f}% | {c.cpu['decode']:.0f}% | {c.cpu['wrk']:.0f}% | {c.cpu['other']:.0f}% "
        f"| {c.legs[0]:.2f} / {c.legs[1]:.2f} |"
    )


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _fmt_range(xs: list[float], fmt: str) -> str:
    return f"{format(min(xs), fmt)} to {format(max(xs), fmt)}" if len(xs) > 1 else ""


def per_cpu_ratios(t: Target, base: Target, stream: bool, conns: list[int]) -> list[float]:
    """Per round: the geometric mean over the connection counts of ``t``'s req/s per proxy
    CPU-second over ``base``'s in the same round (rounds where a row is missing are left out)."""
    out = []
    for i in range(max((len(t.all(stream, c)) for c in conns), default=0)):
        rs = []
        for c in conns:
            x, b = t.all(stream, c), base.all(stream, c)
            if i < len(x) and i < len(b) and x[i].per_cpu and b[i].per_cpu:
                rs.append(x[i].per_cpu / b[i].per_cpu)
        if len(rs) == len(conns):
            out.append(_geomean(rs))
    return out


def verdicts(targets: list[Target], conns: list[int]) -> list[str]:
    stacks = [t for t in targets if t.stack and t.runs]
    by = {t.name: t for t in stacks}
    if BASELINE not in by or len(stacks) < 2:
        return [f"- no verdict: {BASELINE} and at least one other stack must have results."]
    base = by[BASELINE]
    out: list[str] = []
    for stream in (False, True):
        mode = "Streaming" if stream else "Non-streaming"
        ratios = {t.name: rs for t in stacks if (rs := per_cpu_ratios(t, base, stream, conns))}
        p50s = {t.name: [x.r.p50_ms for x in t.all(stream, 1) if x.r.rps > 0] for t in stacks}
        p50s = {k: v for k, v in p50s.items() if v}
        med = {k: statistics.median(v) for k, v in ratios.items()}
        mp50 = {k: statistics.median(v) for k, v in p50s.items()}
        parts = []
        if med:
            best = max(med, key=lambda n: med[n])
            rng = _fmt_range(ratios[best], ".2f")
            parts.append(
                f"most req/s per proxy CPU-second: **{best}**, {med[best]:.2f}x {BASELINE}'s "
                f"(geometric mean over {', '.join(map(str, conns))} connections, median round"
                f"{f'; rounds {rng}' if rng else ''})"
            )
        if mp50 and BASELINE in mp50:
            fastest = min(mp50, key=lambda n: mp50[n])
            parts.append(
                f"lowest p50 at 1 connection: **{fastest}**, {mp50[fastest]:.2f} ms = "
                f"{mp50[fastest] / mp50[BASELINE]:.2f}x {BASELINE}'s {mp50[BASELINE]:.2f} ms "
                "(median of the rounds' p50s)"
            )
        out.append(f"- {mode}: {'; '.join(parts) or 'no comparison'}.")
        out += _chosen(ratios, p50s)
        for c in conns:
            row = {t.name: x for t in stacks if (x := t.cell(stream, c)) is not None and x.per_cpu}
            if row and BASELINE in row:
                w = max(row, key=lambda n: row[n].per_cpu)
                v = max(row, key=lambda n: row[n].r.rps)
                out.append(
                    f"  - {c} conn: most req/s per proxy CPU-second {w} ({row[w].per_cpu:,.0f}, "
                    f"{row[w].per_cpu / row[BASELINE].per_cpu:.2f}x {BASELINE}); most req/s "
                    f"{v} ({row[v].r.rps:,.0f}, {row[v].r.rps / row[BASELINE].r.rps:.2f}x {BASELINE})."
                )
    return out


def _chosen(ratios: dict[str, list[float]], p50s: dict[str, list[float]]) -> list[str]:
    """Whether Motor's stack won, said plainly either way. A lead is called within the noise
    when the two stacks' ranges over the rounds overlap."""
    if CHOSEN not in ratios or CHOSEN not in p50s:
        return [f"  - {CHOSEN} (Motor's stack) has no complete result in this mode."]
    med = {k: statistics.median(v) for k, v in ratios.items()}
    mp50 = {k: statistics.median(v) for k, v in p50s.items()}
    lost = []
    best = max(med, key=lambda n: med[n])
    if best != CHOSEN:
        lead = med[best] / med[CHOSEN] - 1
        noise = " (within the spread of the rounds)" if max(ratios[CHOSEN]) >= min(ratios[best]) else ""
        lost.append(f"{best} gets {lead:.0%} more req/s per proxy CPU-second{noise}")
    fastest = min(mp50, key=lambda n: mp50[n])
    if fastest != CHOSEN:
        lead = 1 - mp50[fastest] / mp50[CHOSEN]
        noise = " (within the spread of the rounds)" if min(p50s[CHOSEN]) <= max(p50s[fastest]) else ""
        lost.append(f"{fastest} has a {lead:.0%} lower p50 at 1 connection{noise}")
    if not lost:
        return [f"  - {CHOSEN} (Motor's stack) wins on both."]
    return [f"  - **{CHOSEN} (Motor's stack) does NOT win here**: {'; '.join(lost)}."]


def _noisy(targets: list[Target], limit: float) -> list[str]:
    """Which runs were re-measured, and which still shared the machine with other jobs."""
    runs = [(t, c) for t in targets for cells in t.runs.values() for c in cells]
    again = [(t, c) for t, c in runs if c.attempts > 1]
    still = [(t, c) for t, c in runs if c.cpu["other"] > limit]

    def name(t: Target, c: Cell) -> str:
        return f"{t.name} ({'streaming' if c.stream else 'non-streaming'}, {c.conns} conn)"

    out = []
    if again:
        out.append(
            f"Re-measured because other jobs took CPU: {len(again)} of {len(runs)} runs "
            f"({', '.join(name(t, c) for t, c in again)})."
        )
    if still:
        rows = ", ".join(f"{name(t, c)} {c.cpu['other']:.0f}%" for t, c in still)
        out.append(f"Runs still above {limit:g}% other CPU after re-measuring: {rows}.")
    return [*out, ""] if out else []


def render(targets: list[Target], args: argparse.Namespace, deaths: list[str]) -> str:
    conns = [int(c) for c in args.connections.split(",")]
    head = (
        "| target | req/s | p50 ms | p99 ms | max ms | non-2xx | socket errors | proxy CPU "
        "| req/s per proxy CPU-s | rounds' range | per CPU vs aiohttp | prefill CPU | decode CPU "
        "| wrk CPU | other CPU | legs/req P / D |"
    )
    by = {t.name: t for t in targets}
    sections = []
    for stream in (False, True):
        mode = 'Streaming (`"stream": true`)' if stream else "Non-streaming"
        for c in conns:
            base = by[BASELINE].cell(stream, c) if BASELINE in by else None
            rows = [_row(t, x, base) for t in targets if (x := t.cell(stream, c)) is not None]
            title = f"## {mode}, {c} connection{'s' if c > 1 else ''}"
            sections += [title, "", head, "|" + "---|" * 16, *rows, ""]
    missing = [f"- {t.name}: not measured (fully): {t.error}" for t in targets if t.error]
    death_lines = [f"- {x}" for x in deaths]
    return "\n".join(
        [
            "# HTTP stack for the inference port: aiohttp vs asyncio protocols + httptools, uvloop, orjson",
            "",
            machine(),
            "",
            f"Libraries: {_versions()}.",
            "",
            "Method: every stack runs the same minimal vLLM-style PD proxy "
            "(`bench/loadgen/stack_proxy.py`, its own process): parse the request JSON, send the "
            'prefill leg (`"stream": false`, `"max_tokens": 1`, `kv_transfer_params` '
            '`{"do_remote_decode": true, ...}`) to the prefill engine, read its JSON answer, splice '
            "its `kv_transfer_params` into the client's original bytes (no re-encode), send that to "
            "the decode engine over a pooled keep-alive connection, relay the answer (chunk by "
            "chunk when streaming). Engines: `motor engine-sim` at zero latency, a prefill "
            "(kv_producer) and a decode (kv_consumer), loopback only. Every measured run starts "
            "fresh processes (both engines and the proxy), so no run inherits another's state "
            "(pooled connections, the prefill engine's ticket store, a grown heap). Load: wrk 2 "
            "threads (1 at 1 connection), keep-alive, a Lua script POSTing a chat completion (one "
            f"short user message, max_tokens 16); {args.warmup:g} s warm-up then {args.seconds:g} s "
            "measured, after waiting (up to 15 s) for a quiet machine. A run during which other "
            f"jobs took more than {args.max_other:g}% of a core is measured again (up to "
            f"{args.retries} more time{'s' if args.retries != 1 else ''}, keeping the run with the "
            f"least other CPU). {args.rounds} round{'s' if args.rounds != 1 else ''}: each round "
            "measures every row of every target once, the targets taking turns row by row in an "
            "order rotated each round, so a drift in the machine's speed spreads over all of them; "
            "each row shows its median round by req/s per proxy CPU-second (by req/s for the "
            "direct row).",
            "",
            "Targets:",
            "",
            *[f"- {t.name}: {t.how}" for t in targets],
            "",
            "Columns: req/s counts 2xx answers only; p50/p99/max are wrk's latency percentiles; CPU "
            "is % of one core over the measured run from /proc; **req/s per proxy CPU-s** is "
            "answered requests per CPU-second the proxy spent, the stack's cost per request and "
            "the fairest single number here, since wrk, both engines and the proxy share the "
            "machine's cores (a cheaper proxy leaves more CPU to the engines); rounds' range is "
            "that number's lowest and highest over the rounds (req/s for the direct row); per CPU "
            "vs aiohttp is that number over aiohttp's in the same table; other CPU is the "
            "machine's user + system time not spent by the engines, the proxy, wrk or the bench "
            "itself, plus time the hypervisor stole (other jobs; interrupt and softirq time are "
            f"not in it; ideally near 0; {100 * (os.cpu_count() or 1)}% = every core); legs/req "
            "P / D are the prefill and decode engines' `motor_sim_pd_legs_total` deltas per "
            "request (1.00 / 1.00: every request made a prefill leg and a decode leg the engine "
            "recognised by its spliced kv_transfer_params; 0 / 0 for the direct row by design).",
            "",
            *sections,
            "## Verdict",
            "",
            *verdicts(targets, conns),
            "",
            *(["## Missing rows", "", *missing, ""] if missing else []),
            *(["## Engine deaths (those runs were redone)", "", *death_lines, ""] if deaths else []),
            *_noisy(targets, args.max_other),
            "Absolute numbers move between runs and with the engines' speed; compare within one "
            "run. Where the machine's cores are all busy (engines + proxy + wrk) or one engine "
            "nears 100%, req/s is capped by the machine or the engine rather than by the stack: "
            "that is why req/s per proxy CPU-second, not req/s, ranks the stacks.",
            "",
        ]
    )


main = entry(amain, parse)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
