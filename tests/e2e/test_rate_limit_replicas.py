"""Rate limits hold across Coordinator replicas without a shared store: a Controller keeping two
``motor coordinator`` processes tells each that two share the deployment, each enforces half of
every bucket, and a client alternating between them, sending three times the limit, gets the
limit's worth over 60 s, within 5 %: requests per minute for one tenant, tokens per minute (as
the answers' own usage counts them) for another. Each replica's ``X-RateLimit-*`` headers count
its own half down one request at a time.

The buckets start full (a client may spend a quiet minute's allowance at once), so the minute is
measured from the moment both replicas refuse the tenant: what passes then is the sustained
rate."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.test_config_reload_processes import coordinator_settings
from tests.poll import until, wait_until
from tests.ports import reserved_pair, reserved_port
from tests.procs import Proc, motor_argv

pytestmark = pytest.mark.timeout(300)

RPM = 120  # tenant "rpm": requests per minute
TPM = 4000  # tenant "tpm": tokens per minute
MAX_TOKENS = 40
WINDOW_S = 60.0
LOAD = 3.0  # times the limit
KEYS = {"rpm": "sk-test-rpm-tenant-000000", "tpm": "sk-test-tpm-tenant-000000"}


async def _post(s: aiohttp.ClientSession, http: str, key: str) -> tuple[int, dict[str, str], int]:
    """(status, headers, tokens the answer's usage counts: prompt + completion)."""
    body = {"model": "motor-sim", "prompt": "rate limits", "max_tokens": MAX_TOKENS}
    async with s.post(
        f"http://{http}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        doc = await r.json(content_type=None)
        used = doc["usage"]["total_tokens"] if r.status == 200 else 0
        return r.status, dict(r.headers), used


async def _drain(s: aiohttp.ClientSession, https: list[str], key: str) -> None:
    """Spend the tenant's allowance on both replicas (until each refuses it)."""
    for http in https:
        for _ in range(10_000):
            status, _, _ = await _post(s, http, key)
            if status == 429:
                break
            assert status == 200
        else:
            raise AssertionError(f"{http} never refused {key[:10]}")


async def _minute(s: aiohttp.ClientSession, https: list[str], key: str, rate: float) -> tuple[int, int]:
    """``rate`` requests a second for WINDOW_S, alternating replicas, open loop: (answered
    200, tokens they used)."""
    results: list[tuple[int, dict[str, str], int]] = []
    t0 = time.monotonic()
    sends = []
    n = int(rate * WINDOW_S)
    for i in range(n):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        sends.append(asyncio.create_task(_post(s, https[i % 2], key)))
    results = await asyncio.gather(*sends)
    ok = [r for r in results if r[0] == 200]
    assert all(r[0] in (200, 429) for r in results)
    return len(ok), sum(r[2] for r in ok)


def _start(tmp_path: Path) -> tuple[list[Proc], list[str], list[str]]:
    tenants = tmp_path / "tenants.json"
    tenants.write_text(
        json.dumps(
            [
                {"name": "rpm", "keys": [KEYS["rpm"]], "requests_per_minute": RPM},
                {"name": "tpm", "keys": [KEYS["tpm"]], "tokens_per_minute": TPM},
            ]
        )
    )
    os.chmod(tenants, 0o600)
    grpc_ports, ctl_port = [reserved_port(), reserved_port()], reserved_port()
    grpcs = [f"127.0.0.1:{p}" for p in grpc_ports]
    sections: dict[str, Any] = {
        "controller": {"port": ctl_port, "coordinators": grpcs, "state_dir": str(tmp_path / "ctl")},
        "coordinator": {
            "http_port": 0,
            "workers": 1,
            "tenants_file": str(tenants),
            "controller": f"127.0.0.1:{ctl_port}",
        },
        "nodemanager": {
            "controller": f"127.0.0.1:{ctl_port}",
            "job_name": "rate-limits",
            "role": "union",
            "ports": [reserved_pair()],
            "state_dir": str(tmp_path / "nm"),
        },
    }
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(sections))
    procs = [Proc(motor_argv("controller", "--config", str(cfg)), cwd=tmp_path)]
    procs += [
        Proc(motor_argv("coordinator", "--config", str(cfg), "--port", str(p)), cwd=tmp_path)
        for p in grpc_ports
    ]
    procs.append(Proc(motor_argv("nodemanager", "--config", str(cfg), "--port", "0"), cwd=tmp_path))
    https = []
    for p in procs[1:3]:
        _, http = p.listening()
        assert http is not None
        https.append(http)
    return procs, grpcs, https


async def _ready(https: list[str]) -> None:
    async with aiohttp.ClientSession() as s:

        async def ready(http: str) -> bool:
            async with s.get(f"http://{http}/readiness") as r:
                return r.status == 200

        for http in https:
            await until(lambda http=http: ready(http), 60, f"{http} ready (the engine in its table)")


def test_limits_hold_across_two_replicas_and_each_counts_its_half(tmp_path: Path) -> None:
    procs, grpcs, https = _start(tmp_path)
    try:
        procs[0].listening()
        for address in grpcs:  # the Controller told each that two share the limits
            wait_until(lambda address=address: coordinator_settings(address) == (0, 2), timeout=30)
        asyncio.run(_ready(https))
        asyncio.run(_check(https))
    finally:
        for p in reversed(procs):
            p.kill()


async def _check(https: list[str]) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        # Each replica counts its own half down, one request at a time.
        for http in https:
            seen = []
            for _ in range(5):
                status, headers, _ = await _post(s, http, KEYS["rpm"])
                assert status == 200 and headers["X-RateLimit-Limit"] == str(RPM // 2)
                seen.append(int(headers["X-RateLimit-Remaining"]))
            assert seen == list(range(RPM // 2 - 1, RPM // 2 - 6, -1))
        await asyncio.gather(*(_drain(s, https, KEYS[t]) for t in ("rpm", "tpm")))
        per_request = MAX_TOKENS + 3  # about: the prompt's few tokens and MAX_TOKENS written
        (requests, _), (_, tokens) = await asyncio.gather(
            _minute(s, https, KEYS["rpm"], LOAD * RPM / 60),
            _minute(s, https, KEYS["tpm"], LOAD * TPM / per_request / 60),
        )
    assert abs(requests - RPM) <= 0.05 * RPM, f"{requests} requests passed in a minute (limit {RPM})"
    assert abs(tokens - TPM) <= 0.05 * TPM, f"{tokens} tokens used in a minute (limit {TPM})"
