"""Motor serving a real model: real vLLM engines (the CPU build) launched by NodeManagers.

One `motor up --engine-type vllm --model <tiny model path> --prefill 1 --decode 1` runs the whole
module (a fresh cluster per test would not fit CI's time). The tests run in file order, the
destructive ones last: serving through the openai SDK, the real KV hand-off over NIXL,
Controller and Coordinator restarts, the decode engine SIGKILLed and relaunched, and `motor up`
stopped with SIGTERM. Routing by the engines' own KV events and precision sampling are
test_vllm_kv.py (a shadow request would add its own tokens to the decode engine's counts here).

The tiny model's weights are random, so what it says is noise; every assertion is about what
noise cannot fake: token counts the engines report, pids, and greedy outputs compared with the
same engine's own.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.e2e.cluster import CONTROLLER, COORDINATOR, CallFailed
from tests.metrics import Scrape, scrape
from tests.poll import wait_until
from tests.procs import group_gone
from tests.real.engines import RealCluster, chat, client, engine_client, running, unique
from tools.real_engines import TINY_MODEL, unavailable

WHY = unavailable()
pytestmark = [pytest.mark.real, pytest.mark.skipif(bool(WHY), reason=WHY), pytest.mark.timeout(600)]

MODEL = str(TINY_MODEL)  # a model given as a path is served under that path
PREFILL, DECODE = 0, 1  # engine numbers (and NodeManager numbers: one engine each)
ENGINES = 2
START_S = 420.0  # real engines loading on two cores; a relaunch waits for one


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    c = RealCluster(
        tmp_path_factory.mktemp("real"),
        prefill=1,
        decode=1,
    )
    with running(c, START_S):
        yield c


SOURCES = ("external_kv_transfer", "local_cache_hit", "local_compute")


def prompt_sources(c: RealCluster) -> dict[str, float]:
    """The decode engine's prompt tokens by where they came from: pulled from a prefill engine
    (``external_kv_transfer``), its own prefix cache, or computed by itself."""
    return {s: c.engine_counter(DECODE, "vllm:prompt_tokens_by_source_total", source=s) for s in SOURCES}


def pulled(c: RealCluster, before: dict[str, float], prompt_tokens: int, what: str) -> None:
    """Wait until the decode engine counts ``prompt_tokens`` more tokens, every one of them pulled
    (its counters are updated as the request finishes; /metrics may show them a moment later)."""

    def grown() -> dict[str, float]:
        now = prompt_sources(c)
        return {s: now[s] - before[s] for s in SOURCES}

    wait_until(
        lambda: sum(grown().values()) >= prompt_tokens, 30, f"{prompt_tokens} prompt tokens counted ({what})"
    )
    assert grown() == {"external_kv_transfer": prompt_tokens, "local_cache_hit": 0, "local_compute": 0}, what


def test_ready_and_serving_through_the_openai_sdk(cluster: RealCluster) -> None:
    api = client(cluster)
    assert [m.id for m in api.models.list().data] == [MODEL]

    resp = api.chat.completions.create(model=MODEL, messages=chat("Say hello."), max_tokens=6)
    assert resp.choices[0].message.content and resp.usage and resp.usage.completion_tokens > 0

    comp = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
    assert comp.choices[0].text and comp.usage and comp.usage.completion_tokens > 0

    pieces = [
        c.choices[0].delta.content or ""
        for c in api.chat.completions.create(model=MODEL, messages=chat("Stream."), max_tokens=6, stream=True)
        if c.choices
    ]
    assert "".join(pieces)
    text = "".join(
        c.choices[0].text
        for c in api.completions.create(model=MODEL, prompt="Stream this", max_tokens=6, stream=True)
        if c.choices
    )
    assert text


def test_the_kv_hand_off_is_real(cluster: RealCluster) -> None:
    """Every prompt token of a request reaches the decode engine through NIXL, none computed
    there, and greedy output through Motor is the engine's own output without PD."""
    api = client(cluster)
    for kind in ("chat", "completion"):
        before = prompt_sources(cluster)
        prompt = unique()
        if kind == "chat":
            resp = api.chat.completions.create(
                model=MODEL, messages=chat(prompt), max_tokens=8, temperature=0
            )
            through_motor = resp.choices[0].message.content
            alone = engine_client(cluster, PREFILL).chat.completions.create(
                model=MODEL, messages=chat(prompt), max_tokens=8, temperature=0
            )
            by_itself = alone.choices[0].message.content
        else:
            resp = api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)  # type: ignore[assignment]
            through_motor = resp.choices[0].text  # type: ignore[attr-defined]
            by_itself = (
                engine_client(cluster, PREFILL)
                .completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
                .choices[0]
                .text
            )
        assert resp.usage is not None
        pulled(cluster, before, resp.usage.prompt_tokens, kind)
        assert through_motor == by_itself, kind


