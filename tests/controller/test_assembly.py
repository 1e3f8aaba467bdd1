"""Registration and assembly: what NodeManagers receive and what Register answers."""

from __future__ import annotations

import logging

import grpc
import pytest
from google.rpc import error_details_pb2

from motor_mesh.common import errors
from motor_mesh.common.errors import details_of
from motor_mesh.controller import assembly, validation
from motor_mesh.controller.model import JobSpec, Member
from motor_mesh.controller.reconcile import assembler
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2
from tests.controller.fakes import (
    ACTIVE,
    DELETED,
    INACTIVE,
    INITIAL,
    NORMAL,
    FakeNodeManager,
    running_controller,
)
from tests.poll import until

SIM, SGLANG = common_pb2.ENGINE_TYPE_SIM, common_pb2.ENGINE_TYPE_SGLANG


def _reason(err: grpc.aio.AioRpcError) -> str:
    infos = [d for d in details_of(err) if isinstance(d, error_details_pb2.ErrorInfo)]
    assert infos, f"no ErrorInfo in {err}"
    return infos[0].reason


# ---- pure layout rules -------------------------------------------------------------------------


def test_plan_orders_by_rank_and_marks_headless() -> None:
    spec = JobSpec(
        role=1, model_name="m", engine_type=SIM, pd_protocol=common_pb2.PD_PROTOCOL_SGLANG, nnodes=2
    )
    rank1 = Member(node_rank=1, host="10.0.0.2", nm_port=7300, ports=[10000], device_count=8)
    rank0 = Member(node_rank=0, host="10.0.0.1", nm_port=7300, ports=[10000], device_count=8)
    plan = assembly.plan(7, "job", spec, [rank1, rank0])
    assert [(e.id, e.host, e.headless) for e in plan.endpoints] == [
        (0, "10.0.0.1", False),
        (1, "10.0.0.2", True),
    ]
    assert [e.bootstrap_port for e in plan.endpoints] == [10001, 10001]
    assert list(plan.endpoints[0].device_ids) == list(range(8))
    cmd = plan.commands["10.0.0.2:7300"]
    assert (cmd.instance_id, cmd.node_rank, cmd.master_host, list(cmd.peers)) == (
        7,
        1,
        "10.0.0.1",
        ["10.0.0.1:7300"],
    )


def test_devices_are_split_between_a_nodes_ports() -> None:
    spec = JobSpec(role=1, model_name="m", engine_type=SIM, pd_protocol=common_pb2.PD_PROTOCOL_VLLM, dp=2)
    m = Member(node_rank=0, host="h", nm_port=1, ports=[10000, 10002], device_count=4)
    plan = assembly.plan(1, "job", spec, [m])
    assert [list(e.device_ids) for e in plan.endpoints] == [[0, 1], [2, 3]]
    assert [e.bootstrap_port for e in plan.endpoints] == [0, 0]


def test_completeness_and_fit() -> None:
    one_node = JobSpec(role=1, model_name="m", engine_type=SIM, pd_protocol=1, dp=2)
    a = Member(node_rank=0, host="h", nm_port=1, ports=[10000])
    b = Member(node_rank=0, host="h", nm_port=2, ports=[10002])
    assert not assembly.is_complete(one_node, [a])
    assert assembly.is_complete(one_node, [a, b])
    assert assembly.misfit(one_node, [a, b], Member(node_rank=0, host="h", nm_port=3, ports=[10004]))
    multi = JobSpec(role=1, model_name="m", engine_type=SIM, pd_protocol=1, dp=1, nnodes=2)
    assert not assembly.is_complete(multi, [a])
    assert assembly.misfit(multi, [a], b)  # a second rank-0 NodeManager for dp=1
    assert not assembly.misfit(multi, [a], Member(node_rank=1, host="h", nm_port=3, ports=[10004]))
    assert assembly.conflict([a], Member(node_rank=0, host="h", nm_port=9, ports=[10000])) is a
    assert assembly.missing(one_node, [a]) == "has 1 of 2 endpoint(s) (parallel.dp)"
    assert assembly.missing(one_node, [a, b]) == ""


