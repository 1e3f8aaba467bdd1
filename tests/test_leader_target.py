"""ControllerTarget: a client of several Controllers talks to the leader: it follows a standby's
NOT_LEADER hint, skips a Controller that is down, resolves a dns:/// name again when a round
found no leader, and waits a growing pause only after a whole round. The Coordinator's alarm
reporter is one such client."""

from __future__ import annotations

import logging

import grpc
import pytest

from motor_mesh.common.config import load
from motor_mesh.common.errors import RpcFailure
from motor_mesh.common.leader_target import ControllerTarget, addresses_of, first_address
from motor_mesh.coordinator.precision.reporter import AlarmReporter, service_ip
from motor_mesh.gen.motor.v1 import alarm_pb2, common_pb2, controller_pb2
from tests.fake_controller import FakeController, controllers
from tests.poll import until
from tests.ports import reserved_port

LIST = controller_pb2.ListInstancesRequest()
UNAVAILABLE = RpcFailure(grpc.StatusCode.UNAVAILABLE, "connection refused")


def not_leader(leader: str = "") -> RpcFailure:
    return RpcFailure(grpc.StatusCode.UNAVAILABLE, "standby", "NOT_LEADER", 1.0, {"leader": leader})


def leader_with(iid: int) -> FakeController:
    fake = FakeController()
    fake.instances = [common_pb2.Instance(id=iid)]
    return fake


async def test_a_standby_names_the_leader_and_the_call_goes_there_at_once() -> None:
    leader, quiet, named = leader_with(7), FakeController(leading=False), FakeController(leading=False)
    async with controllers(leader, quiet, named) as (lead, silent, hinting):
        named.leader_hint = lead.address
        # The first standby knows the leader: the second standby is never asked.
        target = ControllerTarget(f"{hinting.address},{silent.address},{lead.address}")
        try:
            resp = await target.call("ListInstances", LIST, 5)
            assert [i.id for i in resp.instances] == [7]
            assert target.address == lead.address
            assert (named.refused, quiet.refused) == (1, 0)
        finally:
            await target.close()


async def test_a_hint_is_followed_beyond_the_configured_addresses() -> None:
    leader, standby = leader_with(3), FakeController(leading=False)
    async with controllers(leader, standby) as (lead, stand):
        standby.leader_hint = lead.address
        target = ControllerTarget(stand.address)
        try:
            assert [i.id for i in (await target.call("ListInstances", LIST, 5)).instances] == [3]
            assert target.address == lead.address
        finally:
            await target.close()


async def test_a_dead_controller_is_skipped() -> None:
    dead = f"127.0.0.1:{reserved_port()}"  # nothing listens there
    async with controllers(leader_with(1)) as (lead,):
        target = ControllerTarget(f"{dead},{lead.address}")
        try:
            assert [i.id for i in (await target.call("ListInstances", LIST, 5)).instances] == [1]
            assert target.address == lead.address
        finally:
            await target.close()


async def test_standbys_only_give_up_after_the_rounds_with_their_refusal() -> None:
    a, b = FakeController(leading=False), FakeController(leading=False)
    async with controllers(a, b) as servers:
        target = ControllerTarget(",".join(s.address for s in servers))
        try:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await target.call("ListInstances", LIST, 10, rounds=2)
        finally:
            await target.close()
    failure = RpcFailure.of(exc.value)
    assert (failure.code, failure.reason, failure.metadata) == (
        grpc.StatusCode.UNAVAILABLE,
        "NOT_LEADER",
        {"leader": ""},
    )
    assert (a.refused, b.refused) == (2, 2)


async def test_an_error_of_the_leader_itself_is_not_retried() -> None:
    leader, standby = FakeController(), FakeController(leading=False)
    async with controllers(leader, standby) as (lead, stand):
        standby.leader_hint = lead.address
        target = ControllerTarget(f"{stand.address},{lead.address}")
        try:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await target.call("TerminateInstance", controller_pb2.TerminateInstanceRequest(), 5)
        finally:
            await target.close()
    assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert standby.refused == 1


