"""Operator views: ``motor instances``, ``motor alarms [--watch]``, ``motor status`` (with the
fault manager's level, strategy and last outcome of every instance that has any)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from motor.v1 import (
    alarm_pb2,
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    coordinator_pb2,
    coordinator_pb2_grpc,
)

from services.cli import client
from services.common import enums
from services.common.config import ConfigError

if TYPE_CHECKING:
    from google.protobuf.internal.enum_type_wrapper import _EnumTypeWrapper

MULTI_COMMAND = True
_V = TypeVar("_V", bound=int)


def as_dict(msg: Message) -> dict[str, Any]:
    return MessageToDict(msg, preserving_proto_field_name=True)


def short_enum(enum: _EnumTypeWrapper[_V], value: _V, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix)


def endpoint_text(ep: common_pb2.Endpoint) -> str:
    status = enums.endpoint_status_name(ep.status)
    extra = (f",pid={ep.pid}" if ep.pid else "") + (",headless" if ep.headless else "")
    return f"{ep.host}:{ep.port}({status}{extra})"


def instance_rows(instances: Iterable[common_pb2.Instance]) -> list[list[str]]:
    rows = [["ID", "ROLE", "STATUS", "MODEL", "JOB", "ENDPOINTS"]]
    for i in instances:
        rows.append(
            [
                str(i.id),
                short_enum(common_pb2.Role, i.role, "ROLE_"),
                enums.status_name(i.status),
                i.model_name,
                i.job_name,
                " ".join(endpoint_text(e) for e in i.endpoints),
            ]
        )
    return rows


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


async def instances(args: argparse.Namespace, key: str | None) -> int:
    async with client.channel(args, args.controller, key) as ch:
        resp = await controller_pb2_grpc.ControllerStub(ch).ListInstances(
            controller_pb2.ListInstancesRequest(), timeout=args.timeout
        )
    if args.output == "json":
        print(json.dumps(as_dict(resp).get("instances", []), indent=2))
    else:
        print_table(instance_rows(resp.instances))
    return 0


async def alarms(args: argparse.Namespace, key: str | None) -> int:
    async with client.channel(args, args.controller, key) as ch:
        stub = controller_pb2_grpc.ControllerStub(ch)
        if args.watch:
            async for item in stub.WatchAlarms(controller_pb2.WatchAlarmsRequest(after_sequence=args.after)):
                print(json.dumps(as_dict(item.alarm)), flush=True)
            return 0
        resp = await stub.ListAlarms(
            controller_pb2.ListAlarmsRequest(active_only=args.active), timeout=args.timeout
        )
    if args.output == "json":
        print(json.dumps(as_dict(resp).get("alarms", []), indent=2))
        return 0
    rows = [["SEQ", "CATEGORY", "SEVERITY", "ALARM_ID", "INSTANCE", "MOI"]]
    for a in resp.alarms:
        rows.append(
            [
                str(a.sequence),
                short_enum(alarm_pb2.AlarmCategory, a.category, "ALARM_CATEGORY_"),
                short_enum(alarm_pb2.Severity, a.severity, "SEVERITY_"),
                a.alarm_id,
                str(a.instance_id),
                a.moi,
            ]
        )
    print_table(rows)
    return 0


async def _health(ch: grpc.aio.Channel, deadline_s: float) -> str:
    try:
        r = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=deadline_s, wait_for_ready=False
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
    except grpc.aio.AioRpcError as err:
        return f"UNREACHABLE ({err.code().name})"


async def status(args: argparse.Namespace, key: str | None) -> int:
    out: dict[str, Any] = {}
    faults: list[controller_pb2.FaultToleranceEntry] = []
    async with client.channel(args, args.controller, key) as ch:
        out["controller"] = {"address": args.controller, "health": await _health(ch, args.timeout)}
        if out["controller"]["health"] == "SERVING":
            resp = await controller_pb2_grpc.ControllerStub(ch).ListInstances(
                controller_pb2.ListInstancesRequest(), timeout=args.timeout
            )
            counts: dict[str, int] = {}
            for i in resp.instances:
                s = enums.status_name(i.status)
                counts[s] = counts.get(s, 0) + 1
            out["controller"]["instances"] = counts
            ft = await controller_pb2_grpc.ControllerStub(ch).GetFaultToleranceStatus(
                controller_pb2.GetFaultToleranceStatusRequest(), timeout=args.timeout
            )
            # Only instances with something to say: a fault, a strategy, or one that ran.
            faults = [e for e in ft.instances if e.fault_level or e.strategy or e.history]
    async with client.channel(args, args.coordinator, key) as ch:
        health = await _health(ch, args.timeout)
        out["coordinator"] = {"address": args.coordinator, "routable": health == "SERVING", "health": health}
        if not health.startswith("UNREACHABLE"):
            table = await coordinator_pb2_grpc.CoordinatorStub(ch).ListInstances(
                coordinator_pb2.CoordinatorListInstancesRequest(), timeout=args.timeout
            )
            out["coordinator"].update(
                revision=table.revision,
                incarnation=table.incarnation,
                available=len(table.available),
                unavailable=len(table.unavailable),
                paused=len(table.paused),
            )
    if args.output == "json":
        print(json.dumps({**out, "faults": [as_dict(e) for e in faults]}, indent=2))
    else:
        for name, fields in out.items():
            print(f"{name}: " + " ".join(f"{k}={v}" for k, v in fields.items()))
        for e in faults:
            running = f" strategy={e.strategy} phase={e.phase}" if e.strategy else ""
            last = f" last={e.history[-1]!r}" if e.history else ""
            print(f"instance {e.instance_id}: fault_level=L{e.fault_level}{running}{last}")
    return 0 if not any(str(v.get("health", "")).startswith("UNREACHABLE") for v in out.values()) else 1


COMMANDS = {"instances": instances, "alarms": alarms, "status": status}


def main(argv: list[str]) -> int:
    name, rest = argv[0], argv[1:]
    p = argparse.ArgumentParser(prog=f"motor {name}")
    client.add_flags(p)
    if name == "alarms":
        p.add_argument("--watch", action="store_true", help="follow new alarms (JSON lines)")
        p.add_argument(
            "--after", type=int, default=0, help="with --watch: replay history after this sequence"
        )
        p.add_argument("--active", action="store_true", help="only active alarms")
    args = p.parse_args(rest)
    try:
        return asyncio.run(COMMANDS[name](args, client.key_of(args)))
    except ConfigError as err:
        print(f"motor {name}: {err.errors[0]}", file=sys.stderr)
    except grpc.aio.AioRpcError as err:
        print(client.rpc_error_line(f"motor {name}", "Controller", args.controller, err), file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return 1
