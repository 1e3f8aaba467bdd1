"""Engine failures on the inference path, with real simulated-engine processes: killed, hung,
resetting engines, on either leg of a PD pair (vLLM hand-off and SGLang rooms).

What a client observes is asserted (status, error body, stream events), then that nothing was
left behind in the Coordinator (tasks, upstream connections, background legs, server
connections) nor on the engines (legs still waiting).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest

from motor_mesh.common.enums import DECODE, PREFILL
from motor_mesh.coordinator.routes import Target
from motor_mesh.gen.motor.v1 import common_pb2 as c
from tests.coordinator.conftest import (
    ENGINE_ARGS,
    MODEL,
    Engine,
    Running,
    SpawnEngines,
    StartCoordinator,
    get_text,
    instance,
    legs,
    running,
    set_table,
)
from tests.poll import until

SG = c.ENGINE_TYPE_SGLANG
UPSTREAM_ERRORS = re.compile(
    r'^motor_coordinator_upstream_errors_total\{kind="(\w+)",role="(\w+)"\} ([0-9.]+)$', re.M
)
PROMPT = "Tell me a story about a lighthouse keeper."


async def _upstream_errors(http: aiohttp.ClientSession, coord: Running) -> dict[str, float]:
    text = await get_text(http, f"http://{coord.http}/metrics")
    return {f"{role}/{kind}": float(n) for kind, role, n in UPSTREAM_ERRORS.findall(text)}


class Answer:
    def __init__(self, status: int, body: bytes, elapsed: float) -> None:
        self.status = status
        self.body = body
        self.elapsed = elapsed

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[Any]:
        """The ``data:`` payloads of an event stream, decoded ([DONE] stays a string)."""
        out: list[Any] = []
        for line in self.body.split(b"\n"):
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
        return out


async def _complete(coord: Running, stream: bool = False, max_tokens: int = 4, **extra: Any) -> Answer:
    """One completion through a fresh client connection (closed when done)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream, **extra}
    t0 = time.monotonic()
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"http://{coord.http}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=30)
        ) as r,
    ):
        data = await r.read()
        return Answer(r.status, data, time.monotonic() - t0)


def _error_of(answer: Answer, status: int, code: str) -> dict[str, Any]:
    assert answer.status == status, (answer.status, answer.body)
    err = answer.json()["error"]
    assert err["type"] == "server_error" and err["code"] == code, err
    return dict(err)


# -- leaks --------------------------------------------------------------------------------------


def _long_lived(task: asyncio.Task[Any]) -> bool:
    """Tasks that live as long as their owner and are created on first use: an upstream pool's
    deadline sweep (the breaker's probe pool starts one at its first probe)."""
    return getattr(task.get_coro(), "__qualname__", "") == "Pool._sweep"


