"""Router throughput and latency: Motor's Coordinator against vllm-router and sglang-router.

Every target sits in front of zero-latency simulated engines (a prefill and a decode), so the
router's own cost is what is measured. Targets: the decode engine directly (the floor), Motor's
Coordinator (engines added through gRPC AddInstances), vllm-router (`--vllm-pd-disaggregation`)
and sglang-router (`--pd-disaggregation`, in front of a second pair of sim engines speaking the
SGLang bootstrap protocol). Load: wrk (2 threads, keep-alive) with a Lua script POSTing a chat
completion (max_tokens 16), non-streaming and streaming, at 1, 32 and 128 connections; a warm-up
run, then the measured one. CPU of every engine and router comes from /proc. Then what tracing
costs Motor (bench/router_tracing.py): the Coordinator as it was before tracing existed, and the
current one with tracing off, on but sampled out, and on with every request exported to a span
sink in this process, measured in rotation. Writes bench/results/router.md.

    python -m bench.bench_router [--seconds 10] [--warmup 2] [--connections 1,32,128]
    python -m bench.bench_router --only tracing      # just the tracing comparison, printed
    make bench ARGS=router
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench import router_tracing
from bench.loadgen import peers, profile, wrk
from bench.loadgen.harness import Proc, entry, machine
from bench.loadgen.router_rows import Cell, Target, body, connections, measure, start_motor

RESULTS = Path(__file__).parent / "results" / "router.md"
PEERS = ("vllm-router", "sglang-router")
RPS_TARGET = 1.5
KV = '{{"kv_connector":"NixlConnector","kv_role":"{}"}}'


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench_router")
    p.add_argument("--seconds", type=float, default=10.0, help="measured time per cell")
    p.add_argument("--warmup", type=float, default=2.0, help="warm-up wrk run before each cell")
    p.add_argument("--connections", default="1,32,128")
    p.add_argument(
        "--only",
        default="",
        help="comma list of direct,motor,motor1,vllm,sglang,tracing: a quick partial run, printed "
        "and not written to bench/results (the results file only ever holds a whole run)",
    )
    return p.parse_args(argv)


async def run_target(
    target: Target,
    start: Awaitable[tuple[Proc | None, str]],
    pair: dict[str, Proc],
    prefill_base: str,
    args: argparse.Namespace,
    tmp: Path,
    profiled: bool = False,
) -> None:
    """``start`` gives the router (None for the direct target) and the URL to load.
    ``profiled``: then sample where the router's CPU goes, under load at 32 connections."""
    router: Proc | None = None
    try:
        router, url = await start
        procs = {**pair, **({"router": router} if router else {})}
        await measure(target, url, procs, prefill_base, args, tmp)
        if profiled and router is not None:
            await profile_under_load(target, url, router, args, tmp)
    except Exception as exc:  # recorded in the results; the run goes on
        target.error = f"{type(exc).__name__}: {exc}".strip()
        print(f"  {target.name}: {target.error}", file=sys.stderr)
    finally:
        if router:
            await router.stop()


async def profile_under_load(
    target: Target, url: str, router: Proc, args: argparse.Namespace, tmp: Path
) -> None:
    script = wrk.write_script(tmp, "chat-profile", body(False))
    load = asyncio.create_task(wrk.run(url, script, 32, args.seconds + 1))
    await asyncio.sleep(0.5)
    files = await profile.record(profile.session_pids(router.pid), args.seconds, tmp)
    await load
    target.hot, target.samples = profile.hottest(files)


async def start_peer(
    name: str, argv_for: Callable[[int, int], list[str]], tmp: Path
) -> tuple[Proc | None, str]:
    """A peer router on ``port`` (its metrics on ``port + 1``)."""

    async def launch(port: int) -> tuple[Proc | None, str]:
        proc = await peers.start_router(name, argv_for(port, port + 1), tmp)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        try:
            await peers.wait_serving(proc, url, json.dumps(body(False)).encode())
        except BaseException:
            await proc.stop()
            raise
        return proc, url

    return await peers.on_free_ports(launch)


