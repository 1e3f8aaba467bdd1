"""Measurement 2 of ``bench table``: SIGKILL the Coordinator under ``motor up`` and time, from its
gRPC port answering again, until its table equals the Controller's and a chat completion works."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.loadgen.up import CONTROLLER, COORDINATOR, Up, gone
from motor_mesh.gen.motor.v1 import (
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    coordinator_pb2,
    coordinator_pb2_grpc,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
ROUTABLE = (common_pb2.INSTANCE_STATUS_ACTIVE, common_pb2.INSTANCE_STATUS_PAUSED)
LISTENING_RE = re.compile(r"^\[coordinator\] ts=(\S+) .*event=listening", re.M)
REACHABLE_RE = re.compile(r"^\[controller\] ts=(\S+) .*event=coordinator_reachable", re.M)
RESTART_RE = re.compile(r"event=restart component=coordinator .*in_s=([\d.]+)")


@dataclass
class RestartRound:
    down_s: float  # kill → health SERVING again
    synced_ms: float  # SERVING → table equals the Controller's routable set
    chat_ms: float  # SERVING → first chat completion answered 200
    steady_chat_ms: float  # one chat completion just before the kill
    new_incarnation: bool
    kill_wall: float  # wall clocks, to place the log lines of the round
    up_wall: float
    reachable_ms: float | None = None  # SERVING → Controller logs coordinator_reachable
    seen_late_ms: float | None = None  # Coordinator logs event=listening → SERVING seen here


def _wall(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


async def serving_at(addr: str) -> tuple[float, float]:
    """When (perf_counter, wall) the Coordinator's gRPC health ``motor.v1.Coordinator`` first
    answers SERVING."""
    req = health_pb2.HealthCheckRequest(service="motor.v1.Coordinator")
    while True:
        # A fresh channel each try: a used one waits out gRPC's reconnect backoff (1 s and up).
        async with grpc.aio.insecure_channel(addr) as ch:
            try:
                resp = await health_pb2_grpc.HealthStub(ch).Check(req, timeout=0.5, wait_for_ready=False)
                if resp.status == SERVING:
                    return time.perf_counter(), time.time()
            except grpc.aio.AioRpcError:
                pass
        await asyncio.sleep(0.003)


async def coordinator_table(stub: coordinator_pb2_grpc.CoordinatorAsyncStub) -> tuple[set[int], str]:
    r = await stub.ListInstances(coordinator_pb2.CoordinatorListInstancesRequest(), timeout=2)
    return {i.id for group in (r.available, r.unavailable, r.paused) for i in group}, r.incarnation


async def synced_at(addr: str, want: set[int]) -> tuple[float, str]:
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        while True:
            try:
                ids, incarnation = await coordinator_table(stub)
                if ids == want:
                    return time.perf_counter(), incarnation
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.002)


CHAT = {"model": "motor-sim", "messages": [{"role": "user", "content": "restart"}], "max_tokens": 4}


async def chat_ok(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.post(url, json=CHAT) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def first_chat_at(http: aiohttp.ClientSession, url: str) -> float:
    while True:
        if await chat_ok(http, url):
            return time.perf_counter()
        await asyncio.sleep(0.005)


async def routable_ids(ctrl: controller_pb2_grpc.ControllerAsyncStub) -> set[int]:
    resp = await ctrl.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5)
    return {i.id for i in resp.instances if i.status in ROUTABLE}


async def restart_round(
    up: Up, ctrl: controller_pb2_grpc.ControllerAsyncStub, http: aiohttp.ClientSession
) -> RestartRound:
    addr, url = up.addr(COORDINATOR), f"{up.url}/v1/chat/completions"
    want = await routable_ids(ctrl)
    _, old_incarnation = await synced_at(addr, want)
    t = time.perf_counter()
    if not await chat_ok(http, url):
        raise RuntimeError("a chat completion failed before the kill")
    steady_ms = (time.perf_counter() - t) * 1000
    pids = up.children("coordinator")
    if len(pids) != 1:
        raise RuntimeError(f"expected one coordinator under motor up, found {pids}")
    pid = pids[0]
    killed, kill_wall = time.perf_counter(), time.time()
    os.kill(pid, signal.SIGKILL)
    while True:
        if gone(pid):
            break
        await asyncio.sleep(0.001)
    up_at, up_wall = await asyncio.wait_for(serving_at(addr), 60)
    # From SERVING on: before it, the killed Coordinator's inference workers still answer (with
    # its last table) until they miss its beats, and a chat then says nothing of the new one.
    chat = asyncio.create_task(first_chat_at(http, url))
    try:
        synced, incarnation = await asyncio.wait_for(synced_at(addr, want), 60)
        chat_at = await asyncio.wait_for(chat, 60)
    finally:
        chat.cancel()
    if await routable_ids(ctrl) != want:
        raise RuntimeError("the Controller's routable set changed during the round")
    r = RestartRound(
        up_at - killed,
        (synced - up_at) * 1000,
        (chat_at - up_at) * 1000,
        steady_ms,
        incarnation != old_incarnation,
        kill_wall,
        up_wall,
    )
    print(
        f"  restart: down {r.down_s:.2f} s, table {r.synced_ms:.0f} ms, chat {r.chat_ms:.0f} ms",
        file=sys.stderr,
    )
    return r


async def measure_restarts(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    up = await asyncio.to_thread(Up, ["--prefill", "1", "--decode", "1"], tmp)
    rounds: list[RestartRound] = []
    try:
        timeout = aiohttp.ClientTimeout(total=10)
        async with (
            grpc.aio.insecure_channel(up.addr(CONTROLLER)) as ch,
            aiohttp.ClientSession(timeout=timeout) as http,
        ):
            ctrl = controller_pb2_grpc.ControllerStub(ch)
            for _ in range(args.rounds):
                rounds.append(await restart_round(up, ctrl, http))
    finally:
        await asyncio.to_thread(up.stop)
    text = up.log.read_text(errors="replace")
    delays = [float(m.group(1)) for m in RESTART_RE.finditer(text)]
    reachable = [_wall(m.group(1)) for m in REACHABLE_RE.finditer(text)]
    listening = [_wall(m.group(1)) for m in LISTENING_RE.finditer(text)]
    for r in rounds:
        # The Controller may get there before this benchmark's poll does: matched from the kill.
        after = [w for w in reachable if w >= r.kill_wall]
        if after:
            r.reachable_ms = (after[0] - r.up_wall) * 1000
        after = [w for w in listening if w >= r.kill_wall]
        if after:
            r.seen_late_ms = (r.up_wall - after[0]) * 1000
    return {"rounds": rounds, "delays": delays}
