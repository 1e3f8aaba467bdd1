"""``motor alarms [--all|--watch]``: the Controller's alarm store, listed page by page or
followed across Controller restarts (and, with several Controllers, to whichever leads)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC

import grpc

from motor_mesh.cli import client
from motor_mesh.cli.views import as_dict, parser, print_table, run, short_enum
from motor_mesh.common.errors import RpcFailure
from motor_mesh.common.leader_target import ControllerTarget, moves_on
from motor_mesh.common.retry import TERMINAL_CODES, Backoff
from motor_mesh.gen.motor.v1 import alarm_pb2, controller_pb2

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
    target: ControllerTarget,
    *,
    active_only: bool,
    alarm_id: str,
    deadline_s: float,
    wait_for_ready: bool | None = None,
) -> list[alarm_pb2.Alarm]:
    """Every page of ListAlarms, oldest first."""
    found: list[alarm_pb2.Alarm] = []
    token = ""
    while True:
        req = controller_pb2.ListAlarmsRequest(
            active_only=active_only, alarm_id=alarm_id, page_size=PAGE_SIZE, page_token=token
        )
        resp = await target.call("ListAlarms", req, deadline_s, wait_for_ready=wait_for_ready)
        found.extend(resp.alarms)
        token = resp.next_page_token
        if not token:
            found.reverse()
            return found


async def alarms(args: argparse.Namespace, key: str | None) -> int:
    target = client.controller_target(args, key)
    try:
        if args.watch:
            return await watch_alarms(args, target)
        found = await list_alarms(
            target, active_only=not args.all, alarm_id=args.alarm_id, deadline_s=args.timeout
        )
    finally:
        await target.close()
    if args.output == "json":
        print(json.dumps([as_dict(a) for a in found], indent=2))
    else:
        print_table([ALARM_HEADER] + [alarm_row(a) for a in found])
    return 0


async def watch_alarms(args: argparse.Namespace, target: ControllerTarget) -> int:
    """Follow WatchAlarms; a broken stream (a Controller restart, a new leader) is resumed after
    the last sequence seen, so every alarm is printed once."""

    def emit(a: alarm_pb2.Alarm) -> None:
        if not args.alarm_id or a.alarm_id == args.alarm_id:
            print(json.dumps(as_dict(a)) if args.output == "json" else alarm_line(a), flush=True)

    last = args.after
    if not last:
        # "From now on", as a sequence: what a resume after a break must start from.
        newest = await target.call("ListAlarms", controller_pb2.ListAlarmsRequest(page_size=1), args.timeout)
        last = newest.alarms[0].sequence if newest.alarms else 0
    backoff = Backoff(*WATCH_RETRY)
    resumed = False
    while True:
        try:
            if resumed and not last:
                # The store was empty when the watch began and nothing came since: all it holds
                # now is new, and after_sequence=0 would skip it.
                for a in await list_alarms(target, active_only=False, alarm_id="", deadline_s=args.timeout):
                    emit(a)
                    last = a.sequence
            # Of several Controllers, a dead one must fail at once: another may lead.
            watched = target.stub().WatchAlarms(
                controller_pb2.WatchAlarmsRequest(after_sequence=last), wait_for_ready=not target.following
            )
            async for item in watched:
                target.reached()
                if item.alarm.sequence > last:
                    emit(item.alarm)
                    last = item.alarm.sequence
                    backoff.reset()
            why = "stream ended"
            delay = backoff.next()
        except grpc.aio.AioRpcError as err:
            if err.code() in TERMINAL_CODES:
                raise
            failure = RpcFailure.of(err)
            why = err.code().name
            # Not the leader, or not there: the next Controller at once, if there is one.
            delay = target.failed(failure) if moves_on(failure) and target.following else backoff.next()
        if delay:
            print(
                f"motor alarms: watch broken ({why}); resuming after sequence {last}",
                file=sys.stderr,
                flush=True,
            )
        await asyncio.sleep(delay)
        resumed = True


def main(argv: list[str]) -> int:
    p = parser("alarms")
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
    args = p.parse_args(argv)
    if args.after and not args.watch:
        p.error("--after needs --watch")
    return run("alarms", args, lambda key: alarms(args, key))