async def nothing(url: str) -> tuple[Proc | None, str]:
    return None, url


async def amain(args: argparse.Namespace) -> int:
    only = set(filter(None, args.only.split(",")))
    if not wrk.available():
        if not only:  # a partial run never writes bench/results, not even to say it did not run
            not_run = "Not run: `wrk` is not on PATH (`make bench-deps`)."
            RESULTS.write_text(f"# Router benchmark\n\n{not_run}\n")
        print("wrk not found; run `make bench-deps` as root", file=sys.stderr)
        return 1
    versions: str | None = None
    venv_error = None
    if not only or only & {"vllm", "sglang"}:
        try:
            versions = await asyncio.to_thread(peers.ensure_venv)
        except Exception as exc:
            venv_error = f"could not install {' '.join(peers.PINS)}: {exc}"
    targets: list[Target] = []
    traced: list[Target] = []
    with tempfile.TemporaryDirectory(prefix="bench-router-") as d:
        tmp = Path(d)
        model = tmp / "model"
        model.mkdir()
        engines: list[Proc] = []
        try:
            pf, pf_url, _ = await peers.engine(
                "prefill", model, tmp, ["--kv-transfer-config", KV.format("kv_producer")]
            )
            engines.append(pf)
            de, de_url, _ = await peers.engine(
                "decode", model, tmp, ["--kv-transfer-config", KV.format("kv_consumer")]
            )
            engines.append(de)
            sg_mode = ["--protocol", "sglang", "--disaggregation-mode"]
            spf, spf_url, boot = await peers.engine("sg-prefill", model, tmp, [*sg_mode, "prefill"])
            engines.append(spf)
            sde, sde_url, _ = await peers.engine("sg-decode", model, tmp, [*sg_mode, "decode"])
            engines.append(sde)
            pair = {"prefill": pf, "decode": de}
            sg_pair = {"prefill": spf, "decode": sde}

            def wanted(key: str) -> bool:
                return not only or key in only

            direct = Target("direct to decode", "the decode sim engine itself, no router (the floor)")
            if wanted("direct"):
                targets.append(direct)
                await run_target(direct, nothing(f"{de_url}/v1/chat/completions"), pair, pf_url, args, tmp)

            motor = Target(
                "Motor",
                "`motor coordinator --port 0 --http-port 0` with the default `workers = 0` (one "
                "inference worker per core), engines added via gRPC AddInstances",
            )
            if wanted("motor"):
                targets.append(motor)
                await run_target(motor, start_motor(pf_url, de_url, tmp), pair, pf_url, args, tmp, True)
            motor1 = Target("Motor, 1 worker", "the same with `workers = 1` (one process serves everything)")
            if wanted("motor1"):
                targets.append(motor1)
                await run_target(motor1, start_motor(pf_url, de_url, tmp, 1), pair, pf_url, args, tmp)

            vr_argv = peers.vllm_router_argv("PORT", "http://PREFILL", "http://DECODE")
            vr = Target("vllm-router", f"`vllm-router {' '.join(vr_argv[1:])}`")
            sr_argv = peers.sglang_router_argv(
                "PORT", "http://SG_PREFILL", "BOOTSTRAP_PORT", "http://SG_DECODE"
            )
            sr = Target(
                "sglang-router",
                f"`python {' '.join(sr_argv[1:])}` (second sim pair, SGLang protocol)",
            )
            targets += [t for t, key in ((vr, "vllm"), (sr, "sglang")) if wanted(key)]
            if venv_error:
                vr.error = sr.error = venv_error
            else:
                if wanted("vllm"):
                    vr_start = start_peer(
                        "vllm-router", lambda p, m: peers.vllm_router_argv(p, pf_url, de_url, m), tmp
                    )
                    await run_target(vr, vr_start, pair, pf_url, args, tmp)
                if wanted("sglang"):
                    sr_start = start_peer(
                        "sglang-router",
                        lambda p, m: peers.sglang_router_argv(p, spf_url, str(boot), sde_url, m),
                        tmp,
                    )
                    await run_target(sr, sr_start, sg_pair, spf_url, args, tmp)
            if wanted("tracing"):
                traced = await router_tracing.run_tracing(pf_url, de_url, pair, args, tmp)
        finally:
            for e in engines:
                await e.stop()
    text = render(targets, args, versions or venv_error or "", traced)
    if not args.only:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(text)
    print(text)
    return 0


