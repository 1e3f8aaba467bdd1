"""The Coordinator scrapes its table's engines (real simulated engines) and serves the aggregate
on ``/metrics/engines`` and ``GetEngineMetrics``: an engine that stops answering (SIGSTOP to its
process group) leaves the aggregate after ``engine_metrics_stale_s``, one that leaves the table
leaves it at once, and inference workers answer the same as the management process."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Iterator

import aiohttp
import grpc
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from motor_mesh.gen.motor.v1 import common_pb2 as c
from motor_mesh.gen.motor.v1 import coordinator_pb2 as pb
from tests.coordinator.conftest import (
    ENGINE_ARGS,
    Engine,
    Running,
    SpawnEngines,
    StartCoordinator,
    instance,
    set_table,
)
from tests.poll import until

FAST = {"engine_metrics_interval_s": 0.2, "engine_metrics_stale_s": 1.5}


def values(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


async def engines_text(http: aiohttp.ClientSession, coord: Running, query: str = "") -> str:
    async with http.get(
        f"http://{coord.http}/metrics/engines{query}", timeout=aiohttp.ClientTimeout(total=5)
    ) as r:
        assert r.status == 200, await r.text()
        assert r.content_type == "text/plain"
        return await r.text()


async def workers(http: aiohttp.ClientSession, coord: Running, query: str, check: object) -> str:
    async def once() -> str | None:
        text = await engines_text(http, coord, query)
        return text if check(text) else None  # type: ignore[operator]

    return await until(once, 20, f"/metrics/engines{query}")


@pytest.fixture
def pd(spawn_engines: SpawnEngines) -> Iterator[dict[str, Engine]]:
    yield spawn_engines(p=ENGINE_ARGS["vllm_p"], d=ENGINE_ARGS["vllm_d"], d2=ENGINE_ARGS["vllm_d2"])


async def served(http: aiohttp.ClientSession, coord: Running, n: int) -> None:
    for _ in range(n):
        body = {"model": "motor-sim", "prompt": "hello there", "max_tokens": 5}
        async with http.post(f"http://{coord.http}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()


async def test_an_engine_that_stops_answering_leaves_after_the_stale_time_and_comes_back(
    start_coordinator: StartCoordinator, http: aiohttp.ClientSession, pd: dict[str, Engine]
) -> None:
    coord = await start_coordinator(**FAST)
    p, d, d2 = pd["p"], pd["d"], pd["d2"]
    await set_table(
        coord,
        instance(1, c.ROLE_PREFILL, p.port),
        instance(2, c.ROLE_DECODE, d.port),
        instance(3, c.ROLE_DECODE, d2.port),
    )
    await served(http, coord, 4)

    def decoders(n: int):
        return lambda text: values(text, "motor:active_decode_workers").get((("role", "decode"),)) == n

    await workers(http, coord, "?type=role", decoders(2))
    os.killpg(d2.popen.pid, signal.SIGSTOP)
    try:
        text = await workers(http, coord, "?type=role", decoders(1))
        # The stopped engine's requests are gone from the sums with it; the live one's stay.
        gen = values(text, "vllm:generation_tokens_total")
        direct = values(await (await http.get(f"{d.base}/metrics")).text(), "vllm:generation_tokens_total")
        assert gen[(("model_name", "motor-sim"), ("role", "decode"))] == sum(direct.values())
        resp = await coord.stub.GetEngineMetrics(pb.GetEngineMetricsRequest(), timeout=5)
        stopped = next(e for e in resp.engines if e.instance_id == 3)
        assert not stopped.fresh and stopped.error and stopped.HasField("last_success_time")
        assert [e.fresh for e in resp.engines if e.instance_id != 3] == [True, True]
    finally:
        os.killpg(d2.popen.pid, signal.SIGCONT)
    await workers(http, coord, "?type=role", decoders(2))


async def test_an_instance_that_leaves_the_table_leaves_the_answer_at_once(
    start_coordinator: StartCoordinator, http: aiohttp.ClientSession, pd: dict[str, Engine]
) -> None:
    # A long interval: the next answer must not wait for the next round.
    coord = await start_coordinator(engine_metrics_interval_s=3600)
    p, d, d2 = pd["p"], pd["d"], pd["d2"]
    await set_table(
        coord,
        instance(1, c.ROLE_PREFILL, p.port),
        instance(2, c.ROLE_DECODE, d.port),
        instance(3, c.ROLE_DECODE, d2.port),
    )
    assert coord.co.collector is not None
    await coord.co.collector.collect()
    text = await engines_text(http, coord, "?type=instance")
    assert {dict(k)["instance_id"] for k in values(text, "vllm:num_requests_running")} == {"1", "2", "3"}
    await set_table(coord, instance(1, c.ROLE_PREFILL, p.port), instance(2, c.ROLE_DECODE, d.port))
    text = await engines_text(http, coord, "?type=instance")
    assert {dict(k)["instance_id"] for k in values(text, "vllm:num_requests_running")} == {"1", "2"}
    resp = await coord.stub.GetEngineMetrics(
        pb.GetEngineMetricsRequest(view=pb.ENGINE_METRICS_VIEW_INSTANCE), timeout=5
    )
    assert sorted(e.instance_id for e in resp.engines) == [1, 2]


async def test_the_grpc_answer_matches_http_and_checks_its_arguments(
    start_coordinator: StartCoordinator, http: aiohttp.ClientSession, pd: dict[str, Engine]
) -> None:
    coord = await start_coordinator(engine_metrics_interval_s=3600)
    p, d = pd["p"], pd["d"]
    await set_table(coord, instance(1, c.ROLE_PREFILL, p.port), instance(2, c.ROLE_DECODE, d.port))
    await served(http, coord, 3)
    assert coord.co.collector is not None
    await coord.co.collector.collect()
    resp = await coord.stub.GetEngineMetrics(
        pb.GetEngineMetricsRequest(
            view=pb.ENGINE_METRICS_VIEW_ROLE, role=c.ROLE_DECODE, include_coordinator=True
        ),
        timeout=5,
    )
    text = await engines_text(http, coord, "?type=role&role=decode")
    expected = {
        (s, k): v
        for s_name in ("vllm:generation_tokens_total",)
        for k, v in values(text, s_name).items()
        for s in [s_name]
    }
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in resp.families
        for s in f.samples
        if s.name == "vllm:generation_tokens_total"
    }
    assert got == expected and got
    assert all(dict(k)["role"] == "decode" for _, k in got)
    assert [e.instance_id for e in resp.engines] == [2]
    assert "motor_coordinator_migrations" in {f.name for f in resp.coordinator_families}
    assert resp.HasField("collect_time")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coord.stub.GetEngineMetrics(pb.GetEngineMetricsRequest(view=99), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    async with http.get(f"http://{coord.http}/metrics/engines?role=bogus") as r:
        assert r.status == 400
    async with http.get(f"http://{coord.http}/metrics/engines?format=bogus") as r:
        assert r.status == 400
        assert (await r.json())["error"]["code"] == "invalid_format"
    # An unknown type is the full view.
    assert await engines_text(http, coord, "?type=bogus") == await engines_text(http, coord, "")


async def test_collection_off_answers_404_and_failed_precondition(
    start_coordinator: StartCoordinator, http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator(engine_metrics_interval_s=0)
    async with http.get(f"http://{coord.http}/metrics/engines") as r:
        assert r.status == 404
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coord.stub.GetEngineMetrics(pb.GetEngineMetricsRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_inference_workers_answer_from_the_management_process_scrapes(
    start_coordinator: StartCoordinator, http: aiohttp.ClientSession, pd: dict[str, Engine]
) -> None:
    coord = await start_coordinator(workers=2, **FAST)
    p, d = pd["p"], pd["d"]
    await set_table(coord, instance(1, c.ROLE_PREFILL, p.port), instance(2, c.ROLE_DECODE, d.port))
    await served(http, coord, 4)

    def both(text: str) -> bool:
        v = values(text, "vllm:num_requests_running")
        return set(v) == {(("instance_id", "1"), ("model_name", "motor-sim"), ("role", "prefill")),
                          (("instance_id", "2"), ("model_name", "motor-sim"), ("role", "decode"))}  # fmt: skip

    # Several answers: connections land on both workers.
    for _ in range(6):
        await workers(http, coord, "?type=instance", both)
    await set_table(coord, instance(1, c.ROLE_PREFILL, p.port))
    for _ in range(6):
        text = await engines_text(http, coord, "?type=instance")
        assert {dict(k)["instance_id"] for k in values(text, "vllm:num_requests_running")} == {"1"}


async def test_polling_it_does_not_fill_the_access_log(
    start_coordinator: StartCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    """motor top asks every 2 s: its answers are logged at debug level, other calls at info."""
    coord = await start_coordinator(engine_metrics_interval_s=3600)
    caplog.set_level(logging.DEBUG, "motor")
    await coord.stub.GetEngineMetrics(pb.GetEngineMetricsRequest(), timeout=5)
    await coord.stub.ListInstances(pb.CoordinatorListInstancesRequest(), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError):
        await coord.stub.GetEngineMetrics(pb.GetEngineMetricsRequest(view=99), timeout=5)

    def levels() -> dict[tuple[str, str], int]:
        return {
            (r.fields["method"].rsplit("/", 1)[1], r.fields["code"]): r.levelno  # type: ignore[attr-defined]
            for r in caplog.records
            if getattr(r, "event", "") == "rpc"
        }

    # A call's line is written as it finishes on the server, which can be after its client has
    # the answer: the last one is waited for.
    await until(lambda: len(levels()) == 3, 5, "the three calls' lines")
    assert levels() == {
        ("GetEngineMetrics", "OK"): logging.DEBUG,
        ("ListInstances", "OK"): logging.INFO,
        ("GetEngineMetrics", "INVALID_ARGUMENT"): logging.WARNING,
    }


async def test_an_answer_that_arrives_in_pieces_is_read_whole(
    start_coordinator: StartCoordinator, http: aiohttp.ClientSession
) -> None:
    """A large exposition comes in several reads: the collector waits for all of it."""
    lines = ["# TYPE vllm:num_requests_running gauge"]
    lines += [f'vllm:num_requests_running{{model_name="m",k="{i}"}} {i}' for i in range(2000)]
    body = ("\n".join(lines) + "\n").encode()

    async def metrics(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        for i in range(0, len(body), 7000):  # cut mid-line, with pauses between the pieces
            await resp.write(body[i : i + 7000])
            await asyncio.sleep(0.02)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        coord = await start_coordinator(engine_metrics_interval_s=3600)
        await set_table(coord, instance(1, c.ROLE_DECODE, port))
        assert coord.co.collector is not None
        snap = await coord.co.collector.collect()
        assert [e.error for e in snap.engines] == [""]
        text = await engines_text(http, coord)
        total = sum(values(text, "vllm:num_requests_running").values())
        assert total == sum(range(2000))
    finally:
        await runner.cleanup()
