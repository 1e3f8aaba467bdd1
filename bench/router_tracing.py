"""What tracing costs Motor's Coordinator, a part of the router benchmark (bench/bench_router.py).

Four Coordinators run at once: Motor as it was before inference tracing was added (BEFORE_TRACING,
from a copy of that commit's code), and today's Motor with tracing off (no OpenTelemetry variable,
the Motor target's configuration exactly), on but every request sampled out, and on with every
request exported to an OTLP/gRPC sink in the benchmark's process that only counts the spans. Each
row is measured on all of them in turn, before and off twice in mirror image (ROTATION), so drift
over the row touches the two alike and each one's two runs show the noise between two measurements
of one Coordinator. The section it renders judges tracing off against before (the target: tracing
off costs nothing, within that noise) and compares the other two with off.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from bench.loadgen import wrk
from bench.loadgen.harness import REPO, Proc, clean_env
from bench.loadgen.router_rows import Cell, Target, body, connections, measure_cell, start_motor

# The last commit before inference tracing was added: the baseline that tracing off is judged
# against. Its services/ and gen/ are copied out with `git archive` (the checkout is not touched).
BEFORE_TRACING = "bd27dbecb8ff97cb353896394c0f97fb620effc9"
BEFORE = "before tracing"
# (label, OpenTelemetry variables besides the endpoint; None = tracing off).
TRACING: tuple[tuple[str, dict[str, str] | None], ...] = (
    ("off", None),
    ("on, sampled out", {"OTEL_TRACES_SAMPLER": "parentbased_always_off"}),
    ("on, every request", {"OTEL_TRACES_SAMPLER": "always_on"}),
)
# The order the Coordinators are measured in, every row: before and off twice, in mirror image,
# so a drift linear over the row moves their pooled runs alike.
ROTATION = (BEFORE, "off", "on, sampled out", "on, every request", "off", BEFORE)
# Tracing off is judged to cost something only past the larger of this and the row-to-row noise
# between two runs of the before Coordinator.
NOISE_FLOOR = 0.03
# Run in the environment the before Coordinator gets: where its code comes from, and that it has
# no tracing module (it is the code before tracing).
_WHERE = (
    "import importlib.util, services, motor.v1.coordinator_pb2 as pb; "
    "print(services.__file__, pb.__file__, importlib.util.find_spec('services.coordinator.tracing'))"
)


class SpanSink:
    """An OTLP/gRPC trace receiver that counts the spans it is sent and keeps nothing."""

    def __init__(self) -> None:
        self.spans = 0
        self._server = grpc.aio.server()

    async def _export(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        msg = trace_service_pb2.ExportTraceServiceRequest.FromString(request)
        self.spans += sum(len(ss.spans) for rs in msg.resource_spans for ss in rs.scope_spans)
        return b""  # an empty ExportTraceServiceResponse: everything accepted

    async def start(self) -> str:
        export: grpc.RpcMethodHandler = grpc.unary_unary_rpc_method_handler(self._export)  # raw bytes
        service = "opentelemetry.proto.collector.trace.v1.TraceService"
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"Export": export}),)
        )
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        await self._server.stop(None)


async def _run(*argv: str, env: dict[str, str] | None = None) -> str:
    """``argv``'s standard output, run in the checkout; a failure raises with its last words."""
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    if proc.returncode:
        last = (err.decode(errors="replace").strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise RuntimeError(f"`{Path(argv[0]).name}`: {last}")
    return out.decode()


async def start_before(pf_url: str, de_url: str, tmp: Path) -> tuple[Proc, str]:
    """Motor's Coordinator at BEFORE_TRACING, started as the Motor target is, from a copy of that
    commit's services/ and gen/ under ``tmp``."""
    tree, archive = tmp / "before-tracing", tmp / "before-tracing.tar"
    tree.mkdir()
    await _run("git", "-C", str(REPO), "archive", "-o", str(archive), BEFORE_TRACING, "services", "gen")
    await _run("tar", "-x", "-f", str(archive), "-C", str(tree))
    # The processes run in the checkout, and `python -m` would put it ahead of PYTHONPATH:
    # PYTHONSAFEPATH stops that, in the Coordinator and in the workers it starts (they inherit
    # its environment).
    env = {"PYTHONPATH": f"{tree}{os.pathsep}{tree / 'gen'}", "PYTHONSAFEPATH": "1"}
    services, pb, tracing = (await _run(sys.executable, "-c", _WHERE, env=clean_env(**env))).split()
    if not (services.startswith(f"{tree}/") and pb.startswith(f"{tree}/") and tracing == "None"):
        raise RuntimeError(f"the copy of {BEFORE_TRACING[:12]} is not what Python imports: {services} {pb}")
    return await start_motor(pf_url, de_url, tmp, env=env, tag="-before", package="services")


async def run_tracing(
    pf_url: str, de_url: str, pair: dict[str, Proc], args: argparse.Namespace, tmp: Path
) -> list[Target]:
    """The four Coordinators (default workers), all running at once (idle but for the one under
    load), each row measured on them in ROTATION order; a second run of a Coordinator goes to a
    target of its own (", 2nd run"). Each tracing variant exports to a sink of its own; its spans
    are counted once its Coordinator stopped (it exports what it still held). Without the before
    Coordinator (no git, or a clone without that commit) the others are measured all the same."""
    before = Target(BEFORE, f"Motor at commit {BEFORE_TRACING[:12]}, the last before tracing")
    first = {BEFORE: before, **{label: Target(f"tracing {label}", "") for label, _ in TRACING}}
    again = {key: Target(f"{first[key].name}, 2nd run", "") for key in (BEFORE, "off")}
    running: dict[str, tuple[Proc, str]] = {}
    sinks: list[tuple[Target, SpanSink]] = []
    try:
        try:
            running[BEFORE] = await start_before(pf_url, de_url, tmp)
        except Exception as exc:  # stated in the section; tracing is still measured
            before.error = f"{type(exc).__name__}: {exc}".strip()
            print(f"  {BEFORE}: {before.error}", file=sys.stderr)
        for i, (label, otel) in enumerate(TRACING):
            sink = SpanSink()
            sinks.append((first[label], sink))
            env = None if otel is None else {**otel, "OTEL_EXPORTER_OTLP_ENDPOINT": await sink.start()}
            running[label] = await start_motor(pf_url, de_url, tmp, env=env, tag=f"-tracing{i}")
        for stream in (False, True):
            script = wrk.write_script(tmp, f"chat-{int(stream)}", body(stream))
            for c in connections(args):
                done: set[str] = set()
                for key in (k for k in ROTATION if k in running):
                    target = again[key] if key in done else first[key]
                    done.add(key)
                    proc, url = running[key]
                    await measure_cell(target, url, {**pair, "router": proc}, pf_url, args, script, stream, c)
    except Exception as exc:  # recorded in the results; the run goes on
        for target in [*first.values(), *again.values()]:
            target.error = target.error or f"{type(exc).__name__}: {exc}".strip()
        print(f"  tracing: {first['off'].error}", file=sys.stderr)
    finally:
        for proc, _ in running.values():
            await proc.stop()
        for target, sink in sinks:
            target.spans = sink.spans
            await sink.stop()
    return [*first.values(), *again.values()]


def _x(a: float, b: float) -> float:
    return a / b if b else 0.0


def _row(c: Cell) -> str:
    return f"{'stream' if c.stream else 'plain'} {c.conns} conn"


def _pairs(t: Target, base: Target) -> list[tuple[Cell, Cell]]:
    """(t's row, base's row) for every row both measured with an answer."""
    out = []
    for c in t.cells:
        b = base.cell(c.stream, c.conns)
        if b is not None and b.r.rps and c.r.rps:
            out.append((c, b))
    return out


def _rps(c: Cell) -> float:
    return c.r.rps


def _p50(c: Cell) -> float:
    return c.r.p50_ms


def _us(c: Cell) -> float:
    return c.router_us()


def _spread(pairs: list[tuple[Cell, Cell]], value: Callable[[Cell], float], worst: str) -> str:
    """The median over the rows of ``value`` of t's row divided by base's, and the worst row
    (the highest ratio when ``worst`` is "max", the lowest when "min")."""
    ratios = [(_x(value(c), value(b)), c) for c, b in pairs]
    w, wc = (max if worst == "max" else min)(ratios, key=lambda rc: rc[0])
    return f"{statistics.median(r for r, _ in ratios):.2f}x median (worst row {w:.2f}x, {_row(wc)})"


def _worst_latency(pairs: list[tuple[Cell, Cell]], names: tuple[str, str]) -> str:
    c = max((c for c, _ in pairs), key=lambda c: c.r.max_ms)
    b = max((b for _, b in pairs), key=lambda b: b.r.max_ms)
    return f"{c.r.max_ms:.1f} ms ({_row(c)}) vs {names[1]}'s {b.r.max_ms:.1f} ms ({_row(b)})"


def pooled(name: str, a: Target, b: Target) -> Target:
    """One Coordinator's two runs of every row as one: requests, time and CPU summed (so req/s and
    CPU per request cover both), p50 and p99 the mean of the two, max the worse."""
    out = Target(name, a.how, sent=a.sent + b.sent, spans=a.spans + b.spans)
    for x in a.cells:
        if (y := b.cell(x.stream, x.conns)) is None:
            continue
        r = wrk.WrkResult(
            x.r.requests + y.r.requests,
            x.r.seconds + y.r.seconds,
            x.r.non2xx + y.r.non2xx,
            x.r.socket_errors + y.r.socket_errors,
            (x.r.p50_ms + y.r.p50_ms) / 2,
            (x.r.p99_ms + y.r.p99_ms) / 2,
            max(x.r.max_ms, y.r.max_ms),
        )
        cpu = {k: (v + y.cpu.get(k, 0.0)) / 2 for k, v in x.cpu.items()}  # % over equal runs
        m, legs = (x.machine_pct + y.machine_pct) / 2, (x.legs_per_req + y.legs_per_req) / 2
        out.cells.append(Cell(x.stream, x.conns, r, cpu, m, legs))
    return out


def _aa(runs: dict[str, Target], key: str, c: Cell, value: Callable[[Cell], float]) -> str:
    """``key``'s 2nd run of ``c``'s row divided by its 1st."""
    one, two = runs[key].cell(c.stream, c.conns), runs[f"{key}, 2nd run"].cell(c.stream, c.conns)
    return f"{_x(value(two), value(one)):.2f}x" if one and two and value(one) else "—"


def _judge(
    what: str, pairs: list[tuple[Cell, Cell]], aa: list[tuple[Cell, Cell]], value: Callable[[Cell], float]
) -> tuple[bool, str]:
    """Whether off ÷ before of ``value``, the median over the rows, is within the noise; a line
    that says why."""
    med = statistics.median(_x(value(c), value(b)) for c, b in pairs)
    same = [_x(value(c), value(b)) for c, b in aa]
    noise = statistics.median(abs(r - 1) for r in same)
    bar = max(NOISE_FLOOR, noise)
    ok = abs(med - 1) <= bar
    return ok, (
        f"- {what}, off ÷ before: {_spread(pairs, value, 'max' if value is _us else 'min')}. A/A, "
        f"before's 2nd run ÷ its 1st: {min(same):.2f}x to {max(same):.2f}x over the rows, {noise:.1%} "
        f"from 1 in the median row. |{med:.2f} - 1| = {abs(med - 1):.1%} "
        f"{'≤' if ok else '>'} {bar:.1%}: {'within' if ok else 'beyond'} the noise."
    )


def off_vs_before(runs: dict[str, Target], motor: Target | None) -> list[str]:
    """Tracing off against Motor before tracing, both pooled over their two runs, and the verdict;
    ``runs`` by name, 2nd runs included."""
    before = runs[BEFORE]
    if before.error:
        return [
            f"Not judged: Motor before tracing (commit {BEFORE_TRACING[:12]}) did not run: {before.error}",
            "",
        ]
    a, b = (
        pooled("off", runs["tracing off"], runs["tracing off, 2nd run"]),
        pooled(BEFORE, before, runs[f"{BEFORE}, 2nd run"]),
    )
    pairs, aa = _pairs(a, b), _pairs(runs[f"{BEFORE}, 2nd run"], before)
    if not pairs or not aa:
        return ["Not judged: no row was measured twice on both tracing off and before tracing.", ""]
    rows = [
        f"| {'stream' if c.stream else 'plain'} | {c.conns} | {b.r.rps:,.0f} / {c.r.rps:,.0f} "
        f"| {_x(c.r.rps, b.r.rps):.2f}x | {_aa(runs, BEFORE, c, _rps)} / {_aa(runs, 'tracing off', c, _rps)} "
        f"| {b.r.p50_ms:.2f} / {c.r.p50_ms:.2f} | {b.r.max_ms:.1f} / {c.r.max_ms:.1f} "
        f"| {_us(b):.0f} / {_us(c):.0f} | {_x(_us(c), _us(b)):.2f}x "
        f"| {_aa(runs, BEFORE, c, _us)} / {_aa(runs, 'tracing off', c, _us)} |"
        for c, b in pairs
    ]
    cpu_ok, cpu = _judge("router CPU per request", pairs, aa, _us)
    rps_ok, rps = _judge("req/s", pairs, aa, _rps)
    missed = [w for w, ok in (("CPU per request", cpu_ok), ("req/s", rps_ok)) if not ok]
    verdict = (
        "target met: tracing off costs nothing measurable"
        if not missed
        else f"**target missed**: off differs from before tracing beyond the noise in {' and '.join(missed)}"
    )
    earlier = [] if motor is None else _pairs(a, motor)
    return [
        "| mode | conns | req/s before / off | req/s off ÷ before | req/s A/A before / off "
        "| p50 ms before / off | max ms before / off | router µs/req before / off "
        "| µs/req off ÷ before | µs/req A/A before / off |",
        "|" + "---|" * 10,
        *rows,
        "",
        cpu,
        rps,
        f"- p50, off ÷ before: {_spread(pairs, _p50, 'max')}; worst case: off's slowest request "
        f"{_worst_latency(pairs, ('off', 'before'))}.",
        *(
            [
                "- For reference, not judged: off against the Motor rows above, measured minutes earlier "
                f"and not interleaved: router CPU per request {_spread(earlier, _us, 'max')}; req/s "
                f"{_spread(earlier, _rps, 'min')}."
            ]
            if earlier
            else []
        ),
        f"- Verdict: {verdict}.",
        "",
    ]


def on_vs_off(traced: list[Target], off: Target) -> list[str]:
    """Every variant against tracing off, row by row (same mode, same connections)."""
    rows, summary = [], []
    for t in traced:
        pairs = _pairs(t, off)
        for c, b in pairs:
            per_req = f"{t.spans / t.sent:.2f}" if t.sent else "—"
            rows.append(
                f"| {t.name.removeprefix('tracing ')} | {'stream' if c.stream else 'plain'} | {c.conns} "
                f"| {c.r.rps:,.0f} | {_x(c.r.rps, b.r.rps):.2f}x | {c.r.p50_ms:.2f} "
                f"| {_x(c.r.p50_ms, b.r.p50_ms):.2f}x | {c.r.p99_ms:.2f} | {c.r.max_ms:.1f} "
                f"| {_x(c.r.max_ms, b.r.max_ms):.2f}x | {c.router_us():.0f} "
                f"| {_x(c.router_us(), b.router_us()):.2f}x | {per_req} |"
            )
        if t is not off and pairs:
            summary.append(
                f"- {t.name.removeprefix('tracing ')}: req/s {_spread(pairs, _rps, 'min')}; p50 "
                f"{_spread(pairs, _p50, 'max')}; router CPU per request {_spread(pairs, _us, 'max')}; "
                f"worst case: its slowest request {_worst_latency(pairs, ('it', 'off'))}."
            )
    if not rows:
        return []
    return [
        "| tracing | mode | conns | req/s | req/s vs off | p50 ms | p50 vs off | p99 ms | max ms "
        "| max vs off | router µs/req | µs/req vs off | spans/req |",
        "|" + "---|" * 13,
        *rows,
        "",
        "Against tracing off, over the rows (no target: this is what turning tracing on costs):",
        "",
        *summary,
        "",
    ]


def section(traced: list[Target], motor: Target | None) -> list[str]:
    """The results file's tracing section: ``traced`` from run_tracing, ``motor`` the Motor
    target of the same run (None when it was not measured)."""
    runs = {t.name: t for t in traced}
    if "tracing off" not in runs:
        return []
    off = pooled("tracing off", runs["tracing off"], runs["tracing off, 2nd run"])
    errors = [f"- {t.name}: not measured: {t.error}" for t in traced if t.error and t.name != BEFORE]
    return [
        "## What tracing costs Motor",
        "",
        "Four Coordinators run at once, default workers, the same command and config as the Motor "
        f"target: before, Motor at commit `{BEFORE_TRACING[:12]}`, the last before inference tracing "
        "was added (its `services/` and `gen/` from `git archive`, run by the same Python); and "
        "today's Motor with tracing off (no OpenTelemetry variable), on but sampled out, and on "
        "with every request exported. Each row is measured on them in turn, the other three idle, "
        "in the order before, off, sampled out, every request, off, before: before and off run "
        "twice in mirror image, so a drift over the row moves them alike. Figures for before and "
        "off pool their two runs (requests, time and CPU summed; p50 the mean of the two; max the "
        "worse); A/A is a Coordinator's 2nd run of the row divided by its 1st, the noise between "
        "two measurements of one thing. router µs/req is the Coordinator's CPU time (all its "
        "processes) per answered request, the steadiest measure of its own cost on a machine it "
        "shares with the load.",
        "",
        "Target: tracing off costs nothing. Without an OTLP endpoint the Coordinator imports nothing "
        "of OpenTelemetry and makes no tracer. Judged on router CPU per request and on req/s alike: "
        "the median over the rows of off ÷ before is within the noise, |median - 1| ≤ the larger "
        f"of {NOISE_FLOOR:.0%} and the A/A spread (the median over the rows of |before's 2nd run ÷ "
        "its 1st - 1|).",
        "",
        *off_vs_before(runs, motor),
        "Tracing on against tracing off, the same rows: on with `OTEL_EXPORTER_OTLP_ENDPOINT` and "
        "`OTEL_TRACES_SAMPLER=parentbased_always_off` (spans made, context passed to the engines "
        "and back to the client, nothing recorded); on with `OTEL_TRACES_SAMPLER=always_on`, every "
        "span exported (batched, the SDK's defaults) to an OTLP/gRPC sink in the bench process that "
        "only counts them (its CPU is not in the router column). Off is its two runs pooled. "
        "spans/req: spans the sink received over every request of the variant, warm-ups included "
        "(3 = the request's span and its two legs; below 3, the batch processor dropped some: its "
        "queue holds 2,048).",
        "",
        *on_vs_off([off, runs["tracing on, sampled out"], runs["tracing on, every request"]], off),
        *errors,
        *([""] if errors else []),
    ]
