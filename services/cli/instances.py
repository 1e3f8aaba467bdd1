"""``motor instances [--watch]``: the Controller's live instances, once or followed.

The watch is level-triggered, like ``kubectl get -w``: it polls ListInstances and prints what
differs between two snapshots (an instance added, changed or gone), so a state an instance
passes through between two polls is not shown, but the latest one always is. It outlives a
Controller restart: the outage and the recovery are one stderr line each, and the first answer
after it is compared with the last one before; with several Controllers it follows the leader
(the lines name the Controller lost and the one answering again)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterator
from typing import Literal

import grpc

from motor_mesh.cli import client
from motor_mesh.cli.views import (
    INSTANCE_HEADER,
    aligned,
    as_dict,
    column_widths,
    instance_row,
    instance_rows,
    parser,
    print_table,
    run,
)
from motor_mesh.common.leader_target import ControllerTarget
from motor_mesh.common.retry import TERMINAL_CODES, Backoff
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2

# Polling again after a failed ListInstances: from 0.2 s, doubling up to 5 s.
RETRY = (0.2, 5.0)

# ROLE fits PREFILL, STATUS fits INACTIVE and DELETED.
LEAST_WIDTHS = [0, 7, 8, 0, 0, 0]

Change = Literal["ADDED", "MODIFIED", "DELETED"]
Snapshot = dict[int, common_pb2.Instance]


def changes(before: Snapshot, after: Snapshot) -> Iterator[tuple[Change, common_pb2.Instance]]:
    """What turns ``before`` into ``after``, by instance id: any difference in an instance
    (status, an endpoint's status or pid, its NodeManagers) is MODIFIED; a removed one is given
    as last seen."""
    for iid in sorted(before.keys() | after.keys()):
        old, new = before.get(iid), after.get(iid)
        if old is None and new is not None:
            yield "ADDED", new
        elif new is None and old is not None:
            yield "DELETED", old
        elif new is not None and new != old:
            yield "MODIFIED", new


async def list_instances(
    target: ControllerTarget, deadline_s: float, *, wait_for_ready: bool | None = None
) -> Snapshot:
    resp = await target.call(
        "ListInstances", controller_pb2.ListInstancesRequest(), deadline_s, wait_for_ready=wait_for_ready
    )
    return {i.id: i for i in resp.instances}


class Printer:
    """Table rows aligned to the first table's columns, or JSON lines ``{"type", "instance"}``."""

    def __init__(self, as_json: bool, first: Snapshot) -> None:
        self.as_json = as_json
        widths = column_widths([INSTANCE_HEADER] + [instance_row(i) for i in first.values()])
        # Room for every role and status a later line may show (INACTIVE after ACTIVE).
        self.widths = [max(w, least) for w, least in zip(widths, LEAST_WIDTHS, strict=True)]

    def header(self) -> None:
        if not self.as_json:
            print(aligned(INSTANCE_HEADER, self.widths), flush=True)

    def emit(self, change: Change, inst: common_pb2.Instance) -> None:
        if self.as_json:
            line = json.dumps({"type": change, "instance": as_dict(inst)})
        else:
            line = aligned(instance_row(inst, "DELETED" if change == "DELETED" else ""), self.widths)
        print(line, flush=True)


async def watch(args: argparse.Namespace, target: ControllerTarget) -> int:
    seen = await list_instances(target, args.timeout)
    out = Printer(args.output == "json", seen)
    out.header()
    for change, inst in changes({}, seen):
        out.emit(change, inst)
    backoff = Backoff(*RETRY)
    lost = False
    delay = args.interval
    while True:
        await asyncio.sleep(delay)
        try:
            # Not waiting for a connection: a Controller that is down is told at once.
            asked = target.address
            now = await list_instances(target, args.timeout, wait_for_ready=False)
        except grpc.aio.AioRpcError as err:
            if err.code() in TERMINAL_CODES:
                raise
            if not lost:
                lost = True
                print(
                    f"motor instances: lost the Controller at {asked} ({err.code().name}); retrying",
                    file=sys.stderr,
                    flush=True,
                )
            delay = backoff.next()
            continue
        if lost:
            lost = False
            backoff.reset()
            print(
                f"motor instances: the Controller at {target.address} answers again",
                file=sys.stderr,
                flush=True,
            )
        for change, inst in changes(seen, now):
            out.emit(change, inst)
        seen, delay = now, args.interval


async def instances(args: argparse.Namespace, key: str | None) -> int:
    target = client.controller_target(args, key)
    try:
        if args.watch:
            return await watch(args, target)
        found = await list_instances(target, args.timeout)
    finally:
        await target.close()
    if args.output == "json":
        print(json.dumps([as_dict(i) for i in found.values()], indent=2))
    else:
        print_table(instance_rows(found.values()))
    return 0


def _interval(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be above 0")
    return value


def main(argv: list[str]) -> int:
    p = parser("instances")
    p.add_argument(
        "-w",
        "--watch",
        action="store_true",
        help="print the table, then one line per instance added, changed or removed (JSON lines "
        "{type, instance} with -o json); polls the Controller and survives its restart",
    )
    p.add_argument(
        "--interval", type=_interval, default=1.0, metavar="S", help="with --watch: seconds between polls"
    )
    args = p.parse_args(argv)
    return run("instances", args, lambda key: instances(args, key))
