"""``coordinator.workers = 2``: a real ``motor coordinator`` whose inference port is served by
two worker processes sharing it (SO_REUSEPORT), each holding the table the management process
gives it over ZeroMQ."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import aiohttp
import grpc

from motor_mesh.common.enums import UNION
from motor_mesh.gen.motor.v1 import coordinator_pb2 as cpb
from motor_mesh.gen.motor.v1 import coordinator_pb2_grpc
from tests.coordinator.conftest import MODEL, Engine, instance
from tests.poll import until
from tests.procs import Proc

_STARTED = re.compile(r"event=worker_started index=(\d+) pid=(\d+)")
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _start(motor_proc: Callable[..., Proc], tmp_path: Path, **settings: object) -> tuple[Proc, str, str]:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"coordinator": {"workers": 2, **settings}}))
    proc = motor_proc("coordinator", "--config", str(cfg), "--port", "0", "--http-port", "0")
    grpc_addr, http = proc.listening(timeout=30)
    assert http is not None
    return proc, grpc_addr, http


async def _start_serving_union(
    motor_proc: Callable[..., Proc], tmp_path: Path, union: Engine, iid: int
) -> tuple[Proc, str]:
    """A workers = 2 Coordinator with one union instance added; (process, http address)."""
    proc, grpc_addr, http = _start(motor_proc, tmp_path)
    async with grpc.aio.insecure_channel(grpc_addr) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        await stub.AddInstances(
            cpb.AddInstancesRequest(instances=[instance(iid, UNION, union.port)]), timeout=10
        )
    return proc, http


def _worker_pids(proc: Proc) -> dict[int, int]:
    """index → pid of the newest start of each worker, from the management process's log."""
    pids: dict[int, int] = {}
    for line in proc.lines:
        if m := _STARTED.search(line):
            pids[int(m.group(1))] = int(m.group(2))
    return pids


async def _probe(http: str) -> tuple[int, list[str]]:
    """On one fresh connection: which worker answers, and the models it serves."""
    conn = aiohttp.TCPConnector(limit=1)  # one keep-alive connection: both requests, one worker
    async with aiohttp.ClientSession(connector=conn) as s:
        async with s.get(f"http://{http}/health") as r:
            worker = int((await r.json())["worker"])
        async with s.get(f"http://{http}/v1/models") as r:
            models = [m["id"] for m in (await r.json()).get("data", [])] if r.status == 200 else []
    return worker, models


async def _each_worker(http: str, n: int = 2, tries: int = 400) -> dict[int, list[str]]:
    """What every worker answers, reaching each over new connections (the kernel spreads them)."""
    seen: dict[int, list[str]] = {}
    for _ in range(tries):
        worker, models = await _probe(http)
        seen.setdefault(worker, models)
        if len(seen) == n:
            return seen
    raise AssertionError(f"only workers {sorted(seen)} answered in {tries} connections")


async def test_a_management_write_is_in_every_worker_before_the_rpc_answers(
    motor_proc: Callable[..., Proc], tmp_path: Path, engines: dict[str, Engine]
) -> None:
    _, grpc_addr, http = _start(motor_proc, tmp_path)
    before = await _each_worker(http)
    assert before == {0: [], 1: []}  # nothing routable yet, in either worker

    async with grpc.aio.insecure_channel(grpc_addr) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        await stub.AddInstances(
            cpb.AddInstancesRequest(instances=[instance(7, UNION, engines["union"].port)]), timeout=10
        )
        # Asked right after the answer: no poll, no wait. Both workers already route it.
        assert await _each_worker(http) == {0: [MODEL], 1: [MODEL]}

        gone = cpb.DeleteInstancesRequest(instances=[instance(7, UNION, engines["union"].port)])
        await stub.DeleteInstances(gone, timeout=10)
        listed = await stub.ListInstances(cpb.CoordinatorListInstancesRequest(), timeout=10)
        assert not listed.available
        assert await _each_worker(http) == {0: [], 1: []}


async def test_metrics_add_up_across_workers(
    motor_proc: Callable[..., Proc], tmp_path: Path, engines: dict[str, Engine]
) -> None:
    _, http = await _start_serving_union(motor_proc, tmp_path, engines["union"], 8)
    served: set[int] = set()
    n = 0
    while len(served) < 2 or n < 20:
        async with aiohttp.ClientSession() as s:  # a new connection each time: both workers serve
            async with s.get(f"http://{http}/health") as r:
                served.add(int((await r.json())["worker"]))
        conn = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s:
            async with s.post(f"http://{http}/v1/chat/completions", json=BODY) as r:
                assert r.status == 200, await r.text()
        n += 1
        assert n < 400
    # Whichever worker answers /metrics counts what both served (each publishes its own counts
    # at least once a second).
    line = 'motor_coordinator_requests_total{route="/v1/chat/completions",status="200"} '

    async def counted() -> list[float]:
        async with aiohttp.ClientSession() as s, s.get(f"http://{http}/metrics") as r:
            text = await r.text()
        return [float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)]

    async def all_counted() -> bool:
        return await counted() == [float(n)]

    await until(all_counted, timeout=10, what="both workers' requests counted")
    for _ in range(4):  # and stays so, whichever worker answers
        assert await counted() == [float(n)]


async def test_a_killed_worker_is_restarted_with_the_table_and_the_other_keeps_serving(
    motor_proc: Callable[..., Proc], tmp_path: Path, engines: dict[str, Engine]
) -> None:
    proc, http = await _start_serving_union(motor_proc, tmp_path, engines["union"], 9)
    first = _worker_pids(proc)
    assert sorted(first) == [0, 1]

    outcomes: list[int] = []  # status, or 0 for a connection the dead worker dropped
    stop = asyncio.Event()

    async def client() -> None:
        conn = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s:
            while not stop.is_set():
                try:
                    async with s.post(f"http://{http}/v1/chat/completions", json=BODY) as r:
                        await r.read()
                        outcomes.append(r.status)
                except aiohttp.ClientError:
                    outcomes.append(0)

    clients = [asyncio.create_task(client()) for _ in range(8)]
    try:
        await until(lambda: len(outcomes) >= 50, what="load before the kill")
        os.kill(first[0], signal.SIGKILL)
        at_kill = len(outcomes)
        await until(lambda: _worker_pids(proc).get(0, first[0]) != first[0], what="worker 0 restarted")
        await until(
            lambda: any(f"worker=0 pid={_worker_pids(proc)[0]}" in ln for ln in proc.lines),
            what="the new worker 0 serving",
        )
        await until(lambda: len(outcomes) >= at_kill + 200, what="load after the restart")
    finally:
        stop.set()
        await asyncio.gather(*clients)

    after = outcomes[at_kill:]
    # The other worker kept serving throughout; only requests on the killed one's connections failed.
    assert after.count(200) >= 190, after
    assert set(after) <= {200, 0}, set(after)
    assert _worker_pids(proc)[1] == first[1]  # the other worker was never restarted
    assert "event=worker_exited index=0" in proc.output()
    # The restarted worker took the whole table before it accepted anything.
    assert await _each_worker(http) == {0: [MODEL], 1: [MODEL]}
