"""``motor faults report|clear``: node and device faults into the Controller's fault manager.

For operators and device plugins: an L3-L6 fault separates the node's instance (no routing)
until it is cleared; an L2 fault asks for its engines to be relaunched; L1 is only recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc

from motor_mesh.cli import client
from motor_mesh.common.config import ConfigError
from motor_mesh.gen.motor.v1 import controller_pb2

LEVELS = tuple(f"L{n}" for n in range(1, 7))


def _node(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT of a NodeManager, got {text!r}")
    return host.strip("[]"), int(port)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="motor faults", description=__doc__.splitlines()[0])
    client.add_flags(p, coordinator=False)
    sub = p.add_subparsers(dest="action", required=True)
    rep = sub.add_parser("report", help="record a fault on a NodeManager's node")
    rep.add_argument(
        "--node", type=_node, required=True, metavar="H:P", help="the NodeManager (host:grpc port)"
    )
    rep.add_argument("--level", choices=list(LEVELS), required=True)
    rep.add_argument("--code", default="", help="the fault's code; a node holds one fault per code")
    rep.add_argument("--reason", default="", help="free text for the log and the status")
    clr = sub.add_parser("clear", help="the node's faults are gone")
    clr.add_argument("--node", type=_node, required=True, metavar="H:P")
    clr.add_argument("--code", default="", help="only this code's fault (default: every fault of the node)")
    return p.parse_args(argv)


def request_of(args: argparse.Namespace) -> controller_pb2.ReportFaultsRequest:
    host, port = args.node
    if args.action == "clear":
        fault = controller_pb2.NodeFault(host=host, nm_port=port, code=args.code, cleared=True)
    else:
        level = controller_pb2.FaultLevel.Value(f"FAULT_LEVEL_{args.level}")
        fault = controller_pb2.NodeFault(
            host=host, nm_port=port, level=level, code=args.code, reason=args.reason
        )
    return controller_pb2.ReportFaultsRequest(faults=[fault])


async def send(args: argparse.Namespace, key: str | None) -> controller_pb2.ReportFaultsResponse:
    target = client.controller_target(args, key)
    try:
        resp: controller_pb2.ReportFaultsResponse = await target.call(
            "ReportFaults", request_of(args), args.timeout
        )
        return resp
    finally:
        await target.close()


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        resp = asyncio.run(send(args, client.key_of(args)))
    except ConfigError as err:
        print(f"motor faults: {err.errors[0]}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as err:
        print(client.rpc_error_line("motor faults", "Controller", args.controller, err), file=sys.stderr)
        return 1
    if args.output == "json":
        print(json.dumps({"affected_instance_ids": list(resp.affected_instance_ids)}))
        return 0
    ids = " ".join(str(i) for i in resp.affected_instance_ids) or "none"
    print(f"affected instances: {ids}")
    return 0
