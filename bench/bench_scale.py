"""Control-plane scale: N simulated NodeManagers beating every 3 s
to one real Controller pinned to one core, on the SQLite store and on the etcd store.

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

On the etcd store (``--store etcd|both``) every Controller run gets a fresh one-member etcd
(bench/loadgen/etcd_proc.py) pinned to CPU 1 with the generators, and the Controller a fresh
``etcd_prefix``; it starts as a standby, elects itself, and the generators start once it logs
``event=leading``. Measured the same way, plus etcd's own CPU (steady window and assembly) and
its database size at the end. Without etcd installed those rows say so and the rest runs.

The target is judged per run on the Controller's CPU and on its WORST 10 s window's ack p99.
Everything in results/scale.md is written here; the measured numbers also go to
results/scale.json, from which ``--render-only`` writes scale.md again without running anything
(bench/loadgen/scale_report.py renders it). ``--out DIR`` writes both into DIR instead.

    python -m bench.bench_scale [--nodes 1000,5000,10000] [--window 45] [--echo-window 30] [--repeat 1]
                                [--store sqlite|etcd|both] [--out DIR]
    python -m bench.bench_scale --render-only [--out DIR]
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
import uuid
from array import array
from pathlib import Path
from typing import Any

import grpc

from bench.loadgen import etcd_proc
from bench.loadgen.etcd_proc import Etcd
from bench.loadgen.fleets import fleet_status, start_fleets, wait_active, wait_streaming
from bench.loadgen.harness import Proc, clean_env, entry, machine, percentile, publish, system_cpu, wait_quiet
from bench.loadgen.scale_report import (
    CONTROLLER_CPU,
    INTERVAL_S,
    LOAD_CPU,
    RAW_NAME,
    latency_cell,
    not_run,
    render,
)
from motor_mesh.common.config.sections import ControllerConfig
from motor_mesh.gen.motor.v1 import controller_pb2_grpc

RESULTS_DIR = Path(__file__).parent / "results"
REPORT_NAME = "scale.md"
STORES = {"sqlite": ("sqlite",), "etcd": ("etcd",), "both": ("sqlite", "etcd")}
# The slowest assembly (nodes/s) waited for before a run counts as not coping. On etcd every
# state write is a transaction fsynced by etcd, one at a time: far slower than SQLite's.
ASSEMBLY_FLOOR = {"sqlite": 40.0, "etcd": 10.0}
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
    p.add_argument("--keep-logs", metavar="DIR", help="copy the Controller/etcd/echo logs into DIR")
    p.add_argument(
        "--budget", type=float, default=540.0, help="skip larger N past this many seconds per store measured"
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="more Controller runs at the largest N (run-to-run spread)"
    )
    p.add_argument("--store", choices=STORES, default="both", help="the Controller's store(s) to measure")
    p.add_argument("--out", default=str(RESULTS_DIR), help=f"directory of {REPORT_NAME} and {RAW_NAME}")
    p.add_argument(
        "--render-only", action="store_true", help=f"write {REPORT_NAME} again from {RAW_NAME}, run nothing"
    )
    return p.parse_args(argv)


async def measure(
    server: Proc, fleets: list[Proc], window: float, tmp: Path, tag: str, etcd: Etcd | None = None
) -> dict[str, Any]:
    """CPU and latency over a steady window (and the CPU of the Controller's etcd, if any)."""
    await wait_quiet([server.pid, *(f.pid for f in fleets), *([etcd.pid] if etcd else [])])
    offset = server.log.stat().st_size
    s0, g0, t0 = server.cpu(), [f.cpu() for f in fleets], time.perf_counter()
    m0, me0, k0 = system_cpu(), time.process_time(), etcd.cpu() if etcd else 0.0
    for f in fleets:
        await f.send("mark")
    await asyncio.sleep(window)
    reports = [await f.send(f"report {tmp / f'{tag}-samples-{i}.bin'}") for i, f in enumerate(fleets)]
    elapsed = time.perf_counter() - t0
    s1, g1 = server.cpu(), [f.cpu() for f in fleets]
    m1, me1, k1 = system_cpu(), time.process_time(), etcd.cpu() if etcd else 0.0
    ours = (s1 - s0) + sum(b - a for a, b in zip(g0, g1, strict=True)) + (me1 - me0) + (k1 - k0)
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
        **({"etcd_cpu": 100 * (k1 - k0) / elapsed} if etcd else {}),
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


async def run_controller(n: int, args: argparse.Namespace, tmp: Path, store: str) -> dict[str, Any]:
    """One Controller run on ``store``; on etcd, with an etcd of its own started first."""
    if store == "sqlite":
        return await _controller(n, args, tmp, "sqlite", None)
    binary = etcd_proc.etcd_binary()
    if binary is None:
        return {"n": n, "store": store, "skipped": etcd_proc.NOT_INSTALLED}
    etcd = await Etcd.start(binary, tmp / f"etcd-{n}", tmp / f"etcd-{n}.log", cpus=LOAD_CPU)
    try:
        return await _controller(n, args, tmp, "etcd", etcd)
    finally:
        await etcd.stop()
        _keep(etcd.proc, args)


async def _controller(
    n: int, args: argparse.Namespace, tmp: Path, store: str, etcd: Etcd | None
) -> dict[str, Any]:
    tag = f"c{n}" if etcd is None else f"c{n}-etcd"
    log = f"controller-{n}.log" if etcd is None else f"controller-{n}-etcd.log"
    env = clean_env(
        MOTOR_CONTROLLER_STATE_DIR=str(tmp / f"state-{n}"),
        MOTOR_CONTROLLER_COORDINATORS="[]",
        MOTOR_CONTROLLER_HEARTBEAT_INTERVAL_S=str(INTERVAL_S),
        MOTOR_CONTROLLER_INSTANCE_HEARTBEAT_TIMEOUT_S="60",
        MOTOR_CONTROLLER_INSTANCE_ASSEMBLE_TIMEOUT_S="600",
    )
    if etcd is not None:
        env.update(
            MOTOR_CONTROLLER_STORE="etcd",
            MOTOR_CONTROLLER_ETCD_ENDPOINTS=json.dumps([etcd.endpoint]),
            MOTOR_CONTROLLER_ETCD_PREFIX=f"/bench-scale/{uuid.uuid4().hex}",
        )
    argv = ["-m", "motor_mesh.cli", "controller", "--port", "0"]
    ctrl = await Proc.start("controller", argv, tmp / log, cpus=CONTROLLER_CPU, env=env)
    fleets: list[Proc] = []
    channel = None
    try:
        target = (await ctrl.listening())["grpc"]
        if etcd is not None:
            # A standby until it wins the election (at once: no other candidate).
            await ctrl.log_match(r"event=leading", 60)
        channel = grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 256 << 20)])
        stub = controller_pb2_grpc.ControllerStub(channel)
        fleets = await start_fleets(tmp, target, n, tag, assume_started=False)
        rate = min(args.rate, n / INTERVAL_S)  # a ramp of at least one interval spreads beat phases
        cpu0, k0, t0 = ctrl.cpu(), etcd.cpu() if etcd else 0.0, time.perf_counter()
        for f in fleets:
            await f.send(f"start {rate / len(fleets)} {args.inflight}")
        ok = await wait_active(stub, fleets, n, time.monotonic() + n / ASSEMBLY_FLOOR[store] + 60)
        assembly_s, assembly_cpu = time.perf_counter() - t0, ctrl.cpu() - cpu0
        st = await wait_streaming(fleets, n, time.monotonic() + 60)
        out: dict[str, Any] = {"n": n, "store": store, "assembled": ok, "assembly_s": assembly_s}
        out.update(assembly_cpu_s=assembly_cpu, status=st)
        if etcd is not None:
            out["etcd_assembly_cpu_s"] = etcd.cpu() - k0
        if not ok or st["streaming"] < n:
            print(f"  N={n} ({store}): not all assembled/streaming: {st}", file=sys.stderr)
            return out
        await asyncio.sleep(2 * INTERVAL_S)  # settle: every node beats at its own phase
        spy = await _profile(ctrl, args, tag)
        out.update(await measure(ctrl, fleets, args.window, tmp, tag, etcd))
        if spy is not None:
            await spy.proc.wait()
        out["status_after"] = await fleet_status(fleets)
        if etcd is not None:
            out.update({f"etcd_{k}": v for k, v in (await etcd.sizes()).items()})
        if ctrl.proc.returncode is not None:
            # On etcd: a leader that lost its lease exits at once; its numbers stop there.
            out["controller_exit"] = ctrl.proc.returncode
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


