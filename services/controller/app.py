"""The Controller's parts wired together, independent of the gRPC server that serves them.

``Controller(cfg)`` opens the database and loads what it holds (every heartbeat clock starts
now); ``start()`` starts the event pushers and the timer; ``stop()`` ends streams and tasks and
closes channels and the database. ``serve()`` in main.py puts it behind a MotorServer; tests can
do the same in-process.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from pathlib import Path
from typing import Any

from services.common import log
from services.common.config import ControllerConfig, read_key_file
from services.common.gcpolicy import GcGuard

from .heartbeats import HeartbeatHub
from .instances import InstanceTable
from .nm_client import NodeManagerClients
from .pusher import CoordinatorPusher
from .registration import Assembler
from .service import ControllerService
from .sessions import SessionTable
from .store import Store


def _lock_state_dir(state_dir: str) -> int:
    """One Controller per state_dir: a second one would fork the instance history."""
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(state_dir) / "controller.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise OSError(f"state_dir {state_dir} is in use by another Controller") from None
    return fd


class Controller:
    def __init__(self, cfg: ControllerConfig) -> None:
        self.cfg = cfg
        # Key files first: a bad one is a start-up error before anything is opened.
        nm_key = read_key_file(cfg.nodemanager_key_file) if cfg.nodemanager_key_file else None
        coord_key = read_key_file(cfg.coordinator_key_file) if cfg.coordinator_key_file else None
        self._lock = _lock_state_dir(cfg.state_dir)
        try:
            self.store = Store(cfg.state_dir)
        except Exception:
            os.close(self._lock)
            raise
        self.table = InstanceTable(self.store)
        self.sessions = SessionTable()
        tls = cfg
        max_bytes = cfg.max_message_bytes
        self.nm = NodeManagerClients(nm_key, tls, max_bytes)
        self.assembler = Assembler(cfg, self.table, self.sessions, self.store, self.nm)
        self.hub = HeartbeatHub(self.table, self.sessions, cfg.instance_heartbeat_timeout_s)
        self.table.subscribe(self.assembler)
        self.pushers = [
            CoordinatorPusher(
                address,
                self.table,
                key=coord_key,
                tls=tls,
                max_message_bytes=max_bytes,
                sync_interval_s=cfg.coordinator_set_sync_interval_s,
            )
            for address in cfg.coordinators
        ]
        for p in self.pushers:
            self.table.subscribe(p)
        self.servicer = ControllerService(self)
        now = time.monotonic()
        self.table.load(self.store.load_instances(), now)
        self.assembler.load(self.store.load_pending(), now)
        self.gc = GcGuard()
        self.gc.settle(self._working_set())
        shortest = min(cfg.instance_heartbeat_timeout_s, cfg.instance_assemble_timeout_s)
        self._tick_s = min(1.0, max(0.02, shortest / 4))
        self._timer: asyncio.Task | None = None
        self._stopped = False
        log.event(
            "state_loaded",
            state_dir=cfg.state_dir,
            instances=len(self.table.live),
            pending=len(self.assembler.pending),
        )

    def subscribe(self, observer: Any) -> None:
        """Add an observer of transitions and engine events (fault manager, alarms)."""
        self.table.subscribe(observer)

    def _working_set(self) -> int:
        return len(self.sessions) + len(self.table.live) + len(self.assembler.pending)

    async def start(self) -> None:
        for p in self.pushers:
            p.start()
        self._timer = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            try:
                self.hub.sweep(time.monotonic())
                self.hub.report(time.monotonic(), self.gc)
                self.assembler.sweep(time.monotonic(), time.time())
                self.gc.settle(self._working_set())
            except Exception as exc:  # the timer must survive a bug in one sweep
                log.error("sweep_failed", error=repr(exc))

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.hub.cancel_streams()
        if self._timer is not None:
            self._timer.cancel()
            await asyncio.gather(self._timer, return_exceptions=True)
        await self.assembler.close()
        await asyncio.gather(*(p.close() for p in self.pushers), return_exceptions=True)
        await self.nm.close()
        self.store.close()
        self.gc.close()
        os.close(self._lock)