def _fmt_cell(t: Target, c: Cell) -> str:
    r = c.r
    router = f"{c.cpu['router']:.0f}%" if "router" in c.cpu else "—"
    return (
        f"| {t.name} | {c.conns} | {r.rps:,.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | {r.max_ms:.1f} "
        f"| {r.non2xx} | {r.socket_errors} | {c.cpu['prefill']:.0f}% | {c.cpu['decode']:.0f}% | {router} "
        f"| {c.machine_pct:.0f}% | {c.legs_per_req:.2f} |"
    )


def verdicts(targets: list[Target], conns: list[int]) -> list[str]:
    by = {t.name: t for t in targets}
    motor = by.get("Motor")
    if motor is None:
        return ["- no comparison: Motor was not measured in this run."]
    out = []
    for stream in (False, True):
        mode = "streaming" if stream else "non-streaming"
        for c in conns:
            m = motor.cell(stream, c)
            rivals = [(n, by[n].cell(stream, c)) for n in PEERS if n in by]
            got = [(n, x) for n, x in rivals if x is not None and x.r.rps > 0]
            if m is None or not got:
                out.append(f"- {mode}, {c} conn: no comparison (Motor or both peers have no result).")
                continue
            if c == 1:
                name, best = min(got, key=lambda nx: nx[1].r.p50_ms)
                ok = m.r.p50_ms <= best.r.p50_ms
                what = (
                    f"p50 Motor {m.r.p50_ms:.2f} ms vs {name} {best.r.p50_ms:.2f} ms "
                    f"({m.r.p50_ms / best.r.p50_ms:.2f}x); target ≤ the better peer's"
                )
            else:
                name, best = max(got, key=lambda nx: nx[1].r.rps)
                ratio = m.r.rps / best.r.rps
                ok = ratio >= RPS_TARGET
                what = (
                    f"req/s Motor / {name} = {m.r.rps:,.0f} / {best.r.rps:,.0f} = {ratio:.2f}x; "
                    f"target ≥ {RPS_TARGET}x"
                )
            verdict = "target met" if ok else "**target missed**"
            out.append(f"- {mode}, {c} conn: {what}: {verdict}.")
    return out


def _odd(targets: list[Target]) -> list[str]:
    """A note for rows whose p50 at one connection sits near the 40 ms delayed-ACK timer."""
    odd = [
        f"{t.name} ({'streaming' if c.stream else 'non-streaming'}, p50 {c.r.p50_ms:.1f} ms)"
        for t in targets
        for c in t.cells
        if c.conns == 1 and c.r.p50_ms >= 35
    ]
    if not odd:
        return []
    return [
        f"Note: at one connection {', '.join(odd)} sits at or above ~40 ms, the Linux TCP "
        "delayed-ACK timer, with the CPUs idle: a Nagle / delayed-ACK stall on that path rather "
        "than work (not investigated further here).",
        "",
    ]


def hot_section(targets: list[Target]) -> list[str]:
    motor = next((t for t in targets if t.name == "Motor"), None)
    if motor is None or not motor.hot:
        why = "py-spy not found (`pip install -e '.[bench]'`)" if profile.py_spy() is None else "no samples"
        return ["## Where Motor's CPU goes", "", f"Not profiled: {why}.", ""]
    rows = [f"| {h.share:.1%} | `{h.where}` | `{h.code}` |" for h in motor.hot]
    return [
        "## Where Motor's CPU goes",
        "",
        f"py-spy, 250 samples/s, over every Coordinator process while wrk ran 32 connections "
        f"non-streaming ({motor.samples:,} samples). Self time per Python line: time inside a C "
        "call (a socket write, the event loop's poll) counts against the line that made the call.",
        "",
        "| share | where | line |",
        "|---|---|---|",
        *rows,
        "",
    ]


