"""The Controller's ``/metrics`` on a real ``motor controller`` with ``metrics_port`` set: what
NodeManagers, engines, Coordinators and the disk do shows in the numbers, nothing but
``GET /metrics`` is served, and without ``metrics_port`` nothing more listens."""

from __future__ import annotations

import json
import re
import resource
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from tests.controller.fakes import ABNORMAL, NORMAL, FakeCoordinator, NodeAgent
from tests.controller.test_reconcile_metrics import loop_value
from tests.metrics import Scrape, ascrape, scrape_until
from tests.poll import until
from tests.ports import reserved_port
from tests.procs import Proc, listening_ports

FAULT, MAJOR = "0xFC001002", "MAJOR"  # the instance fault alarm and its severity


def start_controller(motor_proc: Callable[..., Proc], tmp_path: Path, **controller: Any) -> Proc:
    cfg = tmp_path / "controller.json"
    base = {"state_dir": str(tmp_path / "state"), "coordinators": [], "engine_relaunch_poll_interval_s": 1}
    cfg.write_text(json.dumps({"controller": {**base, **controller}}))
    return motor_proc("controller", "--config", str(cfg), "--port", "0")


async def listening(proc: Proc) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", await proc.await_line("event=listening")))


async def test_metrics_follow_nodes_engines_coordinators_and_the_disk(
    tmp_path: Path, motor_proc: Callable[..., Proc], node_managers: Any, coordinator: FakeCoordinator
) -> None:
    nm = await node_managers()
    gone = f"127.0.0.1:{reserved_port()}"  # a Coordinator nobody serves
    port = reserved_port()
    proc = start_controller(motor_proc, tmp_path, metrics_port=port, coordinators=[coordinator.address, gone])
    fields = await listening(proc)
    assert fields["metrics"] == f"127.0.0.1:{port}"
    url = f"http://127.0.0.1:{port}/metrics"

    def scraped(check: Callable[[Scrape], Any]) -> Awaitable[Scrape]:
        return scrape_until(url, check)

    # No node yet; the Coordinator that answers is in step, the other one fails and falls behind.
    m = await scraped(
        lambda m: (
            m.value("motor_controller_coordinator_reachable", coordinator=coordinator.address) == 1
            and m.value("motor_controller_push_failures_total", coordinator=gone) >= 1
            and m.value("motor_controller_push_lag_seconds", coordinator=coordinator.address) == 0
        )
    )
    assert m.value("motor_controller_coordinator_reachable", coordinator=gone) == 0
    assert m.value("motor_controller_push_lag_seconds", coordinator=gone) > 0
    assert m.value("motor_controller_push_failures_total", coordinator=coordinator.address) == 0
    assert m.value("motor_controller_nodemanagers_connected") == 0
    assert m.value("motor_controller_instances", role="prefill", status="ACTIVE") == 0
    assert m.value("motor_controller_heartbeat_ack_seconds_count") == 0
    # The failed pushes are failed reconciles of the coordinator loop, retried with backoff.
    w = "motor_controller_workqueue_"
    assert loop_value(m, w + "reconcile_errors_total", "coordinator", kind="retry") >= 1
    assert loop_value(m, w + "retries_total", "coordinator") >= 1
    assert loop_value(m, w + "reconcile_duration_seconds_count", "coordinator") >= 1

    # A node registers and beats: one ACTIVE prefill instance, one stream, beats acked.
    agent = NodeAgent(fields["grpc"], job="p", nm=nm)
    try:
        await agent.register()
        await until(lambda: nm.starts)
        await agent.beat(NORMAL)
        # The ack reaches the agent before the Controller counts it: polled for, like the rest;
        # so is the end of the reconciles that assembled the instance and made it ACTIVE.
        m = await scraped(
            lambda m: (
                m.value("motor_controller_instances", role="prefill", status="ACTIVE") == 1
                and m.value("motor_controller_heartbeats_total", kind="beat") == 1
                and all(
                    loop_value(m, w + "reconcile_duration_seconds_count", loop) >= 1
                    for loop in ("assembly", "instance")
                )
            )
        )
        assert m.value("motor_controller_nodemanagers_connected") == 1
        assert m.value("motor_controller_heartbeats_total", kind="event") == 0
        assert m.value("motor_controller_heartbeat_ack_seconds_count") == 1
        assert m.value("motor_controller_alarms_active", alarm_id=FAULT, severity=MAJOR) == 0
        for loop in ("assembly", "instance"):
            assert loop_value(m, w + "adds_total", loop) >= 1
            assert loop_value(m, w + "reconcile_errors_total", loop, kind="exception") == 0
            assert loop_value(m, w + "longest_running_reconcile_seconds", loop) >= 0
            assert loop_value(m, w + "depth", loop) >= 0

        # Its engine turns ABNORMAL: INACTIVE, and the instance fault alarm is active.
        await agent.beat(ABNORMAL)
        m = await scraped(
            lambda m: m.value("motor_controller_alarms_active", alarm_id=FAULT, severity=MAJOR) == 1
        )
        assert m.value("motor_controller_instances", role="prefill", status="INACTIVE") == 1
        assert m.value("motor_controller_instances", role="prefill", status="ACTIVE") == 0

        # It dies: a relaunch runs until the NodeManager is ready, then succeeds.
        await agent.event(endpoint_id=nm.starts[-1].endpoints[0].id, pid=40000)
        m = await scraped(
            lambda m: (
                m.value("motor_controller_strategies_running", strategy="EngineRelaunch") == 1
                and m.value("motor_controller_heartbeats_total", kind="event") == 1
            )
        )
        assert m.value("motor_controller_relaunches_total", outcome="succeeded") == 0
        nm.ready = True
        m = await scraped(lambda m: m.value("motor_controller_relaunches_total", outcome="succeeded") == 1)
        assert (
            m.value("motor_controller_strategies_total", strategy="EngineRelaunch", outcome="succeeded") == 1
        )
        assert m.value("motor_controller_relaunches_total", outcome="failed") == 0
        m = await scraped(
            lambda m: (
                m.value("motor_controller_strategies_running", strategy="EngineRelaunch") == 0
                and m.value("motor_controller_alarms_active", alarm_id=FAULT, severity=MAJOR) == 0
            )
        )
        assert m.value("motor_controller_instances", role="prefill", status="ACTIVE") == 1

        # Its database cannot grow (as on a full disk): a registration fails and is counted.
        assert m.value("motor_controller_state_write_failures_total") == 0
        _, hard = resource.prlimit(proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (1, hard))
        other = NodeAgent(fields["grpc"], job="q", nm=await node_managers(), ports=(10002,))
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await other.register()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (hard, hard))
            await other.close()
        m = await ascrape(url)
        assert m.value("motor_controller_state_write_failures_total") >= 1
        assert m.value("motor_controller_loop_stalls_total") == 0
    finally:
        await agent.close()
    await scraped(lambda m: m.value("motor_controller_nodemanagers_connected") == 0)


async def test_only_get_metrics_is_served(tmp_path: Path, motor_proc: Callable[..., Proc]) -> None:
    port = reserved_port()
    await listening(start_controller(motor_proc, tmp_path, metrics_port=port))
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as s:
        for method, path in (("GET", "/"), ("GET", "/metricsx"), ("GET", "/metrics/"), ("POST", "/metrics")):
            async with s.request(method, base + path) as resp:
                assert resp.status == 404, (method, path)
        async with s.get(base + "/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=")


async def test_metrics_are_off_by_default(tmp_path: Path, motor_proc: Callable[..., Proc]) -> None:
    proc = start_controller(motor_proc, tmp_path)
    fields = await listening(proc)
    assert "metrics" not in fields
    assert listening_ports(proc.pid) == {int(fields["grpc"].rsplit(":", 1)[1])}
