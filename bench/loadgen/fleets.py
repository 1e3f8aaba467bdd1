"""The scale benchmark's side of its generator processes (bench/loadgen/fleet.py): start them,
pinned to the load CPU, each with its share of the N nodes; add up their counts; wait until the
nodes stream beats, or until every instance is ACTIVE in the Controller.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from bench.loadgen.harness import Proc
from bench.loadgen.scale_report import CHANNELS_PER_GENERATOR, GENERATORS, INTERVAL_S, LOAD_CPU
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2


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
