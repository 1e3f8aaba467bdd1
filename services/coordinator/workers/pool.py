"""The management process's side of ``coordinator.workers > 1``: a private directory for the
ZeroMQ sockets, the shared metrics files and the workers' configuration; the HTTP port held
for the workers; the hub that gives them the table; the supervisor that keeps them running.

The port is held by a socket bound with ``SO_REUSEPORT`` that never listens: ``http_port = 0``
then still means one port for every worker, a port in use fails here before anything starts,
and the kernel only ever hands connections to the workers, which are the ones listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import sys
from collections.abc import Callable

from motor_mesh.common import log, scratch
from motor_mesh.common.config import CoordinatorConfig
from motor_mesh.common.config.sections import to_json
from motor_mesh.common.signals import on_forced_exit
from motor_mesh.coordinator.metrics import forget_process, use_shared_dir
from motor_mesh.coordinator.precision.groups import Completed
from motor_mesh.coordinator.routes import netloc
from motor_mesh.coordinator.table import TableState
from motor_mesh.coordinator.workers.hub import WorkerHub, WorkersUnavailable
from motor_mesh.coordinator.workers.procs import WorkerSupervisor

__all__ = ["WorkerPool", "WorkersUnavailable", "worker_count"]

START_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
CONFIG_FILE = "coordinator.json"


def worker_count(configured: int) -> int:
    """``workers = 0`` is one per CPU core this process may run on."""
    if configured:
        return configured
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _hold_port(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind HTTP {netloc(host, port)}: address in use or not available") from exc
    return sock


class WorkerPool:
    def __init__(self, cfg: CoordinatorConfig, count: int) -> None:
        self.cfg = cfg
        self.count = count
        self.dir = scratch.make("motor-coordinator-")
        metrics_dir = os.path.join(self.dir, "metrics")
        os.mkdir(metrics_dir, 0o700)
        use_shared_dir(metrics_dir)  # this process's gauges (table, precision) go there too
        self.hub = WorkerHub(self.dir)
        self.supervisor = WorkerSupervisor(count, self._argv, self.hub, on_exit=self._exited)
        self._port: socket.socket | None = None
        self._http_port = cfg.http_port
        self.generation = 0  # of the settings the workers are told (a reload adds one)
        self.replicas = 1
        on_forced_exit(self.kill_now)

    def _argv(self, index: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "motor_mesh.coordinator.worker",
            "--dir",
            self.dir,
            "--index",
            str(index),
        ]

    @staticmethod
    def _exited(index: int, pid: int) -> None:
        forget_process(pid)

    def on_sample(self, sink: Callable[[int, int, Completed], None]) -> None:
        self.hub.on_sample = sink

    async def start(self, state: TableState) -> str:
        """Start the workers with ``state``; returns the HTTP ``host:port`` once every worker
        holds the table and listens."""
        cfg = self.cfg
        self._port = _hold_port(cfg.host, cfg.http_port)
        port = self._http_port = int(self._port.getsockname()[1])
        await asyncio.to_thread(self._write_config, self._settings(cfg))
        self.hub.set_state(state)
        await self.hub.start()
        await self.supervisor.start()
        try:
            await self.hub.wait_serving(self.count, START_TIMEOUT_S)
        except TimeoutError:
            raise OSError(
                f"inference workers did not start within {START_TIMEOUT_S:g} s "
                f"({len(self.hub.serving())} of {self.count} serving); see their log lines"
            ) from None
        address = netloc(cfg.host, port)
        log.event("workers_serving", workers=self.count, http=address, pids=",".join(map(str, self.pids())))
        return address

    def _settings(self, cfg: CoordinatorConfig) -> dict[str, object]:
        """What the workers' file holds: the settings generation, the replica count and the
        coordinator section (the port the pool holds in place of ``http_port = 0``)."""
        section = {f.name: to_json(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
        section["http_port"] = self._http_port
        return {"generation": self.generation, "replicas": self.replicas, "coordinator": section}

    def _write_config(self, settings: dict[str, object]) -> None:
        """Replace the file whole (a worker starting meanwhile reads the old or the new one)."""
        path = os.path.join(self.dir, CONFIG_FILE)
        tmp = f"{path}.{self.generation}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(settings, f)
        os.replace(tmp, path)

    async def reconfigure(self, cfg: CoordinatorConfig, replicas: int) -> None:
        """New settings for every worker: the file is rewritten (what a worker that starts
        later reads) and the next heartbeat, sent at once, tells each to read it again."""
        self.generation += 1
        self.replicas = max(1, replicas)
        self.cfg = cfg
        await asyncio.to_thread(self._write_config, self._settings(cfg))
        self.hub.settings_generation = self.generation
        await self.hub.beat_now()

    def pids(self) -> list[int]:
        return [pid for _, pid in sorted(self.supervisor.pids().items())]

    async def publish(self, state: TableState) -> None:
        """Returns once every live worker holds ``state``; WorkersUnavailable otherwise."""
        await self.hub.publish(state)

    async def announce(self, state: TableState) -> None:
        """Give the workers ``state`` without waiting for them to take it."""
        await self.hub.announce(state)

    def kill_now(self) -> None:
        """A forced exit: the workers and the private directory go with this process."""
        for pid in self.supervisor.pids().values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.dir, True)

    async def stop(self) -> None:
        await self.supervisor.stop(STOP_GRACE_S)
        await self.hub.close()
        if self._port is not None:
            self._port.close()
        await asyncio.to_thread(shutil.rmtree, self.dir, True)
