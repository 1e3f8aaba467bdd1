"""``motor controller``: the Controller in the foreground."""

from __future__ import annotations

import asyncio
import sys

from motor_mesh.common.config import Config
from motor_mesh.common.metrics_http import MetricsServer
from motor_mesh.common.server import MotorServer
from motor_mesh.common.service_main import service_main
from motor_mesh.controller import metrics
from motor_mesh.controller.app import Controller
from motor_mesh.controller.db import StateCorrupt
from motor_mesh.gen.motor.v1 import controller_pb2


async def serve(cfg: Config, stop: asyncio.Event) -> int:
    c = cfg.controller
    if c.store == "etcd":
        # Imported here: the SQLite deployment never loads the etcd client.
        from motor_mesh.controller.ha import serve_ha

        return await serve_ha(c, stop)
    try:
        controller = Controller(c)
    except StateCorrupt as err:
        # The message is the whole story (which file, where it went, what to do): one line.
        print(f"motor controller: {err}", file=sys.stderr)
        return 1
    server = MotorServer(
        "controller",
        c,
        [(controller_pb2.DESCRIPTOR.services_by_name["Controller"], controller.servicer)],
        port=c.port,
    )
    # After the drain: end the heartbeat and alarm watch streams so their clients reconnect
    # elsewhere at once.
    server.on_stop(controller.end_streams)
    scrape = MetricsServer(c.host, c.metrics_port, metrics.registry(controller)) if c.metrics_port else None
    try:
        await start_listeners(server, scrape)
    except BaseException:
        await controller.stop()
        raise
    await controller.start()
    server.announce(**({"metrics": scrape.address} if scrape else {}))
    try:
        await stop.wait()
    finally:
        await server.stop()
        if scrape is not None:
            await scrape.stop()
        await controller.stop()
    return 0


async def start_listeners(server: MotorServer, scrape: MetricsServer | None) -> None:
    """/metrics, then the gRPC port: SERVING means /metrics answers too. When either cannot
    start, neither is left running."""
    try:
        if scrape is not None:
            await scrape.start()
        await server.start()
    except BaseException:
        if scrape is not None:
            await scrape.stop()
        raise


def main(argv: list[str]) -> int:
    return service_main("controller", argv, serve, {"--metrics-port": ("metrics_port", int)})
