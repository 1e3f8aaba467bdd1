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
from typing import NamedTuple

from motor_mesh.common import log, tasks
from motor_mesh.common.config import ConfigError, CoordinatorConfig, load
from motor_mesh.common.server import run
from motor_mesh.coordinator.engine_metrics.snapshot import SnapshotFile
from motor_mesh.coordinator.engine_metrics.source import EngineMetrics
from motor_mesh.coordinator.inference import InferenceServer, https, tenants
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


DEMAND_S = 0.5  # how often the rate-limit buckets' demand goes to the management process


class Settings(NamedTuple):
    """The pool's file: its generation, the Coordinator replica count and the section."""

    generation: int
    replicas: int
    cfg: CoordinatorConfig


def _settings(directory: str) -> Settings:
    """Raises OSError, ValueError (not JSON), ConfigError."""
    with open(os.path.join(directory, CONFIG_FILE)) as f:
        doc = json.load(f)
    cfg = load(None, env={}, overrides={"coordinator": doc["coordinator"]}).coordinator
    return Settings(int(doc["generation"]), int(doc["replicas"]), cfg)


class Reloader:
    """Applies the pool's settings file whenever a beat announces a newer generation: read off
    the loop, applied on it, one at a time (a generation announced meanwhile is read after)."""

    def __init__(self, directory: str, index: int, server: InferenceServer) -> None:
        self._directory = directory
        self._index = index
        self._server = server
        self._wanted = 0
        self._applied = 0
        self._task: asyncio.Task[None] | None = None

    def __call__(self, generation: int) -> None:
        self._wanted = max(self._wanted, generation)
        if self._task is None or self._task.done():
            self._task = tasks.spawn("worker_settings", self._apply)

    async def _apply(self) -> None:
        while self._applied < self._wanted:
            try:
                new = await asyncio.to_thread(_settings, self._directory)
                known = await asyncio.to_thread(tenants, new.cfg)
                log.set_level(new.cfg.log_level)
                self._server.reconfigure(new.cfg, new.replicas, known)
            except (OSError, ValueError, KeyError, ConfigError) as exc:
                msg = "; ".join(exc.errors) if isinstance(exc, ConfigError) else str(exc)
                log.error("worker_settings_failed", worker=self._index, reason=msg)
                return  # the management process checked them: a retry would fail alike
            self._applied = new.generation
            log.event("worker_settings_applied", worker=self._index, generation=new.generation)

    async def close(self) -> None:
        await tasks.cancel_quietly(self._task)


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
    cfg = settings.cfg
    log.setup(f"coordinator-worker-{index}", cfg.log_format, cfg.log_level)
    workers = worker_count(cfg.workers)
    use_shared_dir(os.path.join(directory, "metrics"))
    metrics = Metrics()
    known = tenants(cfg)
    ssl_context = https(cfg)
    holder = ViewHolder()

    def lost(why: str) -> None:
        log.warn("management_lost", worker=index, reason=why)
        stop.set()

    reload: Reloader | None = None
    server: InferenceServer | None = None

    def parts(split: dict[str, dict[int, float]]) -> None:
        if server is not None:  # (none is sent before this worker's demand is)
            server.gate.set_parts(split, index, asyncio.get_running_loop().time())

    def newer_settings(generation: int) -> None:
        if reload is not None:  # else applied below, once the server exists
            reload(generation)

    link = WorkerLink(
        directory,
        index,
        holder.apply,
        holder.remote_loads,
        on_lost=lost,
        on_settings=newer_settings,
        settings_generation=settings.generation,
        on_parts=parts,
    )
    await link.start()
    server = InferenceServer(
        cfg,
        lambda: holder.view,
        metrics,
        known,
        ssl_context,
        workers=workers,
        worker=index,
        kv_shared_dir=directory,
        engine_metrics=_engine_metrics(cfg, directory, lambda: holder.state),
    )
    server.set_replicas(settings.replicas)
    reload = Reloader(directory, index, server)
    if link.settings_generation > settings.generation:  # announced while this worker started
        reload(link.settings_generation)
    if cfg.precision_check_enabled:
        server.set_completed(SampleGate(cfg.precision_interval_s, link.send_sample))
    try:
        address = await server.start()
        link.serving()
        # server.admission is read at each report: it may be replaced when settings change.
        link.report_loads(
            holder.local_loads,
            lambda: holder.view.legs(),
            lambda: (server.admission.active, server.admission.queued),
        )
        log.event(
            "worker_serving", worker=index, pid=os.getpid(), http=address, revision=holder.view.revision
        )
        gate = server.gate

        async def report_demand() -> None:
            while True:
                await asyncio.sleep(DEMAND_S)
                link.send_demand(gate.take_demand())

        demand = tasks.spawn("worker_demand", report_demand)
        await stop.wait()
        await tasks.cancel_quietly(demand)
    finally:
        await reload.close()
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
