"""Measurement 1 of ``bench table``: SetInstances of 1,000 instances on a real Coordinator,
timed until ``GET /v1/models`` shows the new set, plus the same steps run in process."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from bench.loadgen.harness import Proc, system_cpu, wait_quiet
from motor_mesh.coordinator import validation
from motor_mesh.coordinator.routes import build_view
from motor_mesh.coordinator.table import RoutingTable
from motor_mesh.gen.motor.v1 import common_pb2, coordinator_pb2

INSTANCES = 1000
MODELS = 4
STAGE_RUNS = 50
SET_METHOD = "/motor.v1.Coordinator/SetInstances"
RPC_MS_RE = re.compile(r"event=rpc method=/motor\.v1\.Coordinator/SetInstances code=OK ms=([\d.]+)")


def listening_ports() -> set[int]:
    """Local TCP ports something listens on (any address, v4 or v6)."""
    ports = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def engine_ports(n: int, first: int = 30000) -> list[int]:
    taken = listening_ports()
    return [p for p in range(first, first + n + len(taken)) if p not in taken][:n]


def instance_set(tag: str, first_id: int, ports: list[int]) -> coordinator_pb2.SetInstancesRequest:
    """What the Controller would send for ``len(ports)`` one-node instances, half prefill."""
    half = len(ports) // 2
    instances = []
    for i, port in enumerate(ports):
        role, n = (common_pb2.ROLE_PREFILL, i) if i < half else (common_pb2.ROLE_DECODE, i - half)
        model = f"{tag}-{i % MODELS}"
        role_name = "prefill" if role == common_pb2.ROLE_PREFILL else "decode"
        instances.append(
            common_pb2.Instance(
                id=first_id + i,
                role=role,
                job_name=f"{model}-{role_name}-{n}",
                model_name=model,
                engine_type=common_pb2.ENGINE_TYPE_VLLM,
                status=common_pb2.INSTANCE_STATUS_ACTIVE,
                endpoints=[
                    common_pb2.Endpoint(
                        id=0,
                        host="127.0.0.1",
                        port=port,
                        status=common_pb2.ENDPOINT_STATUS_NORMAL,
                        device_ids=list(range(8)),
                        pid=100000 + i,
                    )
                ],
                parallel=common_pb2.ParallelConfig(dp=1, tp=8, pp=1, ep=1, nnodes=1),
                node_managers=[f"127.0.0.1:{port + 1}"],
                pd_protocol=common_pb2.PD_PROTOCOL_VLLM,
            )
        )
    return coordinator_pb2.SetInstancesRequest(instances=instances)


def model_names(req: coordinator_pb2.SetInstancesRequest) -> set[str]:
    return {i.model_name for i in req.instances}


@dataclass
class SetRound:
    rpc_ms: float
    visible_ms: float | None  # None: nothing was polling


async def timed_set(call: Any, data: bytes) -> tuple[float, float]:
    t0 = time.perf_counter()
    await call(data, timeout=30)
    return t0, time.perf_counter()


async def visible_at(http: aiohttp.ClientSession, url: str, want: set[str]) -> float:
    """When ``GET /v1/models`` first lists exactly ``want``."""
    while True:
        async with http.get(url) as resp:
            body = await resp.read()
        if resp.status == 200 and {m["id"] for m in json.loads(body)["data"]} == want:
            return time.perf_counter()


async def measure_sets(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    ports = engine_ports(INSTANCES)
    sets = [instance_set("a", 1, ports), instance_set("b", 1 + INSTANCES, ports)]
    raw = [s.SerializeToString() for s in sets]
    coord = await Proc.start(
        "coordinator",
        ["-m", "motor_mesh.cli", "coordinator", "--port", "0", "--http-port", "0"],
        tmp / "coordinator.log",
    )
    try:
        where = await coord.listening()
        url = f"http://{where['http']}/v1/models"
        async with (
            grpc.aio.insecure_channel(where["grpc"]) as ch,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http,
        ):
            # Raw bytes in: the request is encoded once, outside the timing.
            call: grpc.aio.UnaryUnaryMultiCallable[bytes, coordinator_pb2.SetInstancesResponse]
            call = ch.unary_unary(
                SET_METHOD,
                request_serializer=None,
                response_deserializer=coordinator_pb2.SetInstancesResponse.FromString,
            )
            t0, t1 = await timed_set(call, raw[0])  # onto the empty table, as after a restart
            cold_ms = (t1 - t0) * 1000
            await visible_at(http, url, model_names(sets[0]))
            rounds: list[SetRound] = []
            await wait_quiet([coord.pid])
            m0, c0, w0 = system_cpu()[0], coord.cpu() + time.process_time(), time.perf_counter()
            for i in range(2 * args.sets):
                polled = i < args.sets
                k = (i + 1) % 2
                await asyncio.sleep(0.05)
                task = asyncio.create_task(timed_set(call, raw[k]))
                seen = await visible_at(http, url, model_names(sets[k])) if polled else None
                t0, t1 = await task
                if not polled:
                    await visible_at(http, url, model_names(sets[k]))  # it did take effect
                rounds.append(SetRound((t1 - t0) * 1000, None if seen is None else (seen - t0) * 1000))
            ours = coord.cpu() + time.process_time() - c0
            background = 100 * max(0.0, system_cpu()[0] - m0 - ours) / (time.perf_counter() - w0)
    finally:
        await coord.stop(15)
    server_ms = [float(m.group(1)) for m in RPC_MS_RE.finditer((tmp / "coordinator.log").read_text())]
    return {
        "bytes": len(raw[0]),
        "bytes_b": len(raw[1]),
        "cold_ms": cold_ms,
        "background": background,
        "rounds": rounds,
        # One access-log line per Set, in order: the first is the cold one.
        "server_ms": server_ms[1:] if len(server_ms) == 2 * args.sets + 1 else [],
        "stages": stages_in_process(raw, sets),
    }


def stages_in_process(raw: list[bytes], sets: list[coordinator_pb2.SetInstancesRequest]) -> dict[str, Any]:
    """Each step the Coordinator takes for one Set replacing the whole table, run on the same
    code here (no gRPC, no event loop), with the garbage collector's pauses in between."""
    table = RoutingTable()
    table.set(sets[0].instances)
    view = build_view(table.state)
    times: dict[str, list[float]] = {"parse": [], "validate": [], "table": [], "view": [], "total": []}
    full_gc: list[float] = []
    began = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        elif info["generation"] == 2:
            full_gc.append((time.perf_counter() - began[0]) * 1000)

    gc.callbacks.append(on_gc)
    try:
        for i in range(STAGE_RUNS):
            data = raw[(i + 1) % 2]
            t0 = time.perf_counter()
            req = coordinator_pb2.SetInstancesRequest.FromString(data)
            t1 = time.perf_counter()
            assert not validation.set_instances(req)
            t2 = time.perf_counter()
            table.set(req.instances)
            t3 = time.perf_counter()
            view = build_view(table.state, view.targets)
            t4 = time.perf_counter()
            steps = (
                ("parse", t0, t1),
                ("validate", t1, t2),
                ("table", t2, t3),
                ("view", t3, t4),
                ("total", t0, t4),
            )
            for key, a, b in steps:
                times[key].append((b - a) * 1000)
    finally:
        gc.callbacks.remove(on_gc)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in times.items()}
    out["total_max"] = max(times["total"])
    out["full_gc"] = full_gc
    return out