class NoLeaks:
    """Snapshot of the in-process Coordinator taken before a fault; :meth:`check` waits (a short
    settle) until everything the fault's request used is given back."""

    def __init__(self, coord: Running) -> None:
        assert coord.co.inference is not None
        self.inference = coord.co.inference
        self.before = set(asyncio.all_tasks())

    def problems(self) -> list[str]:
        inf = self.inference
        out = []
        extra = [t for t in asyncio.all_tasks() - self.before if not t.done() and not _long_lived(t)]
        if extra:
            out.append(f"tasks left: {[t.get_coro() for t in extra]}")
        if inf.router.engines.pool.active:
            out.append(f"upstream exchanges still open: {len(inf.router.engines.pool.active)}")
        if inf.router.background:
            out.append(f"background prefill legs: {inf.router.background}")
        busy = [conn for conn in inf.http.connections if not conn.idle]
        if busy:
            out.append(f"client connections still busy: {len(busy)}")
        if inf.http.in_flight or inf.admission.active or inf.admission.queued:
            out.append(
                f"in flight {inf.http.in_flight}, admitted {inf.admission.active}, "
                f"queued {inf.admission.queued}"
            )
        return out

    async def check(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        await until(lambda: not self.problems(), timeout=timeout, what="nothing left behind")


async def _warm(coord: Running) -> None:
    """One request that succeeds: pools and sweeps exist before a leak snapshot is taken."""
    answer = await _complete(coord, max_tokens=1)
    assert answer.status == 200, answer.body


def _vllm(iid: int, role: int, e: Engine) -> c.Instance:
    return instance(iid, role, e.port)


def _sgl(iid: int, role: int, e: Engine) -> c.Instance:
    return instance(iid, role, e.port, engine_type=SG, bootstrap=e.bootstrap_port)


HANG_AFTER_ONE = ["--fault", "hang", "--fault-after-requests", "1"]


async def _vllm_pair(
    start: StartCoordinator,
    spawn: SpawnEngines,
    p: Sequence[str] = (),
    d: Sequence[str] = (),
    **cfg: Any,
) -> tuple[Running, dict[str, Engine]]:
    """Engines of the test's own, a vLLM prefill (extra flags ``p``) and decode (``d``), routed by
    a Coordinator of its own (``cfg``) as instances 1 and 2."""
    e = spawn(p=[*ENGINE_ARGS["vllm_p"], *p], d=[*ENGINE_ARGS["vllm_d"], *d])
    coord = await start(**cfg)
    await set_table(coord, _vllm(1, PREFILL, e["p"]), _vllm(2, DECODE, e["d"]))
    return coord, e


def _target(coord: Running, iid: int) -> Target:
    return next(t for t in coord.co.view.targets if t.id == iid)


# -- 1. the vLLM decode dies while the prefill runs -------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_killed_during_prefill_is_retried_on_another_pair(
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    http: aiohttp.ClientSession,
    stream: bool,
) -> None:
    e = spawn_engines(
        p=[*ENGINE_ARGS["vllm_p"], "--ttft-ms", "800"],
        d1=ENGINE_ARGS["vllm_d"],
        d2=ENGINE_ARGS["vllm_d2"],
    )
    coord = await start_coordinator(decode_policy="round_robin")
    # One instance first, for the warm-up; then d1 joins ahead of d2 in the rotation.
    await set_table(coord, _vllm(1, PREFILL, e["p"]), _vllm(3, DECODE, e["d2"]))
    await _warm(coord)
    await set_table(coord, _vllm(1, PREFILL, e["p"]), _vllm(2, DECODE, e["d1"]), _vllm(3, DECODE, e["d2"]))
    leaks = NoLeaks(coord)
    before_p, before_d2 = await legs(http, e["p"]), await legs(http, e["d2"])

    request = asyncio.create_task(_complete(coord, stream=stream))
    await until(lambda: running(http, e["p"]), timeout=10, what="the prefill leg running")
    e["d1"].kill()  # SIGKILL while the prefill is under way
    answer = await asyncio.wait_for(request, 15)

    assert answer.status == 200, answer.body
    if stream:
        events = answer.events()
        assert events[-1] == "[DONE]" and not any("error" in ev for ev in events if isinstance(ev, dict))
        assert "".join(ev["choices"][0]["text"] for ev in events[:-1] if ev["choices"])
    else:
        assert answer.json()["choices"][0]["text"]
    # A fresh pair: a second prefill (no ticket is shared between attempts), decoded on d2.
    assert (await legs(http, e["p"]))["prefill/vllm"] - before_p["prefill/vllm"] == 2
    assert (await legs(http, e["d2"]))["decode/vllm"] - before_d2["decode/vllm"] == 1
    assert (await _upstream_errors(http, coord)).get("decode/connect") == 1
    assert _target(coord, 2).endpoints[0].down  # out of rotation at once
    await leaks.check()