def _restart_keeps_engines(cluster: RealCluster, component: str, port: int) -> None:
    pids = [cluster.engine_pid(i) for i in range(ENGINES)]
    assert all(pids)
    old = cluster.component_pid(component)
    assert old
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: cluster.component_pid(component) not in (0, old), 60, f"{component} restarted")
    wait_until(
        lambda: (
            cluster.call(cluster.grpc(port), "grpc.health.v1.Health/Check", {"service": ""}).get("status")
            == "SERVING"
        ),
        60,
        f"{component} serving again",
        retry=(CallFailed,),  # refused until the new process listens
    )
    states = lambda: sorted(i.get("status", "") for i in cluster.controller_instances())  # noqa: E731
    wait_until(lambda: states() == ["INSTANCE_STATUS_ACTIVE"] * ENGINES, 60, "every instance ACTIVE")
    assert [cluster.engine_pid(i) for i in range(ENGINES)] == pids, "engines kept running"

    def serves() -> bool:
        try:
            client(cluster).chat.completions.create(model=MODEL, messages=chat(unique()), max_tokens=4)
        except openai.APIError:
            return False
        return True

    wait_until(serves, 60, "a request served after the restart", every=1.0)


def test_the_coordinator_aggregates_the_real_engines_metrics(cluster: RealCluster) -> None:
    """/metrics/engines?type=role reads the real engines' own vLLM series: both roles are there,
    and at rest each role's counters are its engine's own, exactly."""
    api = client(cluster)
    api.chat.completions.create(model=MODEL, messages=chat(unique()), max_tokens=4)
    names = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:request_success_total")

    def agreed() -> Scrape | None:
        m = scrape(f"{cluster.base_url}/metrics/engines?type=role")
        for role, k in (("prefill", PREFILL), ("decode", DECODE)):
            for name in names:
                got = sum(s.value for s in m.samples if s.name == name and s.labels.get("role") == role)
                if got != cluster.engine_counter(k, name):
                    return None
        return m

    m = wait_until(agreed, 30, "the role view equal to each engine's own counters")
    for name in (
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_count",
    ):
        assert {s.labels["role"] for s in m.samples if s.name == name} == {"prefill", "decode"}, name
    assert m.value("motor:active_decode_workers", role="decode") == 1


def test_a_controller_restart_leaves_the_engines_serving(cluster: RealCluster) -> None:
    _restart_keeps_engines(cluster, "controller", CONTROLLER)


def test_a_coordinator_restart_leaves_the_engines_serving(cluster: RealCluster) -> None:
    _restart_keeps_engines(cluster, "coordinator", COORDINATOR)


def test_a_killed_decode_engine_is_relaunched_in_place(cluster: RealCluster) -> None:
    """SIGKILL of the decode engine's process group (its API server, EngineCore and worker):
    the same NodeManager starts a new one, the instance is ACTIVE again and serves."""
    nm = cluster.nodemanager_pid(DECODE)
    old = cluster.engine_pid(DECODE)
    os.killpg(old, signal.SIGKILL)
    wait_until(lambda: group_gone(old), 30, "the old engine's process group gone")

    def relaunched() -> bool:
        st = cluster.nm_status(DECODE)
        (ep,) = st["endpoints"]
        return int(ep.get("pid", 0)) not in (0, old) and ep.get("status") == "ENDPOINT_STATUS_NORMAL"

    wait_until(relaunched, 300, "the decode engine relaunched and healthy", every=1.0)
    assert cluster.nodemanager_pid(DECODE) == nm, "relaunched in place, not by a new NodeManager"
    wait_until(
        lambda: (
            sorted(i.get("status", "") for i in cluster.controller_instances())
            == ["INSTANCE_STATUS_ACTIVE"] * ENGINES
        ),
        120,
        "every instance ACTIVE",
    )

    def serves() -> Any:
        try:
            return client(cluster).completions.create(model=MODEL, prompt=unique(), max_tokens=4)
        except openai.APIError:
            return None

    wait_until(serves, 120, "a request served by the relaunched decode engine", every=1.0)
    before = prompt_sources(cluster)
    resp = serves()
    assert resp is not None
    pulled(cluster, before, resp.usage.prompt_tokens, "after the relaunch")


def test_sigterm_of_motor_up_leaves_no_engine_process(cluster: RealCluster) -> None:
    """Every engine's process group (vLLM's API server, EngineCore and worker processes) is gone
    once `motor up` has exited."""
    groups = cluster.engine_pgids()
    assert len(groups) == ENGINES and all(not group_gone(g) for g in groups)
    cluster.proc.signal(signal.SIGTERM)
    assert cluster.proc.popen.wait(120) == 0
    for g in groups:
        assert group_gone(g), f"engine process group {g} outlived motor up"
