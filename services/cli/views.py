"""Operator views: ``motor instances``, ``motor alarms [--watch]``, ``motor status`` (with the
fault manager's level, strategy and last outcome of every instance that has any)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterable
from datetime import UTC
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
from services.common.retry import TERMINAL_CODES, Backoff

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


# Alarms per ListAlarms call (the server's maximum).
PAGE_SIZE = 1000
# Reconnecting a broken watch: from 0.2 s, doubling up to 5 s.
WATCH_RETRY = (0.2, 5.0)
ALARM_HEADER = ["SEQ", "TIME", "CATEGORY", "SEVERITY", "ALARM_ID", "INSTANCE", "MOI", "REASON"]


def alarm_row(a: alarm_pb2.Alarm) -> list[str]:
    when = (
        a.occur_time.ToDatetime(tzinfo=UTC).isoformat(timespec="seconds") if a.HasField("occur_time") else "-"
    )
    return [
        str(a.sequence),
        when,
        short_enum(alarm_pb2.AlarmCategory, a.category, "ALARM_CATEGORY_"),
        short_enum(alarm_pb2.Severity, a.severity, "SEVERITY_"),
        a.alarm_id,
        str(a.instance_id),
        a.moi,
        a.reason,
    ]


def alarm_line(a: alarm_pb2.Alarm) -> str:
    """One watched alarm on one line: the table's columns, unaligned ("-" for an empty one, so
    the columns can still be told apart)."""
    return "  ".join(v or "-" for v in alarm_row(a))


async def list_alarms(
    stub: controller_pb2_grpc.ControllerAsyncStub, *, active_only: bool, alarm_id: str, deadline_s: float
) -> list[alarm_pb2.Alarm]:
    """Every page of ListAlarms, oldest first."""
    found: list[alarm_pb2.Alarm] = []
    token = ""
    while True:
        req = controller_pb2.ListAlarmsRequest(
            active_only=active_only, alarm_id=alarm_id, page_size=PAGE_SIZE, page_token=token
        )
        resp = await stub.ListAlarms(req, timeout=deadline_s)
        found.extend(resp.alarms)
        token = resp.next_page_token
        if not token:
            found.reverse()
            return found


async def alarms(args: argparse.Namespace, key: str | None) -> int:
    async with client.channel(args, args.controller, key) as ch:
        stub = controller_pb2_grpc.ControllerStub(ch)
        if args.watch:
            return await watch_alarms(args, stub)
        found = await list_alarms(
            stub, active_only=not args.all, alarm_id=args.alarm_id, deadline_s=args.timeout
        )
    if args.output == "json":
        print(json.dumps([as_dict(a) for a in found], indent=2))
    else:
        print_table([ALARM_HEADER] + [alarm_row(a) for a in found])
    return 0


async def watch_alarms(args: argparse.Namespace, stub: controller_pb2_grpc.ControllerAsyncStub) -> int:
    """Follow WatchAlarms; a broken stream (a Controller restart) is resumed after the last
    sequence seen, so every alarm is printed once."""

    def emit(a: alarm_pb2.Alarm) -> None:
        if not args.alarm_id or a.alarm_id == args.alarm_id:
            print(json.dumps(as_dict(a)) if args.output == "json" else alarm_line(a), flush=True)

    last = args.after
    if not last:
        # "From now on", as a sequence: what a resume after a break must start from.
        newest = await stub.ListAlarms(controller_pb2.ListAlarmsRequest(page_size=1), timeout=args.timeout)
        last = newest.alarms[0].sequence if newest.alarms else 0
    backoff = Backoff(*WATCH_RETRY)
    resumed = False
    while True:
        try:
            if resumed and not last:
                # The store was empty when the watch began and nothing came since: all it holds
                # now is new, and after_sequence=0 would skip it.
                for a in await list_alarms(stub, active_only=False, alarm_id="", deadline_s=args.timeout):
                    emit(a)
                    last = a.sequence
            async for item in stub.WatchAlarms(controller_pb2.WatchAlarmsRequest(after_sequence=last)):
                if item.alarm.sequence > last:
                    emit(item.alarm)
                    last = item.alarm.sequence
                    backoff.reset()
            why = "stream ended"
        except grpc.aio.AioRpcError as err:
            if err.code() in TERMINAL_CODES:
                raise
            why = err.code().name
        delay = backoff.next()
        print(
            f"motor alarms: watch broken ({why}); resuming after sequence {last}", file=sys.stderr, flush=True
        )
        await asyncio.sleep(delay)
        resumed = True


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
        which = p.add_mutually_exclusive_group()
        which.add_argument("--active", action="store_true", help="the active alarms (the default)")
        which.add_argument("--all", action="store_true", help="the history: alarms, clears and events")
        which.add_argument(
            "--watch",
            action="store_true",
            help="follow alarms, clears and events as they are stored (one line each, JSON with -o json); "
            "survives a Controller restart",
        )
        p.add_argument(
            "--after",
            type=int,
            default=0,
            metavar="N",
            help="with --watch: replay the history after sequence N first",
        )
        p.add_argument("--alarm-id", default="", metavar="ID", help='only this alarm id, e.g. "0xFC001002"')
    args = p.parse_args(rest)
    if name == "alarms" and args.after and not args.watch:
        p.error("--after needs --watch")
    try:
        return asyncio.run(COMMANDS[name](args, client.key_of(args)))
    except ConfigError as err:
        print(f"motor {name}: {err.errors[0]}", file=sys.stderr)
    except grpc.aio.AioRpcError as err:
        print(client.rpc_error_line(f"motor {name}", "Controller", args.controller, err), file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return 1