def test_multi_node_counts_endpoints_per_node_rank() -> None:
    # DP 2, each rank spanning 2 nodes, one NodeManager with two engine ports per node.
    spec = JobSpec(role=2, model_name="m", engine_type=SIM, pd_protocol=1, dp=2, nnodes=2)
    head = Member(node_rank=0, host="10.0.0.1", nm_port=7300, ports=[10000, 10002])
    tail = Member(node_rank=1, host="10.0.0.2", nm_port=7300, ports=[10000, 10002])
    assert assembly.missing(spec, [tail]) == "node_rank 0 has 0 of 2 endpoint(s)"
    assert "on node_rank 1" in assembly.misfit(
        spec, [tail], Member(node_rank=1, host="x", nm_port=1, ports=[1])
    )
    assert assembly.is_complete(spec, [tail, head])
    plan = assembly.plan(3, "job", spec, [tail, head])
    # ids are node_rank * dp + DP rank
    assert [(e.id, e.host, e.port, e.headless) for e in plan.endpoints] == [
        (0, "10.0.0.1", 10000, False),
        (1, "10.0.0.1", 10002, False),
        (2, "10.0.0.2", 10000, True),
        (3, "10.0.0.2", 10002, True),
    ]
    cmd = plan.commands["10.0.0.2:7300"]
    assert [e.id for e in cmd.endpoints] == [2, 3] and cmd.node_rank == 1
    # Both nodes learn every rank's routable endpoint, the DP master first.
    for c in plan.commands.values():
        assert [(h.id, h.host, h.port) for h in c.heads] == [(0, "10.0.0.1", 10000), (1, "10.0.0.1", 10002)]


def test_registrations_the_engines_could_not_run_are_refused() -> None:
    def problems(**kw: object) -> list[tuple[str, str]]:
        req = controller_pb2.RegisterRequest(
            job_name="j", role=1, model_name="m", host="h", nm_port=7300, ports=[10000, 10002], **kw
        )
        return validation.register(req)

    assert problems(parallel=common_pb2.ParallelConfig(dp=2)) == []
    assert problems(parallel=common_pb2.ParallelConfig(dp=1)) == [
        ("ports", "2 engine ports but parallel.dp is 1 (one endpoint per DP rank)")
    ]
    multi = common_pb2.ParallelConfig(dp=2, tp=4, pp=1, nnodes=3)
    assert problems(parallel=multi, node_rank=1) == [
        ("parallel.nnodes", "must divide tp * pp (4 * 1): each node runs an equal share of a rank's workers")
    ]


# ---- through the Controller --------------------------------------------------------------------


async def test_single_node_instance_gets_start_engines(tmp_path, node_managers) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path) as h:
        agent = h.agent(job="p0", nm=nm, ports=(10000,))
        resp = await agent.register()
        assert resp.node_id and resp.session_epoch and resp.instance_id == 0
        assert resp.heartbeat_interval_ms == 3000
        assert resp.engine_relaunch_enabled  # controller.enable_engine_relaunch, on by default
        await until(lambda: nm.starts)
        cmd = nm.starts[0]
        assert (cmd.job_name, cmd.instance_id, cmd.role, cmd.master_host, cmd.node_rank) == (
            "p0",
            1,
            common_pb2.ROLE_PREFILL,
            "127.0.0.1",
            0,
        )
        assert [(e.id, e.host, e.port, e.bootstrap_port, e.headless) for e in cmd.endpoints] == [
            (0, "127.0.0.1", 10000, 0, False)
        ]
        [inst] = await h.instances()
        assert (inst.id, inst.status, inst.job_name, inst.model_name) == (1, INITIAL, "p0", "motor-sim")
        assert inst.pd_protocol == common_pb2.PD_PROTOCOL_VLLM
        assert list(inst.node_managers) == [f"127.0.0.1:{nm.port}"]
        assert inst.endpoints[0].pid == 40000  # from the StartEngines answer


