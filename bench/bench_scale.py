"""Control-plane scale: N simulated NodeManagers beating every 3 s
to one real Controller pinned to one core.

For each N: a Controller (``motor controller``, empty ``coordinators``, heartbeat interval 3 s,
heartbeat timeout 60 s) pinned to CPU 0; four generator processes (bench/loadgen/fleet.py)
pinned to CPU 1, each multiplexing N/4 nodes over 25 grpc.aio channels (100 connections in
all) and answering the Controller's GetStatus/StartEngines from one fake NodeManager server.
Each node registers its own one-endpoint job (its own instance), then streams beats. Measured:
assembly time (first Register → every instance ACTIVE in ListInstances), then over a steady
window the Controller's CPU, its own ``event=heartbeat_stats`` ack latency (server side), the
generators' round trip (client side, includes the generators' queueing) and CPU. The same
generators then drive the echo-only server (bench/loadgen/echo.py) at the same N, pinned the
same way: the Controller's CPU is reported as a ratio to it. The largest N is then run again
(``--repeat``, Controller only) to show the spread from one run to the next.

The target is judged per run on the Controller's CPU and on its WORST 10 s window's ack p99.
Everything in results/scale.md is written here; the measured numbers also go to
results/scale.json, from which ``--render-only`` writes scale.md again without running anything.

    python -m bench.bench_scale [--nodes 1000,5000,10000] [--window 45] [--echo-window 30] [--repeat 1]
    python -m bench.bench_scale --render-only
    python -m bench scale        (defaults; BENCH_SCALE_NODES=1000 to override)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

import grpc
from motor.v1 import common_pb2, controller_pb2, controller_pb2_grpc

from bench.loadgen.harness import Proc, clean_env, entry, machine, percentile, publish, system_cpu, wait_quiet

RESULTS = Path(__file__).parent / "results" / "scale.md"
RAW = RESULTS.with_suffix(".json")  # every measured number, for --render-only
INTERVAL_S = 3.0
GENERATORS = 4
CHANNELS_PER_GENERATOR = 25
CONTROLLER_CPU, LOAD_CPU = "0", "1"
TARGET_NODES, TARGET_CPU, TARGET_P99_MS = 10_000, 60.0, 100.0
STATS_LINE = re.compile(r"^.*event=heartbeat_stats .*$", re.M)
WINDOW_FIELDS = ("messages", "ack_p50_ms", "ack_p99_ms", "window_s", "gc_collections", "gc_max_ms")


def _ns(value: str) -> list[int]:
    return [int(v) for v in value.split(",") if v.strip()]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench_scale")
    p.add_argument("--nodes", type=_ns, default=_ns(os.environ.get("BENCH_SCALE_NODES", "1000,5000,10000")))
    p.add_argument("--window", type=float, default=45.0, help="steady window, Controller run (s)")
    p.add_argument("--echo-window", type=float, default=30.0, help="steady window, echo run (s)")
    p.add_argument("--rate", type=float, default=1000.0, help="max registrations/s (Controller run)")
    p.add_argument(
        "--inflight", type=int, default=16, help="max nodes registered, not yet assembled, per generator"
    )
    p.add_argument("--echo-rate", type=float, default=2000.0, help="max registrations/s (echo run)")
    p.add_argument("--no-echo", action="store_true")
    p.add_argument("--profile", metavar="DIR", help="py-spy record the Controller's window into DIR (raw)")
    p.add_argument("--keep-logs", metavar="DIR", help="copy the Controller/echo logs into DIR")
    p.add_argument("--budget", type=float, default=540.0, help="skip larger N past this many seconds")
    p.add_argument(
        "--repeat", type=int, default=1, help="more Controller runs at the largest N (run-to-run spread)"
    )
    p.add_argument(
        "--render-only", action="store_true", help=f"write {RESULTS.name} again from {RAW.name}, run nothing"
    )
    return p.parse_args(argv)


async def start_fleets(tmp: Path, target: str, n: int, tag: str, assume_started: bool) -> list[Proc]:
    fleets = []
    base = 20000
    for g in range(GENERATORS):
        count = n // GENERATORS + (1 if g < n % GENERATORS else 0)
        args = ["-m", "bench.loadgen.fleet", "--target", target, "--nodes", str(count)]
        args += ["--channels", str(min(CHANNELS_PER_GENERATOR, count)), "--prefix", f"{tag}-g{g}"]
        args += ["--first-port", str(base), "--interval", str(INTERVAL_S)]
        if assume_started:
            args.append("--assume-started")
        base += count
        proc = await Proc.start(f"gen{g}", args, tmp / f"{tag}-gen{g}.log", cpus=LOAD_CPU, pipes=True)
        fleets.append(proc)
    for f in fleets:
        await f.read_json(30)  # {"event": "listening"}
    return fleets


async def fleet_status(fleets: list[Proc]) -> dict[str, Any]:
    answers = [await f.send("status") for f in fleets]
    counts = [k for k in answers[0] if k not in ("event", "codes")]
    out: dict[str, Any] = {k: sum(int(a[k]) for a in answers) for k in counts}
    codes: dict[str, int] = {}
    for a in answers:
        for code, count in a.get("codes", {}).items():
            codes[code] = codes.get(code, 0) + count
    out["codes"] = codes
    return out


async def wait_streaming(fleets: list[Proc], n: int, deadline: float) -> dict[str, Any]:
    while True:
        st = await fleet_status(fleets)
        if st["streaming"] >= n or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.2)


async def wait_active(stub: Any, fleets: list[Proc], n: int, deadline: float) -> bool:
    """Every instance ACTIVE: first every node got StartEngines (cheap to ask the generators),
    then no INITIAL instance left (a small answer), then one full count."""
    while (await fleet_status(fleets))["started"] < n:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    initial = controller_pb2.ListInstancesRequest(status=common_pb2.INSTANCE_STATUS_INITIAL)
    while (await stub.ListInstances(initial, timeout=30)).instances:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    active = controller_pb2.ListInstancesRequest(status=common_pb2.INSTANCE_STATUS_ACTIVE)
    return len((await stub.ListInstances(active, timeout=30)).instances) == n


async def measure(server: Proc, fleets: list[Proc], window: float, tmp: Path, tag: str) -> dict[str, Any]:
    """CPU and latency over a steady window."""
    await wait_quiet([server.pid, *(f.pid for f in fleets)])
    offset = server.log.stat().st_size
    s0, g0, t0 = server.cpu(), [f.cpu() for f in fleets], time.perf_counter()
    m0, me0 = system_cpu(), time.process_time()
    for f in fleets:
        await f.send("mark")
    await asyncio.sleep(window)
    reports = [await f.send(f"report {tmp / f'{tag}-samples-{i}.bin'}") for i, f in enumerate(fleets)]
    elapsed = time.perf_counter() - t0
    s1, g1 = server.cpu(), [f.cpu() for f in fleets]
    m1, me1 = system_cpu(), time.process_time()
    ours = (s1 - s0) + sum(b - a for a, b in zip(g0, g1, strict=True)) + (me1 - me0)
    samples = array("d")
    for i in range(len(fleets)):
        samples.frombytes((tmp / f"{tag}-samples-{i}.bin").read_bytes())
    lat = sorted(samples)
    acks = sum(r["acks"] for r in reports)
    with server.log.open("rb") as fh:
        fh.seek(offset)
        windows = [_window(m.group(0)) for m in STATS_LINE.finditer(fh.read().decode(errors="replace"))]
    return {
        "server_cpu": 100 * (s1 - s0) / elapsed,
        "gen_cpu": 100 * sum(b - a for a, b in zip(g0, g1, strict=True)) / elapsed,
        "beats_s": acks / statistics.mean(r["window_s"] for r in reports),
        "client_p50": percentile(lat, 50),
        "client_p99": percentile(lat, 99),
        "client_max": lat[-1] if lat else float("nan"),
        "errors": sum(r["errors"] for r in reports),
        # Anything else running on the machine during the window (other users' processes) and
        # the hypervisor's steal: a busy neighbour makes every number here worse.
        "other_cpu": 100 * max(0.0, (m1[0] - m0[0]) - ours) / elapsed,
        "steal": 100 * (m1[1] - m0[1]) / elapsed,
        "server_windows": windows,
    }


def _window(line: str) -> dict[str, float]:
    """One ``heartbeat_stats`` line: its counts, ack latencies and garbage collections (the echo
    server logs no gc_* fields)."""
    fields = dict(re.findall(r"(\w+)=(\S+)", line))
    return {k: float(fields[k]) for k in WINDOW_FIELDS if k in fields}


async def run_controller(n: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    env = clean_env(
        MOTOR_CONTROLLER_STATE_DIR=str(tmp / f"state-{n}"),
        MOTOR_CONTROLLER_COORDINATORS="[]",
        MOTOR_CONTROLLER_HEARTBEAT_INTERVAL_S=str(INTERVAL_S),
        MOTOR_CONTROLLER_INSTANCE_HEARTBEAT_TIMEOUT_S="60",
        MOTOR_CONTROLLER_INSTANCE_ASSEMBLE_TIMEOUT_S="600",
    )
    argv = ["-m", "services.cli", "controller", "--port", "0"]
    ctrl = await Proc.start("controller", argv, tmp / f"controller-{n}.log", cpus=CONTROLLER_CPU, env=env)
    fleets: list[Proc] = []
    channel = None
    try:
        target = (await ctrl.listening())["grpc"]
        channel = grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 256 << 20)])
        stub = controller_pb2_grpc.ControllerStub(channel)
        fleets = await start_fleets(tmp, target, n, f"c{n}", assume_started=False)
        rate = min(args.rate, n / INTERVAL_S)  # a ramp of at least one interval spreads beat phases
        cpu0, t0 = ctrl.cpu(), time.perf_counter()
        for f in fleets:
            await f.send(f"start {rate / len(fleets)} {args.inflight}")
        ok = await wait_active(stub, fleets, n, time.monotonic() + n / 40 + 60)
        assembly_s, assembly_cpu = time.perf_counter() - t0, ctrl.cpu() - cpu0
        st = await wait_streaming(fleets, n, time.monotonic() + 60)
        out: dict[str, Any] = {"n": n, "assembled": ok, "assembly_s": assembly_s}
        out.update(assembly_cpu_s=assembly_cpu, status=st)
        if not ok or st["streaming"] < n:
            print(f"  N={n}: not all assembled/streaming: {st}", file=sys.stderr)
            return out
        await asyncio.sleep(2 * INTERVAL_S)  # settle: every node beats at its own phase
        spy = await _profile(ctrl, args, n)
        out.update(await measure(ctrl, fleets, args.window, tmp, f"c{n}"))
        if spy is not None:
            await spy.proc.wait()
        out["status_after"] = await fleet_status(fleets)
        return out
    finally:
        for f in fleets:
            await f.stop()
        if channel is not None:
            await channel.close()
        await ctrl.stop(15)
        _keep(ctrl, args)


def _keep(proc: Proc, args: argparse.Namespace) -> None:
    if args.keep_logs:
        Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
        shutil.copy(proc.log, Path(args.keep_logs) / proc.log.name)


async def _profile(ctrl: Proc, args: argparse.Namespace, n: int) -> Proc | None:
    spy = Path(sys.executable).parent / "py-spy"
    if not args.profile or not spy.exists():
        return None
    out = Path(args.profile) / f"scale-profile-{n}.txt"
    argv = [str(spy), "record", "-p", str(ctrl.pid), "-d", str(int(args.window)), "-o", str(out), "-f", "raw"]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True
    )
    return Proc("py-spy", proc, out)


async def run_echo(n: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    echo = await Proc.start("echo", ["-m", "bench.loadgen.echo"], tmp / f"echo-{n}.log", cpus=CONTROLLER_CPU)
    fleets: list[Proc] = []
    try:
        target = (await echo.listening())["grpc"]
        fleets = await start_fleets(tmp, target, n, f"e{n}", assume_started=True)
        rate = min(args.echo_rate, n / INTERVAL_S)
        for f in fleets:
            await f.send(f"start {rate / len(fleets)}")
        st = await wait_streaming(fleets, n, time.monotonic() + n / rate + 60)
        if st["streaming"] < n:
            return {"n": n, "status": st}
        await asyncio.sleep(2 * INTERVAL_S)
        return {"n": n, **await measure(echo, fleets, args.echo_window, tmp, f"e{n}")}
    finally:
        for f in fleets:
            await f.stop()
        await echo.stop()
        _keep(echo, args)


def _f(v: Any, fmt: str = ".1f") -> str:
    return "—" if v is None or v != v else format(v, fmt)


def _windows(r: dict[str, Any] | None) -> list[dict[str, float]]:
    return r.get("server_windows", []) if r else []


def beats_per_s(windows: list[dict[str, float]]) -> float | None:
    seconds = sum(w["window_s"] for w in windows)
    return sum(w["messages"] for w in windows) / seconds if seconds else None


def median_window(windows: list[dict[str, float]], key: str) -> float:
    return statistics.median(w[key] for w in windows)


def worst_window(windows: list[dict[str, float]]) -> dict[str, float]:
    """The 10 s window with the highest server-side ack p99: what the target is judged on."""
    return max(windows, key=lambda w: w["ack_p99_ms"])


def _latency_cell(r: dict[str, Any] | None) -> str:
    windows = _windows(r)
    if not windows:
        return "—"
    p50, p99 = median_window(windows, "ack_p50_ms"), median_window(windows, "ack_p99_ms")
    return f"{p50:.2f} / {p99:.1f} / {worst_window(windows)['ack_p99_ms']:.1f}"


def _label(c: dict[str, Any]) -> str:
    return f"{c['n']:,}" + (f" (repeat {c['repeat']})" if c.get("repeat") else "")


def verdict(c: dict[str, Any]) -> str:
    """Pass or fail for one run at the target size, on its CPU and its WORST window's p99."""
    if "server_cpu" not in c:
        return f"N={_label(c)}: **target missed**: the run never reached a steady state."
    windows, cpu = _windows(c), c["server_cpu"]
    missed = [f"Controller CPU {cpu:.1f}% is over {TARGET_CPU:g}%"] if cpu >= TARGET_CPU else []
    if not windows:
        missed.append("no `heartbeat_stats` window to judge the ack p99 by")
        detail = ""
    else:
        worst, median = worst_window(windows)["ack_p99_ms"], median_window(windows, "ack_p99_ms")
        if worst >= TARGET_P99_MS:
            missed.append(f"the worst window's server ack p99 {worst:.1f} ms is over {TARGET_P99_MS:g} ms")
        detail = (
            f" Controller CPU {cpu:.1f}% = {cpu / TARGET_CPU:.2f} x the {TARGET_CPU:g}% target; worst "
            f"window's ack p99 {worst:.1f} ms = {worst / TARGET_P99_MS:.2f} x the {TARGET_P99_MS:g} ms "
            f"target (median window {median:.1f} ms)."
        )
    head = "**target missed**: " + "; ".join(missed) + "." if missed else "target met."
    return f"N={_label(c)}: {head}{detail}"