async def test_a_dns_name_is_resolved_again_when_a_round_found_no_leader() -> None:
    standby = FakeController(leading=False)
    async with controllers(standby, leader_with(9)) as (stand, lead):
        answers = [[stand.address], [lead.address, stand.address]]
        asked: list[tuple[str, int]] = []

        async def resolver(name: str, port: int) -> list[str]:
            asked.append((name, port))
            return answers[min(len(asked), len(answers)) - 1]

        target = ControllerTarget("dns:///controllers.test:7100", resolver=resolver)
        try:
            assert [i.id for i in (await target.call("ListInstances", LIST, 5)).instances] == [9]
            assert target.address == lead.address
        finally:
            await target.close()
    assert asked == [("controllers.test", 7100)] * 2


def test_the_pause_comes_only_after_a_whole_round_and_grows() -> None:
    target = ControllerTarget("a:1,b:2,c:3")
    assert target.following
    assert (target.failed(UNAVAILABLE), target.address) == (0.0, "b:2")
    assert (target.failed(not_leader()), target.address) == (0.0, "c:3")
    first = target.failed(UNAVAILABLE)  # every address tried: the round is over
    assert 0.15 <= first <= 0.25 and target.address == "a:1"
    # A new round: a named leader is followed at once, one that already failed in it is not.
    assert (target.failed(not_leader("c:3")), target.address) == (0.0, "c:3")
    assert (target.failed(not_leader("a:1")), target.address) == (0.0, "b:2")
    second = target.failed(not_leader("a:1"))
    assert 0.3 <= second <= 0.5
    # The round ended on a hint: the next one starts at the leader named.
    assert target.address == "a:1"
    for _ in range(6):
        target.failed(UNAVAILABLE)
    assert target.failed(UNAVAILABLE) <= 1.2  # the ceiling, with jitter
    # Reaching the leader starts afresh.
    target.reached()
    assert (target.failed(UNAVAILABLE), target.failed(UNAVAILABLE)) == (0.0, 0.0)
    assert 0.15 <= target.failed(UNAVAILABLE) <= 0.25


def test_the_leaders_own_error_moves_nothing() -> None:
    target = ControllerTarget("a:1,b:2")
    refused = RpcFailure(grpc.StatusCode.ALREADY_EXISTS, "node registered", retry_after=0.6)
    assert target.failed(refused) >= 0.6 and target.address == "a:1"


async def test_a_change_of_leader_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="motor")
    leader, standby = leader_with(1), FakeController(leading=False)
    async with controllers(leader, standby) as (lead, stand):
        standby.leader_hint = lead.address
        target = ControllerTarget(f"{stand.address},{lead.address}")
        try:
            for _ in range(3):
                await target.call("ListInstances", LIST, 5)
        finally:
            await target.close()
    found = [r.fields for r in caplog.records if getattr(r, "event", "") == "controller_leader"]
    assert found == [{"address": lead.address, "target": f"{stand.address},{lead.address}"}]


def test_the_addresses_a_target_names() -> None:
    assert addresses_of("a:1, b:2,a:1") == ["a:1", "b:2"]
    assert addresses_of("dns:///controllers:7100") == []
    assert first_address("a:1,b:2") == "a:1"
    assert first_address("dns:///controllers:7100") == "controllers:7100"
    assert ControllerTarget("a:1").following is False
    assert ControllerTarget("dns:///controllers:7100").following is True


async def test_the_coordinators_alarm_reporter_delivers_to_the_leader() -> None:
    standby, leader = FakeController(leading=False), FakeController()
    async with controllers(standby, leader) as (stand, lead):
        controller = f"{stand.address},{lead.address}"
        cfg = load(None, env={}, overrides={"coordinator": {"controller": controller}}).coordinator
        reporter = AlarmReporter(cfg, None)
        reporter.start()
        try:
            reporter.submit(alarm_pb2.Alarm(alarm_id="0xFC001009", instance_id=3))
            await until(lambda: [a.instance_id for a in leader.alarms] == [3], 10, "the alarm at the leader")
            assert standby.refused >= 1
        finally:
            await reporter.close()
        assert await service_ip("0.0.0.0", controller) == "127.0.0.1"
