"""What admission adds to a request, in process: the code a completion passes through before and
after routing (key lookup, rate-limit buckets and their headers, a slot, the answer metered and
the token charge settled), with 1,000 tenants configured against none (the open API with no
limit). The answer is a 300-byte JSON body sent to a connection that drops it.

Batches of each alternate, so drift in the machine's speed falls on both alike; the figure is the
median (and the worst) of the per-request time of each batch."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import statistics
import tempfile
import time
from dataclasses import dataclass, replace

from motor_mesh.common.apikeys import hash_key
from motor_mesh.common.config import CoordinatorConfig
from motor_mesh.common.httpmessages import Responder
from motor_mesh.coordinator.admission.gate import Gate
from motor_mesh.coordinator.admission.tenants import load_directory
from motor_mesh.coordinator.admission.usage import MeteredResponder

BODY = json.dumps(
    {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "x" * 120}],
     "usage": {"prompt_tokens": 30, "completion_tokens": 20, "total_tokens": 50}}
).encode()  # fmt: skip
PATH = "/v1/completions"


class _Drop:
    pending_head = b""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass


@dataclass
class Cost:
    median_us: float
    worst_us: float


async def _path(gate: Gate, header: bytes, now: float) -> None:
    """One request's admission, as InferenceApp runs it (http_app.py)."""
    account = gate.identify(header)
    assert account is not None
    ticket = gate.charge(account, 150, now) if gate.limited(PATH) else None
    slots = gate.slots
    gate.asks_for_a_slot(account)
    granted = await slots.acquire(account, 30, 120)
    out = Responder(_Drop(), False)  # type: ignore[arg-type]
    meter = None
    if ticket is not None and ticket.token_buckets:
        meter = out = MeteredResponder(out)
    out.send(200, BODY, headers=ticket.headers if ticket is not None else None)
    slots.release(account, granted)
    if meter is not None and ticket is not None:
        used = meter.used()
        gate.settle(ticket, None if used is None else used + (meter.prompt_tokens or 30), now)


def _tenants_file(directory: str, n: int) -> tuple[str, list[bytes]]:
    keys = [f"sk-{secrets.token_urlsafe(24)}" for _ in range(n)]
    tenants = [
        {"name": f"t{i}", "keys": [hash_key(k)], "requests_per_minute": 10**9, "tokens_per_minute": 10**12,
         "weight": 1 + i % 3, "priority": ("interactive", "standard", "batch")[i % 3]}
        for i, k in enumerate(keys)
    ]  # fmt: skip
    path = os.path.join(directory, "tenants.json")
    with open(path, "w") as f:
        json.dump(tenants, f)
    os.chmod(path, 0o600)
    return path, [f"Bearer {k}".encode() for k in keys]


def wrong_keys(tenants: int = 1000, calls: int = 20000, rounds: int = 20) -> dict[str, float]:
    """Median microseconds to refuse a wrong key (401), by how close it is to a valid one: a
    valid key with its last character changed, its first, and a random key of the same length.
    Equal times are what constant time means here."""
    from motor_mesh.common.http_errors import OpenAIError

    with tempfile.TemporaryDirectory() as d:
        path, headers = _tenants_file(d, tenants)
        gate = Gate(replace(CoordinatorConfig(), tenants_file=path), load_directory(path, ""), 1, 0.0)
    valid = headers[tenants // 2]  # b"Bearer sk-...": byte 10 is the key's first random one
    cases = {
        "all but its last character right": valid[:-1] + (b"x" if valid[-1:] != b"x" else b"y"),
        "its first character wrong": valid[:10] + bytes([valid[10] ^ 1]) + valid[11:],
        "random": f"Bearer sk-{secrets.token_urlsafe(24)}".encode(),
    }
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, header in cases.items():
            t0 = time.perf_counter_ns()
            for _ in range(calls // rounds):
                try:
                    gate.identify(header)
                except OpenAIError:
                    pass
            runs[name].append((time.perf_counter_ns() - t0) / (calls // rounds) / 1000)
    return {name: statistics.median(v) for name, v in runs.items()}


async def measure(tenants: int = 1000, batches: int = 200, per_batch: int = 1000) -> tuple[Cost, Cost]:
    """(no tenants, ``tenants`` tenants with limits): the admission path's time per request."""
    loop = asyncio.get_running_loop()
    with tempfile.TemporaryDirectory() as d:
        path, headers = _tenants_file(d, tenants)
        base = CoordinatorConfig()
        open_gate = Gate(base, None, 1, loop.time())
        cfg = replace(base, tenants_file=path)
        tenant_gate = Gate(cfg, load_directory(path, ""), 1, loop.time())
    runs: dict[str, list[float]] = {"none": [], "tenants": []}
    anonymous = [b"Bearer x"] * len(headers)
    for b in range(batches):
        for name, gate, keys in (("none", open_gate, anonymous), ("tenants", tenant_gate, headers)):
            t0 = time.perf_counter_ns()
            now = loop.time()
            for i in range(per_batch):
                await _path(gate, keys[(b * per_batch + i) % len(keys)], now)
            runs[name].append((time.perf_counter_ns() - t0) / per_batch / 1000)
    return tuple(Cost(statistics.median(v), max(v)) for v in (runs["none"], runs["tenants"]))  # type: ignore[return-value]
