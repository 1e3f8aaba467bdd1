"""``motor drain ID [ID...]``: take instances out of routing for a planned stop, on every
Coordinator given, and wait until no request is left on them.

Each Coordinator is sent ``DrainInstances``: from then on no new request goes to the instances,
and the requests still on them finish there or, after the grace (``--grace``, else the
Coordinator's ``coordinator.drain_grace_s``), continue on another instance of their role. The
command prints one line per instance (when its requests move, how many are in flight, over every
Coordinator), then, unless ``--no-wait``, asks again every ``POLL_S`` (a second drain keeps the
first deadline, so asking again only reports) until every Coordinator reports nothing in flight
on any of them, and prints a final line. ``--nodemanager H:P`` drains the instance that
NodeManager serves (what a Kubernetes preStop hook knows: its own pod).

The drain is the Coordinators': it ends when the Controller deletes the instance (stopping it:
``TerminateInstance``, which drains by itself first), when its engines come back as other
processes, or when ``ResumeInstances`` names it. ``motor drain`` stops nothing.

Exit codes: 0 drained (or, with ``--no-wait``, the drain started), 1 a call failed or
``--max-wait`` passed (one line on stderr), 2 bad usage, 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import grpc
from google.rpc import error_details_pb2

from motor_mesh.cli import client
from motor_mesh.common import dns, errors
from motor_mesh.common.config import ConfigError
from motor_mesh.gen.motor.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    nodemanager_pb2,
    nodemanager_pb2_grpc,
)

PROG = "motor drain"
POLL_S = 0.5
# While waiting, a Coordinator that does not answer is asked again: these say it is (for now)
# not there, not that the drain is refused.
TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class Failed(Exception):
    """The one line to print on stderr (exit 1)."""


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value < 1e9:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text!r}")
    return value


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Take instances out of routing on every Coordinator given and wait until no "
        "request is left on them: the ones in flight finish where they are or, after the grace, "
        "continue on another instance. Stops nothing (TerminateInstance drains by itself first).",
        epilog="Exit codes: 0 drained (with --no-wait: the drain started), 1 a call failed or "
        "--max-wait passed, 2 bad usage.",
    )
    p.add_argument(
        "ids", nargs="*", type=client.instance_id, metavar="ID", help="instance ids (decimal or 0x hex)"
    )
    # Every Coordinator routes, so every one must drain.
    p.add_argument(
        "--coordinator",
        type=client.addresses,
        default=["127.0.0.1:7200"],
        metavar="H:P[,H:P...]",
        help="every Coordinator, comma-separated; dns:///NAME:PORT stands for every address NAME "
        "resolves to (a headless Service)",
    )
    client.add_flags(p, controller=False, coordinator=False)
    p.add_argument(
        "--grace",
        type=_seconds,
        metavar="S",
        help="how long requests may finish where they are before they move; 0 = at once "
        "(default: each Coordinator's coordinator.drain_grace_s). Ignored for an instance "
        "already draining",
    )
    p.add_argument("--no-wait", action="store_true", help="start the drain, print it, and exit")
    p.add_argument(
        "--nodemanager",
        metavar="H:P",
        help="also drain the instance this NodeManager serves (its GetStatus instance_id)",
    )
    p.add_argument(
        "--max-wait",
        type=_seconds,
        default=0.0,
        metavar="S",
        help="give up waiting after S seconds (exit 1; the drain stays); 0 = wait until drained",
    )
    args = p.parse_args(argv)
    if not args.ids and not args.nodemanager:
        p.error("name at least one instance ID (or --nodemanager)")
    if len(set(args.ids)) != len(args.ids):
        p.error("an instance ID is named twice")
    return args


# ---- one Coordinator -----------------------------------------------------------------------


@dataclass
class Drain:
    """One instance on one Coordinator, as last reported."""

    move_at: float = 0.0  # wall clock; 0 = not said
    in_flight: int = 0
    gone: bool = False  # the Coordinator no longer holds it: nothing of it is left there


class Coordinator:
    def __init__(self, args: argparse.Namespace, address: str, key: str | None) -> None:
        self.address = address
        self.channel = client.channel(args, address, key)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.timeout = args.timeout
        self.grace: float | None = args.grace
        self.drains: dict[int, Drain] = {}
        self.lost = False  # a call while waiting failed; said once on stderr

    async def drain(self, ids: list[int], *, first: bool) -> None:
        """DrainInstances of the ids it still holds. While waiting (not ``first``), an id it
        answers NOT_FOUND for is gone from it (deleted meanwhile), and it is asked again
        without it."""
        asked = [i for i in ids if not self.drains.get(i, Drain()).gone]
        while asked:
            req = coordinator_pb2.DrainInstancesRequest(ids=asked)
            if self.grace is not None:
                req.grace.FromNanoseconds(int(self.grace * 1e9))
            try:
                resp = await self.stub.DrainInstances(req, timeout=self.timeout, wait_for_ready=False)
            except grpc.aio.AioRpcError as err:
                missing = _missing_id(err)
                if first or missing not in asked:
                    raise
                self.drains.setdefault(missing, Drain()).gone = True
                self.drains[missing].in_flight = 0
                asked.remove(missing)
                continue
            for d in resp.drains:
                entry = self.drains.setdefault(d.instance_id, Drain())
                entry.in_flight = d.requests_in_flight
                if d.HasField("move_time"):
                    entry.move_at = d.move_time.ToNanoseconds() / 1e9
            return

    async def close(self) -> None:
        await self.channel.close()


def _missing_id(err: grpc.aio.AioRpcError) -> int | None:
    """The instance id a NOT_FOUND names (its ResourceInfo)."""
    if err.code() != grpc.StatusCode.NOT_FOUND:
        return None
    for d in errors.details_of(err):
        if isinstance(d, error_details_pb2.ResourceInfo) and d.resource_name.isdigit():
            return int(d.resource_name)
    return None


def failure_line(address: str, err: grpc.aio.AioRpcError) -> str:
    missing = _missing_id(err)
    if missing is not None:
        return f"{PROG}: the Coordinator at {address} holds no instance {missing} (NOT_FOUND)"
    if err.code() == grpc.StatusCode.UNIMPLEMENTED:
        return f"{PROG}: the Coordinator at {address} cannot drain (UNIMPLEMENTED: an older version)"
    return client.rpc_error_line(PROG, "Coordinator", address, err)


# ---- what is printed -----------------------------------------------------------------------


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Summary:
    """One instance over every Coordinator: the latest move time, the requests in flight."""

    instance_id: int
    move_at: float
    in_flight: int
    per_coordinator: dict[str, Drain]

    def line(self, now: float) -> str:
        if self.move_at > now:
            moves = f"requests move at {iso(self.move_at)} (in {self.move_at - now:.0f}s)"
        elif self.move_at:
            moves = f"requests moved at {iso(self.move_at)}"
        else:
            moves = "requests move: not said"
        return f"instance {self.instance_id}: {moves}, {self.in_flight} in flight"

    def document(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "move_time": iso(self.move_at) if self.move_at else None,
            "requests_in_flight": self.in_flight,
            "coordinators": [
                {
                    "address": a,
                    "move_time": iso(d.move_at) if d.move_at else None,
                    "requests_in_flight": d.in_flight,
                    "holds": not d.gone,
                }
                for a, d in self.per_coordinator.items()
            ],
        }


def summaries(ids: list[int], coordinators: list[Coordinator]) -> list[Summary]:
    out = []
    for iid in ids:
        per = {c.address: c.drains.get(iid, Drain()) for c in coordinators}
        moves = [d.move_at for d in per.values() if d.move_at and not d.gone]
        out.append(Summary(iid, max(moves, default=0.0), sum(d.in_flight for d in per.values()), per))
    return out


class Printer:
    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.shown: dict[int, int] = {}  # in flight last printed, by instance

    def state(self, found: list[Summary], now: float, *, changes_only: bool) -> None:
        for s in found:
            if changes_only and self.shown.get(s.instance_id) == s.in_flight:
                continue
            self.shown[s.instance_id] = s.in_flight
            if self.as_json:
                print(json.dumps(s.document()), flush=True)
            elif changes_only:
                left = "drained" if not s.in_flight else f"{s.in_flight} in flight"
                print(f"instance {s.instance_id}: {left}", flush=True)
            else:
                print(s.line(now), flush=True)

    def done(self, ids: list[int], coordinators: int, seconds: float) -> None:
        if self.as_json:
            print(
                json.dumps({"drained": True, "instance_ids": ids, "seconds": round(seconds, 1)}), flush=True
            )
            return
        names = " ".join(str(i) for i in ids)
        print(
            f"drained: nothing in flight on instance(s) {names} on {coordinators} Coordinator(s) "
            f"after {seconds:.1f}s",
            flush=True,
        )


# ---- the command ---------------------------------------------------------------------------


async def coordinator_addresses(entries: list[str]) -> list[str]:
    """``--coordinator``, every ``dns:///NAME:PORT`` expanded to the addresses NAME has."""
    found: list[str] = []
    for entry in entries:
        named = dns.split_entry(entry)
        if named is None:
            found.append(entry)
            continue
        try:
            addresses = await dns.resolve(*named)
        except OSError as exc:
            raise Failed(f"{PROG}: cannot resolve {entry}: {exc}") from None
        if not addresses:
            raise Failed(f"{PROG}: no Coordinator at {entry} (the name has no address)")
        found += addresses
    return list(dict.fromkeys(found))


