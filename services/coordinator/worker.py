"""One inference worker of a Coordinator with ``workers > 1`` (started by the management
process, never by hand): ``python -m motor_mesh.coordinator.worker --dir D --index I``.

It takes the table from the management process over ZeroMQ before it listens, serves the
inference port beside the other workers (``SO_REUSEPORT``), routes with its own in-flight
counts plus the others' broadcast, and sends precision samples back. It exits when the
management process is gone: a worker must never serve a table nobody updates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Callable

from motor_mesh.common import log
from motor_mesh.common.config import ConfigError, CoordinatorConfig, load
from motor_mesh.common.server import run
from motor_mesh.coordinator.engine_metrics.snapshot import SnapshotFile
from motor_mesh.coordinator.engine_metrics.source import EngineMetrics
from motor_mesh.coordinator.inference import InferenceServer, api_keys, https
from motor_mesh.coordinator.metrics import MULTIPROC_ENV, Metrics, use_shared_dir
from motor_mesh.coordinator.pd import CompletedSink
from motor_mesh.coordinator.precision.groups import Completed
from motor_mesh.coordinator.routes import RoutingView, build_view
from motor_mesh.coordinator.table import TableState
from motor_mesh.coordinator.workers.link import WorkerLink
from motor_mesh.coordinator.workers.pool import CONFIG_FILE, worker_count


class ViewHolder:
    """The worker's routing view, rebuilt from each table revision the link applies."""

    def __init__(self) -> None:
        self.view = RoutingView()
        self.state = TableState()

    def apply(self, state: TableState) -> None:
        self.view = build_view(state, self.view.targets, self.view.retired)
        self.state = state

    def remote_loads(self, loads: dict[int, int]) -> None:
        for t in self.view.targets:
            t.set_remote(loads.get(t.id, 0))

    def local_loads(self) -> dict[int, int]:
        return {t.id: t.local_load for t in self.view.targets if t.local_load}


def _settings(directory: str) -> dict[str, object]:
    with open(os.path.join(directory, CONFIG_FILE)) as f:
        settings: dict[str, object] = json.load(f)
    return settings


class SampleGate:
    """Sends the management process at most one completed request per PD group per
    ``precision_interval_s`` (what its sampler could use at most), so a worker pays for a
    message a few times a minute per group instead of once per request."""

    def __init__(self, interval_s: float, send: CompletedSink) -> None:
        self._interval = interval_s
        self._send = send
        self._last: dict[tuple[int, int], float] = {}

    def __call__(self, p: int, d: int, completed: Completed) -> None:
        now = time.monotonic()
        key = (p, d)
        if now - self._last.get(key, -math.inf) < self._interval:
            return
        if len(self._last) > 65536:  # groups come and go with the table
            self._last.clear()
        self._last[key] = now
        self._send(p, d, completed)


def _engine_metrics(
    cfg: CoordinatorConfig, directory: str, table: Callable[[], TableState]
) -> EngineMetrics | None:
    """The management process scrapes the engines; each worker answers from the file it writes."""
    if cfg.engine_metrics_interval_s <= 0:
        return None
    return EngineMetrics(SnapshotFile(directory).read, table, blocking_read=True)


async def serve(directory: str, index: int, stop: asyncio.Event) -> int:
    settings = await asyncio.to_thread(_settings, directory)
    cfg = load(None, env={}, overrides={"coordinator": settings}).coordinator
    log.setup(f"coordinator-worker-{index}", cfg.log_format, cfg.log_level)
    workers = worker_count(cfg.workers)
    use_shared_dir(os.path.join(directory, "metrics"))
    metrics = Metrics()
    keys = api_keys(cfg.api_keys_file)
    ssl_context = https(cfg)
    holder = ViewHolder()

    def lost(why: str) -> None:
        log.warn("management_lost", worker=index, reason=why)
        stop.set()

    link = WorkerLink(directory, index, holder.apply, holder.remote_loads, on_lost=lost)
    await link.start()
    server = InferenceServer(
        cfg,
        lambda: holder.view,
        metrics,
        keys,
        ssl_context,
        workers=workers,
        worker=index,
        kv_shared_dir=directory,
        engine_metrics=_engine_metrics(cfg, directory, lambda: holder.state),
    )
    if cfg.precision_check_enabled:
        server.set_completed(SampleGate(cfg.precision_interval_s, link.send_sample))
    try:
        address = await server.start()
        link.serving()
        link.report_loads(holder.local_loads, lambda: holder.view.legs())
        log.event(
            "worker_serving", worker=index, pid=os.getpid(), http=address, revision=holder.view.revision
        )
        await stop.wait()
    finally:
        await server.stop()
        await link.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="motor_mesh.coordinator.worker")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--index", type=int, required=True)
    args = parser.parse_args(argv)
    log.setup(f"coordinator-worker-{args.index}")
    os.environ.setdefault(MULTIPROC_ENV, os.path.join(args.dir, "metrics"))
    try:
        return run(lambda stop: serve(args.dir, args.index, stop), fast_loop=True)
    except (OSError, ConfigError, TimeoutError) as err:
        msg = "; ".join(err.errors) if isinstance(err, ConfigError) else str(err) or type(err).__name__
        log.error("worker_start_failed", worker=args.index, reason=msg)
        return 1


if __name__ == "__main__":
    sys.exit(main())