async def _profile(ctrl: Proc, args: argparse.Namespace, tag: str) -> Proc | None:
    spy = Path(sys.executable).parent / "py-spy"
    if not args.profile or not spy.exists():
        return None
    out = Path(args.profile) / f"scale-profile-{tag}.txt"
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


async def amain(args: argparse.Namespace) -> int:
    report, raw_path = Path(args.out) / REPORT_NAME, Path(args.out) / RAW_NAME
    if args.render_only:
        publish(report, render(json.loads(raw_path.read_text())))
        return 0
    if (os.cpu_count() or 1) < 2:
        print("bench_scale needs 2 CPUs (Controller on one, generators on the other)", file=sys.stderr)
        return 1
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(LOAD_CPU)})  # this process polls: keep it off the Controller's CPU
    raw: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-scale-") as d:
            raw["rows"] = await _runs(args, Path(d))
            if any(c.get("store") == "etcd" and "skipped" not in c for c, _ in raw["rows"]):
                raw["etcd"] = _etcd_setup(Path(d))
    finally:
        os.sched_setaffinity(0, own)
    rows = raw["rows"]
    raw_path.parent.mkdir(parents=True, exist_ok=True)
    raw_path.write_text(json.dumps(raw, indent=1) + "\n")
    publish(report, render(raw))
    return 0 if rows and all("skipped" in c or not_run(c) is None for c, _ in rows) else 1