async def nodemanager_instance(args: argparse.Namespace, key: str | None) -> int:
    async with client.channel(args, args.nodemanager, key) as ch:
        try:
            status = await nodemanager_pb2_grpc.NodeManagerStub(ch).GetStatus(
                nodemanager_pb2.GetStatusRequest(), timeout=args.timeout, wait_for_ready=False
            )
        except grpc.aio.AioRpcError as err:
            raise Failed(client.rpc_error_line(PROG, "NodeManager", args.nodemanager, err)) from None
    if not status.instance_id:
        raise Failed(f"{PROG}: the NodeManager at {args.nodemanager} serves no instance yet")
    return int(status.instance_id)


async def ask_all(coordinators: list[Coordinator], ids: list[int], *, first: bool) -> None:
    """Every Coordinator at once. The first round fails on any error; later ones ask a
    Coordinator that does not answer again next time (one stderr line per outage)."""
    results = await asyncio.gather(*(c.drain(ids, first=first) for c in coordinators), return_exceptions=True)
    for c, r in zip(coordinators, results, strict=True):
        if isinstance(r, grpc.aio.AioRpcError):
            if first or r.code() not in TRANSIENT:
                raise Failed(failure_line(c.address, r))
            if not c.lost:
                c.lost = True
                print(
                    f"{PROG}: lost the Coordinator at {c.address} ({r.code().name}); retrying",
                    file=sys.stderr,
                )
        elif isinstance(r, BaseException):
            raise r
        elif c.lost:
            c.lost = False
            print(f"{PROG}: the Coordinator at {c.address} answers again", file=sys.stderr)