async def test_dp2_across_two_node_managers(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path) as h:
        await h.agent(
            job="d", nm=a, ports=(10000,), dp=2, role=common_pb2.ROLE_DECODE, engine_type=SGLANG
        ).register()
        assert await h.instances() == []  # still pending
        await h.agent(
            job="d", nm=b, ports=(10002,), dp=2, role=common_pb2.ROLE_DECODE, engine_type=SGLANG
        ).register()
        await until(lambda: a.starts and b.starts)
        eps = sorted([*a.starts[0].endpoints, *b.starts[0].endpoints], key=lambda e: e.id)
        # DP ranks 0, 1 in NodeManager order (host, nm_port); SGLang bootstrap = port + 1.
        first = 10000 if a.port < b.port else 10002
        assert [e.id for e in eps] == [0, 1] and eps[0].port == first
        assert {(e.port, e.bootstrap_port) for e in eps} == {(10000, 10001), (10002, 10003)}
        assert list(a.starts[0].peers) == [f"127.0.0.1:{b.port}"]
        [inst] = await h.instances()
        assert inst.parallel.dp == 2 and len(inst.endpoints) == 2
        assert inst.pd_protocol == common_pb2.PD_PROTOCOL_SGLANG


async def test_multi_node_instance_has_headless_rank(tmp_path, node_managers) -> None:
    rank0, rank1 = await node_managers("127.0.0.1"), await node_managers("127.0.0.2")
    async with running_controller(tmp_path) as h:
        await h.agent(job="u", nm=rank1, nnodes=2, node_rank=1, role=common_pb2.ROLE_UNION).register()
        await h.agent(job="u", nm=rank0, nnodes=2, node_rank=0, role=common_pb2.ROLE_UNION).register()
        await until(lambda: rank0.starts and rank1.starts)
        c0, c1 = rank0.starts[0], rank1.starts[0]
        assert (c0.node_rank, c1.node_rank) == (0, 1)
        assert c0.master_host == c1.master_host == "127.0.0.1"
        assert [(e.id, e.host, e.headless) for e in c0.endpoints] == [(0, "127.0.0.1", False)]
        assert [(e.id, e.host, e.headless) for e in c1.endpoints] == [(1, "127.0.0.2", True)]
        assert [(e.id, e.host) for e in c1.heads] == [(0, "127.0.0.1")]
        [inst] = await h.instances()
        assert [e.headless for e in inst.endpoints] == [False, True]


