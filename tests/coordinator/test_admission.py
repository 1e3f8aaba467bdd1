"""Fair admission on a running Coordinator, with a real simulated engine and real HTTP clients:
tenants and their (hashed) keys, rate limits with their headers and 429 bodies, the token charge
corrected by what an answer used, and priority classes under overload.

Only what a client sees is asserted: statuses, headers, error bodies, and the log lines (no key
in any of them). Timings are never compared with numbers."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from motor_mesh.common.apikeys import hash_key
from motor_mesh.common.enums import UNION
from motor_mesh.gen.motor.v1 import coordinator_pb2 as pb
from tests.coordinator.conftest import MODEL, Engine, Running, SpawnEngines, StartCoordinator, instance
from tests.http import ERROR_FIELDS
from tests.poll import until

SECRET_A = "sk-tenant-a-0123456789abcdef"
SECRET_B = "sk-tenant-b-fedcba9876543210"
SECRET_SLOW = "sk-tenant-pbkdf2-0123456789"


@pytest.fixture
def union(spawn_engines: SpawnEngines) -> Iterator[Engine]:
    yield spawn_engines(u=[])["u"]


def _tenants(tmp_path: Path, tenants: list[dict[str, Any]]) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(tenants))
    os.chmod(path, 0o600)
    return str(path)


async def _coordinator(start: StartCoordinator, engine: Engine, **cfg: object) -> Running:
    coord = await start(**cfg)
    await coord.stub.SetInstances(
        pb.SetInstancesRequest(instances=[instance(1, UNION, engine.port)]), timeout=5
    )
    return coord


async def _post(
    s: aiohttp.ClientSession, coord: Running, key: str | None, **body: Any
) -> tuple[int, dict[str, str], dict[str, Any]]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    payload = {"model": MODEL, "prompt": "admission", "max_tokens": 2, **body}
    async with s.post(f"http://{coord.http}/v1/completions", json=payload, headers=headers) as r:
        data = await r.read()
        return r.status, dict(r.headers), json.loads(data) if data.startswith(b"{") else {}


async def test_hashed_keys_authenticate_and_no_key_reaches_a_log(
    start_coordinator: StartCoordinator, union: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    path = _tenants(
        tmp_path,
        [
            {"name": "a", "keys": [hash_key(SECRET_A)]},
            {"name": "b", "keys": [hash_key(SECRET_B, "pbkdf2", iterations=100_000)]},
        ],
    )
    coord = await _coordinator(start_coordinator, union, tenants_file=path)
    async with aiohttp.ClientSession() as s:
        for key in (SECRET_A, SECRET_B, SECRET_B):  # the PBKDF2 key: checked once, then remembered
            status, _, _ = await _post(s, coord, key)
            assert status == 200
        for key in (None, SECRET_A[:-1], SECRET_A + "0", SECRET_SLOW, ""):
            status, headers, body = await _post(s, coord, key)
            assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
            assert body["error"].keys() == ERROR_FIELDS and body["error"]["code"] == "invalid_api_key"
        async with s.get(f"http://{coord.http}/readiness") as r:
            assert r.status == 200  # probes need no key
    logged = "\n".join(r.getMessage() + repr(getattr(r, "fields", "")) for r in caplog.records)
    for secret in (SECRET_A, SECRET_B, SECRET_SLOW):
        assert secret not in logged


async def test_a_tenants_request_limit_counts_down_then_refuses_with_an_openai_error(
    start_coordinator: StartCoordinator, union: Engine, tmp_path: Path
) -> None:
    path = _tenants(
        tmp_path,
        [
            {"name": "a", "keys": [SECRET_A], "requests_per_minute": 3},
            {"name": "b", "keys": [SECRET_B]},
        ],
    )
    coord = await _coordinator(start_coordinator, union, tenants_file=path)
    async with aiohttp.ClientSession() as s:
        remaining = []
        for _ in range(3):
            status, headers, _ = await _post(s, coord, SECRET_A)
            assert status == 200 and headers["X-RateLimit-Limit"] == "3"
            remaining.append(headers["X-RateLimit-Remaining"])
            assert int(headers["X-RateLimit-Reset"]) > 0
        assert remaining == ["2", "1", "0"]
        status, headers, body = await _post(s, coord, SECRET_A)
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert headers["X-RateLimit-Remaining"] == "0"
        err = body["error"]
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
        assert "requests_per_minute" in err["message"]
        for _ in range(5):  # the other tenant is not limited by a's limit
            status, headers, _ = await _post(s, coord, SECRET_B)
            assert status == 200 and "X-RateLimit-Limit" not in headers


async def test_the_global_token_limit_is_corrected_by_what_answers_used(
    start_coordinator: StartCoordinator, union: Engine
) -> None:
    """Requests without max_tokens are charged the Coordinator's default estimate (128 tokens)
    but the engine writes 16: without the correction the bucket would refuse the eighth."""
    coord = await _coordinator(
        start_coordinator, union, rate_limit={"max_tokens_per_window": 1000, "window_s": 3600}
    )
    async with aiohttp.ClientSession() as s:
        left = []
        for stream in [False, True] * 10:
            status, headers, _ = await _post(s, coord, None, max_tokens=None, stream=stream)
            assert status == 200
            left.append(int(headers["X-RateLimit-Remaining"]))
    # Each answer charged about 130 at admission and kept about 20 (prompt + 16 written).
    assert 1000 - 20 * 40 < left[-1] < 1000 - 20 * 10


async def test_under_overload_batch_is_refused_before_interactive(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, tmp_path: Path
) -> None:
    slow = spawn_engines(u=["--ttft-ms", "300"])["u"]
    path = _tenants(
        tmp_path,
        [
            {"name": "batch", "keys": [SECRET_A], "priority": "batch"},
            {"name": "live", "keys": [SECRET_B], "priority": "interactive"},
        ],
    )
    coord = await _coordinator(
        start_coordinator, slow, tenants_file=path, max_concurrent_requests=1, max_queued_requests=4
    )
    admission = coord.co.inference.admission if coord.co.inference else None
    assert admission is not None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        batch = [asyncio.create_task(_post(s, coord, SECRET_A)) for _ in range(5)]
        await until(lambda: admission.active == 1 and admission.queued == 4, timeout=10, every=0.005)
        live = [asyncio.create_task(_post(s, coord, SECRET_B)) for _ in range(4)]
        live_results = await asyncio.gather(*live)
        batch_results = await asyncio.gather(*batch)
    assert [r[0] for r in live_results] == [200] * 4
    statuses = sorted(r[0] for r in batch_results)
    assert statuses == [200, 429, 429, 429, 429]  # the one running, then every waiting one gave way
    refused = [r[2]["error"] for r in batch_results if r[0] == 429]
    assert all("higher priority" in e["message"] for e in refused)


async def test_a_client_on_one_connection_gets_its_whole_limit_from_the_worker_it_reached(
    start_coordinator: StartCoordinator, union: Engine
) -> None:
    """Two inference workers: each starts with half of the bucket, then the parts follow the
    demand, so one keep-alive connection (one worker) gets about the whole limit, not half."""
    rate, window = 20, 2.0  # 10 requests a second
    coord = await _coordinator(
        start_coordinator, union, workers=2, rate_limit={"max_requests": rate, "window_s": window}
    )
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        loop = asyncio.get_running_loop()

        async def send_for(seconds: float) -> int:
            passed, end = 0, loop.time() + seconds
            while loop.time() < end:
                status, _, _ = await _post(s, coord, None, max_tokens=1)
                assert status in (200, 429)
                passed += status == 200
            return passed

        await send_for(3.0)  # the bucket drained, the parts moved to this worker
        seconds = 6.0
        passed = await send_for(seconds)
    whole = rate / window * seconds
    assert 0.75 * whole < passed <= 1.1 * whole, f"{passed} passed in {seconds} s (the limit: {whole:g})"