async def run(args: argparse.Namespace, key: str | None) -> int:
    ids = list(args.ids)
    if args.nodemanager:
        own = await nodemanager_instance(args, key)
        if own not in ids:
            ids.append(own)
    addresses = await coordinator_addresses(args.coordinator)
    coordinators = [Coordinator(args, a, key) for a in addresses]
    out = Printer(args.output == "json")
    started = time.monotonic()
    try:
        await ask_all(coordinators, ids, first=True)
        out.state(summaries(ids, coordinators), time.time(), changes_only=False)
        if args.no_wait:
            return 0
        while True:
            found = summaries(ids, coordinators)
            waited = time.monotonic() - started
            if not any(s.in_flight for s in found) and not any(c.lost for c in coordinators):
                out.done(ids, len(coordinators), waited)
                return 0
            if args.max_wait and waited >= args.max_wait:
                left = ", ".join(f"{s.in_flight} on instance {s.instance_id}" for s in found if s.in_flight)
                left = left or "a Coordinator does not answer"
                raise Failed(f"{PROG}: still in flight after {args.max_wait:g}s: {left} (the drain stays)")
            await asyncio.sleep(POLL_S)
            await ask_all(coordinators, ids, first=False)
            out.state(summaries(ids, coordinators), time.time(), changes_only=True)
    finally:
        await asyncio.gather(*(c.close() for c in coordinators), return_exceptions=True)


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        return asyncio.run(run(args, client.key_of(args)))
    except Failed as err:
        print(str(err), file=sys.stderr)
    except ConfigError as err:
        print(f"{PROG}: {err.errors[0]}", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return 1
