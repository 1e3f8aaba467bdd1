"""Real servers for the fuzzer: the Controller and the Coordinator in-process (started the way
their own tests start them), the NodeManager as a real ``motor nodemanager`` process."""

from __future__ import annotations

import json
import resource
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message

from motor_mesh.common.enums import DECODE, PREFILL, UNION
from motor_mesh.gen.motor.v1 import alarm_pb2, common_pb2, controller_pb2, coordinator_pb2, nodemanager_pb2
from tests.controller.conftest import quick_stop  # noqa: F401  (autouse: no drain in tests)
from tests.controller.fakes import ACTIVE, FakeNodeManager, running_controller
from tests.coordinator.conftest import instance, set_table, start_coordinator  # noqa: F401
from tests.fuzz.harness import SERVICES, LogTrap, Target, finally_clean
from tests.nodemanager.conftest import NodeManagerProc, nm_config
from tests.poll import until
from tests.ports import reserved_pair, reserved_port
from tests.procs import Proc, motor_argv

# Address space the test process may grow by while a fuzz test runs. A request that makes a
# server in this process allocate without bound (a list the size of a uint32 field) then ends in
# MemoryError, a failed test, instead of the kernel's OOM killer taking the whole run.
MEMORY_HEADROOM = 4 << 30


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(autouse=True)
def memory_cap() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    size = _vm_size()
    if not size:
        yield
        return
    cap = size + MEMORY_HEADROOM
    for limit in (soft, hard):
        if limit != resource.RLIM_INFINITY:
            cap = min(cap, limit)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# Read-only Controller methods: accepting one changes nothing, now or later.
CONTROLLER_READS = frozenset({"ListInstances", "ListAlarms", "WatchAlarms", "GetFaultToleranceStatus"})
BASE_JOBS = ("fuzz-p", "fuzz-d")  # the instances set up before fuzzing, watched for loss


def _ser(msgs: list[Message]) -> list[bytes]:
    return [m.SerializeToString(deterministic=True) for m in msgs]


@pytest.fixture
async def controller_target(tmp_path: Path) -> AsyncIterator[Target]:
    """An in-process Controller holding two ACTIVE instances (a prefill and a decode, each on a
    fake NodeManager whose heartbeat stream stays open) and a few alarms."""
    with LogTrap() as trap:
        async with running_controller(tmp_path, instance_heartbeat_timeout_s=3600) as h:
            nms = [await FakeNodeManager().start(), await FakeNodeManager().start()]
            try:
                agents = [
                    await h.start_node(nms[0], job=BASE_JOBS[0], role=common_pb2.ROLE_PREFILL),
                    await h.start_node(nms[1], job=BASE_JOBS[1], role=common_pb2.ROLE_DECODE),
                ]
                base = await until(
                    lambda: _all_active(h.instances()), what="both instances ACTIVE", timeout=10
                )
                ids = [i.id for i in base]
                await h.stub.ReportAlarms(
                    controller_pb2.ReportAlarmsRequest(alarms=_alarms(ids[0], ids[1])), timeout=5
                )
                page = await h.stub.ListAlarms(controller_pb2.ListAlarmsRequest(page_size=1), timeout=5)
                flux: set[int] = set()  # instances an accepted call may still be changing

                async def snapshot() -> Any:
                    alarms = await h.stub.ListAlarms(
                        controller_pb2.ListAlarmsRequest(page_size=1000), timeout=5
                    )
                    return await h.instances(), list(alarms.alarms)

                base_nodes = {(nm.host, nm.port) for nm in nms}
                # Set once an accepted call may have made the Controller raise alarms of its own
                # about instances the fuzzer cannot name (one assembled on a base node's address).
                noisy: list[bool] = []

                def comparable(state: Any) -> Any:
                    insts, alarms = state
                    kept = [i for i in insts if i.job_name in BASE_JOBS and i.id not in flux]
                    quiet = [
                        a
                        for a in alarms
                        if not {a.instance_id, a.p_instance_id} & flux
                        and not (noisy and a.instance_id not in ids)
                    ]
                    return _ser(kept), _ser(quiet)

                def accepted(method: MethodDescriptor, req: Any, responses: list[Message]) -> None:
                    name = method.name
                    if name in CONTROLLER_READS or name == "ReportAlarms":  # precision recovery is off
                        return
                    if name == "TerminateInstance" and req is not None:
                        flux.update({req.instance_id, req.p_instance_id})
                    elif name == "ReportFaults" and responses:
                        flux.update(getattr(responses[0], "affected_instance_ids", ()))
                    elif name == "Heartbeat" and not any(r.HasField("ack") for r in responses):
                        pass
                    elif (
                        name == "Register"
                        and req is not None
                        and req.job_name not in BASE_JOBS
                        and (req.host, req.nm_port) not in base_nodes
                    ):
                        pass  # a node nothing answers at: dropped before it becomes an instance
                    else:  # anything else accepted may touch the base instances
                        flux.update(ids)
                        noisy.append(True)

                first = agents[0]
                seeds = _controller_seeds(
                    first.request, first.node_id, first.epoch, ids, nms[0], page.next_page_token
                )
                target = Target(
                    SERVICES["motor.v1.Controller"],
                    h.channel,
                    lambda: trap.lines,
                    snapshot,
                    seeds,
                    accepted,
                    comparable,
                )
                target.new_log()  # what set-up logged is not the fuzzer's doing
                yield target
                finally_clean(target)
            finally:
                for nm in nms:
                    await nm.stop()


