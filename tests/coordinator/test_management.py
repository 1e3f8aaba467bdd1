"""The management plane through a real in-process gRPC server: every error code with its detail,
all-or-nothing requests, revision, identity and ListInstances groups."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from motor_mesh.common.enums import DECODE, PREFILL, UNION
from motor_mesh.common.errors import details_of
from motor_mesh.coordinator.precision.groups import Completed
from motor_mesh.gen.motor.v1 import common_pb2 as c
from motor_mesh.gen.motor.v1 import coordinator_pb2 as pb
from tests.coordinator.conftest import MODEL, Running, StartCoordinator, endpoint, instance
from tests.ports import reserved_port

T = 5.0


async def _set(r: Running, *insts: c.Instance) -> pb.SetInstancesResponse:
    return await r.stub.SetInstances(pb.SetInstancesRequest(instances=insts), timeout=T)


async def _add(r: Running, *insts: c.Instance) -> pb.AddInstancesResponse:
    return await r.stub.AddInstances(pb.AddInstancesRequest(instances=insts), timeout=T)


async def _list(r: Running) -> pb.CoordinatorListInstancesResponse:
    return await r.stub.ListInstances(pb.CoordinatorListInstancesRequest(), timeout=T)


def _ids(insts: object) -> list[int]:
    return [i.id for i in insts]  # type: ignore[attr-defined]


async def _error(coro: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro  # type: ignore[misc]
    return info.value


def _detail(err: grpc.aio.AioRpcError, cls: type) -> object:
    found = [d for d in details_of(err) if isinstance(d, cls)]
    assert found, f"no {cls.__name__} in {details_of(err)}"
    return found[0]


async def test_add_list_and_revision_only_on_change(coord: Running) -> None:
    first = await _add(coord, instance(1, PREFILL, 10000), instance(2, DECODE, 10002))
    assert (first.revision, first.instance_count) == (1, 2)
    assert len(first.incarnation) >= 16
    # The same ids and identities again (order, status and pid differ): success, no change.
    again = instance(1, PREFILL, 10000)
    again.status = c.INSTANCE_STATUS_ACTIVE
    again.endpoints[0].pid = 4242
    same = await _add(coord, instance(2, DECODE, 10002), again)
    assert (same.revision, same.instance_count, same.incarnation) == (1, 2, first.incarnation)
    listed = await _list(coord)
    assert _ids(listed.available) == [1, 2] and not listed.unavailable and not listed.paused
    assert listed.revision == 1 and listed.incarnation == first.incarnation
    # Status UNSPECIFIED is stored ACTIVE.
    assert all(i.status == c.INSTANCE_STATUS_ACTIVE for i in listed.available)


async def test_identity_ignores_endpoint_order_status_and_pid(coord: Running) -> None:
    await _add(coord, instance(7, UNION, 10000, 10002, job="u"))
    shuffled = instance(7, UNION, 10002, 10000, job="u")
    shuffled.endpoints[0].status = c.ENDPOINT_STATUS_ABNORMAL
    shuffled.endpoints[1].pid = 99
    resp = await _add(coord, shuffled)
    assert resp.revision == 1
    # A delete naming the endpoints in another order matches too.
    deleted = await coord.stub.DeleteInstances(pb.DeleteInstancesRequest(instances=[shuffled]), timeout=T)
    assert (deleted.revision, deleted.instance_count) == (2, 0)


async def test_add_conflicting_id_is_already_exists_and_changes_nothing(coord: Running) -> None:
    await _add(coord, instance(1, PREFILL, 10000))
    for other in (
        instance(1, DECODE, 10000),  # another role
        instance(1, PREFILL, 10000, job="elsewhere"),  # another job
        instance(1, PREFILL, 10000, 10002),  # another endpoint set
    ):
        err = await _error(_add(coord, instance(5, DECODE, 10008), other))
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        info = _detail(err, error_details_pb2.ErrorInfo)
        assert info.reason == "INSTANCE_ID_CONFLICT" and info.domain == "motor"  # type: ignore[attr-defined]
        assert "instances[1]" in err.details()
    listed = await _list(coord)
    assert _ids(listed.available) == [1] and listed.revision == 1  # id 5 was not added either


async def test_duplicate_ids_in_one_set_is_invalid_argument(coord: Running) -> None:
    await _set(coord, instance(1, PREFILL, 10000))
    err = await _error(_set(coord, instance(3, PREFILL, 10000), instance(3, DECODE, 10002)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    fields = [v.field for v in _detail(err, error_details_pb2.BadRequest).field_violations]  # type: ignore[attr-defined]
    assert fields == ["instances[1].id"]
    listed = await _list(coord)
    assert _ids(listed.available) == [1] and listed.revision == 1


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (c.Instance(id=4, role=DECODE, job_name="d", model_name="m"), "instances[1].endpoints"),
        (instance(4, DECODE, 0), "instances[1].endpoints[0].port"),
        (
            c.Instance(id=4, role=DECODE, model_name="m", endpoints=[endpoint(70000)]),
            "instances[1].endpoints[0].port",
        ),
        (
            c.Instance(id=4, role=DECODE, model_name="m", endpoints=[endpoint(1, host="")]),
            "instances[1].endpoints[0].host",
        ),
        (c.Instance(id=0, role=DECODE, model_name="m", endpoints=[endpoint(1)]), "instances[1].id"),
        (c.Instance(id=4, model_name="m", endpoints=[endpoint(1)]), "instances[1].role"),
        (c.Instance(id=4, role=DECODE, endpoints=[endpoint(1)]), "instances[1].model_name"),
        (instance(4, DECODE, 10002, 10002), "instances[1].endpoints[1]"),
        (
            instance(4, PREFILL, 10002, engine_type=c.ENGINE_TYPE_SGLANG),
            "instances[1].endpoints[0].bootstrap_port",
        ),
    ],
)
async def test_malformed_instance_is_invalid_argument_and_nothing_changes(
    coord: Running, bad: c.Instance, field: str
) -> None:
    await _set(coord, instance(1, PREFILL, 10000))
    for rpc in (_add, _set):
        err = await _error(rpc(coord, instance(2, DECODE, 10004), bad))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        violations = _detail(err, error_details_pb2.BadRequest).field_violations  # type: ignore[attr-defined]
        assert field in [v.field for v in violations], violations
    listed = await _list(coord)
    assert _ids(listed.available) == [1] and listed.revision == 1


async def test_set_replaces_the_table(coord: Running) -> None:
    await _add(coord, instance(1, PREFILL, 10000), instance(2, DECODE, 10002))
    resp = await _set(coord, instance(2, DECODE, 10002), instance(3, UNION, 10004))
    assert (resp.revision, resp.instance_count) == (2, 2)
    assert (await _set(coord, instance(3, UNION, 10004), instance(2, DECODE, 10002))).revision == 2
    assert _ids((await _list(coord)).available) == [2, 3]
    assert (await _set(coord)).instance_count == 0  # an empty Set empties the table


async def test_delete_errors(coord: Running) -> None:
    await _add(coord, instance(1, PREFILL, 10000, job="p"), instance(2, DECODE, 10002, job="d"))
    unknown = await _error(
        coord.stub.DeleteInstances(
            pb.DeleteInstancesRequest(instances=[c.Instance(id=2), c.Instance(id=99)]), timeout=T
        )
    )
    assert unknown.code() == grpc.StatusCode.NOT_FOUND
    res = _detail(unknown, error_details_pb2.ResourceInfo)
    assert (res.resource_type, res.resource_name) == ("instance", "99")  # type: ignore[attr-defined]
    assert "instances[1]" in unknown.details()
    for given in (
        c.Instance(id=2, role=PREFILL),
        c.Instance(id=2, job_name="p"),
        c.Instance(id=2, endpoints=[endpoint(10004)]),
    ):
        err = await _error(
            coord.stub.DeleteInstances(
                pb.DeleteInstancesRequest(instances=[c.Instance(id=1), given]), timeout=T
            )
        )
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        violation = _detail(err, error_details_pb2.PreconditionFailure).violations[0]  # type: ignore[attr-defined]
        assert violation.subject == "instances[1]"
        assert violation.type == "INSTANCE_IDENTITY_MISMATCH"
    assert _ids((await _list(coord)).available) == [1, 2]  # all-or-nothing: 1 is still there
    ok = await coord.stub.DeleteInstances(
        pb.DeleteInstancesRequest(
            instances=[c.Instance(id=2, role=DECODE, job_name="d", endpoints=[endpoint(10002)])]
        ),
        timeout=T,
    )
    assert (ok.revision, ok.instance_count) == (2, 1)


async def test_pause_resume_and_groups(coord: Running) -> None:
    inactive = instance(3, DECODE, 10004, status=c.INSTANCE_STATUS_INACTIVE)
    paused_by_status = instance(4, DECODE, 10006, status=c.INSTANCE_STATUS_PAUSED)
    await _add(coord, instance(1, PREFILL, 10000), instance(2, DECODE, 10002), inactive, paused_by_status)
    listed = await _list(coord)
    assert (_ids(listed.available), _ids(listed.unavailable), _ids(listed.paused)) == ([1, 2], [3], [4])

    paused = await coord.stub.PauseInstances(pb.PauseInstancesRequest(ids=[2]), timeout=T)
    assert paused.revision == 2
    assert (await coord.stub.PauseInstances(pb.PauseInstancesRequest(ids=[2]), timeout=T)).revision == 2
    listed = await _list(coord)
    assert (_ids(listed.available), _ids(listed.paused)) == ([1], [2, 4])

    err = await _error(coord.stub.PauseInstances(pb.PauseInstancesRequest(ids=[1, 77]), timeout=T))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "ids[1]" in err.details()
    assert _ids((await _list(coord)).available) == [1]  # 1 was not paused
    err = await _error(coord.stub.ResumeInstances(pb.ResumeInstancesRequest(ids=[77]), timeout=T))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    err = await _error(coord.stub.PauseInstances(pb.PauseInstancesRequest(ids=[0]), timeout=T))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT

    resumed = await coord.stub.ResumeInstances(pb.ResumeInstancesRequest(ids=[2, 4]), timeout=T)
    assert resumed.revision == 3 and resumed.instance_count == 4
    listed = await _list(coord)
    assert (_ids(listed.available), _ids(listed.unavailable), _ids(listed.paused)) == ([1, 2, 4], [3], [])


async def test_health_follows_routability(coord: Running) -> None:
    health = health_pb2_grpc.HealthStub(coord.channel)

    async def status() -> int:
        return (await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=T)).status

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    svc = await health.Check(health_pb2.HealthCheckRequest(service="motor.v1.Coordinator"), timeout=T)
    assert svc.status == serving
    assert await status() == not_serving
    await _add(coord, instance(1, PREFILL, 10000))
    assert await status() == not_serving  # a prefill alone is not a pair
    await _add(coord, instance(2, DECODE, 10002, model="other"))
    assert await status() == not_serving  # not the same model
    await _add(coord, instance(3, DECODE, 10004))
    assert await status() == serving
    await coord.stub.PauseInstances(pb.PauseInstancesRequest(ids=[3]), timeout=T)
    assert await status() == not_serving
    await _set(coord, instance(9, UNION, 10008))
    assert await status() == serving
    await _set(coord)
    assert await status() == not_serving


async def _clear_alarm(r: Running, d: int, p: int = 0) -> bool:
    req = pb.ClearPrecisionAlarmRequest(d_instance_id=d, p_instance_id=p)
    return (await r.stub.ClearPrecisionAlarm(req, timeout=T)).dismissed


async def test_clear_precision_alarm_needs_a_decode_instance_and_holds_nothing_with_detection_off(
    coord: Running,
) -> None:
    err = await _error(
        coord.stub.ClearPrecisionAlarm(pb.ClearPrecisionAlarmRequest(p_instance_id=1), timeout=T)
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = _detail(err, error_details_pb2.BadRequest)
    assert [v.field for v in bad.field_violations] == ["d_instance_id"]  # type: ignore[attr-defined]
    # Detection off: no state, nothing to dismiss, every time.
    assert await _clear_alarm(coord, d=2, p=1) is False
    assert await _clear_alarm(coord, d=2) is False


async def test_clear_precision_alarm_drops_the_group_state_once(start_coordinator: StartCoordinator) -> None:
    # The Controller is never reached here: nothing is sampled (no instance is routable).
    r = await start_coordinator(precision_check_enabled=True, controller=f"127.0.0.1:{reserved_port()}")
    monitor = r.co.precision
    assert monitor is not None
    asked = Completed("/v1/chat/completions", MODEL, {"messages": [{"role": "user", "content": "hi"}]})
    for p, d in [(1, 2), (0, 5), (1, 5), (3, 5)]:
        monitor.record(p, d, asked)  # what the inference path does for an answered request
    assert await _clear_alarm(r, d=2, p=1) is True
    assert await _clear_alarm(r, d=2, p=1) is False  # idempotent
    assert await _clear_alarm(r, d=5) is True  # p = 0: every group of decode instance 5
    assert await _clear_alarm(r, d=5, p=3) is False
    assert len(monitor.groups) == 0


async def test_a_push_from_an_older_leader_term_is_refused_and_changes_nothing(coord: Running) -> None:
    """Fencing of Controller leaders: once term 7 has pushed, a push of term 6 (a paused old
    leader waking up) is FAILED_PRECONDITION STALE_LEADER and the table stays as term 7 left it;
    the same or a newer term, and a push without a term, are applied."""
    term = "x-motor-leader-term"
    new = await coord.stub.SetInstances(
        pb.SetInstancesRequest(instances=[instance(1, PREFILL, 9001)]), timeout=T, metadata=((term, "7"),)
    )
    for call in (
        coord.stub.SetInstances(pb.SetInstancesRequest(), timeout=T, metadata=((term, "6"),)),
        coord.stub.AddInstances(
            pb.AddInstancesRequest(instances=[instance(2, DECODE, 9002)]), timeout=T, metadata=((term, "6"),)
        ),
        coord.stub.DeleteInstances(
            pb.DeleteInstancesRequest(instances=[c.Instance(id=1)]), timeout=T, metadata=((term, "1"),)
        ),
        coord.stub.PauseInstances(pb.PauseInstancesRequest(ids=[1]), timeout=T, metadata=((term, "6"),)),
        coord.stub.ResumeInstances(pb.ResumeInstancesRequest(ids=[1]), timeout=T, metadata=((term, "6"),)),
    ):
        err = await _error(call)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        (failure,) = [d for d in details_of(err) if isinstance(d, error_details_pb2.PreconditionFailure)]
        assert failure.violations[0].type == "STALE_LEADER"
    listed = await _list(coord)
    assert (listed.revision, _ids(listed.available)) == (new.revision, [1])

    same = await coord.stub.AddInstances(
        pb.AddInstancesRequest(instances=[instance(2, DECODE, 9002)]), timeout=T, metadata=((term, "7"),)
    )
    untermed = await _add(coord, instance(3, DECODE, 9003))
    newer = await coord.stub.PauseInstances(
        pb.PauseInstancesRequest(ids=[3]), timeout=T, metadata=((term, "8"),)
    )
    assert new.revision < same.revision < untermed.revision < newer.revision
    err = await _error(
        coord.stub.ResumeInstances(pb.ResumeInstancesRequest(ids=[3]), timeout=T, metadata=((term, "7"),))
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    bad = await _error(coord.stub.SetInstances(pb.SetInstancesRequest(), timeout=T, metadata=((term, "x"),)))
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _ids((await _list(coord)).paused) == [3]