async def test_only_decode_killed_during_prefill_is_502(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    coord, e = await _vllm_pair(start_coordinator, spawn_engines, p=["--ttft-ms", "800"])
    await _warm(coord)
    leaks = NoLeaks(coord)
    before_p = await legs(http, e["p"])

    request = asyncio.create_task(_complete(coord))
    await until(lambda: running(http, e["p"]), timeout=10, what="the prefill leg running")
    e["d"].kill()
    answer = await asyncio.wait_for(request, 15)

    err = _error_of(answer, 502, "upstream_unreachable")
    assert "decode" in err["message"]
    # No decode left to pair with: no second prefill is wasted on the way to the 502.
    assert (await legs(http, e["p"]))["prefill/vllm"] - before_p["prefill/vllm"] == 1
    # The last decode stays in rotation (the breaker never empties a role); asked again, the
    # Coordinator tries it again and answers the same, without hanging.
    assert not _target(coord, 2).endpoints[0].down
    again = await asyncio.wait_for(_complete(coord), 15)
    _error_of(again, 502, "upstream_unreachable")
    await leaks.check()


# -- 2. SGLang: the prefill dies while the decode waits on its room ----------------------------


@pytest.mark.parametrize("spare_prefill", [True, False])
async def test_sglang_prefill_killed_while_decode_waits_on_its_room(
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    http: aiohttp.ClientSession,
    spare_prefill: bool,
) -> None:
    # The decode engine runs one sequence at a time: a leg left waiting on a dead room would
    # hold its only slot, and the next request would wait behind it.
    spawn = {
        "p1": [*ENGINE_ARGS["sgl_p"], "--ttft-ms", "800"],
        "d": [*ENGINE_ARGS["sgl_d"], "--max-num-seqs", "1", "--bootstrap-timeout-s", "30"],
    }
    if spare_prefill:
        spawn["p2"] = ENGINE_ARGS["sgl_p"]
    e = spawn_engines(**spawn)
    coord = await start_coordinator(prefill_policy="round_robin")
    prefills = [_sgl(1, PREFILL, e["p1"])]
    if spare_prefill:
        prefills.append(_sgl(3, PREFILL, e["p2"]))
    await set_table(coord, prefills[-1], _sgl(2, DECODE, e["d"]))
    await _warm(coord)
    # A new view: the round-robin starts over at p1, the one killed below.
    await set_table(coord, *prefills, _sgl(2, DECODE, e["d"]))
    leaks = NoLeaks(coord)

    request = asyncio.create_task(_complete(coord, stream=True))
    await until(lambda: running(http, e["p1"]), timeout=10, what="the prefill leg running")
    await until(lambda: running(http, e["d"]), timeout=10, what="the decode leg waiting on its room")
    e["p1"].kill()
    answer = await asyncio.wait_for(request, 15)
    # Well within every deadline: no decode leg waits on a room that will never fill.
    assert answer.elapsed < 10

    if spare_prefill:
        assert answer.status == 200, answer.body
        assert answer.events()[-1] == "[DONE]"
    else:
        err = _error_of(answer, 502, "upstream_unreachable")
        assert "prefill" in err["message"]
    # The decode engine is not left with a leg waiting: its one slot is free again...
    await until(lambda: _idle(http, e["d"]), timeout=5, what="the decode engine's waiting leg to end")
    await leaks.check()
    if spare_prefill:
        # ...and the next request is served at once.
        nxt = await asyncio.wait_for(_complete(coord), 10)
        assert nxt.status == 200, nxt.body


async def _idle(http: aiohttp.ClientSession, engine: Engine) -> bool:
    return await running(http, engine) == 0.0


async def test_sglang_decode_killed_while_waiting_cancels_its_prefill_and_retries(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    e = spawn_engines(
        p=[*ENGINE_ARGS["sgl_p"], "--ttft-ms", "800"], d1=ENGINE_ARGS["sgl_d"], d2=ENGINE_ARGS["sgl_d"]
    )
    coord = await start_coordinator(decode_policy="round_robin")
    await set_table(coord, _sgl(1, PREFILL, e["p"]), _sgl(3, DECODE, e["d2"]))
    await _warm(coord)
    await set_table(coord, _sgl(1, PREFILL, e["p"]), _sgl(2, DECODE, e["d1"]), _sgl(3, DECODE, e["d2"]))
    leaks = NoLeaks(coord)
    before_p, before_d2 = await legs(http, e["p"]), await legs(http, e["d2"])

    request = asyncio.create_task(_complete(coord))
    await until(lambda: running(http, e["d1"]), timeout=10, what="the decode leg waiting on its room")
    e["d1"].kill()
    answer = await asyncio.wait_for(request, 15)

    assert answer.status == 200, answer.body
    # The first prefill leg was cancelled with its decode (it never finished: no room was
    # filled for nobody); the retry's pair did the work.
    assert (await legs(http, e["p"]))["prefill/sglang"] - before_p["prefill/sglang"] == 1
    assert (await legs(http, e["d2"]))["decode/sglang"] - before_d2["decode/sglang"] == 1
    await until(lambda: _idle(http, e["p"]), timeout=5, what="the prefill engine idle")
    await leaks.check()


async def test_sglang_prefill_error_ends_the_decode_wait(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    # The prefill engine refuses every request after the first with its own 500; the decode
    # leg, sent at the same time, would wait for a room that is never filled.
    e = spawn_engines(
        p=[*ENGINE_ARGS["sgl_p"], "--fault", "error", "--fault-after-requests", "1"],
        d=[*ENGINE_ARGS["sgl_d"], "--bootstrap-timeout-s", "30"],
    )
    coord = await start_coordinator()
    await set_table(coord, _sgl(1, PREFILL, e["p"]), _sgl(2, DECODE, e["d"]))
    await _warm(coord)
    leaks = NoLeaks(coord)
    for stream in (False, True):
        answer = await asyncio.wait_for(_complete(coord, stream=stream), 15)
        assert answer.status == 500, answer.body  # the engine's own answer passes through
        assert answer.json()["error"]["message"] == "injected fault"
    await until(lambda: _idle(http, e["d"]), timeout=5, what="the decode legs waiting on rooms to end")
    await leaks.check()


# -- client disconnect cancels both legs --------------------------------------------------------


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_client_leaving_during_the_prefill_cancels_both_legs(
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    http: aiohttp.ClientSession,
    protocol: str,
) -> None:
    if protocol == "vllm":
        e = spawn_engines(p=[*ENGINE_ARGS["vllm_p"], "--ttft-ms", "1000"], d=ENGINE_ARGS["vllm_d"])
        insts = (_vllm(1, PREFILL, e["p"]), _vllm(2, DECODE, e["d"]))
    else:
        e = spawn_engines(p=[*ENGINE_ARGS["sgl_p"], "--ttft-ms", "1000"], d=ENGINE_ARGS["sgl_d"])
        insts = (_sgl(1, PREFILL, e["p"]), _sgl(2, DECODE, e["d"]))
    coord = await start_coordinator()
    await set_table(coord, *insts)
    await _warm(coord)
    leaks = NoLeaks(coord)
    before = {k: await legs(http, e[k]) for k in ("p", "d")}

    session = aiohttp.ClientSession()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    request = asyncio.create_task(session.post(f"http://{coord.http}/v1/completions", json=body))
    try:
        await until(lambda: running(http, e["p"]), timeout=10, what="the prefill leg running")
        if protocol == "sglang":
            await until(lambda: running(http, e["d"]), timeout=10, what="the decode leg waiting")
    finally:
        request.cancel()
        await session.close()  # the client goes away
    await until(lambda: _idle(http, e["p"]), timeout=5, what="the prefill leg to stop")
    await until(lambda: _idle(http, e["d"]), timeout=5, what="the decode leg to stop")
    await leaks.check()
    await asyncio.sleep(1.2)  # past the prefill's own time: a leg left running would be counted
    assert await legs(http, e["p"]) == before["p"]
    assert await legs(http, e["d"]) == before["d"]


# -- 3. hung engines: per-phase deadlines -------------------------------------------------------


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_hung_prefill_is_504_naming_prefill_timeout(
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    http: aiohttp.ClientSession,
    protocol: str,
) -> None:
    if protocol == "vllm":
        e = spawn_engines(p=[*ENGINE_ARGS["vllm_p"], "--fault", "hang", "--fault-after-requests", "1"],
                          d=ENGINE_ARGS["vllm_d"])  # fmt: skip
        insts = (_vllm(1, PREFILL, e["p"]), _vllm(2, DECODE, e["d"]))
    else:
        e = spawn_engines(p=[*ENGINE_ARGS["sgl_p"], "--fault", "hang", "--fault-after-requests", "1"],
                          d=ENGINE_ARGS["sgl_d"])  # fmt: skip
        insts = (_sgl(1, PREFILL, e["p"]), _sgl(2, DECODE, e["d"]))
    coord = await start_coordinator(prefill_timeout_s=1)
    await set_table(coord, *insts)
    await _warm(coord)  # request 1 is served; every later one hangs
    leaks = NoLeaks(coord)

    answer = await asyncio.wait_for(_complete(coord), 15)
    err = _error_of(answer, 504, "upstream_timeout")
    assert "prefill_timeout_s" in err["message"] and "prefill" in err["message"]
    assert answer.elapsed < 1 + 5
    if protocol == "sglang":
        # The decode leg waiting for the hung prefill's room was cancelled with it.
        await until(lambda: _idle(http, e["d"]), timeout=5, what="the SGLang decode leg to end")
    await leaks.check()


async def test_hung_decode_is_504_naming_decode_first_byte_timeout(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines
) -> None:
    coord, _ = await _vllm_pair(
        start_coordinator, spawn_engines, d=HANG_AFTER_ONE, decode_first_byte_timeout_s=1
    )
    await _warm(coord)
    leaks = NoLeaks(coord)
    for stream in (False, True):
        answer = await asyncio.wait_for(_complete(coord, stream=stream), 15)
        err = _error_of(answer, 504, "upstream_timeout")
        assert "decode_first_byte_timeout_s" in err["message"]
        assert answer.elapsed < 1 + 5
    await leaks.check()


async def test_stream_that_goes_quiet_ends_with_an_error_event(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines
) -> None:
    # The decode's first stream sends its first token, then the engine hangs for good.
    # Continuation off: this is how a broken stream ends when it cannot go on elsewhere
    # (tests/coordinator/migration covers the continuation).
    coord, _ = await _vllm_pair(
        start_coordinator,
        spawn_engines,
        d=["--tpot-ms", "50", *HANG_AFTER_ONE],
        decode_idle_timeout_s=0.5,
        migration_limit=0,
    )
    # No warm-up on the decode (it would be the one stream that gets its first token):
    # the pools start with this request, and the leak snapshot allows their sweeps.
    leaks = NoLeaks(coord)
    answer = await asyncio.wait_for(_complete(coord, stream=True, max_tokens=50), 15)
    assert answer.status == 200  # the head went out with the first token
    events = answer.events()
    assert events and "[DONE]" not in events
    assert events[0]["choices"][0]["text"]  # the first token reached the client
    err = events[-1]["error"]
    assert err["code"] == "upstream_timeout" and "decode_idle_timeout_s" in err["message"], err
    assert answer.elapsed < 0.5 + 5
    await leaks.check()


# -- 4. the engine resets the connection mid-answer ---------------------------------------------


async def test_reset_mid_stream_ends_with_an_error_event_and_non_stream_is_502(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines
) -> None:
    coord, _ = await _vllm_pair(
        start_coordinator,
        spawn_engines,
        d=["--fault", "disconnect", "--fault-after-requests", "1"],
        migration_limit=0,  # as above: the end of a stream that cannot continue
    )
    await _warm(coord)
    leaks = NoLeaks(coord)

    answer = await asyncio.wait_for(_complete(coord, stream=True, max_tokens=8), 15)
    assert answer.status == 200
    events = answer.events()
    assert "[DONE]" not in events
    assert events[0]["choices"][0]["text"]  # what the engine sent before the reset got through
    err = events[-1]["error"]  # and then the client is told: no silent truncation
    assert err["code"] == "upstream_disconnected" and err["type"] == "server_error", err

    answer = await asyncio.wait_for(_complete(coord, stream=False), 15)
    assert answer.status == 502, answer.body
    assert answer.json()["error"]["type"] == "server_error"
    await leaks.check()


# -- 6. one of two decodes dies under load --------------------------------------------------------


async def test_decode_killed_under_load_is_routed_around_then_back(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    e = spawn_engines(
        p=[*ENGINE_ARGS["vllm_p"], "--ttft-ms", "20"],
        d1=[*ENGINE_ARGS["vllm_d"], "--tpot-ms", "10"],
        d2=[*ENGINE_ARGS["vllm_d2"], "--tpot-ms", "10"],
    )
    coord = await start_coordinator()
    await set_table(coord, _vllm(1, PREFILL, e["p"]), _vllm(2, DECODE, e["d1"]), _vllm(3, DECODE, e["d2"]))
    await _warm(coord)
    leaks = NoLeaks(coord)
    d1_ep = _target(coord, 2).endpoints[0]
    url = f"http://{coord.http}/v1/completions"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}
    statuses: list[int] = []
    stop = asyncio.Event()

    async def client(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
                await r.read()
                statuses.append(r.status)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        clients = [asyncio.create_task(client(s)) for _ in range(16)]
        try:
            await until(lambda: len(statuses) >= 50, timeout=20, what="load under way")
            assert (await legs(http, e["d1"]))["decode/vllm"] > 0  # d1 was taking its share
            e["d1"].kill()
            await until(lambda: d1_ep.down, timeout=10, what="the killed decode leaving rotation")
            after_kill = (await _upstream_errors(http, coord)).get("decode/connect", 0)
            served = len(statuses)
            await until(lambda: len(statuses) >= served + 100, timeout=20, what="more load after the kill")
        finally:
            stop.set()
            await asyncio.gather(*clients)

    assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    errors = await _upstream_errors(http, coord)
    # Connection attempts to the dead engine: at most one per request in flight at the kill,
    # and none once it was out of rotation.
    assert 1 <= errors["decode/connect"] <= 16
    assert errors["decode/connect"] == after_kill

    # A new engine on the same port is probed back into rotation and gets requests again.
    port = e["d1"].port
    revived = spawn_engines(d1b=[*ENGINE_ARGS["vllm_d"], "--port", str(port)])["d1b"]
    assert revived.port == port
    await until(lambda: not d1_ep.down, timeout=10, what="the revived decode back in rotation")

    async def served_by_revived() -> bool:
        r = await _complete(coord, max_tokens=2)
        assert r.status == 200, r.body
        return (await legs(http, revived))["decode/vllm"] > 0

    await until(served_by_revived, timeout=10, what="a request decoded by the revived engine")
    await leaks.check()
