"""The Controller's wiring: its parts put together (``Controller``), and ``serve()``, which runs
them behind the gRPC server and the metrics endpoint on the SQLite store (leader/ha.py does the
same on etcd, as a leader or standby).

Handlers (Register, the heartbeat streams) record what they observe and enqueue a key; three
reconcilers act on it (docs/architecture.md, "The Controller's reconcile loops"):

- ``assembly`` (key: job name): a pending assembly becomes an instance;
- ``instance`` (key: instance id): teardowns of doomed instances, heartbeat timeout, the state
  machine, StartEngines, and the fault manager's recovery strategies;
- ``precision`` (key: PD group): automatic recovery of precision alarms, and the clearing of
  those whose instances are gone;
- ``coordinator`` (key: address): each Coordinator's table follows the routable instances;
- ``planner`` (one key): the planner's decisions, and the role switches they start
  (planner/planner.py; the switches themselves are steps of the instance reconcile).

``Controller(cfg)`` opens the database and loads what it holds (every heartbeat clock starts
now; the alarms are compared with the instances); ``start()`` starts the reconcilers and the
timer; ``end_streams()`` (a server stop hook) ends the heartbeat and alarm watch streams;
``stop()`` ends streams and tasks and closes channels and the database. Tests build a
``Controller`` in-process the way ``serve()`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sys
from pathlib import Path

from motor_mesh.common import log, sighup
from motor_mesh.common.config import Config, ControllerConfig, read_key_file
from motor_mesh.common.config.source import Source, recorded
from motor_mesh.common.gcpolicy import GcGuard
from motor_mesh.common.metrics_http import MetricsServer
from motor_mesh.common.retry import Backoff
from motor_mesh.common.server import MotorServer, start_with_metrics
from motor_mesh.common.tasks import spawn
from motor_mesh.controller import metrics
from motor_mesh.controller.alarms.alertmanager import AlertmanagerSink
from motor_mesh.controller.alarms.sources import COORDINATOR_ALARM_AFTER_S, CoordinatorAlarms, InstanceAlarms
from motor_mesh.controller.alarms.store import AlarmStore
from motor_mesh.controller.alarms.watch import AlarmWatchHub
from motor_mesh.controller.desired import DesiredInstances, role_label
from motor_mesh.controller.faults.manager import FaultManager
from motor_mesh.controller.faults.recovery import CoordinatorClears, Group, Recovery
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.leader.election import Leadership
from motor_mesh.controller.nodes.client import NodeManagerClients
from motor_mesh.controller.nodes.heartbeats import STATS_WINDOW_S, HeartbeatHub
from motor_mesh.controller.nodes.liveclock import LiveClock
from motor_mesh.controller.nodes.pending import PendingAssemblies
from motor_mesh.controller.nodes.registration import Registrar
from motor_mesh.controller.nodes.sessions import SessionTable
from motor_mesh.controller.planner.planner import KEY as PLANNER_KEY
from motor_mesh.controller.planner.planner import PlannerLoop
from motor_mesh.controller.planner.signals import Signals
from motor_mesh.controller.planner.switches import RoleSwitches
from motor_mesh.controller.push.coordinator_set import CoordinatorSet
from motor_mesh.controller.push.pusher import CoordinatorSync
from motor_mesh.controller.reconcile.assembler import Assembler
from motor_mesh.controller.reconcile.instances import InstanceReconciler
from motor_mesh.controller.reconcile.runner import Reconciler
from motor_mesh.controller.reconcile.teardown import Teardowns
from motor_mesh.controller.service import ControllerService
from motor_mesh.controller.settings import Settings, starting_config
from motor_mesh.controller.store.db import StateCorrupt
from motor_mesh.controller.store.interface import StateStore
from motor_mesh.controller.store.sqlite import Store
from motor_mesh.gen.motor.v1 import controller_pb2

# Every key is looked at again this often, whatever events said: what a lost event missed is
# corrected within one period.
RESYNC_S = 30.0
# How long the start waits for the first resolution of dns:/// Coordinators.
FIRST_RESOLVE_S = 2.0
# Reconciles in flight at once per kind: each waits on NodeManagers (probes, StartEngines), and a
# fleet registering at once must not wait in line behind one slow node.
WORKERS = 32


def _tick_of(cfg: ControllerConfig) -> float:
    """How often the Controller's timer runs: a quarter of its shortest timeout, within bounds."""
    shortest = min(cfg.instance_heartbeat_timeout_s, cfg.instance_assemble_timeout_s)
    return min(1.0, max(0.02, shortest / 4))


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
    def __init__(
        self,
        cfg: ControllerConfig,
        *,
        coordinator_alarm_after_s: float = COORDINATOR_ALARM_AFTER_S,
        store: StateStore | None = None,
        leadership: Leadership | None = None,
        source: Source | None = None,
    ) -> None:
        """``store``: an opened shared store (etcd) instead of ``state_dir``'s database, and
        ``leadership`` the election this process has won, whose term fences every push.
        ``source``: how ``motor controller`` loaded its configuration (its whole file, its flags
        and environment), which a reload (ReloadConfig) is read and compared with; None: ``cfg``
        and the defaults of the other sections."""
        self.cfg = cfg
        self.leadership = leadership
        # Key files first: a bad one is a start-up error before anything is opened.
        nm_key = read_key_file(cfg.nodemanager_key_file) if cfg.nodemanager_key_file else None
        coord_key = read_key_file(cfg.coordinator_key_file) if cfg.coordinator_key_file else None
        # A shared store is guarded by the election instead of a lock file.
        self._lock = _lock_state_dir(cfg.state_dir) if store is None else None
        try:
            self._build(cfg, nm_key, coord_key, coordinator_alarm_after_s, store, source)
        except BaseException:  # a corrupt state file among others: the next start may retry
            if self._lock is not None:
                os.close(self._lock)
            raise

    def _build(
        self,
        cfg: ControllerConfig,
        nm_key: str | None,
        coord_key: str | None,
        coordinator_alarm_after_s: float,
        store: StateStore | None,
        source: Source | None,
    ) -> None:
        self.store: StateStore = Store(cfg.state_dir) if store is None else store
        # The settings a reload changes, with the last reload's applied over the file's: the
        # reloadable keys below are read through self.cfg when used (apply_settings).
        self.settings = Settings(self.store, starting_config(cfg, source), source)
        if self.settings.running.controller.log_level != cfg.log_level:
            log.set_level(self.settings.running.controller.log_level)
        cfg = self.cfg = self.settings.running.controller
        self._tick_s = _tick_of(cfg)
        # The timer reads the clock every tick, so a gap of several ticks (and at least one
        # heartbeat interval) is the loop not running, not NodeManagers being silent.
        self.clock = LiveClock(stall_s=max(cfg.heartbeat_interval_s, 3 * self._tick_s))
        # The instance reconcile carries out what the table is asked (doom): bound once it exists.
        self.table = InstanceTable(self.store, lambda iid: self.instance_loop.enqueue(iid))
        self.alarms = AlarmStore(self.store)
        self.alarm_watch = AlarmWatchHub(self.alarms)
        # SetDesiredInstances: recorded and exported for what runs the processes.
        self.desired = DesiredInstances(self.store)
        self.instance_alarms = InstanceAlarms(self.table, self.alarms)
        # controller.coordinators, with dns:/// names expanded (and followed while running).
        self.coordinator_set = CoordinatorSet(cfg.coordinators, self._coordinators_changed)
        self.coordinator_alarms = CoordinatorAlarms(
            self.alarms, self.coordinator_set.current, coordinator_alarm_after_s
        )
        self.sessions = SessionTable()
        self.pending = PendingAssemblies(self.store, self.sessions)
        self.nm_clients = NodeManagerClients(nm_key, cfg, cfg.max_message_bytes)
        # TerminateInstance, and what a reported precision alarm leads to.
        self.clears = CoordinatorClears(cfg, coord_key)
        self.recovery = Recovery(cfg, self.table, self.alarms, self.clears)
        self.alert_sink: AlertmanagerSink | None = None
        if cfg.alarm_webhook_url:
            self.alert_sink = AlertmanagerSink(
                cfg.alarm_webhook_url, self.alarms.active, tls_ca_file=cfg.tls_ca_file
            )
            self.alarms.subscribe(self.alert_sink)

        self.faults = FaultManager(cfg, self.table, self.nm_clients, self.store, settings=self.current)
        self.teardowns = Teardowns(self.table, self.nm_clients, self.alarms, self.clears)
        # Role switches (the planner's decisions), carried out by the instance reconcile.
        self.switches = RoleSwitches(self.table, self.nm_clients, self.current, self.faults.note)
        self.instances = InstanceReconciler(
            cfg,
            self.table,
            self.nm_clients,
            self.faults,
            self.teardowns,
            self.clock.now,
            settings=self.current,
            switches=self.switches,
        )
        self.instance_loop: Reconciler[int] = Reconciler(
            "instance",
            self.instances.reconcile,
            workers=WORKERS,
            backoff=Backoff(0.5, 5.0),
            resync_s=RESYNC_S,
            keys=lambda: [*self.table.live, *self.teardowns.pending()],
        )
        self.precision_loop: Reconciler[Group] = Reconciler(
            "precision",
            self.recovery.reconcile,
            workers=WORKERS,
            backoff=Backoff(1.0, 30.0),
            resync_s=RESYNC_S,
            keys=self.recovery.groups,
        )
        self.recovery.enqueue_group = self.precision_loop.enqueue
        self.assembler = Assembler(
            cfg,
            self.pending,
            self.table,
            self.store,
            self.nm_clients,
            self.instance_loop.enqueue,
            self.clock.now,
            settings=self.current,
        )
        self.assembly_loop: Reconciler[str] = Reconciler(
            "assembly",
            self.assembler.reconcile,
            workers=WORKERS,
            backoff=Backoff(0.5, 5.0),
            resync_s=RESYNC_S,
            keys=self.pending.jobs,
        )
        self.registrar = Registrar(
            cfg,
            self.table,
            self.pending,
            self.sessions,
            self.store,
            self.assembly_loop.enqueue,
            self.nm_clients,
            self.clock.now,
            settings=self.current,
        )
        self.hub = HeartbeatHub(
            self.table,
            self.sessions,
            cfg.instance_heartbeat_timeout_s,
            self.instance_loop.enqueue,
            self.clock.now,
        )
        self.table.subscribe(self.registrar)
        self.table.subscribe(self.faults)
        self.table.subscribe(self.instance_alarms)
        self.table.subscribe(self.recovery)
        self.coordinators = CoordinatorSync(
            self.coordinator_set.current,
            self.table,
            key=coord_key,
            tls=cfg,
            max_message_bytes=cfg.max_message_bytes,
            sync_interval_s=cfg.coordinator_set_sync_interval_s,
            resync_s=RESYNC_S,
            on_reachability=self.coordinator_alarms.on_reachability,
            push_metadata=self.leadership.push_metadata if self.leadership else None,
            settings=self.settings.pushed,
        )
        self.switches.drainer = self.coordinators  # a switching instance drains first
        self.planner = PlannerLoop(
            self.table,
            self.switches,
            Signals(self.coordinators),
            self.desired,
            self.current,
            lambda: self.planner_loop.enqueue(PLANNER_KEY),
        )
        self.planner_loop: Reconciler[str] = Reconciler(
            "planner",
            self.planner.reconcile,
            backoff=Backoff(1.0, 30.0),
            resync_s=RESYNC_S,
            keys=lambda: [PLANNER_KEY],
        )
        self.switches.on_finished = self.planner.switch_finished
        self.table.subscribe(self.planner)
        self.settings.on_controller = self.apply_settings
        self.settings.on_push = self.coordinators.settings_changed
        self.clears.coordinators = lambda: self.coordinator_set.current
        self.teardowns.drainer = self.coordinators  # planned removals drain on every Coordinator
        self.loops = (
            self.assembly_loop,
            self.instance_loop,
            self.precision_loop,
            self.coordinators.reconciler,
            self.planner_loop,
        )
        self.servicer = ControllerService(self)

        now = self.clock.now()
        self.table.load(self.store.load_instances(), now)
        self.pending.load(self.store.load_pending(), now)
        self._last_alarm_resync = now
        self.gc = GcGuard()
        self.gc.settle(self._working_set())
        self._timer: asyncio.Task[None] | None = None
        self._last_report = now
        self._stopped = False
        log.event(
            "state_loaded",
            store=cfg.store,
            at=cfg.state_dir if store is None else cfg.etcd_prefix,
            instances=len(self.table.live),
            pending=len(self.pending),
            desired=",".join(f"{role_label(r)}={n}" for r, n in self.desired.counts().items()) or "none",
        )

    def current(self) -> ControllerConfig:
        """The Controller's section as it runs now (a reload replaces it)."""
        return self.cfg

    def apply_settings(self, cfg: ControllerConfig) -> None:
        """A reload's controller section (settings.py): the log level at once; the heartbeat
        timeout from the next sweep; start retries and relaunch timings as the next attempt or
        step reads them (a relaunch already waiting keeps the deadline it set)."""
        if cfg.log_level != self.cfg.log_level:
            log.set_level(cfg.log_level)
        self.cfg = cfg
        self.hub.timeout_s = cfg.instance_heartbeat_timeout_s
        self._tick_s = _tick_of(cfg)
        self.clock.stall_s = max(cfg.heartbeat_interval_s, 3 * self._tick_s)

    def _coordinators_changed(self, addresses: list[str]) -> None:
        self.coordinators.set_addresses(addresses)
        self.coordinator_alarms.set_addresses(addresses)

    def _working_set(self) -> int:
        return len(self.sessions) + len(self.table.live) + len(self.pending)

    async def start(self) -> None:
        if self.alert_sink is not None:
            self.alert_sink.start()
        if self.coordinator_set.dynamic:
            # Resolved before the first alarm reconcile, which clears the alarms of Coordinators
            # not in the set; bounded, since a hung resolver must not hold the start.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.coordinator_set.refresh(), FIRST_RESOLVE_S)
        self.coordinators.start()
        self.coordinator_set.start()
        self.assembly_loop.start()
        self.instance_loop.start()
        self.precision_loop.start()
        self.planner_loop.start()
        self._reconcile_alarms()
        self._timer = spawn("controller-timer", self._tick)
        sighup.on_reload(self._reload_own)  # SIGHUP: its own section, stored like a reload

    async def _reload_own(self, new: Config) -> None:
        await self.settings.reload_own(new)

    async def _tick(self) -> None:
        """The clock's observations: silent NodeManagers (enqueued for their instance's
        reconcile), the periodic stats lines, and the garbage collector's policy."""
        while True:
            await asyncio.sleep(self._tick_s)
            now = self.clock.now()
            self.hub.sweep(now)
            self.hub.report(now, self.gc)
            if now - self._last_report >= STATS_WINDOW_S:
                self._last_report = now
                for loop in self.loops:
                    loop.report()
            if now - self._last_alarm_resync >= RESYNC_S:
                self._last_alarm_resync = now
                self._reconcile_alarms()
            self.gc.settle(self._working_set())

    def _reconcile_alarms(self) -> None:
        """Level-triggered alarms: what a lost transition or a failed write missed is put right."""
        self.instance_alarms.reconcile()
        self.coordinator_alarms.reconcile()

    def end_streams(self) -> None:
        """On stop, after the drain: NodeManagers and alarm watchers reconnect to the next
        Controller at once."""
        self.hub.cancel_streams()
        self.alarm_watch.close()

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        sighup.on_reload(None)  # a standby (or the next leader) applies the log level alone
        self.end_streams()
        self.coordinator_alarms.close()
        if self._timer is not None:
            self._timer.cancel()
            await asyncio.gather(self._timer, return_exceptions=True)
        await self.assembly_loop.stop()
        await self.instance_loop.stop()
        await self.precision_loop.stop()
        await self.planner_loop.stop()
        await self.clears.close()
        if self.alert_sink is not None:
            await self.alert_sink.close()  # before the database closes: its resend reads it
        await self.coordinator_set.close()
        await self.coordinators.close()
        await self.nm_clients.close()
        await self.alarms.drain()
        await self.store.close()
        self.gc.close()
        if self._lock is not None:
            os.close(self._lock)


async def serve(cfg: Config, stop: asyncio.Event) -> int:
    """The Controller on the SQLite store (leader/ha.py serves the etcd one): the gRPC and
    metrics listeners, then the Controller, until ``stop``."""
    c = cfg.controller
    try:
        controller = Controller(c, source=recorded())
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
        await start_with_metrics(server, scrape)
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
