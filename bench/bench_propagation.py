"""Propagation: Controller instance change → Coordinator table.

A real Coordinator and a real Controller (its ``coordinators`` pointing at the Coordinator), and
two fake NodeManagers in this process (bench/loadgen: one prefill job, one decode job, served by
one in-process motor.v1.NodeManager server) that register and beat. Once both instances are
ACTIVE and the Coordinator is routable, the decode endpoint is flipped ABNORMAL (one beat at
once → instance INACTIVE → DeleteInstances → nothing routable) and back NORMAL (→ ACTIVE →
AddInstances → routable), again and again. Each change is timed from the beat's write to the
Coordinator's health ``""`` Watch stream reporting the new routability (pushed by the
Coordinator after the table swap, so nothing polls). The Controller's ``instance_transition``
and the Coordinator's ``table_changed`` log lines (ms timestamps) split it into stages.

    python -m bench.bench_propagation [--changes 200]
    python -m bench propagation
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.loadgen.fakenm import FakeNodeManagers
from bench.loadgen.harness import Proc, clean_env, entry, machine, percentile, publish, system_cpu
from bench.loadgen.node import ABNORMAL, NORMAL, FakeNode, NodeSpec, Stats
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2_grpc, coordinator_pb2, coordinator_pb2_grpc

RESULTS = Path(__file__).parent / "results" / "propagation.md"
TARGET_MS = 100.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TS_RE = re.compile(r"^ts=(\S+) ")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench_propagation")
    p.add_argument("--changes", type=int, default=200, help="instance changes to time (half each way)")
    return p.parse_args(argv)


def _wall(line: str) -> float:
    m = TS_RE.match(line)
    if not m:
        return float("nan")
    return datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


class Watcher:
    """Health ``""`` of the Coordinator as a stream of (perf_counter, wall, status)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.queue: asyncio.Queue[tuple[float, float, int]] = asyncio.Queue()
        self._stub = health_pb2_grpc.HealthStub(channel)
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        async for resp in self._stub.Watch(health_pb2.HealthCheckRequest(service="")):
            self.queue.put_nowait((time.perf_counter(), time.time(), resp.status))

    async def until(self, status: int, timeout_s: float) -> tuple[float, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            t, wall, got = await asyncio.wait_for(self.queue.get(), max(0.0, deadline - time.monotonic()))
            if got == status:
                return t, wall


async def start_mesh(tmp: Path) -> tuple[Proc, Proc, str, str]:
    coord = await Proc.start(
        "coordinator",
        ["-m", "motor_mesh.cli", "coordinator", "--port", "0", "--http-port", "0"],
        tmp / "coordinator.log",
    )
    coord_addr = (await coord.listening())["grpc"]
    env = clean_env(
        MOTOR_CONTROLLER_STATE_DIR=str(tmp / "state"),
        MOTOR_CONTROLLER_COORDINATORS=json.dumps([coord_addr]),
        MOTOR_CONTROLLER_HEARTBEAT_INTERVAL_S="3",
        # No periodic full Set in the middle of the measurement.
        MOTOR_CONTROLLER_COORDINATOR_SET_SYNC_INTERVAL_S="3600",
    )
    argv = ["-m", "motor_mesh.cli", "controller", "--port", "0"]
    ctrl = await Proc.start("controller", argv, tmp / "controller.log", env=env)
    return coord, ctrl, coord_addr, (await ctrl.listening())["grpc"]


async def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    coord, ctrl, coord_addr, ctrl_addr = await start_mesh(tmp)
    nm = FakeNodeManagers()
    nm_port = await nm.start()
    ctrl_ch = grpc.aio.insecure_channel(ctrl_addr)
    coord_ch = grpc.aio.insecure_channel(coord_addr)
    tasks: list[asyncio.Task[None]] = []
    watcher: Watcher | None = None
    try:
        stub = controller_pb2_grpc.ControllerStub(ctrl_ch)
        stats = Stats()
        nodes = {}
        for name, role, port in (
            ("prefill", common_pb2.ROLE_PREFILL, 41001),
            ("decode", common_pb2.ROLE_DECODE, 41002),
        ):
            spec = NodeSpec(f"bench-prop-{name}", role, "motor-sim", "127.0.0.1", nm_port, port)
            nodes[name] = FakeNode(spec, stub, stats)
            nm.add(nodes[name])
            tasks.append(asyncio.get_running_loop().create_task(nodes[name].run()))
        watcher = Watcher(coord_ch)
        await watcher.until(SERVING, 30.0)
        decode = nodes["decode"]
        flips: list[dict[str, Any]] = []
        procs = (coord, ctrl)
        m0, c0, t0 = system_cpu()[0], sum(p.cpu() for p in procs) + time.process_time(), time.perf_counter()
        for i in range(args.changes):
            status, expect, kind = (
                (ABNORMAL, NOT_SERVING, "delete") if i % 2 == 0 else (NORMAL, SERVING, "add")
            )
            # Decorrelate from the 3 s beat timer and from the previous change's tail.
            await asyncio.sleep(random.uniform(0.02, 0.06))
            decode.set_status(status)
            t_rx, wall_rx = await watcher.until(expect, 10.0)
            flips.append(
                {
                    "kind": kind,
                    "ms": (t_rx - decode.change_sent_at) * 1000,
                    "sent_wall": decode.change_sent_wall,
                    "rx_wall": wall_rx,
                }
            )
        elapsed = time.perf_counter() - t0
        ours = sum(p.cpu() for p in procs) + time.process_time() - c0
        background = 100 * max(0.0, system_cpu()[0] - m0 - ours) / elapsed
        table = await coordinator_pb2_grpc.CoordinatorStub(coord_ch).ListInstances(
            coordinator_pb2.CoordinatorListInstancesRequest(), timeout=5
        )
        return {
            "flips": flips,
            "revision": table.revision,
            "decode_id": decode.instance_id,
            "background": background,
        }
    finally:
        for t in tasks + ([watcher.task] if watcher else []):
            t.cancel()
        await asyncio.gather(*tasks, *([watcher.task] if watcher else []), return_exceptions=True)
        await ctrl_ch.close()
        await coord_ch.close()
        await nm.stop()
        await ctrl.stop(15)
        await coord.stop(15)


def stages(tmp: Path, flips: list[dict[str, Any]], instance_id: int) -> None:
    """Add each flip's Controller and Coordinator log times (wall clock, ms resolution)."""
    ctrl_lines = (tmp / "controller.log").read_text(errors="replace").splitlines()
    transitions = [
        _wall(x)
        for x in ctrl_lines
        if "event=instance_transition" in x and f" instance_id={instance_id} " in x
    ]
    coord_lines = (tmp / "coordinator.log").read_text(errors="replace").splitlines()
    changes = [_wall(x) for x in coord_lines if "event=table_changed" in x]
    ti = ci = 0
    for f in flips:
        # Log stamps are whole ms: allow 1 ms of rounding before the beat's own stamp.
        while ti < len(transitions) and transitions[ti] < f["sent_wall"] - 0.001:
            ti += 1
        if ti == len(transitions):
            return
        f["controller_ms"] = (transitions[ti] - f["sent_wall"]) * 1000
        while ci < len(changes) and changes[ci] < transitions[ti] - 0.001:
            ci += 1
        if ci == len(changes):
            return
        f["push_ms"] = (changes[ci] - transitions[ti]) * 1000
        f["watch_ms"] = (f["rx_wall"] - changes[ci]) * 1000
        ti, ci = ti + 1, ci + 1


def _row(name: str, values: list[float]) -> str:
    v = sorted(values)
    p50, p90, p99 = (percentile(v, q) for q in (50, 90, 99))
    return (
        f"| {name} | {len(v)} | {p50:.1f} | {p90:.1f} | {p99:.1f} | {v[-1]:.1f} | {statistics.mean(v):.1f} "
        f"| {p99 / TARGET_MS:.2f} |"
    )


def _stage_row(name: str, flips: list[dict[str, Any]], key: str) -> str:
    v = sorted(f[key] for f in flips if key in f)
    if not v:
        return f"| {name} | — | — | — |"
    return f"| {name} | {percentile(v, 50):.0f} | {percentile(v, 90):.0f} | {percentile(v, 99):.0f} |"


def render(result: dict[str, Any]) -> str:
    flips = result["flips"]
    every = [f["ms"] for f in flips]
    p99 = percentile(sorted(every), 99)
    return "\n".join(
        [
            "# Propagation: Controller instance change → Coordinator table",
            "",
            machine(),
            "",
            "One real Controller, one real Coordinator (its `coordinators` = that Coordinator), two fake "
            "NodeManagers in the benchmark process (one prefill, one decode instance). Each change: the "
            "decode endpoint flips ABNORMAL (a beat at once → INACTIVE → DeleteInstances → nothing routable) "
            "or back NORMAL (→ ACTIVE → AddInstances → routable); timed from the beat's write to the "
            'Coordinator\'s health `""` Watch stream reporting the new routability (no polling). '
            f"Target: p99 under {TARGET_MS:g} ms.",
            "",
            "| change | count | p50 ms | p90 ms | p99 ms | max ms | mean ms | p99 / target |",
            "|---|---|---|---|---|---|---|---|",
            _row("all", every),
            _row("ABNORMAL → removed (DeleteInstances)", [f["ms"] for f in flips if f["kind"] == "delete"]),
            _row("NORMAL → added (AddInstances)", [f["ms"] for f in flips if f["kind"] == "add"]),
            "",
            f"p99 {p99:.1f} ms = {p99 / TARGET_MS:.2f} x the {TARGET_MS:g} ms target. Coordinator table "
            f"revision after the run: {result['revision']} ({len(flips)} changes plus the initial adds). "
            f"Background CPU (other users' processes) during the run: {result['background']:.0f}%.",
            "",
            "Where the time goes (from log timestamps, whole milliseconds, so ±1 ms each):",
            "",
            "| stage | p50 ms | p90 ms | p99 ms |",
            "|---|---|---|---|",
            _stage_row("beat written → Controller `instance_transition` logged", flips, "controller_ms"),
            _stage_row("→ Coordinator `table_changed` logged (event pusher + RPC)", flips, "push_ms"),
            _stage_row("→ health Watch update received by the client", flips, "watch_ms"),
            "",
        ]
    )


async def amain(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-propagation-") as d:
        tmp = Path(d)
        result = await measure(args, tmp)
        stages(tmp, result["flips"], result["decode_id"])
    text = render(result)
    return publish(RESULTS, text)


main = entry(amain, parse)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
