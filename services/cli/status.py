"""``motor status``: the Controller, every Coordinator and every NodeManager on one screen.

Everything is asked at once under one deadline (``--timeout``): the Controller and the
Coordinators together, and each NodeManager the Controller's instances name as soon as the
Controller has answered. A part that does not answer is shown as UNREACHABLE with its status
code; the rest is still shown, and the exit status is 1. The document built here is what ``-o
json`` prints; status_table.py lays the same out as text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Any, TypeVar

import grpc
from google.protobuf import timestamp_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from motor_mesh.cli import client, status_table
from motor_mesh.cli.alarms import list_alarms
from motor_mesh.cli.scale import entry as desired_entry
from motor_mesh.cli.status_table import UNREACHABLE
from motor_mesh.cli.views import run, short_enum
from motor_mesh.common import enums
from motor_mesh.gen.motor.v1 import (
    alarm_pb2,
    common_pb2,
    controller_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    nodemanager_pb2,
    nodemanager_pb2_grpc,
)

T = TypeVar("T")
# Live statuses, in lifecycle order: the keys of every role's counts.
STATUSES = (enums.INITIAL, enums.ACTIVE, enums.INACTIVE, enums.PAUSED)
# Active alarms shown by name; the rest are counted.
MOST_SEVERE = 3


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.001, self.at - time.monotonic())


async def attempt(call: Awaitable[T]) -> T | grpc.aio.AioRpcError:
    """The answer, or the call's error as a value (one part failing must not stop the others)."""
    try:
        return await call
    except grpc.aio.AioRpcError as err:
        return err


def unimplemented(answer: object) -> bool:
    """The call's error says the server has no such RPC (an older version)."""
    return isinstance(answer, grpc.aio.AioRpcError) and answer.code() == grpc.StatusCode.UNIMPLEMENTED


def failure(err: grpc.aio.AioRpcError) -> dict[str, str]:
    return {"code": err.code().name, "message": err.details() or ""}


def iso(ts: timestamp_pb2.Timestamp) -> str:
    return ts.ToDatetime(tzinfo=UTC).isoformat(timespec="seconds")


async def health(ch: grpc.aio.Channel, service: str, deadline: Deadline) -> str:
    r = await health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=deadline.left(), wait_for_ready=False
    )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))


# ---- Controller ----------------------------------------------------------------------------


def instance_counts(instances: list[common_pb2.Instance]) -> dict[str, dict[str, int]]:
    counts = {role: {enums.status_name(s): 0 for s in STATUSES} for role in enums.ROLE_NAMES.values()}
    for i in instances:
        role = enums.ROLE_NAMES.get(i.role)
        status = enums.status_name(i.status)
        if role is not None and status in counts[role]:
            counts[role][status] += 1
    return counts


def desired_counts(
    listed: controller_pb2.ListDesiredInstancesResponse, counts: dict[str, dict[str, int]] | None
) -> dict[str, dict[str, Any]]:
    """Each role with a recorded desired count: the count, when it was set, and how many of its
    instances are running (live: every status but DELETED; None when the instances are unknown)."""
    out: dict[str, dict[str, Any]] = {}
    for d in listed.desired:
        e = desired_entry(d)
        running = None if counts is None else sum(counts.get(e["role"], {}).values())
        out[e["role"]] = {"replicas": e["replicas"], "running": running, "update_time": e["update_time"]}
    return out


def recovery_entry(e: controller_pb2.FaultToleranceEntry) -> dict[str, Any]:
    return {
        "instance_id": e.instance_id,
        "fault_level": e.fault_level,
        "strategy": e.strategy,
        "phase": e.phase,
        "since": iso(e.since) if e.HasField("since") else None,
        "last_outcome": e.history[-1] if e.history else None,
    }