async def _all_active(pending: Awaitable[list[common_pb2.Instance]]) -> list[common_pb2.Instance] | None:
    insts = await pending
    return insts if len(insts) == 2 and all(i.status == ACTIVE for i in insts) else None


def _alarms(p: int, d: int) -> list[alarm_pb2.Alarm]:
    moi = f"service name=Coordinator, service ip=127.0.0.1, pId={p}, instanceId={d}"
    return [
        alarm_pb2.Alarm(
            alarm_id="0xFC001009",
            category=alarm_pb2.ALARM_CATEGORY_ALARM,
            severity=alarm_pb2.SEVERITY_MAJOR,
            moi=moi,
            instance_id=d,
            p_instance_id=p,
            additional_info={"k": "v"},
        ),
        alarm_pb2.Alarm(
            alarm_id="0xFC001002", category=alarm_pb2.ALARM_CATEGORY_EVENT, instance_id=d, reason="fuzz"
        ),
    ]


def _controller_seeds(
    reg: controller_pb2.RegisterRequest,
    node_id: int,
    epoch: int,
    ids: list[int],
    nm: FakeNodeManager,
    page_token: str,
) -> dict[str, list[Message]]:
    p, d = ids
    again = controller_pb2.RegisterRequest()
    again.CopyFrom(reg)
    again.instance_id = p  # the base node registering again, as after a NodeManager restart
    other = controller_pb2.RegisterRequest()
    other.CopyFrom(reg)
    other.job_name = "fuzz-other"
    other.nm_port = 1
    other.parallel.nnodes = 2  # waits for a second node: pending, never an instance
    other.parallel.tp = 2
    ep = common_pb2.Endpoint(id=0, port=reg.ports[0], status=common_pb2.ENDPOINT_STATUS_NORMAL, pid=40000)
    beat = controller_pb2.Beat(node_id=node_id, session_epoch=epoch, seq=7, endpoints=[ep])
    event = controller_pb2.EngineEvent(
        endpoint_id=0, pid=40000, type=controller_pb2.ENGINE_EVENT_TYPE_UNHEALTHY, seq=8,
        node_id=node_id, session_epoch=epoch,
    )  # fmt: skip
    fault = controller_pb2.NodeFault(
        host=nm.host, nm_port=nm.port, level=controller_pb2.FAULT_LEVEL_L1, code="F"
    )
    return {
        "Register": [again, other],
        "Heartbeat": [
            controller_pb2.HeartbeatRequest(beat=beat),
            controller_pb2.HeartbeatRequest(engine_event=event),
        ],
        "ReportAlarms": [controller_pb2.ReportAlarmsRequest(alarms=_alarms(p, d))],
        "TerminateInstance": [controller_pb2.TerminateInstanceRequest(instance_id=d, p_instance_id=p)],
        "ListInstances": [controller_pb2.ListInstancesRequest(role=common_pb2.ROLE_PREFILL)],
        "ListAlarms": [
            controller_pb2.ListAlarmsRequest(page_size=1, page_token=page_token),
            controller_pb2.ListAlarmsRequest(active_only=True, alarm_id="0xFC001009"),
        ],
        "WatchAlarms": [controller_pb2.WatchAlarmsRequest(after_sequence=1)],
        "GetFaultToleranceStatus": [controller_pb2.GetFaultToleranceStatusRequest(instance_id=p)],
        "ReportFaults": [
            controller_pb2.ReportFaultsRequest(faults=[fault]),
            controller_pb2.ReportFaultsRequest(
                faults=[controller_pb2.NodeFault(host=nm.host, nm_port=nm.port, cleared=True)]
            ),
        ],
    }


