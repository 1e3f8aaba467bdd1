"""``motor controller`` on the etcd store: stand by, win the election, lead, and stop leading.

The life of one process:

1. The gRPC server starts at once with :class:`LeaderGate` in front of the Controller service
   (health ``motor.v1.Controller`` NOT_SERVING, ``""`` SERVING: alive) and the metrics endpoint,
   so clients learn where the leader is and probes see a live standby.
2. It campaigns (leader/election.py). On winning it reads the whole state from etcd, builds the
   Controller on it, then opens the gate and turns health SERVING.
3. It leads until SIGTERM — then it stops like a single Controller and gives the lease back,
   so a standby takes over at once — or until the lease is lost: then it exits at once (exit
   code 3), without a drain or any further write or push. The supervisor (``motor up``,
   Kubernetes) starts it again, as a standby.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from motor_mesh.common import log
from motor_mesh.common.config import ControllerConfig
from motor_mesh.common.config.source import recorded
from motor_mesh.common.metrics_http import MetricsServer
from motor_mesh.common.server import MotorServer, start_with_metrics
from motor_mesh.common.tasks import cancel_quietly, spawn
from motor_mesh.controller import metrics
from motor_mesh.controller.app import Controller
from motor_mesh.controller.leader.election import Leadership
from motor_mesh.controller.leader.standby import LeaderGate
from motor_mesh.controller.store.db import StateCorrupt
from motor_mesh.controller.store.etcd import EtcdStore
from motor_mesh.controller.store.etcd_client import EtcdClient, EtcdUnavailable
from motor_mesh.gen.motor.v1 import controller_pb2

# The exit status of a leader that lost its lease: not a crash, a step-down.
LOST_LEADERSHIP_EXIT = 3
# Deadline of every etcd call.
ETCD_TIMEOUT_S = 2.0


def _exit_now() -> None:
    """Stop acting at once: no drain, no stop hooks, no last write."""
    log.error("exiting", reason="leadership lost", status=LOST_LEADERSHIP_EXIT)
    sys.stderr.flush()
    os._exit(LOST_LEADERSHIP_EXIT)


def advertise_address(c: ControllerConfig, port: int) -> str:
    return c.advertise_address or f"{c.host}:{port}"


class Lead:
    """What the metrics endpoint reads: the election, and the Controller once elected."""

    def __init__(self, leadership: Leadership) -> None:
        self.leadership = leadership
        self.controller: Controller | None = None


async def serve_ha(c: ControllerConfig, stop: asyncio.Event, on_lost: Callable[[], None] = _exit_now) -> int:
    client = EtcdClient(
        c.etcd_endpoints,
        ca_file=c.etcd_ca_file,
        cert_file=c.etcd_cert_file,
        key_file=c.etcd_key_file,
        timeout_s=ETCD_TIMEOUT_S,
    )
    leadership = Leadership(client, c.etcd_prefix, "", c.leader_lease_s)
    gate = LeaderGate(lambda: leadership.leader_address)
    server = MotorServer(
        "controller",
        c,
        [(controller_pb2.DESCRIPTOR.services_by_name["Controller"], gate)],
        port=c.port,
        standby=True,
    )
    lead = Lead(leadership)
    scrape = MetricsServer(c.host, c.metrics_port, metrics.ha_registry(lead)) if c.metrics_port else None
    try:
        await start_with_metrics(server, scrape)
    except BaseException:
        await client.close()
        raise
    # Known only once bound (port 0 in tests).
    leadership.address = advertise_address(c, server.port)
    server.announce(role="standby", **({"metrics": scrape.address} if scrape else {}))
    try:
        if not await _first(leadership.campaign(), stop):
            return 0
        # Renewing from the first moment: loading a large state must not cost the lease.
        keeper = spawn("leader-lease", leadership.keep)
        try:
            store = await EtcdStore.open(client, c.etcd_prefix, leadership)
        except (EtcdUnavailable, StateCorrupt) as err:
            # Elected but cannot read the state: lead nothing; the next start campaigns again.
            log.error("state_load_failed", store="etcd", error=str(err))
            await cancel_quietly(keeper)
            await leadership.resign()
            return 1
        # The stored settings (the last reload's) come with the store: a new leader goes on with them.
        controller = lead.controller = Controller(c, store=store, leadership=leadership, source=recorded())
        gate.activate(controller.servicer)
        server.on_stop(controller.end_streams)
        await controller.start()
        await server.set_serving(True)
        log.event("leading", address=leadership.address, term=leadership.term)
        try:
            if await _first(leadership.ended.wait(), stop):
                on_lost()
                return LOST_LEADERSHIP_EXIT
            # Still renewing while the last writes drain; the lease goes back only once
            # nothing more will be written.
            await server.stop()
            await controller.stop()
            await cancel_quietly(keeper)
            await leadership.resign()
        finally:
            await cancel_quietly(keeper)
        return 0
    finally:
        await server.stop()
        if scrape is not None:
            await scrape.stop()
        await client.close()


async def _first(work: Coroutine[Any, Any, object], stop: asyncio.Event) -> bool:
    """Run ``work`` until it finishes (True) or ``stop`` is set first (False)."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
            return True
        return False
    finally:
        await cancel_quietly(task)
        await cancel_quietly(stopping)
