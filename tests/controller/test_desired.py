"""SetDesiredInstances / ListDesiredInstances on an in-process Controller over real gRPC: what is
set is listed, sorted by role; a bad role or count is INVALID_ARGUMENT naming the field; the
count survives a restart on the same state_dir; ``motor_desired_instances{role}`` on the
Controller's metrics port follows it; a write the disk refuses is UNAVAILABLE
(STATE_WRITE_FAILED) and changes nothing; the management key guards both; a standby names the
leader. (The etcd store: e2e/test_desired_etcd.py.)"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from motor_mesh.common.errors import RpcFailure, details_of
from motor_mesh.common.interceptors import KEY_METADATA
from motor_mesh.common.metrics_http import MetricsServer
from motor_mesh.common.server import MotorServer
from motor_mesh.controller import metrics
from motor_mesh.controller.app import Controller
from motor_mesh.controller.leader.standby import LeaderGate
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from tests.controller.fakes import Harness, controller_cfg, running_controller
from tests.metrics import ascrape
from tests.ports import reserved_port

PREFILL, DECODE, UNION = common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE, common_pb2.ROLE_UNION
METRIC = "motor_desired_instances"


async def set_desired(h: Harness, role: int, replicas: int, **kw: Any) -> controller_pb2.DesiredInstances:
    req = controller_pb2.SetDesiredInstancesRequest(role=role, replicas=replicas)
    resp = await h.stub.SetDesiredInstances(req, timeout=5, **kw)
    return resp.desired


async def listed(h: Harness) -> list[tuple[int, int]]:
    resp = await h.stub.ListDesiredInstances(controller_pb2.ListDesiredInstancesRequest(), timeout=5)
    return [(d.role, d.replicas) for d in resp.desired]


def bad_fields(err: grpc.aio.AioRpcError) -> list[str]:
    return [
        v.field
        for d in details_of(err)
        if isinstance(d, error_details_pb2.BadRequest)
        for v in d.field_violations
    ]


class FullDisk:
    """Every write of the Controller's database fails as on a full disk until ``lift()``
    (as tests/controller/e2e/test_storage_faults.py makes it). Its own patch, so lifting it
    undoes nothing else the test patched."""

    def __init__(self, controller: Controller) -> None:
        self._patch = pytest.MonkeyPatch()
        self.failed = 0

        def full(fn: Any, args: Any) -> Any:
            self.failed += 1
            raise sqlite3.OperationalError("database or disk is full")

        self._patch.setattr(controller.store._writer, "_transaction", full)

    def lift(self) -> None:
        self._patch.undo()


@asynccontextmanager
async def scraped_controller(tmp_path: Path) -> AsyncIterator[tuple[Harness, str]]:
    """An in-process Controller and its metrics endpoint, as ``motor controller`` serves them."""
    async with running_controller(tmp_path) as h:
        scrape = MetricsServer("127.0.0.1", reserved_port(), metrics.registry(h.controller))
        await scrape.start()
        try:
            yield h, f"http://{scrape.address}/metrics"
        finally:
            await scrape.stop()


async def test_set_and_list_over_grpc(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with running_controller(tmp_path) as h:
        assert await listed(h) == []  # nothing recorded yet
        before = time.time()
        d = await set_desired(h, DECODE, 3)
        assert (d.role, d.replicas) == (DECODE, 3)
        assert before - 1 <= d.update_time.ToNanoseconds() / 1e9 <= time.time() + 1
        await set_desired(h, UNION, 0)  # 0 is a count like any other
        await set_desired(h, PREFILL, 1)
        assert await listed(h) == [(PREFILL, 1), (DECODE, 3), (UNION, 0)]  # sorted by role
        again = await set_desired(h, DECODE, 1024)  # the bound itself is allowed
        assert again.replicas == 1024 and again.update_time.ToNanoseconds() >= d.update_time.ToNanoseconds()
        assert await listed(h) == [(PREFILL, 1), (DECODE, 1024), (UNION, 0)]
    # One structured line per set, naming the role and the count it replaced.
    lines = [r.fields for r in caplog.records if getattr(r, "event", "") == "desired_instances_set"]
    assert lines == [
        {"role": "decode", "replicas": 3, "previous": "none"},
        {"role": "union", "replicas": 0, "previous": "none"},
        {"role": "prefill", "replicas": 1, "previous": "none"},
        {"role": "decode", "replicas": 1024, "previous": 3},
    ]


@pytest.mark.parametrize(
    ("role", "replicas", "fields"),
    [
        (common_pb2.ROLE_UNSPECIFIED, 1, ["role"]),
        (99, 1, ["role"]),  # a role this server does not know
        (DECODE, 1025, ["replicas"]),
        (common_pb2.ROLE_UNSPECIFIED, 5000, ["role", "replicas"]),
    ],
)
async def test_a_bad_role_or_count_is_invalid_argument_and_changes_nothing(
    tmp_path: Path, role: int, replicas: int, fields: list[str]
) -> None:
    async with running_controller(tmp_path) as h:
        await set_desired(h, DECODE, 2)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await set_desired(h, role, replicas)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_fields(err.value) == fields
        assert await listed(h) == [(DECODE, 2)]


async def test_the_count_survives_a_restart(tmp_path: Path) -> None:
    async with running_controller(tmp_path) as h:
        await set_desired(h, PREFILL, 2)
        stored = await set_desired(h, DECODE, 5)
        await set_desired(h, PREFILL, 1)
    async with running_controller(tmp_path) as h:
        resp = await h.stub.ListDesiredInstances(controller_pb2.ListDesiredInstancesRequest(), timeout=5)
        assert [(d.role, d.replicas) for d in resp.desired] == [(PREFILL, 1), (DECODE, 5)]
        assert resp.desired[1].update_time == stored.update_time  # as stored, not the load time
        await set_desired(h, DECODE, 4)
    async with running_controller(tmp_path) as h:
        assert await listed(h) == [(PREFILL, 1), (DECODE, 4)]


async def test_the_metric_follows_the_stored_count(tmp_path: Path) -> None:
    async with scraped_controller(tmp_path) as (h, url):
        m = await ascrape(url)
        assert not any(s.name == METRIC for s in m.samples)  # no count recorded: no series
        await set_desired(h, DECODE, 3)
        m = await ascrape(url)
        assert m.value(METRIC, role="decode") == 3
        assert [s.labels["role"] for s in m.samples if s.name == METRIC] == ["decode"]
        await set_desired(h, PREFILL, 0)
        await set_desired(h, DECODE, 2)
        m = await ascrape(url)
        assert (m.value(METRIC, role="prefill"), m.value(METRIC, role="decode")) == (0, 2)
    # A restart exports the stored counts from the start.
    async with scraped_controller(tmp_path) as (h, url):
        m = await ascrape(url)
        assert (m.value(METRIC, role="prefill"), m.value(METRIC, role="decode")) == (0, 2)
        assert "# TYPE motor_desired_instances gauge" in m.text


async def test_a_write_the_disk_refuses_is_unavailable_and_changes_nothing(tmp_path: Path) -> None:
    async with scraped_controller(tmp_path) as (h, url):
        await set_desired(h, DECODE, 2)
        disk = FullDisk(h.controller)
        failures = h.controller.store.write_failures
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await set_desired(h, DECODE, 7)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        failure = RpcFailure.of(err.value)
        assert failure.reason == "STATE_WRITE_FAILED" and failure.retry_after is not None
        assert "database or disk is full" in failure.message
        assert disk.failed >= 1 and h.controller.store.write_failures > failures
        # Neither memory nor the metric moved; a role never set stays unset.
        with pytest.raises(grpc.aio.AioRpcError):
            await set_desired(h, PREFILL, 1)
        assert await listed(h) == [(DECODE, 2)]
        assert (await ascrape(url)).value(METRIC, role="decode") == 2
        disk.lift()
        await set_desired(h, PREFILL, 1)
        assert await listed(h) == [(PREFILL, 1), (DECODE, 2)]
    async with running_controller(tmp_path) as h:  # and the disk holds what was answered
        assert await listed(h) == [(PREFILL, 1), (DECODE, 2)]


async def test_both_rpcs_need_the_management_key(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    key.chmod(0o600)
    async with running_controller(tmp_path / "state", management_key_file=str(key)) as h:
        for call in (
            lambda **kw: set_desired(h, DECODE, 1, **kw),
            lambda **kw: h.stub.ListDesiredInstances(
                controller_pb2.ListDesiredInstancesRequest(), timeout=5, **kw
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(metadata=((KEY_METADATA, "wrong"),))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            await call(metadata=((KEY_METADATA, "s3cret"),))
        assert [(d.role, d.replicas) for d in h.controller.desired.entries()] == [(DECODE, 1)]


async def test_a_standby_names_the_leader(tmp_path: Path) -> None:
    gate = LeaderGate(lambda: "10.0.0.1:7100")
    server = MotorServer(
        "controller",
        controller_cfg(tmp_path),
        [(controller_pb2.DESCRIPTOR.services_by_name["Controller"], gate)],
        port=0,
        standby=True,
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = controller_pb2_grpc.ControllerStub(ch)
            for call in (
                stub.SetDesiredInstances(
                    controller_pb2.SetDesiredInstancesRequest(role=DECODE, replicas=1), timeout=5
                ),
                stub.ListDesiredInstances(controller_pb2.ListDesiredInstancesRequest(), timeout=5),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                failure = RpcFailure.of(err.value)
                assert (failure.code, failure.reason) == (grpc.StatusCode.UNAVAILABLE, "NOT_LEADER")
                assert failure.metadata["leader"] == "10.0.0.1:7100"
    finally:
        await server.stop()
