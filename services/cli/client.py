"""What every operator command shares: the flags that say where the services are and how to
talk to them, the channel they open, and the one line printed when a call fails.

``--controller`` takes one Controller, several (comma-separated) or ``dns:///NAME:PORT``: every
call goes to the leader among them (:class:`~motor_mesh.common.leader_target.ControllerTarget`).
"""

from __future__ import annotations

import argparse

import grpc

from motor_mesh.common import errors
from motor_mesh.common.channel import ClientTLS, open_channel
from motor_mesh.common.config import read_key_file
from motor_mesh.common.leader_target import NOT_LEADER, ControllerTarget


def instance_id(text: str) -> int:
    """An argparse type: an instance id, decimal or 0x hex, 1..2^64-1."""
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an instance id (decimal or 0x hex), got {text!r}"
        ) from None
    if not 0 < value < 2**64:
        raise argparse.ArgumentTypeError(f"instance id must be 1..2^64-1, got {text!r}")
    return value


def addresses(text: str) -> list[str]:
    """``H:P[,H:P...]``: the addresses of a comma-separated list, each once, in order."""
    found = list(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    if not found:
        raise argparse.ArgumentTypeError("needs at least one H:P")
    return found


def add_flags(
    p: argparse.ArgumentParser,
    *,
    controller: bool = True,
    coordinator: bool = True,
    coordinators: bool = False,
) -> None:
    """``coordinators``: ``--coordinator`` takes a comma-separated list (``args.coordinator``
    is then a list of addresses)."""
    if controller:
        p.add_argument(
            "--controller",
            default="127.0.0.1:7100",
            metavar="H:P[,H:P...]",
            help="the Controller; with several (comma-separated, or dns:///NAME:PORT) the one "
            "leading them answers",
        )
    if coordinators:
        p.add_argument(
            "--coordinator",
            type=addresses,
            default=["127.0.0.1:7200"],
            metavar="H:P[,H:P...]",
            help="every Coordinator to show, comma-separated",
        )
    elif coordinator:
        p.add_argument("--coordinator", default="127.0.0.1:7200", metavar="H:P")
    p.add_argument("--key-file", metavar="F", help="management key file (x-motor-management-key)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="deadline of each call")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    tls = p.add_argument_group("TLS (when the services serve TLS)")
    tls.add_argument("--tls", action="store_true", help="use TLS, verifying the server with the system roots")
    tls.add_argument(
        "--tls-ca-file", metavar="F", default="", help="use TLS, verifying the server with this CA"
    )
    tls.add_argument("--tls-cert-file", metavar="F", default="", help="client certificate (mTLS)")
    tls.add_argument("--tls-key-file", metavar="F", default="", help="client certificate's key (mTLS)")


def key_of(args: argparse.Namespace) -> str | None:
    """The management key; a bad key file raises ConfigError with a one-line message."""
    return read_key_file(args.key_file) if args.key_file else None


def tls_of(args: argparse.Namespace) -> ClientTLS | None:
    if not (args.tls or args.tls_ca_file or args.tls_cert_file):
        return None
    return ClientTLS(ca_file=args.tls_ca_file, cert_file=args.tls_cert_file, key_file=args.tls_key_file)


def channel(
    args: argparse.Namespace, target: str, key: str | None, *, retries: bool = True
) -> grpc.aio.Channel:
    """``retries=False`` for a probe: a refusal is reported at once, with its cause, instead of
    being retried until the deadline hides it."""
    return open_channel(target, key=key, tls=tls_of(args), service="cli", retries=retries)


def controller_target(args: argparse.Namespace, key: str | None) -> ControllerTarget:
    """The Controllers ``--controller`` names; ``close()`` it when done."""
    return ControllerTarget(args.controller, key=key, tls=tls_of(args), service="cli")


def rpc_error_line(prog: str, peer: str, address: str, err: grpc.aio.AioRpcError) -> str:
    """The one line a command prints for a failed call to ``peer`` ("Controller"...)."""
    failure = errors.RpcFailure.of(err)
    if failure.reason == NOT_LEADER:
        return f"{prog}: no {peer} leader among {address} ({failure.message})"
    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return f"{prog}: cannot reach the {peer} at {address} ({err.code().name})"
    return f"{prog}: {err.code().name}: {err.details()}"
