"""``motor scale``: how many instances of a role the cluster should have, recorded in the
Controller (SetDesiredInstances), or the counts recorded so far (``--list``).

The Controller stores the count (it survives a restart and a change of leader) and exports it as
``motor_desired_instances{role}``; it launches nothing itself. What runs the processes acts on
it: ``motor up`` while it runs starts instances or drains and stops the highest-numbered ones,
and in Kubernetes an HPA or KEDA scales the role's StatefulSet to follow the metric.

Exit codes: 0 done, 1 the call failed (one line on stderr), 2 bad usage (one line on stderr),
130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC
from typing import Any, NoReturn

import grpc

from motor_mesh.cli import client
from motor_mesh.cli.views import print_table
from motor_mesh.common import enums, errors
from motor_mesh.common.config import ConfigError
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2

PROG = "motor scale"
# The Controller's bound (SetDesiredInstances answers INVALID_ARGUMENT above it).
MAX_REPLICAS = 1024
HEADER = ["ROLE", "DESIRED", "SET_AT"]


class Usage(Exception):
    """Bad usage: the one line to print (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise Usage(message)


def _replicas(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of instances, got {text!r}") from None
    if not 0 <= value <= MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"must be 0..{MAX_REPLICAS}, got {text!r}")
    return value


def parse(argv: list[str]) -> argparse.Namespace:
    p = _Parser(
        prog=PROG,
        description="Record in the Controller how many instances of a role the cluster should have "
        "(motor up, or an HPA/KEDA following motor_desired_instances{role}, acts on it), or list "
        "the counts recorded so far (--list, the default without --role).",
        epilog="Exit codes: 0 done, 1 the call failed, 2 bad usage.",
    )
    p.add_argument("--role", choices=list(enums.ROLES_BY_NAME), help="the role to set the count of")
    p.add_argument(
        "--replicas",
        type=_replicas,
        metavar="N",
        help=f"instances of the role the cluster should have, 0..{MAX_REPLICAS} (an instance spanning "
        "several nodes counts once)",
    )
    p.add_argument("--list", action="store_true", help="print the recorded counts (the default)")
    client.add_flags(p, coordinator=False)
    args = p.parse_args(argv)
    if args.list and (args.role or args.replicas is not None):
        p.error("--list takes no --role or --replicas")
    if args.role and args.replicas is None:
        p.error("--role needs --replicas N")
    if args.replicas is not None and not args.role:
        p.error("--replicas needs --role prefill|decode|union")
    return args


def role_name(role: enums.Role) -> str:
    return enums.ROLE_NAMES.get(role) or enums.enum_name(common_pb2.Role, role, "ROLE_").lower()


def entry(d: controller_pb2.DesiredInstances) -> dict[str, Any]:
    """One recorded count as ``-o json`` prints it (``motor status`` the same)."""
    when = (
        d.update_time.ToDatetime(tzinfo=UTC).isoformat(timespec="seconds")
        if d.HasField("update_time")
        else None
    )
    return {"role": role_name(d.role), "replicas": d.replicas, "update_time": when}


def line(d: controller_pb2.DesiredInstances) -> str:
    return f"{role_name(d.role)}: {d.replicas} instance{'' if d.replicas == 1 else 's'} desired"


async def run(args: argparse.Namespace, key: str | None) -> int:
    target = client.controller_target(args, key)
    try:
        if args.role:
            req = controller_pb2.SetDesiredInstancesRequest(
                role=enums.ROLES_BY_NAME[args.role], replicas=args.replicas
            )
            resp = await target.call("SetDesiredInstances", req, args.timeout)
            print(json.dumps(entry(resp.desired)) if args.output == "json" else line(resp.desired))
            return 0
        listed = await target.call(
            "ListDesiredInstances", controller_pb2.ListDesiredInstancesRequest(), args.timeout
        )
    finally:
        await target.close()
    found = list(listed.desired)
    if args.output == "json":
        print(json.dumps([entry(d) for d in found], indent=2))
    elif not found:
        print("no desired instance counts recorded (motor scale --role ROLE --replicas N records one)")
    else:
        rows = [[e["role"], str(e["replicas"]), e["update_time"] or "-"] for e in map(entry, found)]
        print_table([HEADER, *rows])
    return 0


def failure_line(address: str, err: grpc.aio.AioRpcError) -> str:
    failure = errors.RpcFailure.of(err)
    if failure.reason == "STATE_WRITE_FAILED":
        return f"{PROG}: the Controller at {address} could not store it, nothing changed ({failure.message})"
    if err.code() == grpc.StatusCode.UNIMPLEMENTED:
        return (
            f"{PROG}: the Controller at {address} records no desired counts (UNIMPLEMENTED: an older version)"
        )
    return client.rpc_error_line(PROG, "Controller", address, err)


def main(argv: list[str]) -> int:
    try:
        args = parse(argv)
    except Usage as err:
        print(f"{PROG}: {err} (see {PROG} --help)", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(args, client.key_of(args)))
    except ConfigError as err:
        print(f"{PROG}: {err.errors[0]}", file=sys.stderr)
    except grpc.aio.AioRpcError as err:
        print(failure_line(args.controller, err), file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return 1