def planner_entry(got: controller_pb2.GetPlannerStatusResponse) -> dict[str, Any]:
    """The planner's mode, its last decision with the measurements and predictions it was made
    on, the switches in progress and the cooldowns. While it is off, the mode and nothing else."""
    off = got.mode == "off"
    return {
        "mode": got.mode,
        "decision": got.decision or None,
        "reason": got.reason or None,
        "decide_time": iso(got.decide_time) if got.HasField("decide_time") else None,
        "predicted_attainment": None if off else round(got.predicted_attainment, 3),
        "recommended_attainment": None if off else round(got.recommended_attainment, 3),
        # -1: no interval measured yet.
        "measured_attainment": (
            None if off or got.measured_attainment < 0 else round(got.measured_attainment, 3)
        ),
        "roles": {
            enums.ROLE_NAMES.get(r.role, str(r.role)): {
                "instances": r.instances,
                "recommended": r.recommended,
                # 0: no request measured in the last interval.
                "latency_p90_ms": round(r.latency_p90_ms, 1),
                "target_ms": r.target_ms,
                "demand": round(r.demand, 3),
                # 0: not learned yet.
                "capacity_per_instance": round(r.capacity_per_instance, 3),
            }
            for r in got.roles
        },
        "switches": [
            {
                "instance_id": w.instance_id,
                "from": enums.ROLE_NAMES.get(w.from_role, str(w.from_role)),
                "to": enums.ROLE_NAMES.get(w.to_role, str(w.to_role)),
                "phase": w.phase,
                "since": iso(w.start_time) if w.HasField("start_time") else None,
                "reason": w.reason,
            }
            for w in got.switches
        ],
        "cooldowns": [
            {"instance_id": c.instance_id, "until": iso(c.end_time) if c.HasField("end_time") else None}
            for c in got.cooldowns
        ],
    }


def alarm_entry(a: alarm_pb2.Alarm) -> dict[str, Any]:
    return {
        "sequence": a.sequence,
        "alarm_id": a.alarm_id,
        "severity": enums.enum_name(alarm_pb2.Severity, a.severity, "SEVERITY_"),
        "instance_id": a.instance_id,
        "reason": a.reason,
        "time": iso(a.occur_time) if a.HasField("occur_time") else None,
    }


def most_severe(active: list[alarm_pb2.Alarm]) -> list[alarm_pb2.Alarm]:
    """CRITICAL first (severity 1; unset last), the newest first within a severity."""
    return sorted(active, key=lambda a: (a.severity or 99, -a.sequence))[:MOST_SEVERE]


async def controller_part(
    args: argparse.Namespace, key: str | None, deadline: Deadline
) -> tuple[dict[str, Any], list[common_pb2.Instance] | None]:
    """The Controller's part, and its instances (None when it could not list them)."""
    part: dict[str, Any] = {
        "address": args.controller,
        "health": None,
        "error": None,
        "instances": None,
        "strategies_running": None,
        "fault_tolerance": None,
        "alarms": None,
        # Recorded desired instance counts by role; None when unknown (a Controller without
        # ListDesiredInstances, or a failed call).
        "desired": None,
        # The planner's mode, last decision, switches and cooldowns; None when unknown (a
        # Controller without GetPlannerStatus, or a failed call).
        "planner": None,
    }
    target = client.controller_target(args, key)
    try:
        # The instances first: finding them finds the leader (of several Controllers), which
        # the rest is asked of.
        listed = await attempt(
            target.call(
                "ListInstances", controller_pb2.ListInstancesRequest(), deadline.left(), wait_for_ready=False
            )
        )
        if not isinstance(listed, grpc.aio.AioRpcError):
            part["address"] = target.address
        left = deadline.left()
        served, ft, active, desired, planner = await asyncio.gather(
            attempt(health(target.channel(), "", deadline)),
            attempt(
                target.stub().GetFaultToleranceStatus(
                    controller_pb2.GetFaultToleranceStatusRequest(), timeout=left, wait_for_ready=False
                )
            ),
            attempt(
                list_alarms(target, active_only=True, alarm_id="", deadline_s=left, wait_for_ready=False)
            ),
            attempt(
                target.stub().ListDesiredInstances(
                    controller_pb2.ListDesiredInstancesRequest(), timeout=left, wait_for_ready=False
                )
            ),
            attempt(
                target.stub().GetPlannerStatus(
                    controller_pb2.GetPlannerStatusRequest(), timeout=left, wait_for_ready=False
                )
            ),
        )
    finally:
        await target.close()
    # A Controller older than ListDesiredInstances or GetPlannerStatus: nothing to show, and
    # nothing wrong.
    newer = [r for r in (desired, planner) if not unimplemented(r)]
    errors = [r for r in (listed, served, ft, active, *newer) if isinstance(r, grpc.aio.AioRpcError)]
    part["health"] = UNREACHABLE if isinstance(served, grpc.aio.AioRpcError) else served
    part["error"] = failure(errors[0]) if errors else None
    instances = None
    if isinstance(listed, controller_pb2.ListInstancesResponse):
        instances = list(listed.instances)
        part["instances"] = instance_counts(instances)
    if isinstance(ft, controller_pb2.GetFaultToleranceStatusResponse):
        # Only instances with something to say: a fault, a running strategy, or one that ran.
        entries = [e for e in ft.instances if e.fault_level or e.strategy or e.history]
        part["strategies_running"] = sum(1 for e in entries if e.strategy)
        part["fault_tolerance"] = [recovery_entry(e) for e in entries]
    if isinstance(active, list):
        part["alarms"] = {"active": len(active), "most_severe": [alarm_entry(a) for a in most_severe(active)]}
    if isinstance(desired, controller_pb2.ListDesiredInstancesResponse):
        part["desired"] = desired_counts(desired, part["instances"])
    if isinstance(planner, controller_pb2.GetPlannerStatusResponse):
        part["planner"] = planner_entry(planner)
    return part, instances


