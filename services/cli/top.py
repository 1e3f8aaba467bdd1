"""``motor top``: a live view of the engines — load, KV cache, tokens/s, latency — per role and
per instance, with the Coordinator's migrations and the Controller's active alarms.

Each refresh asks the Coordinator for its aggregated engine metrics twice (GetEngineMetrics, the
INSTANCE view with its own series, and the ROLE view) and, unless none is given, the Controller
for its instances and active alarms, all at once. top_model.py turns the answers into one
document (what ``-o json`` prints), top_view.py lays it out. A Coordinator that fails the first
refresh is one line on stderr and exit 1; later, the screen keeps the last data and says why it
is old. A Controller that does not answer only loses its part (a note says so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import grpc
from rich.console import Console
from rich.live import Live

from motor_mesh.cli import client
from motor_mesh.cli.alarms import list_alarms
from motor_mesh.cli.top_model import ControllerView, TopModel
from motor_mesh.cli.top_view import render
from motor_mesh.common import enums
from motor_mesh.common.config import ConfigError
from motor_mesh.gen.motor.v1 import controller_pb2, coordinator_pb2, coordinator_pb2_grpc

PROG = "motor top"
DEFAULT_CONTROLLER = "127.0.0.1:7100"
# The width of a view written to a file or pipe: no terminal to fit, every column whole.
PIPE_WIDTH = 200
# In live mode a Controller that hangs may hold a refresh back at most this long (or the
# interval, if longer, or --timeout, if shorter).
CONTROLLER_WAIT_S = 1.0


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}")
    return value


def coordinator_error(address: str, err: grpc.aio.AioRpcError) -> str:
    code = err.code()
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return f"{PROG}: engine metrics collection is off (coordinator.engine_metrics_interval_s = 0)"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (
            f"{PROG}: the Coordinator at {address} does not serve GetEngineMetrics (UNIMPLEMENTED): "
            "it is older than this motor"
        )
    return client.rpc_error_line(PROG, "Coordinator", address, err)


class Sources:
    """The Coordinator's channel and the Controller's target, kept across refreshes."""

    def __init__(self, args: argparse.Namespace, key: str | None) -> None:
        self.args = args
        self.channel = client.channel(args, args.coordinator, key, retries=False)
        self.coordinator = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.controller = client.controller_target(args, key) if args.controller else None

    async def close(self) -> None:
        await self.channel.close(grace=None)
        if self.controller is not None:
            await self.controller.close()

    async def engine_metrics(
        self, view: coordinator_pb2.EngineMetricsView.ValueType, *, own: bool
    ) -> coordinator_pb2.GetEngineMetricsResponse:
        req = coordinator_pb2.GetEngineMetricsRequest(view=view, include_coordinator=own)
        return await self.coordinator.GetEngineMetrics(req, timeout=self.args.timeout, wait_for_ready=False)

    async def controller_view(self) -> ControllerView:
        target = self.controller
        if target is None:
            return ControllerView()
        view = ControllerView(address=self.args.controller)
        timeout = self.args.timeout
        if not self.args.once:
            timeout = min(timeout, max(CONTROLLER_WAIT_S, self.args.interval))
        # Both calls within it.
        deadline = time.monotonic() + timeout
        try:
            # One round: a Controller that is not there (standalone) must not hold the view back.
            listed = await target.call(
                "ListInstances",
                controller_pb2.ListInstancesRequest(),
                timeout,
                rounds=1,
                wait_for_ready=False,
            )
            left = max(0.001, deadline - time.monotonic())
            active = await list_alarms(
                target, active_only=True, alarm_id="", deadline_s=left, wait_for_ready=False
            )
        except grpc.aio.AioRpcError as err:
            view.error = {"code": err.code().name, "message": err.details() or ""}
            return view
        view.address = target.address
        view.statuses = {i.id: enums.status_name(i.status) for i in listed.instances}
        view.alarms = active
        return view

    async def fetch(
        self,
    ) -> tuple[
        coordinator_pb2.GetEngineMetricsResponse, coordinator_pb2.GetEngineMetricsResponse, ControllerView
    ]:
        """Everything one refresh needs; a failed Coordinator call raises."""
        per_instance, per_role, controller = await asyncio.gather(
            self.engine_metrics(coordinator_pb2.ENGINE_METRICS_VIEW_INSTANCE, own=True),
            self.engine_metrics(coordinator_pb2.ENGINE_METRICS_VIEW_ROLE, own=False),
            self.controller_view(),
        )
        return per_instance, per_role, controller


def console() -> Console:
    out = Console(highlight=False)
    if not out.is_terminal:
        out = Console(highlight=False, width=PIPE_WIDTH)
    return out


async def top(args: argparse.Namespace, key: str | None) -> int:
    sources = Sources(args, key)
    model = TopModel(args.coordinator)
    try:
        try:
            doc = model.update(*await sources.fetch())
        except grpc.aio.AioRpcError as err:
            print(coordinator_error(args.coordinator, err), file=sys.stderr)
            return 1
        if args.once:
            if args.output == "json":
                print(json.dumps(doc, indent=2))
            else:
                console().print(render(doc, now=time.time()))
            return 0
        await follow(args, sources, model, doc)
        return 0
    finally:
        await sources.close()


async def follow(args: argparse.Namespace, sources: Sources, model: TopModel, doc: dict[str, Any]) -> None:
    """Refresh every --interval seconds until Ctrl-C: in place on a terminal (rich Live), one
    frame after another to a file or pipe, one JSON document per line with -o json."""
    out = console()
    problem: str | None = None
    due = time.monotonic()  # when the last refresh was due

    def screen() -> Any:
        return render(doc, now=time.time(), interval=args.interval, problem=problem)

    async def refresh() -> None:
        nonlocal doc, problem, due
        # The next tick; after a refresh slower than the interval, not a burst to catch up.
        due = max(due + args.interval, time.monotonic())
        await asyncio.sleep(due - time.monotonic())
        try:
            doc = model.update(*await sources.fetch())
            problem = None
        except grpc.aio.AioRpcError as err:
            problem = coordinator_error(args.coordinator, err).removeprefix(f"{PROG}: ")
            if args.output == "json":
                print(f"{PROG}: {problem}", file=sys.stderr, flush=True)

    if args.output == "json":
        while True:
            if problem is None:
                print(json.dumps(doc), flush=True)
            await refresh()
    if not out.is_terminal:
        while True:
            out.print(screen())
            out.print()
            out.file.flush()
            await refresh()
    with Live(screen(), console=out, auto_refresh=False, redirect_stderr=False) as live:
        while True:
            await refresh()
            live.update(screen(), refresh=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="A live view of the engines: requests running and waiting, KV cache usage, "
        "tokens/s, TTFT and TPOT percentiles per role and per instance, migrations and active alarms. "
        "Ctrl-C ends it.",
    )
    p.add_argument(
        "--controller",
        default=DEFAULT_CONTROLLER,
        metavar="H:P[,H:P...]",
        help="the Controller, for instance status and alarms ('' for none: a standalone Coordinator)",
    )
    client.add_flags(p, controller=False)
    p.add_argument(
        "--interval", type=positive_seconds, default=2.0, metavar="S", help="seconds between refreshes"
    )
    p.add_argument("--once", action="store_true", help="print one view and exit (no live refresh)")
    args = p.parse_args(argv)
    try:
        key = client.key_of(args)
    except ConfigError as err:
        print(f"{PROG}: {err.errors[0]}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(top(args, key))
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # The reader went away (motor top -o json | head -1): nothing more to say to it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