async def test_an_instance_that_cannot_complete_says_why(
    tmp_path, node_managers, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(assembler, "INCOMPLETE_WARN_S", 0.2)
    nm = await node_managers()
    async with running_controller(tmp_path) as h:
        await h.agent(job="p", nm=nm, ports=(10000,), dp=2).register()  # one port, dp 2

        def warnings() -> list[logging.LogRecord]:
            return [r for r in caplog.records if getattr(r, "event", "") == "assembly_incomplete"]

        (rec,) = await until(warnings)
        assert rec.levelno == logging.WARNING
        fields = rec.fields  # type: ignore[attr-defined]
        assert fields["job"] == "p"
        assert (
            fields["reason"] == "instance has 1 of 2 endpoint(s) (parallel.dp); waiting for more NodeManagers"
        )
        assert not nm.starts


async def test_pending_instance_expires_and_its_id_is_not_reused(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, instance_assemble_timeout_s=0.3) as h:
        first = h.agent(job="x", nm=a, dp=2)
        await first.register()

        async def told_to_reregister() -> bool:
            resp = await first.beat()
            return resp.directive == controller_pb2.DIRECTIVE_REREGISTER

        await until(told_to_reregister)
        await first.register()
        await h.agent(job="x", nm=b, ports=(10002,), dp=2).register()
        await until(lambda: a.starts and b.starts)
        assert a.starts[0].instance_id == 2  # id 1 went with the expired assembly


async def test_unreachable_node_manager_is_dropped_before_completion(tmp_path, node_managers) -> None:
    a, c = await node_managers(), await node_managers()
    gone = await node_managers()
    await gone.stop()  # registered but its server does not answer
    async with running_controller(tmp_path) as h:
        await h.agent(job="j", nm=a, dp=2).register()
        silent = h.agent(job="j", nm=gone, ports=(10002,), dp=2)
        await silent.register()

        async def dropped() -> bool:
            return (await silent.beat()).directive == controller_pb2.DIRECTIVE_REREGISTER

        await until(dropped)
        assert not a.starts and await h.instances() == []
        await h.agent(job="j", nm=c, ports=(10004,), dp=2).register()
        await until(lambda: a.starts and c.starts)
        assert {e.port for e in [*a.starts[0].endpoints, *c.starts[0].endpoints]} == {10000, 10004}


async def test_duplicate_slot_is_already_exists(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path) as h:
        agent = h.agent(job="j", nm=a, dp=2)
        await agent.register()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await agent.register()
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert _reason(err.value) == "DUPLICATE_REGISTRATION"
        # Another NodeManager claiming the same engine port on the same host and rank.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.agent(job="j", nm=b, ports=(10000,), dp=2).register()
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_assembled_job_refuses_new_registrations(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path) as h:
        await h.agent(job="j", nm=a).register()
        await until(lambda: a.starts)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.agent(job="j", nm=b, ports=(10002,)).register()
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert _reason(err.value) == "JOB_ALREADY_ASSEMBLED"


async def test_reregister_with_instance_id_keeps_engines(tmp_path, node_managers) -> None:
    a = await node_managers()
    async with running_controller(tmp_path) as h:
        agent = h.agent(job="j", nm=a)
        first = await agent.register()
        await until(lambda: a.starts)
        old_stream = h.agent(job="j", nm=a)
        old_stream.node_id, old_stream.epoch = first.node_id, first.session_epoch
        again = await agent.register(instance_id=1)
        assert again.instance_id == 1
        assert (again.node_id, again.session_epoch) != (first.node_id, first.session_epoch)
        # The earlier session is stale now; the new one is accepted.
        assert (await old_stream.beat()).directive == controller_pb2.DIRECTIVE_REREGISTER
        assert (await agent.beat()).ack.seq == agent.seq
        assert len(a.starts) == 1
        [inst] = await h.instances()
        assert inst.id == 1


async def test_registration_disagreeing_with_its_job_is_refused(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path) as h:
        await h.agent(job="j", nm=a, dp=2).register()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.agent(job="j", nm=b, ports=(10002,), dp=2, model="other").register()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        [pf] = [d for d in details_of(err.value) if isinstance(d, error_details_pb2.PreconditionFailure)]
        assert pf.violations[0].type == "JOB_MISMATCH" and "model_name" in pf.violations[0].description


async def test_start_engines_failing_drops_the_instance(tmp_path, node_managers) -> None:
    a = await node_managers()
    a.fail_starts = 100
    async with running_controller(tmp_path, start_command_retries=1) as h:
        agent = h.agent(job="j", nm=a)
        await agent.register()
        [gone] = await until(lambda: h.instances(status=DELETED))
        assert gone.id == 1 and len(a.starts) == 2  # one try + one retry
        assert await h.instances() == []
        assert (await agent.beat()).directive == controller_pb2.DIRECTIVE_REREGISTER


async def test_start_engines_is_retried_and_the_instance_survives(tmp_path, node_managers) -> None:
    a = await node_managers()
    a.fail_starts = 2  # the NodeManager recovers on the third try
    async with running_controller(tmp_path, start_command_retries=3) as h:
        agent = h.agent(job="j", nm=a)
        await agent.register()
        await until(lambda: len(a.starts) == 3)
        await agent.beat(NORMAL)
        [inst] = await until(lambda: h.instances(status=ACTIVE))
        assert inst.id == 1 and await h.instances(status=DELETED) == []
        assert len(a.starts) == 3 and a.starts[0] == a.starts[2]  # the same command each time


async def test_node_mismatch_is_not_retried(tmp_path, node_managers) -> None:
    a = await node_managers()
    a.fail_starts = 100
    a.start_error = errors.precondition("NODE_MISMATCH", "node/x", "test: not this node's job")
    async with running_controller(tmp_path, start_command_retries=3) as h:
        agent = h.agent(job="j", nm=a)
        await agent.register()
        [gone] = await until(lambda: h.instances(status=DELETED))
        assert gone.id == 1 and len(a.starts) == 1
        assert (await agent.beat()).directive == controller_pb2.DIRECTIVE_REREGISTER


# ---- a NodeManager restarted in place ----------------------------------------------------------


async def test_a_restarted_node_manager_retires_its_instance_at_once(tmp_path, node_managers) -> None:
    nm = await node_managers()
    # A heartbeat timeout far away: only the restart proof can retire the old instance in time.
    async with running_controller(tmp_path, instance_heartbeat_timeout_s=600) as h:
        nm.incarnation = 100
        old = h.agent(job="p", nm=nm, incarnation=100)
        await old.register()
        await until(lambda: nm.starts)
        await old.beat(NORMAL)
        await until(lambda: h.instances(status=ACTIVE))
        old.drop_stream()  # the process died
        nm.incarnation = 200  # a new process answers at the same address
        resp = await h.agent(job="p", nm=nm, incarnation=200).register()
        assert resp.node_id != old.node_id
        await until(lambda: len(nm.starts) == 2)
        assert nm.starts[1].instance_id == 2  # assembled again, under a new id
        assert [i.id for i in await h.instances(status=DELETED)] == [1]


async def test_a_node_manager_restarted_right_after_it_was_found_gone_is_assembled_at_once(
    tmp_path, node_managers, caplog: pytest.LogCaptureFixture
) -> None:
    """The Controller found the dead process unreachable (its channels to the address are in
    reconnect backoff) just before the new one registers: the new one is probed on a fresh
    channel, not refused by the old one's backoff and dropped."""
    old_nm = await node_managers()
    async with running_controller(tmp_path, instance_heartbeat_timeout_s=600) as h:
        old_nm.incarnation = 100
        old = h.agent(job="p", nm=old_nm, incarnation=100)
        await old.register()
        await until(lambda: old_nm.starts)
        await old.beat(NORMAL)
        await until(lambda: h.instances(status=ACTIVE))
        await old_nm.stop()
        old.drop_stream()
        await until(
            lambda: any(getattr(r, "event", "") == "node_manager_unreachable" for r in caplog.records)
        )
        new_nm = FakeNodeManager()
        new_nm.incarnation = 200
        await new_nm.start(old_nm.host, old_nm.port)
        try:
            await h.agent(job="p", nm=new_nm, incarnation=200).register()
            await until(lambda: new_nm.starts, 10, "the new process told to start its engines")
            assert not [r for r in caplog.records if getattr(r, "event", "") == "registration_dropped"]
        finally:
            await new_nm.stop()


async def test_a_stale_or_forged_registration_cannot_evict_a_live_member(tmp_path, node_managers) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path, instance_heartbeat_timeout_s=600) as h:
        nm.incarnation = 100
        live = h.agent(job="p", nm=nm, incarnation=100)
        await live.register()
        await until(lambda: nm.starts)
        # An earlier process's registration arriving late, and one claiming a later process while
        # the address still answers with the live one's incarnation: both refused.
        for incarnation in (50, 300):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.agent(job="p", nm=nm, incarnation=incarnation).register()
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        (inst,) = await h.instances()
        assert inst.id == 1 and len(nm.starts) == 1
        assert (await live.beat(NORMAL)).HasField("ack")  # its session is untouched