def render(targets: list[Target], args: argparse.Namespace, versions: str, traced: list[Target]) -> str:
    conns = connections(args)
    head = (
        "| target | conns | req/s | p50 ms | p99 ms | max ms | non-2xx | socket errors "
        "| prefill CPU | decode CPU | router CPU | machine CPU | prefill legs/req |"
    )
    sections = []
    for stream in (False, True):
        rows = [_fmt_cell(t, c) for t in targets for c in t.cells if c.stream == stream]
        title = 'Streaming (`"stream": true`)' if stream else "Non-streaming"
        sections += [f"## {title}", "", head, "|" + "---|" * 13, *rows, ""]
    missing = [f"- {t.name}: not measured: {t.error}" for t in targets if t.error]
    by = {t.name: t for t in targets}
    by_conn = {}
    for c in conns:
        ratios = [
            x.r.rps / y.r.rps
            for s in (False, True)
            if "Motor" in by and "direct to decode" in by
            if (x := by["Motor"].cell(s, c)) and (y := by["direct to decode"].cell(s, c)) and y.r.rps
        ]
        if ratios:
            by_conn[c] = statistics.median(ratios)
    floor = ", ".join(f"{c} conn {v:.2f}x" for c, v in by_conn.items())
    return "\n".join(
        [
            "# Router overhead: Motor's Coordinator vs vllm-router and sglang-router",
            "",
            machine(),
            "",
            f"Peers: {versions} (in `.bench-venv/`, run with `HF_HUB_OFFLINE=1 "
            "HF_ENDPOINT=http://127.0.0.1:9`, loopback only). Load: wrk 2 threads "
            "(1 at 1 connection), keep-alive, a Lua script POSTing a chat completion "
            f"(one short user message, max_tokens 16); {args.warmup:g} s warm-up then {args.seconds:g} s "
            "measured per row, one run per row. Engines: `motor engine-sim` at zero latency (an "
            "empty temp dir as MODEL, served as `motor-sim`), a prefill (kv_producer) and a decode "
            "(kv_consumer); sglang-router gets its own pair started with `--protocol sglang "
            "--disaggregation-mode prefill|decode`.",
            "",
            "Targets:",
            "",
            *[f"- {t.name}: {t.how}" for t in targets],
            "",
            "Columns: req/s counts 2xx answers only; p50/p99/max are wrk's latency percentiles "
            "(max is the worst case of the row); CPU is % of one core over the measured run from "
            "/proc (every process of the target's session); machine CPU is the whole machine's "
            "busy time, 200% = both cores, wrk included; prefill legs/req is the prefill engine's "
            "`motor_sim_pd_legs_total` delta per request (1.00 = every request went through "
            "prefill, 0 for the direct target by design).",
            "",
            *sections,
            "## Targets",
            "",
            "Motor's req/s at 32 and 128 connections ≥ 1.5x the better Rust peer's; Motor's p50 at "
            "one connection ≤ the better peer's.",
            "",
            *verdicts(targets, conns),
            "",
            f"Motor / direct-to-decode req/s (median over both modes): {floor or 'n/a'}.",
            "",
            *hot_section(targets),
            *router_tracing.section(traced, next((t for t in targets if t.name == "Motor"), None)),
            *(["## Missing rows", "", *missing, ""] if missing else []),
            *_odd(targets),
            "Everything shares the machine's two cores (wrk, the router, two or four engines), so "
            "a router that uses less CPU leaves more to the engines and to wrk: read req/s with the "
            "CPU columns. Engine CPU near 100% means the one-event-loop engine, not the router, "
            "capped that row. Absolute numbers move between runs; compare within one run.",
            "",
        ]
    )


main = entry(amain, parse)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
