"""``motor up`` under load: the Coordinator's ``/metrics/engines`` aggregates what its engines
export, and the sums match scraping each engine directly at the same moment."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime

import aiohttp
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import CONTROLLER, COORDINATOR, Cluster
from tests.poll import until, wait_until
from tests.procs import motor_argv

COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("engine-metrics"), "--prefill", "1", "--decode", "2", nodes=3)
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


def parse(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def by_role(series: dict[tuple[tuple[str, str], ...], float], role: str) -> float:
    return sum(v for k, v in series.items() if dict(k).get("role") == role)


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
        return r.status, await r.text()


async def engines(http: aiohttp.ClientSession, cluster: Cluster, query: str) -> dict[str, dict]:
    status, text = await get(http, f"{cluster.base_url}/metrics/engines{query}")
    assert status == 200, text
    return parse(text)


async def direct(http: aiohttp.ClientSession, cluster: Cluster) -> dict[str, dict[str, float]]:
    """Each counter summed per role over the engines' own /metrics, read now."""
    out = {name: {"prefill": 0.0, "decode": 0.0} for name in COUNTERS}
    for inst in await asyncio.to_thread(cluster.controller_instances):
        role = inst["role"].removeprefix("ROLE_").lower()
        for ep in inst["endpoints"]:
            _, text = await get(http, f"http://{ep['host']}:{ep['port']}/metrics")
            m = parse(text)
            for name in COUNTERS:
                out[name][role] += sum(m.get(name, {}).values())
    return out


def collect_time(cluster: Cluster) -> float:
    answer = cluster.call(cluster.grpc(COORDINATOR), "motor.v1.Coordinator/GetEngineMetrics")
    stamp = answer.get("collect_time")
    if not stamp:
        return 0.0
    whole, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp() + float(f"0.{frac or 0}")


async def rounds_after(cluster: Cluster, n: int) -> None:
    """Wait until ``n`` more collection rounds have ended: the last of them began after now."""
    seen = await asyncio.to_thread(collect_time, cluster)
    for _ in range(n):

        async def newer(s: float = seen) -> float | None:
            t = await asyncio.to_thread(collect_time, cluster)
            return t if t > s else None

        seen = await until(newer, 30, "a collection round")


@pytest.fixture
async def load(cluster: Cluster) -> AsyncIterator[asyncio.Event]:
    """Chat requests from four clients until the test sets the event."""
    stop = asyncio.Event()
    failures: list[str] = []

    async def client(http: aiohttp.ClientSession, k: int) -> None:
        while not stop.is_set():
            body = {
                "model": "motor-sim",
                "messages": [{"role": "user", "content": f"tell me {k}"}],
                "max_tokens": 16,
            }
            async with http.post(f"{cluster.base_url}/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    failures.append(f"{r.status} {await r.text()}")

    async with aiohttp.ClientSession() as http:
        tasks = [asyncio.create_task(client(http, k)) for k in range(4)]
        yield stop
        stop.set()
        await asyncio.gather(*tasks)
    assert failures == []


async def test_the_role_view_under_load_equals_the_engines_own_sums(
    cluster: Cluster, load: asyncio.Event
) -> None:
    async with aiohttp.ClientSession() as http:

        async def busy() -> dict | None:
            m = await engines(http, cluster, "?type=role")
            ready = (
                by_role(m.get("motor:generation_tokens_per_second", {}), "decode") > 0
                and by_role(m.get("motor:prompt_tokens_per_second", {}), "prefill") > 0
            )
            return m if ready else None

        m = await until(busy, 60, "tokens/s of both roles in the role view")
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc_max"):
            assert {dict(k)["role"] for k in m[name]} == {"prefill", "decode"}, name
        assert by_role(m["motor:active_decode_workers"], "decode") == 2
        assert by_role(m["motor:active_prefill_workers"], "prefill") == 1

        # Under load: the aggregate of a round that began after a direct read, and before a
        # second one, lies between the two.
        before = await direct(http, cluster)
        await rounds_after(cluster, 2)
        agg = await engines(http, cluster, "?type=role")
        after = await direct(http, cluster)
        for name in COUNTERS:
            for role in ("prefill", "decode"):
                got = by_role(agg[name], role)
                assert before[name][role] <= got <= after[name][role], (name, role)
            assert after[name]["decode"] > before[name]["decode"], name  # it was under load

        # At rest, the sums are the engines' own, exactly.
        load.set()

        async def idle() -> bool:
            # No client sends another request once the event is set; wait out the ones in flight.
            for inst in await asyncio.to_thread(cluster.controller_instances):
                for ep in inst["endpoints"]:
                    _, text = await get(http, f"http://{ep['host']}:{ep['port']}/metrics")
                    if sum(parse(text).get("vllm:num_requests_running", {}).values()):
                        return False
            return True

        await until(idle, 30, "every engine idle")
        still = await direct(http, cluster)
        await rounds_after(cluster, 2)
        agg = await engines(http, cluster, "?type=role")
        assert await direct(http, cluster) == still
        for name in COUNTERS:
            for role in ("prefill", "decode"):
                assert by_role(agg[name], role) == still[name][role], (name, role)


async def test_the_instance_view_has_one_series_set_per_instance(cluster: Cluster) -> None:
    ids = {str(i["id"]) for i in cluster.controller_instances()}
    assert len(ids) == 3
    async with aiohttp.ClientSession() as http:

        async def every() -> dict | None:
            m = await engines(http, cluster, "?type=instance")
            running = m.get("vllm:num_requests_running", {})
            return m if {dict(k)["instance_id"] for k in running} == ids else None

        m = await until(every, 30, "every instance in the instance view")
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total"):
            assert sorted(dict(k)["instance_id"] for k in m[name]) == sorted(ids), name
        status, body = await get(
            http, f"{cluster.base_url}/metrics/engines?type=instance&format=opentelemetry"
        )
        assert status == 200
        req = json_format.Parse(body, ExportMetricsServiceRequest())
        names = {m.name for m in req.resource_metrics[0].scope_metrics[0].metrics}
        assert {
            "vllm:num_requests_running",
            "vllm:time_to_first_token_seconds",
            "motor:prompt_tokens_per_second",
        } <= names
        status, body = await get(http, f"{cluster.base_url}/metrics/engines?format=bogus")
        assert status == 400
        assert json.loads(body)["error"]["code"] == "invalid_format"


def test_motor_top_once_json_lists_every_instance(cluster: Cluster) -> None:
    ids = sorted(int(i["id"]) for i in cluster.controller_instances())

    def every() -> dict | None:
        out = subprocess.run(
            motor_argv(
                "top", "--once", "-o", "json",
                "--coordinator", cluster.grpc(COORDINATOR), "--controller", cluster.grpc(CONTROLLER),
            ),
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        listed = sorted(int(i["instance_id"]) for i in doc["instances"])
        fresh = all(e["fresh"] for i in doc["instances"] for e in i["engines"])
        return doc if listed == ids and fresh else None

    doc = wait_until(every, 30, "motor top listing every instance, scraped")
    assert {i["role"] for i in doc["instances"]} == {"prefill", "decode"}
    assert all(i["status"] == "ACTIVE" for i in doc["instances"])
    assert doc["roles"]["decode"]["engines"] == 2
    assert doc["alarms"] == [] and doc["controller"]["error"] is None