async def test_a_node_manager_gone_with_its_stream_takes_its_instance_out_at_once(
    tmp_path, node_managers, caplog: pytest.LogCaptureFixture
) -> None:
    alive, dead = await node_managers(), await node_managers()
    # The heartbeat timeout is far away: only the probe after the broken stream can act in time.
    async with running_controller(tmp_path, instance_heartbeat_timeout_s=600) as h:
        agents = {}
        for job, nm, port in (("a", alive, 10000), ("d", dead, 10002)):
            agents[job] = h.agent(job=job, nm=nm, ports=(port,))
            await agents[job].register()
            await until(lambda nm=nm: nm.starts)
            await agents[job].beat(NORMAL)
        await until(lambda: _count(h, ACTIVE, 2))
        agents["a"].drop_stream()  # a blip: the NodeManager still answers
        await dead.stop()  # this one is gone: its stream breaks and it answers nothing
        agents["d"].drop_stream()

        def unreachable() -> list[str]:
            return [
                r.fields["node_manager"]  # type: ignore[attr-defined]
                for r in caplog.records
                if getattr(r, "event", "") == "node_manager_unreachable"
            ]

        assert await until(unreachable) == [f"127.0.0.1:{dead.port}"]

        async def left_active() -> dict[str, int] | None:
            # The reconcile logs the probe's verdict, then writes the transition it causes.
            statuses = {i.job_name: i.status for i in await h.instances()}
            return statuses if statuses["d"] != ACTIVE else None

        assert await until(left_active, what="d's transition after the probe") == {"a": ACTIVE, "d": INACTIVE}


async def _count(h, status: int, n: int) -> bool:
    return len(await h.instances(status=status)) == n