async def _runs(args: argparse.Namespace, tmp: Path) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Every N on every store (the echo run once per N, its row the first store's), then the
    repeats at the largest N. A store that did not cope with an N is not tried at a larger one."""
    rows: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    active = list(STORES[args.store])
    budget = args.budget * len(active)
    start = time.monotonic()
    last: list[dict[str, Any]] = []
    for n in args.nodes:
        if rows and time.monotonic() - start > budget:
            print(f"N={n}: skipped, past the {budget:g} s budget", file=sys.stderr)
            break
        last = [await _run(n, args, tmp, s) for s in active]
        e = None
        if not args.no_echo:
            print(f"N={n}: echo run", file=sys.stderr)
            e = await run_echo(n, args, tmp)
            print(f"  {_summary(e)}", file=sys.stderr)
        rows += [(c, e if i == 0 else None) for i, c in enumerate(last)]
        active = [c["store"] for c in last if "skipped" in c or not_run(c) is None]
        if not active:
            break  # no store coped with this N: a larger one will not do better
    for k in range(1, args.repeat + 1):
        for c in last:
            if "skipped" not in c and not_run(c) is None:
                fresh = tmp / f"repeat-{k}-{c['store']}"  # a state directory of its own: a new Controller
                fresh.mkdir()
                again = await _run(c["n"], args, fresh, c["store"], repeat=k)
                rows.append((again, None))
    return rows


async def _run(n: int, args: argparse.Namespace, tmp: Path, store: str, repeat: int = 0) -> dict[str, Any]:
    print(f"N={n}: Controller run on {store}" + (f", repeat {repeat}" if repeat else ""), file=sys.stderr)
    try:
        c = await run_controller(n, args, tmp, store)
    except (RuntimeError, TimeoutError, grpc.aio.AioRpcError) as err:
        # A process that died or never answered: the report says so, the other runs go on.
        c = {"n": n, "store": store, "error": f"{type(err).__name__}: {err}"[:300]}
    if repeat:
        c["repeat"] = repeat
    print(f"  {_summary(c)}", file=sys.stderr)
    return c


def _etcd_setup(tmp: Path) -> dict[str, Any]:
    binary = etcd_proc.etcd_binary()
    return {
        "version": etcd_proc.etcd_version(binary) if binary else "unknown",
        "fs": etcd_proc.filesystem(tmp),
        "quota_bytes": etcd_proc.QUOTA_BYTES,
        "lease_s": ControllerConfig().leader_lease_s,
    }


def _summary(r: dict[str, Any]) -> str:
    keys = (
        "assembly_s",
        "server_cpu",
        "etcd_cpu",
        "beats_s",
        "client_p50",
        "client_p99",
        "gen_cpu",
        "errors",
        "other_cpu",
        "skipped",
        "error",
    )
    out = {k: round(r[k], 2) if isinstance(r[k], float) else r[k] for k in keys if k in r}
    if r.get("server_windows"):
        out["server"] = latency_cell(r)
    return str(out)


main = entry(amain, parse)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