# ---- Coordinators --------------------------------------------------------------------------


def pd_groups(available: list[common_pb2.Instance]) -> list[dict[str, Any]]:
    """The routable PD groups of a Coordinator's available instances, by model and KV hand-off
    protocol: every prefill instance there can be paired with every decode instance there (an
    instance with no serving endpoint is not routed to and is left out)."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for i in available:
        if i.role not in (enums.PREFILL, enums.DECODE) or all(e.headless for e in i.endpoints):
            continue
        protocol = short_enum(
            common_pb2.PdProtocol, enums.pd_protocol_of(i.pd_protocol, i.engine_type), "PD_PROTOCOL_"
        )
        g = groups.setdefault(
            (i.model_name, protocol),
            {"model": i.model_name, "protocol": protocol.lower(), "prefill": [], "decode": []},
        )
        g["prefill" if i.role == enums.PREFILL else "decode"].append(i.id)
    return [g for _, g in sorted(groups.items()) if g["prefill"] and g["decode"]]


async def coordinator_part(
    args: argparse.Namespace, key: str | None, address: str, deadline: Deadline
) -> dict[str, Any]:
    part: dict[str, Any] = {
        "address": address,
        "health": None,
        "routable": None,
        "error": None,
        "revision": None,
        "incarnation": None,
        "instances": None,
        "routable_pd_groups": None,
        "pd_groups": None,
        "inference_workers": None,
        "inference_workers_serving": None,
        # The Controller's settings revision it applies (0: its own file's values) and the
        # Coordinators it shares its rate limits with (docs/configuration-reload.md).
        "settings_revision": None,
        "replicas": None,
    }
    async with client.channel(args, address, key, retries=False) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        served, routable, table = await asyncio.gather(
            attempt(health(ch, "motor.v1.Coordinator", deadline)),
            # "" is SERVING exactly when the Coordinator can route a request.
            attempt(health(ch, "", deadline)),
            attempt(
                stub.ListInstances(
                    coordinator_pb2.CoordinatorListInstancesRequest(),
                    timeout=deadline.left(),
                    wait_for_ready=False,
                )
            ),
        )
    errors = [r for r in (served, routable, table) if isinstance(r, grpc.aio.AioRpcError)]
    part["health"] = UNREACHABLE if isinstance(served, grpc.aio.AioRpcError) else served
    part["error"] = failure(errors[0]) if errors else None
    if isinstance(routable, str):
        part["routable"] = routable == "SERVING"
    if isinstance(table, coordinator_pb2.CoordinatorListInstancesResponse):
        groups = pd_groups(list(table.available))
        part.update(
            revision=table.revision,
            incarnation=table.incarnation,
            instances={
                "available": len(table.available),
                "unavailable": len(table.unavailable),
                "paused": len(table.paused),
            },
            routable_pd_groups=sum(len(g["prefill"]) * len(g["decode"]) for g in groups),
            pd_groups=groups,
            inference_workers=table.inference_workers,
            inference_workers_serving=table.inference_workers_serving,
            settings_revision=table.settings_revision,
            replicas=table.replicas or 1,  # 0: a Coordinator older than the field
        )
    return part


# ---- NodeManagers --------------------------------------------------------------------------


def nodemanagers_of(instances: list[common_pb2.Instance]) -> dict[str, common_pb2.Instance]:
    """Every NodeManager address the instances name, with the instance it serves."""
    found: dict[str, common_pb2.Instance] = {}
    for i in instances:
        for address in i.node_managers:
            found.setdefault(address, i)
    return dict(sorted(found.items(), key=lambda item: address_key(item[0])))


def address_key(address: str) -> tuple[str, int]:
    """``host:port`` in host order, then port order (7300 before 7310)."""
    host, _, port = address.rpartition(":")
    return (host, int(port)) if port.isdigit() else (address, 0)


def engine_entry(ep: common_pb2.Endpoint) -> dict[str, Any]:
    return {
        "endpoint": f"{ep.host}:{ep.port}",
        "pid": ep.pid,
        "status": enums.endpoint_status_name(ep.status),
        "headless": ep.headless,
        # Set while it starts (WAIT_TO_START): how long it has been at it, by the node's clock.
        "startup_elapsed_s": (
            round(ep.startup_elapsed.ToNanoseconds() / 1e9, 1) if ep.HasField("startup_elapsed") else None
        ),
        "last_output_lines": list(ep.last_output_lines),
    }


async def nodemanager_part(
    args: argparse.Namespace, key: str | None, address: str, inst: common_pb2.Instance, deadline: Deadline
) -> dict[str, Any]:
    part: dict[str, Any] = {
        "address": address,
        "error": None,
        "instance_id": inst.id,
        "role": enums.ROLE_NAMES.get(inst.role, ""),
        "ready": None,
        "engines": None,
        "started_at": None,
        "uptime_s": None,
        "restarts": None,
        "frozen": None,
        "frozen_until": None,
    }
    async with client.channel(args, address, key, retries=False) as ch:
        got = await attempt(
            nodemanager_pb2_grpc.NodeManagerStub(ch).GetStatus(
                nodemanager_pb2.GetStatusRequest(), timeout=deadline.left(), wait_for_ready=False
            )
        )
    if isinstance(got, grpc.aio.AioRpcError):
        part["error"] = failure(got)
        return part
    now = time.time()
    part.update(
        instance_id=got.instance_id or inst.id,
        ready=got.ready,
        engines=[engine_entry(e) for e in got.endpoints],
        restarts=got.relaunch_count,
    )
    if got.incarnation:
        # The incarnation is the wall clock, in nanoseconds, when the NodeManager started.
        started = got.incarnation / 1e9
        part["started_at"] = datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds")
        part["uptime_s"] = round(max(0.0, now - started), 1)
    # Frozen: the NodeManager holds back its suicide fallback (a relaunch is under way).
    part["frozen"] = got.HasField("frozen_until") and got.frozen_until.ToNanoseconds() / 1e9 > now
    if part["frozen"]:
        part["frozen_until"] = iso(got.frozen_until)
    return part


# ---- the whole ------------------------------------------------------------------------------


async def collect(args: argparse.Namespace, key: str | None) -> dict[str, Any]:
    deadline = Deadline(args.timeout)

    async def controller_and_nodes() -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
        part, instances = await controller_part(args, key, deadline)
        if instances is None:
            return part, None
        nodes = nodemanagers_of(instances)
        return part, list(
            await asyncio.gather(*(nodemanager_part(args, key, a, i, deadline) for a, i in nodes.items()))
        )

    (controller, nodemanagers), coordinators = await asyncio.gather(
        controller_and_nodes(),
        asyncio.gather(*(coordinator_part(args, key, a, deadline) for a in args.coordinator)),
    )
    parts = [controller, *coordinators, *(nodemanagers or [])]
    return {
        "ok": all(p["error"] is None for p in parts),
        "controller": controller,
        "coordinators": list(coordinators),
        # null: the Controller did not say which NodeManagers there are.
        "nodemanagers": nodemanagers,
    }


async def status(args: argparse.Namespace, key: str | None) -> int:
    doc = await collect(args, key)
    if args.output == "json":
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join(status_table.render(doc, time.time())))
    failed = [
        f"{what} {p['address']} ({p['error']['code']})"
        for what, parts in (
            ("Controller", [doc["controller"]]),
            ("Coordinator", doc["coordinators"]),
            ("NodeManager", doc["nodemanagers"] or []),
        )
        for p in parts
        if p["error"] is not None
    ]
    if failed:
        print(f"motor status: not every part answered: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="motor status",
        description="The Controller, every Coordinator and every NodeManager on one screen; "
        "--timeout bounds the whole command.",
    )
    client.add_flags(p, coordinators=True)
    args = p.parse_args(argv)
    return run("status", args, lambda key: status(args, key))
