"""One HTTP router target of the router benchmark, measured row by row: for each mode
(non-streaming, streaming) and connection count, a wrk warm-up, then the measured run, with the
CPU of every process of the target from /proc and the prefill legs it sent. Also how Motor's
Coordinator is started for it (engines added through gRPC AddInstances). Used by
bench/bench_router.py and bench/router_tracing.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.bench_precision import table
from bench.loadgen import peers, profile, wrk
from bench.loadgen.harness import Proc, clean_env, system_cpu, wait_quiet
from motor_mesh.gen.motor.v1 import coordinator_pb2_grpc


def body(stream: bool) -> dict[str, object]:
    b: dict[str, object] = {
        "model": peers.MODEL,
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": 16,
    }
    return {**b, "stream": True} if stream else b


@dataclass
class Cell:
    stream: bool
    conns: int
    r: wrk.WrkResult
    cpu: dict[str, float]  # % of one core over the run: prefill, decode, router
    machine_pct: float
    legs_per_req: float

    def router_us(self) -> float:
        """The router's CPU time (all its processes) per answered request, in µs."""
        rps = self.r.rps
        return self.cpu.get("router", 0.0) / 100 / rps * 1e6 if rps else 0.0


@dataclass
class Target:
    name: str
    how: str
    cells: list[Cell] = field(default_factory=list)
    error: str | None = None
    hot: list[profile.Hot] = field(default_factory=list)  # py-spy, 32 connections, plain
    samples: int = 0
    sent: int = 0  # requests over every run, warm-ups included
    spans: int = 0  # spans the router exported (tracing variants)

    def cell(self, stream: bool, conns: int) -> Cell | None:
        return next((c for c in self.cells if c.stream == stream and c.conns == conns), None)


def connections(args: argparse.Namespace) -> list[int]:
    return [int(c) for c in args.connections.split(",")]


async def measure(
    target: Target, url: str, procs: dict[str, Proc], prefill_base: str, args: argparse.Namespace, tmp: Path
) -> None:
    for stream in (False, True):
        script = wrk.write_script(tmp, f"chat-{int(stream)}", body(stream))
        for c in connections(args):
            await measure_cell(target, url, procs, prefill_base, args, script, stream, c)


async def measure_cell(
    target: Target,
    url: str,
    procs: dict[str, Proc],
    prefill_base: str,
    args: argparse.Namespace,
    script: Path,
    stream: bool,
    c: int,
) -> None:
    """One row: a warm-up run, then the measured one with ``c`` connections."""
    target.sent += (await wrk.run(url, script, c, args.warmup)).requests
    await wait_quiet([p.pid for p in procs.values()], max_wait_s=5)
    cpu0 = {k: peers.group_cpu(p.pid) for k, p in procs.items()}
    legs0, m0, t0 = await peers.prefill_legs(prefill_base), system_cpu()[0], time.perf_counter()
    r = await wrk.run(url, script, c, args.seconds)
    elapsed = time.perf_counter() - t0
    target.sent += r.requests
    m1, legs1 = system_cpu()[0], await peers.prefill_legs(prefill_base)
    cpu = {k: 100 * (peers.group_cpu(p.pid) - cpu0[k]) / elapsed for k, p in procs.items()}
    cell = Cell(stream, c, r, cpu, 100 * (m1 - m0) / elapsed, (legs1 - legs0) / max(1, r.requests))
    target.cells.append(cell)
    print(
        f"  {target.name} {'stream' if stream else 'plain'} c={c}: {r.rps:,.0f} req/s, "
        f"p50 {r.p50_ms:.2f} ms, non-2xx {r.non2xx}, errors {r.socket_errors}",
        file=sys.stderr,
    )


async def start_motor(
    prefill: str,
    decode: str,
    tmp: Path,
    workers: int = 0,
    env: dict[str, str] | None = None,
    tag: str = "",
    package: str = "motor_mesh",
) -> tuple[Proc, str]:
    """``env``: variables besides a clean environment (``tag`` names its config and log);
    ``package``: the import name of the Motor being run (an old commit's is ``services``)."""
    cfg = tmp / f"coordinator-{workers}{tag}.json"
    cfg.write_text(json.dumps({"coordinator": {"workers": workers}}))
    coord = await Proc.start(
        "coordinator",
        ["-m", f"{package}.cli", "coordinator", "--config", str(cfg), "--port", "0", "--http-port", "0"],
        tmp / f"coordinator-{workers}{tag}.log",
        env=clean_env(**env) if env else None,
    )
    try:
        where = await coord.listening()
        ports = [int(u.rsplit(":", 1)[1]) for u in (prefill, decode)]
        async with grpc.aio.insecure_channel(where["grpc"]) as ch:
            await coordinator_pb2_grpc.CoordinatorStub(ch).AddInstances(table(ports), timeout=10)
        url = f"http://{where['http']}/v1/chat/completions"
        await peers.wait_serving(coord, url, json.dumps(body(False)).encode())
    except BaseException:
        await coord.stop()
        raise
    return coord, url
