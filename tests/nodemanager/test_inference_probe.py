"""The inference probe (nodemanager.engine_probe_inference) of one Engine, in process: a stand-in
engine's HTTP surface on our own server, whose /health the test keeps answering 200 while its
completions fail or hang, and a real process group (a sleeping Python) as the engine's process,
so the kill at the end of the hang timeout is a real one."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from motor_mesh.common import enums
from motor_mesh.common.httpmessages import Request, Responder, route_table
from motor_mesh.common.httpserver import HttpServer
from motor_mesh.common.procgroup import Reaper
from motor_mesh.nodemanager import inference_probe
from motor_mesh.nodemanager.engine import Engine, Timing
from motor_mesh.nodemanager.launch import EndpointSpec, LaunchParams
from tests.poll import until
from tests.procs import group_gone

pytestmark = pytest.mark.timeout(60)

SERVED = "served-1"
PARAMS = LaunchParams(engine_type="sim", model="m1", served_model_name=SERVED, role="decode", instance_id=1)
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
# Health probes every 50 ms; an inference probe every 0.3 s (its deadline too): short, yet long
# enough that an in-process answer on a busy machine is never late.
TIMING = Timing(
    poll_s=0.05,
    probe_timeout_s=1.0,
    max_failures=2,
    hang_timeout_s=0.6,
    probe_inference=True,
    inference_interval_s=0.3,
    max_inference_failures=3,
)


class StandIn:
    """What the probes reach: ``/health`` answers ``health`` (a status), ``/v1/completions``
    takes the next of ``script`` ("ok", "fail": 500, "hang": never answers), then ``then``.
    ``log`` is every request in order (``health <status>`` or ``completions``)."""

    def __init__(self) -> None:
        self.health = 200
        self.script: list[str] = []
        self.then = "ok"
        self.log: list[str] = []
        self.bodies: list[Any] = []
        self.request_ids: list[str] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.server: HttpServer | None = None
        self.port = 0

    @property
    def completions(self) -> int:
        return self.log.count("completions")

    async def start(self) -> StandIn:
        routes = {
            ("GET", "/health"): self._health,
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/completions"): self._complete,
        }
        self.server = HttpServer(route_table(routes), max_body_bytes=1 << 20)
        self.port = await self.server.listen("127.0.0.1", 0)
        return self

    async def _health(self, req: Request, out: Responder) -> None:
        self.log.append(f"health {self.health}")
        out.send(self.health, b"")

    async def _models(self, req: Request, out: Responder) -> None:
        out.send(200, json.dumps({"data": [{"id": SERVED}]}).encode())

    async def _complete(self, req: Request, out: Responder) -> None:
        self.log.append("completions")
        self.bodies.append(json.loads(req.body))
        self.request_ids.append(req.headers.get(b"x-request-id", b"").decode())
        outcome = self.script.pop(0) if self.script else self.then
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if outcome == "hang":
                await asyncio.Event().wait()  # cancelled when the client gives up and closes
            elif outcome == "fail":
                out.send(500, b'{"error": {"message": "scheduler broke"}}')
            else:
                out.send(200, json.dumps({"choices": [{"index": 0, "text": "1"}]}).encode())
        finally:
            self.in_flight -= 1


@dataclass
class Hooks:
    """What the engine tells its supervisor."""

    statuses: list[int] = field(default_factory=list)
    unhealthy: list[str] = field(default_factory=list)
    died: list[str] = field(default_factory=list)
    inference: list[bool] = field(default_factory=list)

    def status_changed(self, engine: Engine) -> None:
        self.statuses.append(engine.status)

    def engine_died(self, engine: Engine, pid: int, detail: str) -> None:
        self.died.append(detail)

    def engine_unhealthy(self, engine: Engine, detail: str) -> None:
        self.unhealthy.append(detail)

    def probed(self, seconds: float, ok: bool) -> None:
        pass

    def inference_probed(self, ok: bool) -> None:
        self.inference.append(ok)


@dataclass
class Running:
    engine: Engine
    stand_in: StandIn
    hooks: Hooks


Start = Callable[..., Awaitable[Running]]


@pytest.fixture
async def start_engine() -> AsyncIterator[Start]:
    """``start_engine(spec_id=0, timing=TIMING, health=200)``: an Engine on a fresh stand-in
    (answering ``health`` to /health), spawned; everything stopped at teardown."""
    async with aiohttp.ClientSession() as http:
        started: list[Running] = []

        async def start(spec_id: int = 0, timing: Timing = TIMING, health: int = 200) -> Running:
            stand_in = await StandIn().start()
            stand_in.health = health
            hooks = Hooks()
            spec = EndpointSpec(spec_id, "127.0.0.1", stand_in.port)
            engine = Engine(spec, PARAMS, 0, timing, hooks, Reaper(), http)
            run = Running(engine, stand_in, hooks)
            started.append(run)
            await engine.spawn(SLEEPER, dict(os.environ))
            return run

        try:
            yield start
        finally:
            for run in started:
                await run.engine.stop(0)
                assert run.stand_in.server is not None
                await run.stand_in.server.close(0)


async def normal(run: Running) -> None:
    await until(lambda: run.engine.status == enums.EP_NORMAL, 10, "the engine NORMAL")


async def test_failures_in_a_row_make_it_abnormal_while_health_answers_then_it_is_killed(
    start_engine: Start,
) -> None:
    run = await start_engine()
    await normal(run)
    pid = run.engine.pid
    run.stand_in.then = "fail"
    await until(lambda: run.hooks.unhealthy, 10, "the endpoint reported unhealthy")
    assert run.engine.status == enums.EP_ABNORMAL
    (why,) = run.hooks.unhealthy
    assert why == "3 inference probes failed in a row, last: /v1/completions answered 500"
    assert run.hooks.inference[-3:] == [False, False, False]
    # /health answered 200 all along: only the inference probe saw the hang...
    assert {line for line in run.stand_in.log if line.startswith("health")} == {"health 200"}
    # ...and the hang timeout kills the engine all the same: a real SIGKILL of its group.
    (detail,) = await until(lambda: run.hooks.died, 10, "the engine killed and reported dead")
    assert re.fullmatch(r"hung: ABNORMAL for \d+s \(\d+ inference probes failed in a row, last: .+\)", detail)
    await until(lambda: group_gone(pid), 10, "the engine's group gone")

    # What it sent: a one-token completion of the served model, marked as ours.
    assert run.stand_in.bodies[0] == {"model": SERVED, "prompt": "1", "max_tokens": 1}
    assert all(re.fullmatch(r"\d+\.\d{3}_virtual", rid) for rid in run.stand_in.request_ids)


async def test_one_success_resets_the_count(start_engine: Start) -> None:
    # A longer deadline: one "ok" answered late would make three failures in a row here.
    run = await start_engine(timing=Timing(**{**TIMING.__dict__, "inference_interval_s": 0.6}))
    await normal(run)
    script = ["fail", "fail", "ok", "fail", "fail", "ok", "fail", "fail", "ok"]
    run.stand_in.script = list(script)
    await until(lambda: run.stand_in.completions >= len(script) + 2, 20, "the script and two more served")
    assert run.hooks.unhealthy == [] and run.engine.status == enums.EP_NORMAL
    assert run.hooks.inference.count(False) >= 6


async def test_a_probe_that_hangs_ends_at_its_deadline_and_is_never_stacked(start_engine: Start) -> None:
    run = await start_engine(timing=Timing(**{**TIMING.__dict__, "hang_timeout_s": 600}))
    await normal(run)
    run.stand_in.then = "hang"
    await until(lambda: run.hooks.unhealthy, 10, "the endpoint reported unhealthy")
    assert run.hooks.unhealthy[0].endswith("last: /v1/completions did not answer within 0.3s")
    # Each stuck probe was given up (its connection closed) before the next one was sent.
    assert run.stand_in.completions >= 3 and run.stand_in.most_in_flight == 1


async def test_recovered_before_the_hang_timeout_it_is_normal_again_and_not_killed(
    start_engine: Start,
) -> None:
    run = await start_engine(timing=Timing(**{**TIMING.__dict__, "hang_timeout_s": 3}))
    await normal(run)
    run.stand_in.script = ["fail", "fail", "fail"]
    await until(lambda: run.engine.status == enums.EP_ABNORMAL, 10, "ABNORMAL")
    await until(lambda: run.engine.status == enums.EP_NORMAL, 10, "NORMAL again at the next success")
    served = run.stand_in.completions
    # Past the hang timeout counted from the ABNORMAL turn (twelve more probes of 0.3 s each).
    await until(lambda: run.stand_in.completions >= served + 12, 20, "twelve more probes answered")
    assert run.engine.alive and run.hooks.died == [] and run.engine.status == enums.EP_NORMAL


async def test_only_dp_rank_0_probes_and_only_once_it_was_normal(start_engine: Start) -> None:
    loading = await start_engine(spec_id=0, health=503)  # still loading its model
    other_rank = await start_engine(spec_id=1)
    await normal(other_rank)
    await until(
        lambda: loading.stand_in.log.count("health 503") >= 20, 10, "twenty probes of a loading engine"
    )
    assert loading.stand_in.completions == 0  # never NORMAL yet: no inference probe
    loading.stand_in.health = 200
    await until(lambda: loading.stand_in.completions >= 2, 10, "inference probes once NORMAL")
    first = loading.stand_in.log.index("completions")
    assert "health 200" in loading.stand_in.log[:first]
    # Meanwhile DP rank 1, NORMAL for longer still, was only ever health-probed.
    assert other_rank.stand_in.completions == 0 and other_rank.stand_in.log.count("health 200") >= 20


def test_the_request_body_by_engine() -> None:
    assert json.loads(inference_probe.body(PARAMS)) == {"model": SERVED, "prompt": "1", "max_tokens": 1}
    # SGLang prefill and decode engines refuse a request without a room: SGLang's fake
    # bootstrap host makes them serve it alone (a union engine needs none).
    for params in (
        LaunchParams(engine_type="sglang", model="m", served_model_name="s", role="prefill", instance_id=1),
        LaunchParams("sim", "m", "s", "decode", 1, sim_protocol="sglang"),
    ):
        body = json.loads(inference_probe.body(params))
        assert body["bootstrap_host"] == "2.2.2.2" and isinstance(body["bootstrap_room"], int)
    union = LaunchParams(engine_type="sglang", model="m", served_model_name="s", role="union", instance_id=1)
    assert "bootstrap_host" not in json.loads(inference_probe.body(union))