def gc_note(c: dict[str, Any]) -> str | None:
    """What the collector did in a run's steady windows, and in its worst one."""
    windows = [w for w in _windows(c) if "gc_collections" in w]
    if not windows:
        return None
    collections = sum(int(w["gc_collections"]) for w in windows)
    longest = max(w["gc_max_ms"] for w in windows)
    quiet = sum(1 for w in windows if not w["gc_collections"])
    worst = worst_window(windows)
    line = (
        f"N={_label(c)}: {collections} garbage collections over the {len(windows)} steady windows "
        f"({quiet} without any), the longest pause {longest:.1f} ms; the worst window "
        f"(ack p99 {worst['ack_p99_ms']:.1f} ms) had {int(worst['gc_collections'])}"
    )
    if worst["gc_collections"]:
        return line + f", pausing up to {worst['gc_max_ms']:.1f} ms."
    return line + ": no collection ran in it, so its tail is not a collector pause."


def render(raw: dict[str, Any]) -> str:
    args = argparse.Namespace(**raw["args"])
    rows: list[tuple[dict[str, Any], dict[str, Any] | None]] = [(c, e) for c, e in raw["rows"]]
    lines = [
        "# Control-plane scale: N simulated NodeManagers → one Controller",
        "",
        raw["machine"],
        "",
        f"Controller pinned to CPU {CONTROLLER_CPU}; {GENERATORS} generator processes pinned to "
        f"CPU {LOAD_CPU}, "
        f"≤{CHANNELS_PER_GENERATOR} grpc.aio channels each (one TCP connection per channel); one beat per "
        f"node every {INTERVAL_S:g} s; one one-endpoint instance per node. Steady window "
        f"{args.window:g} s (Controller) / {args.echo_window:g} s (echo). CPU is % of one core. "
        f"Target: {TARGET_NODES:,} nodes under {TARGET_CPU:g}% CPU and server-side ack p99 under "
        f"{TARGET_P99_MS:g} ms in every 10 s window.",
        "",
        "| N | beats/s | Controller CPU % | echo CPU % | ratio | server ack ms p50 / p99 / worst p99 "
        "| echo server ack ms p50 / p99 / worst p99 | client ack ms p50 / p99 | assembly s (nodes/s) "
        "| assembly CPU ms/node | generator CPU % | errors | background CPU % (steal %) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for c, e in rows:
        if "server_cpu" not in c:
            lines.append(
                f"| {_label(c)} | did not reach steady state: {c.get('status')} | | | | | | | | | | | |"
            )
            continue
        if not _windows(c):
            notes.append(f"N={_label(c)}: no `event=heartbeat_stats` line in the Controller log.")
        echo_cpu = e.get("server_cpu") if e else None
        # CPU per beat, Controller over echo: the two runs' beat rates differ a little.
        ratio = (c["server_cpu"] / c["beats_s"]) / (echo_cpu / e["beats_s"]) if e and echo_cpu else None
        n = c["n"]
        lines.append(
            f"| {_label(c)} | {c['beats_s']:,.0f} | {c['server_cpu']:.1f} | {_f(echo_cpu)} "
            f"| {_f(ratio, '.2f')} "
            f"| {_latency_cell(c)} | {_latency_cell(e)} | {c['client_p50']:.1f} / {c['client_p99']:.1f} "
            f"| {c['assembly_s']:.1f} ({n / c['assembly_s']:.0f}/s) | {1000 * c['assembly_cpu_s'] / n:.1f} "
            f"| {c['gen_cpu']:.0f} | {c['errors']} | {c['other_cpu']:.0f} ({c['steal']:.0f}) |"
        )
    judged = [c for c, _ in rows if c["n"] >= TARGET_NODES]
    if judged:
        verdicts = [verdict(c) for c in judged]
        missed = sum("target missed" in v for v in verdicts)
        overall = (
            f"**The target is missed** in {missed} of {len(judged)} run(s) at {TARGET_NODES:,} nodes or more."
            if missed
            else f"The target is met in every run at {TARGET_NODES:,} nodes or more ({len(judged)})."
        )
        lines += ["", overall, "", *(f"- {v}" for v in verdicts)]
    else:
        lines += ["", f"No run at {TARGET_NODES:,} nodes: the target was not tried."]
    gc_lines = [g for c, _ in rows if (g := gc_note(c))]
    if gc_lines:
        lines += [
            "",
            "Garbage collection in the Controller (from `heartbeat_stats`):",
            "",
            *(f"- {g}" for g in gc_lines),
        ]
    lines += [
        "",
        "- **server ack**: from the Controller's own `event=heartbeat_stats` lines (one per 10 s window: "
        "message in hand → ack handed to gRPC and the handler resumed): the median over the windows of "
        "each window's p50 and p99, and the worst window's p99. The echo server logs the same line. The "
        "target is judged on the worst window.",
        "- **client ack**: beat write → ack read in the generators; includes the generators' own queueing "
        f"(they share CPU {LOAD_CPU}), so it is an upper bound on what the Controller adds.",
        "- **assembly s**: first Register → every instance ACTIVE in `ListInstances`. The generators "
        f"keep at most {args.inflight} nodes each registered but not yet assembled (a closed loop: the "
        "Controller sets the pace; an open-loop ramp past its pace gets Register calls CANCELLED by gRPC), "
        "at most one interval's worth of nodes per second. Each node's fake NodeManager answers "
        "GetStatus/StartEngines at once and beats NORMAL right after StartEngines. **assembly CPU "
        "ms/node**: Controller CPU spent from first Register to all ACTIVE, per node (it includes the "
        "beats of the nodes already up).",
        "- **background CPU**: CPU used on the machine during the Controller's window by processes other "
        "than this benchmark's (other users), and the hypervisor's steal time; both as % of one core. "
        "Numbers taken with a busy background are pessimistic.",
        "- **ratio**: Controller CPU per beat / echo CPU per beat at the same N (the echo server acks "
        "beats on the same proto with a bare grpc.aio servicer, read/write as the Controller does: "
        "no validation, interceptors or state).",
        "- **repeat**: the largest N run again (Controller only, same settings): how far one run is "
        "from the next on this machine.",
        "- The fake nodes of one generator share one NodeManager address (127.0.0.1, one port per "
        f"generator), so the Controller's NodeManager channel cache holds {GENERATORS} channels; a real "
        "fleet costs one connection per NodeManager at assembly.",
        *[f"- {n}" for n in notes],
        "",
        f"Written by `python -m bench.bench_scale`; every number is also in `{RAW.name}` "
        "(`--render-only` writes this file again from it).",
        "",
    ]
    return "\n".join(lines)


async def amain(args: argparse.Namespace) -> int:
    if args.render_only:
        publish(RESULTS, render(json.loads(RAW.read_text())))
        return 0
    if (os.cpu_count() or 1) < 2:
        print("bench_scale needs 2 CPUs (Controller on one, generators on the other)", file=sys.stderr)
        return 1
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(LOAD_CPU)})  # this process polls: keep it off the Controller's CPU
    rows: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-scale-") as d:
            tmp = Path(d)
            for n in args.nodes:
                if rows and time.monotonic() - start > args.budget:
                    print(f"N={n}: skipped, past the {args.budget:g} s budget", file=sys.stderr)
                    break
                print(f"N={n}: Controller run", file=sys.stderr)
                c = await run_controller(n, args, tmp)
                print(f"  {_summary(c)}", file=sys.stderr)
                e = None
                if not args.no_echo:
                    print(f"N={n}: echo run", file=sys.stderr)
                    e = await run_echo(n, args, tmp)
                    print(f"  {_summary(e)}", file=sys.stderr)
                rows.append((c, e))
                if "server_cpu" not in c:
                    break  # it did not cope with this N: a larger one will not do better
            largest = rows[-1][0] if rows else {}
            for k in range(1, args.repeat + 1 if "server_cpu" in largest else 1):
                print(f"N={largest['n']}: Controller run, repeat {k}", file=sys.stderr)
                fresh = tmp / f"repeat-{k}"  # a state directory of its own: a new Controller
                fresh.mkdir()
                c = await run_controller(largest["n"], args, fresh)
                c["repeat"] = k
                print(f"  {_summary(c)}", file=sys.stderr)
                rows.append((c, None))
    finally:
        os.sched_setaffinity(0, own)
    raw = {"machine": machine(), "args": vars(args), "rows": rows}
    RAW.write_text(json.dumps(raw, indent=1) + "\n")
    publish(RESULTS, render(raw))
    return 0 if rows and all("server_cpu" in c for c, _ in rows) else 1


def _summary(r: dict[str, Any]) -> str:
    keys = (
        "assembly_s",
        "server_cpu",
        "beats_s",
        "client_p50",
        "client_p99",
        "gen_cpu",
        "errors",
        "other_cpu",
    )
    out = {k: round(r[k], 2) if isinstance(r[k], float) else r[k] for k in keys if k in r}
    if _windows(r):
        out["server"] = _latency_cell(r)
    return str(out)


main = entry(amain, parse)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
