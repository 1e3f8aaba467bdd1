"""``motor controller``: the Controller in the foreground, on SQLite (app.py) or, with
``controller.store = "etcd"``, as a leader or standby (leader/ha.py)."""

from __future__ import annotations

import asyncio

from motor_mesh.common.config import Config
from motor_mesh.common.service_main import service_main
from motor_mesh.controller import app


async def serve(cfg: Config, stop: asyncio.Event) -> int:
    if cfg.controller.store == "etcd":
        # Imported here: the SQLite deployment never loads the etcd client.
        from motor_mesh.controller.leader.ha import serve_ha

        return await serve_ha(cfg.controller, stop)
    return await app.serve(cfg, stop)


def main(argv: list[str]) -> int:
    return service_main("controller", argv, serve, {"--metrics-port": ("metrics_port", int)})
