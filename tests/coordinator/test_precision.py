"""Precision detection end to end: a real in-process Coordinator with detection on, real simulated
engines as the PD pair, and a fake Controller receiving the alarms.

The simulated engine's ``precision`` fault garbles its output and collapses its log-probabilities
(``POST /sim/fault {"mode": "precision"}``); ``{"mode": "none"}`` heals it. Which legs an engine
served is read from its ``motor_sim_pd_legs_total``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from motor_mesh.common.config import ConfigError
from motor_mesh.common.enums import DECODE, PREFILL, UNION
from motor_mesh.coordinator.precision import reporter, sampler
from motor_mesh.coordinator.precision.groups import Action, Completed, PrecisionGroups, ProbeOutcome
from motor_mesh.gen.motor.v1 import alarm_pb2
from motor_mesh.gen.motor.v1 import common_pb2 as c
from motor_mesh.gen.motor.v1 import coordinator_pb2 as pb
from tests.coordinator.conftest import (
    ENGINE_ARGS,
    MODEL,
    Engine,
    FakeController,
    Running,
    SpawnEngines,
    StartCoordinator,
    get_text,
    instance,
    legs,
    running,
    serve_controller,
    set_table,
)
from tests.poll import until
from tests.ports import reserved_port

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
ALARM = alarm_pb2.ALARM_CATEGORY_ALARM
CLEAR = alarm_pb2.ALARM_CATEGORY_CLEAR


def detection(fake: FakeController, **more: Any) -> dict[str, Any]:
    """Coordinator settings for a test: detection on, everything short."""
    return {
        "precision_check_enabled": True,
        "precision_interval_s": 0.05,
        "precision_issue_threshold": 2,
        "precision_clear_threshold": 2,
        "probe_max_attempts": 2,
        "probe_timeout_s": 10,
        "controller": fake.address,
        **more,
    }


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def _detecting(start: StartCoordinator, fake: FakeController, p: Engine, d: Engine) -> Running:
    """A Coordinator with detection on, routing the pair p (instance 1) → d (instance 2)."""
    coord = await start(**detection(fake))
    await set_table(coord, instance(1, PREFILL, p.port), instance(2, DECODE, d.port))
    return coord


Pair = tuple[Running, Engine, Engine]


@pytest.fixture
async def vllm_pair(
    start_coordinator: StartCoordinator, engines: dict[str, Engine], fake_controller: FakeController
) -> Pair:
    """The shared vLLM pair behind a Coordinator with detection on: (coordinator, p, d)."""
    p, d = engines["vllm_p"], engines["vllm_d"]
    return await _detecting(start_coordinator, fake_controller, p, d), p, d


async def _samples(http: aiohttp.ClientSession, coord: Running) -> dict[str, float]:
    text = await get_text(http, f"http://{coord.http}/metrics")
    found = re.findall(r'^motor_coordinator_precision_samples_total\{result="(\w+)"\} ([0-9.]+)$', text, re.M)
    return {result: float(n) for result, n in found}


async def _has(http: aiohttp.ClientSession, coord: Running, result: str, n: int) -> bool:
    return (await _samples(http, coord)).get(result, 0) >= n


async def _gauge(http: aiohttp.ClientSession, coord: Running, name: str) -> float:
    text = await get_text(http, f"http://{coord.http}/metrics")
    m = re.search(rf"^{name} ([0-9.]+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


async def _fault(http: aiohttp.ClientSession, engine: Engine, mode: str, **more: Any) -> None:
    async with http.post(f"{engine.base}/sim/fault", json={"mode": mode, **more}) as resp:
        assert resp.status == 200, await resp.text()


async def _dismiss(coord: Running, d: int, p: int = 0) -> bool:
    resp = await coord.stub.ClearPrecisionAlarm(
        pb.ClearPrecisionAlarmRequest(d_instance_id=d, p_instance_id=p), timeout=5
    )
    return resp.dismissed


def _body(path: str, i: int, **more: Any) -> dict[str, Any]:
    if path == CHAT:
        return {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **more}
    return {"model": MODEL, "prompt": "What is 2 + 3?", "max_tokens": 4, **more}


class Load:
    """Client traffic through the Coordinator until stopped, alternating chat and completions;
    every fifth request asks for one top logprob. Every answer is kept for the checks."""

    def __init__(
        self, http: aiohttp.ClientSession, coord: Running, paths: tuple[str, ...] = (CHAT, COMPLETIONS)
    ):
        self.http = http
        self.base = f"http://{coord.http}"
        self.paths = paths
        self.results: list[tuple[str, bool, int, dict[str, Any]]] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            path = self.paths[i % len(self.paths)]
            asked = i % 5 == 4
            extra: dict[str, Any] = {}
            if asked:
                extra = {"logprobs": True, "top_logprobs": 1} if path == CHAT else {"logprobs": 1}
            async with self.http.post(self.base + path, json=_body(path, i, **extra)) as resp:
                self.results.append((path, asked, resp.status, json.loads(await resp.read())))
            i += 1
            await asyncio.sleep(0.01)  # pacing, so the engines' logs stay small

    async def __aenter__(self) -> Load:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._task is not None
        await self._task

    def check(self) -> None:
        """Every client got its answer, untouched by sampling: 200, and logprobs only when it
        asked (then exactly the one top logprob it asked for, not the sampler's)."""
        assert self.results
        for path, asked, status, body in self.results:
            assert status == 200, body
            assert "kv_transfer_params" not in body
            choice = body["choices"][0]
            lp = choice["logprobs"]
            if not asked:
                assert lp is None, body
            elif path == CHAT:
                assert all(len(e["top_logprobs"]) == 1 for e in lp["content"]), body
            else:
                assert all(len(t) == 1 for t in lp["top_logprobs"]), body


def _answer(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


# -- the whole story on a vLLM pair ------------------------------------------------------------


async def test_alarm_with_retry_then_clear_then_dismiss(
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    fake_controller: FakeController,
    http: aiohttp.ClientSession,
) -> None:
    eng = spawn_engines(p=ENGINE_ARGS["vllm_p"], d=ENGINE_ARGS["vllm_d"])
    p, d = eng["p"], eng["d"]
    coord = await _detecting(start_coordinator, fake_controller, p, d)
    fake = fake_controller
    fake.refuse = True  # the Controller is down when the alarm is raised
    # What a healthy engine answers (the simulated engine is deterministic per prompt).
    expected = {}
    for path in (CHAT, COMPLETIONS):
        async with http.post(d.base + path, json=_body(path, 0)) as resp:
            expected[path] = _answer(await resp.json())

    async with Load(http, coord) as load:
        await until(lambda: _has(http, coord, "normal", 3), what="three normal samples")
        assert fake.calls == 0 and (await _samples(http, coord))["anomalous"] == 0
        healthy = len(load.results)
        await _fault(http, d, "precision")

        await until(lambda: fake.refused >= 2, what="the ALARM refused twice")
        assert await _gauge(http, coord, "motor_coordinator_precision_reports_pending") >= 1
        fake.refuse = False
        await until(lambda: fake.of(ALARM), what="the ALARM accepted")
        assert await _gauge(http, coord, "motor_coordinator_precision_alarms_active") == 1

        await _fault(http, d, "none")
        await until(lambda: fake.of(CLEAR), what="the CLEAR")
        assert await _gauge(http, coord, "motor_coordinator_precision_alarms_active") == 0
        assert await _gauge(http, coord, "motor_coordinator_precision_reports_pending") == 0

    load.check()
    for path, _, _, body in load.results[:healthy]:
        assert _answer(body) == expected[path]
    # The fault reached clients too (the Coordinator never rewrites answers): garbled ones.
    assert any("\ufffd" in _answer(body) for *_, body in load.results[healthy:])

    [alarm] = fake.of(ALARM)
    moi = "service name=Coordinator, service ip=127.0.0.1, pId=1, instanceId=2"
    assert alarm.alarm_id == "0xFC001009"
    assert alarm.severity == alarm_pb2.SEVERITY_MAJOR
    assert alarm.moi == moi
    assert (alarm.instance_id, alarm.p_instance_id) == (2, 1)
    assert alarm.alarm_name == "Precision issue"
    assert alarm.reason and alarm.probable_cause and alarm.occur_time.seconds > 0
    info = dict(alarm.additional_info)
    assert info["last_anomaly_kind"] == "collapsed_logprobs"
    assert int(info["consecutive_anomalous_samples"]) == 2
    assert info["probe_attempts"] == "2" and "Paris" not in info["probe_answer"]
    [clear] = fake.of(CLEAR)
    assert (clear.moi, clear.alarm_id, clear.instance_id, clear.p_instance_id) == (moi, "0xFC001009", 2, 1)
    assert clear.occur_time.ToNanoseconds() >= alarm.occur_time.ToNanoseconds()
    assert fake.alarms.index(alarm) < fake.alarms.index(clear)
    text = await get_text(http, f"http://{coord.http}/metrics")
    assert 'motor_coordinator_precision_probes_total{result="fail"} 1.0' in text

    # ClearPrecisionAlarm: the group's state goes (once); samples in flight are waited out first.
    co = coord.co
    assert co.precision is not None
    await until(lambda: co.precision is not None and co.precision.in_flight == 0, what="samples done")
    assert await _dismiss(coord, d=2, p=1) is True
    assert await _dismiss(coord, d=2, p=1) is False


# -- SGLang pairs and union instances ----------------------------------------------------------


async def test_sglang_pair_is_sampled_through_the_bootstrap_hand_off(
    start_coordinator: StartCoordinator,
    engines: dict[str, Engine],
    fake_controller: FakeController,
    http: aiohttp.ClientSession,
) -> None:
    p, d = engines["sgl_p"], engines["sgl_d"]
    coord = await start_coordinator(**detection(fake_controller))
    sg = c.ENGINE_TYPE_SGLANG
    await set_table(
        coord,
        instance(1, PREFILL, p.port, engine_type=sg, bootstrap=p.bootstrap_port),
        instance(2, DECODE, d.port, engine_type=sg),
    )
    before = {"p": await legs(http, p), "d": await legs(http, d)}
    async with Load(http, coord) as load:
        await until(lambda: _has(http, coord, "normal", 3), what="three normal samples")
    load.check()
    n = len(load.results)
    after = {"p": await legs(http, p), "d": await legs(http, d)}
    # Both legs of every shadow went through the rendezvous, like the clients' requests.
    assert after["p"]["prefill/sglang"] - before["p"]["prefill/sglang"] >= n + 3
    assert after["d"]["decode/sglang"] - before["d"]["decode/sglang"] >= n + 3
    samples = await _samples(http, coord)
    assert samples["anomalous"] == 0 and samples["error"] == 0
    assert fake_controller.calls == 0


async def test_union_instance_alarm_names_p_zero_and_completions_are_probed(
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    fake_controller: FakeController,
    http: aiohttp.ClientSession,
) -> None:
    eng = spawn_engines(u=["--fault", "precision"])["u"]
    coord = await start_coordinator(**detection(fake_controller))
    await set_table(coord, instance(7, UNION, eng.port))
    async with Load(http, coord, paths=(COMPLETIONS,)) as load:
        [alarm] = await until(lambda: fake_controller.of(ALARM), what="the ALARM")
        assert alarm.moi == "service name=Coordinator, service ip=127.0.0.1, pId=0, instanceId=7"
        assert (alarm.instance_id, alarm.p_instance_id) == (7, 0)
        await _fault(http, eng, "none")
        [clear] = await until(lambda: fake_controller.of(CLEAR), what="the CLEAR")
        assert clear.moi == alarm.moi
    load.check()
    assert coord.co.precision is not None
    await until(lambda: coord.co.precision is not None and coord.co.precision.in_flight == 0, what="idle")
    # p = 0 names every group of the instance.
    assert await _dismiss(coord, d=7) is True
    assert await _dismiss(coord, d=7) is False


async def test_alarms_wait_for_a_controller_that_is_down(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    eng = spawn_engines(u=["--fault", "precision"])["u"]
    port = reserved_port()  # nothing listens there yet
    fake = FakeController()
    fake.address = f"127.0.0.1:{port}"
    coord = await start_coordinator(**detection(fake))
    await set_table(coord, instance(3, UNION, eng.port))
    async with Load(http, coord, paths=(CHAT,)) as load:
        await until(
            lambda: _gauge_at_least(http, coord, "motor_coordinator_precision_reports_pending", 1),
            what="the ALARM queued",
        )
        server = await serve_controller(fake, port)
        try:
            [alarm] = await until(
                lambda: fake.of(ALARM), what="the ALARM delivered once the Controller is up"
            )
        finally:
            await server.stop(None)
    load.check()
    assert alarm.moi == "service name=Coordinator, service ip=127.0.0.1, pId=0, instanceId=3"


async def _gauge_at_least(http: aiohttp.ClientSession, coord: Running, name: str, n: float) -> bool:
    return await _gauge(http, coord, name) >= n


# -- off the client's path ---------------------------------------------------------------------


async def test_detection_off_sends_no_shadow_request(
    start_coordinator: StartCoordinator,
    engines: dict[str, Engine],
    fake_controller: FakeController,
    http: aiohttp.ClientSession,
) -> None:
    p, d = engines["vllm_p"], engines["vllm_d"]
    insts = (instance(1, PREFILL, p.port), instance(2, DECODE, d.port))
    off = await start_coordinator(controller=fake_controller.address, precision_interval_s=0.05)
    await set_table(off, *insts)
    before = (await legs(http, p), await legs(http, d))
    async with Load(http, off) as load:
        await until(lambda: len(load.results) >= 12, what="twelve client requests")
    load.check()
    n = len(load.results)
    after = (await legs(http, p), await legs(http, d))
    assert after[0]["prefill/vllm"] - before[0]["prefill/vllm"] == n
    assert after[1]["decode/vllm"] - before[1]["decode/vllm"] == n
    assert await _samples(http, off) == {"normal": 0, "anomalous": 0, "error": 0}
    assert off.co.precision is None and await _dismiss(off, d=2, p=1) is False

    # The same measurement sees shadows when detection is on: one client request, one more leg.
    on = await start_coordinator(**detection(fake_controller))
    await set_table(on, *insts)
    before = (await legs(http, p), await legs(http, d))
    async with http.post(f"http://{on.http}{CHAT}", json=_body(CHAT, 0)) as resp:
        assert resp.status == 200

    async def shadowed() -> bool:
        return (await legs(http, d))["decode/vllm"] - before[1]["decode/vllm"] == 2

    await until(shadowed, what="the shadow's decode leg")
    assert (await legs(http, p))["prefill/vllm"] - before[0]["prefill/vllm"] == 2
    assert fake_controller.calls == 0


async def test_a_slow_shadow_never_holds_up_client_requests(
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    fake_controller: FakeController,
    http: aiohttp.ClientSession,
) -> None:
    # 2 s per token after the first: a 16-token shadow takes 30 s, a 1-token answer none.
    eng = spawn_engines(p=ENGINE_ARGS["vllm_p"], d=[*ENGINE_ARGS["vllm_d"], "--tpot-ms", "2000"])
    p, d = eng["p"], eng["d"]
    coord = await _detecting(start_coordinator, fake_controller, p, d)
    url = f"http://{coord.http}{CHAT}"
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1}
    async with http.post(url, json=body) as resp:
        assert resp.status == 200
        first = await resp.json()
    await until(lambda: _busy(http, d), what="the shadow running on the decode engine")
    assert coord.co.precision is not None and coord.co.precision.in_flight == 1
    for _ in range(8):
        async with http.post(url, json=body) as resp:
            assert resp.status == 200
            answer = await resp.json()
        assert _answer(answer) == _answer(first) and answer["choices"][0]["logprobs"] is None
    # Every client request was answered while the shadow was still being decoded, and the
    # group's next samples were dropped, not queued behind it.
    assert await running(http, d) == 1
    assert coord.co.precision.in_flight == 1
    assert await _samples(http, coord) == {"normal": 0, "anomalous": 0, "error": 0}


async def _busy(http: aiohttp.ClientSession, engine: Engine) -> bool:
    return await running(http, engine) >= 1


async def test_failing_samples_never_fail_client_requests(
    vllm_pair: Pair, fake_controller: FakeController, http: aiohttp.ClientSession
) -> None:
    coord = vllm_pair[0]
    co = coord.co
    assert co.precision is not None

    async def broken(*args: Any) -> tuple[int, bytes]:
        raise RuntimeError("the shadow request fell over")

    co.precision._exchange = broken
    async with Load(http, coord) as load:
        await until(lambda: _has(http, coord, "error", 3), what="three failed samples")
        # Even a bug in the hook itself stays off the client's path.
        co.precision.groups.take_sample = _explode  # type: ignore[method-assign]
        seen = len(load.results)
        await until(lambda: len(load.results) >= seen + 5, what="five more client requests")
    load.check()
    samples = await _samples(http, coord)
    assert samples["normal"] == 0 and samples["anomalous"] == 0
    assert fake_controller.calls == 0


def _explode(*args: Any) -> None:
    raise RuntimeError("bug in the sampler")


async def test_groups_whose_instances_leave_the_table_are_forgotten(
    vllm_pair: Pair, fake_controller: FakeController, http: aiohttp.ClientSession
) -> None:
    coord, p, d = vllm_pair
    async with http.post(f"http://{coord.http}{CHAT}", json=_body(CHAT, 0)) as resp:
        assert resp.status == 200
    co = coord.co
    assert co.precision is not None
    assert co.precision.groups.get(1, 2) is not None
    await until(lambda: co.precision is not None and co.precision.in_flight == 0, what="the sample done")
    await set_table(coord, instance(1, PREFILL, p.port), instance(3, DECODE, d.port))
    assert co.precision.groups.get(1, 2) is None
    assert await _dismiss(coord, d=2, p=1) is False


async def test_a_bad_controller_key_file_stops_the_coordinator_before_it_serves(
    start_coordinator: StartCoordinator, fake_controller: FakeController, tmp_path: Any
) -> None:
    key = tmp_path / "controller.key"
    key.write_text("s3cret\n")
    key.chmod(0o644)
    with pytest.raises(ConfigError, match=r"coordinator\.controller_key_file: .*chmod 600"):
        await start_coordinator(**detection(fake_controller, controller_key_file=str(key)))


async def test_alarms_carry_the_controller_key(
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    fake_controller: FakeController,
    tmp_path: Any,
) -> None:
    key = tmp_path / "controller.key"
    key.write_text("s3cret\n")
    key.chmod(0o600)
    eng = spawn_engines(u=["--fault", "precision"])["u"]
    coord = await start_coordinator(**detection(fake_controller, controller_key_file=str(key)))
    await set_table(coord, instance(4, UNION, eng.port))
    async with aiohttp.ClientSession() as http, Load(http, coord, paths=(CHAT,)):
        await until(lambda: fake_controller.of(ALARM), what="the ALARM")
    assert fake_controller.metadata[-1].get("x-motor-management-key") == "s3cret"


# -- the pieces on their own -------------------------------------------------------------------


def test_group_state_machine() -> None:
    g = PrecisionGroups(interval_s=10, issue_threshold=3, clear_threshold=2)
    s = g.take_sample(1, 2, now=100)
    assert s is not None and g.take_sample(1, 2, now=200) is None  # busy
    s.busy = False
    assert g.take_sample(1, 2, now=105) is None  # not due yet
    assert g.observe(s, True, "repetition") is Action.NONE
    assert g.observe(s, False) is Action.NONE and s.anomalies == 0  # a normal sample resets
    assert [g.observe(s, True, "collapsed_logprobs") for _ in range(3)][-1] is Action.PROBE
    assert g.probed(s, ProbeOutcome.PASS) is Action.NONE and s.anomalies == 0
    for _ in range(3):
        action = g.observe(s, True, "collapsed_logprobs")
    assert action is Action.PROBE
    assert g.probed(s, ProbeOutcome.ERROR) is Action.NONE and s.anomalies == 3  # proves nothing
    assert g.observe(s, True, "collapsed_logprobs") is Action.PROBE
    assert g.probed(s, ProbeOutcome.FAIL) is Action.RAISE
    g.raised(s, "moi")
    assert g.active_alarms() == 1
    # While the alarm is active anomalies never probe again; normals count towards the clear.
    assert g.observe(s, True, "repetition") is Action.NONE
    assert g.observe(s, False) is Action.NONE
    assert g.observe(s, True, "repetition") is Action.NONE and s.normals == 0
    assert g.observe(s, False) is Action.NONE
    assert g.observe(s, False) is Action.CLEAR
    g.cleared(s)
    assert g.active_alarms() == 0 and s.alarm_moi == ""
    # Dropping: (p, d) exactly, or every group of d; retain keeps live instances only.
    for key in [(3, 2), (0, 2), (1, 5)]:
        g.take_sample(*key, now=0)
    assert [x.key for x in g.drop(3, 2)] == [(3, 2)]
    assert sorted(x.key for x in g.drop(0, 2)) == [(0, 2), (1, 2)]
    assert g.drop(0, 2) == []
    assert [x.key for x in g.retain({5})] == [(1, 5)] and len(g) == 0


def test_shadow_bodies_keep_only_the_prompt() -> None:
    chat = Completed(CHAT, "m", {"model": "m", "messages": QUESTION, "stream": True, "n": 3,
                                 "tools": [{"type": "function"}], "max_tokens": 900})  # fmt: skip
    assert sampler.shadow_body(chat, 5) == {
        "model": "m", "stream": False, "max_tokens": 16, "messages": QUESTION, "logprobs": True, "top_logprobs": 5,
    }  # fmt: skip
    comp = Completed(COMPLETIONS, "m", {"prompt": ["first", "second"], "echo": True})
    assert sampler.shadow_body(comp, 3) == {
        "model": "m", "stream": False, "max_tokens": 16, "prompt": "first", "logprobs": 3,
    }  # fmt: skip
    assert sampler.shadow_body(Completed(COMPLETIONS, "m", {"prompt": [1, 2, 3]}), 1)["prompt"] == [1, 2, 3]  # type: ignore[index]
    assert sampler.shadow_body(Completed(CHAT, "m", {"messages": []}), 1) is None
    assert sampler.shadow_body(Completed(COMPLETIONS, "m", {}), 1) is None
    probe = sampler.probe_body(chat, "Capital of France?")
    assert probe["messages"] == [{"role": "user", "content": "Capital of France?"}]
    assert probe["temperature"] == 0 and probe["stream"] is False
    assert sampler.probe_body(comp, "Q?")["prompt"] == "Q?"


async def test_moi_ip_is_the_served_host_or_the_address_towards_the_controller() -> None:
    assert await reporter.service_ip("10.1.2.3", "127.0.0.1:7100") == "10.1.2.3"
    assert await reporter.service_ip("coordinator-0.motor", "127.0.0.1:7100") == "coordinator-0.motor"
    # A wildcard names no one: the local address the Controller is reached from.
    assert await reporter.service_ip("0.0.0.0", "127.0.0.1:7100") == "127.0.0.1"
    assert reporter.moi_of("::1", 0, 9) == "service name=Coordinator, service ip=::1, pId=0, instanceId=9"