@pytest.fixture
async def coordinator_target(start_coordinator: Callable[..., Any]) -> AsyncIterator[Target]:  # noqa: F811
    """An in-process Coordinator (gRPC + HTTP) holding a prefill, a decode and a union instance."""
    with LogTrap() as trap:
        coord = await start_coordinator()
        base = [
            instance(1, PREFILL, reserved_port()),
            instance(2, DECODE, reserved_port()),
            instance(3, UNION, reserved_port(), reserved_port()),
        ]
        await set_table(coord, *base)

        async def snapshot() -> bytes:
            resp = await coord.stub.ListInstances(
                coordinator_pb2.CoordinatorListInstancesRequest(), timeout=5
            )
            return resp.SerializeToString(deterministic=True)

        newcomer = instance(4, UNION, reserved_port(), model="other-model")
        seeds: dict[str, list[Message]] = {
            "SetInstances": [coordinator_pb2.SetInstancesRequest(instances=base)],
            "AddInstances": [
                coordinator_pb2.AddInstancesRequest(instances=[newcomer]),
                coordinator_pb2.AddInstancesRequest(instances=base),
            ],
            "DeleteInstances": [
                coordinator_pb2.DeleteInstancesRequest(instances=[common_pb2.Instance(id=3)]),
                coordinator_pb2.DeleteInstancesRequest(instances=[base[0]]),
            ],
            "PauseInstances": [coordinator_pb2.PauseInstancesRequest(ids=[1, 2])],
            "ResumeInstances": [coordinator_pb2.ResumeInstancesRequest(ids=[1])],
            "ClearPrecisionAlarm": [
                coordinator_pb2.ClearPrecisionAlarmRequest(d_instance_id=2, p_instance_id=1)
            ],
        }
        target = Target(SERVICES["motor.v1.Coordinator"], coord.channel, lambda: trap.lines, snapshot, seeds)
        target.new_log()
        yield target
        finally_clean(target)


# -- the NodeManager: a real process, shared by a module (it takes a second to start) ------------


async def start_nodemanager(tmp_path: Path) -> NodeManagerProc:
    port = reserved_pair()
    cfg = nm_config(tmp_path, [port], engine_stop_grace_s=1)
    path = tmp_path / "nm.json"
    path.write_text(json.dumps(cfg))
    proc = Proc(motor_argv("nodemanager", "--config", str(path)), cwd=tmp_path)
    try:
        address, _ = proc.listening(timeout=30)
    except BaseException:
        proc.kill()
        raise
    return NodeManagerProc(proc, address, cfg, set())


def nodemanager_seeds(nm: NodeManagerProc) -> dict[str, list[Message]]:
    # Never a command for this node: that would launch real engines. Wrong role and wrong ports,
    # so no mutation of one field alone makes it match.
    port = nm.cfg["nodemanager"]["ports"][0]
    foreign = nm.start_request(
        role=common_pb2.ROLE_DECODE,
        endpoints=[common_pb2.Endpoint(id=0, host="127.0.0.1", port=port + 2)],
        peers=["127.0.0.1:7301"],
    )
    return {
        "StartEngines": [foreign],
        "RestartEngines": [
            nodemanager_pb2.RestartEnginesRequest(
                action=nodemanager_pb2.RESTART_ACTION_RESTART, instance_id=5
            ),
            nodemanager_pb2.RestartEnginesRequest(action=nodemanager_pb2.RESTART_ACTION_ABORT),
        ],
        "GetStatus": [nodemanager_pb2.GetStatusRequest(relaxed=True)],
        # No start command is ever recorded here, so a switch is refused and never relaunches.
        "SwitchRole": [
            nodemanager_pb2.SwitchRoleRequest(instance_id=5, role=common_pb2.ROLE_DECODE),
            nodemanager_pb2.SwitchRoleRequest(instance_id=5, role=common_pb2.ROLE_PREFILL),
        ],
        "Stop": [nodemanager_pb2.StopRequest(reason="fuzz")],
    }


def nodemanager_target(nm: NodeManagerProc, channel: grpc.aio.Channel) -> Target:
    """``channel``: a plain one, without the client-side message limit of Motor's own channels
    (the server's limits are what is being tried)."""

    async def snapshot() -> bytes:
        resp = await nm.stub.GetStatus(nodemanager_pb2.GetStatusRequest(), timeout=5)
        return resp.SerializeToString(deterministic=True)

    target = Target(
        SERVICES["motor.v1.NodeManager"], channel, lambda: nm.proc.lines, snapshot, nodemanager_seeds(nm)
    )
    target.new_log()
    return target


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_nodemanager(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[NodeManagerProc, grpc.aio.Channel]]:
    nm = await start_nodemanager(tmp_path_factory.mktemp("nm"))
    channel = grpc.aio.insecure_channel(nm.address)
    yield nm, channel
    nm.proc.kill()
    await channel.close()
    await nm.channel.close()


@pytest.fixture
def nm_target(shared_nodemanager: tuple[NodeManagerProc, grpc.aio.Channel]) -> Iterator[Target]:
    """The shared NodeManager, with the log read from here on."""
    target = nodemanager_target(*shared_nodemanager)
    yield target
    finally_clean(target)
