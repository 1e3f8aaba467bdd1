"""The NodeManager's wiring: one node's engine supervisor, its gRPC server and its link to the
Controller, run by :func:`serve` until stopped.

Start-up: kill the engines an earlier NodeManager left behind (``state_dir/engines.json``),
become child subreaper, serve motor.v1.NodeManager, then register with the Controller and keep
the heartbeat stream open. Exit: SIGTERM (rc 0; its instance is drained first, stopping.py),
SIGINT or stdin closing under ``motor up`` (rc 0, at once), ``Stop`` or suicide arbitration or a
refused registration (rc 1); every path stops the engines first.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from motor_mesh.common import errors, log, procgroup, tasks
from motor_mesh.common.config import Config, NodeManagerConfig
from motor_mesh.common.metrics_http import MetricsServer
from motor_mesh.common.server import MotorServer
from motor_mesh.common.signals import on_forced_exit
from motor_mesh.gen.motor.v1 import nodemanager_pb2
from motor_mesh.nodemanager import devices, metrics
from motor_mesh.nodemanager.arbiter import SuicideArbiter
from motor_mesh.nodemanager.link import ControllerLink, RegistrationRefused
from motor_mesh.nodemanager.service import NodeManagerService
from motor_mesh.nodemanager.statefile import StateFile, kill_recorded_engines
from motor_mesh.nodemanager.stopping import TERMINATE_TIMEOUT_S, StopSignals
from motor_mesh.nodemanager.supervisor import EngineSupervisor

# On shutdown engines get at most this long after SIGTERM before SIGKILL, whatever
# engine_stop_grace_s says: a stopping NodeManager must be gone within seconds (motor up stops
# everything within 15 s), and a stopped node's engines are not coming back anyway.
SHUTDOWN_ENGINE_GRACE_S = 5.0


def by_pod_index(c: NodeManagerConfig) -> NodeManagerConfig:
    """``c`` with the job name and node rank this node takes from ``pod_index`` (Kubernetes: the
    pod's StatefulSet ordinal, so one StatefulSet holds whole instances): pods are grouped by
    ordinal, ``parallel.nnodes`` per instance, so ordinal ``i`` is rank ``i % nnodes`` of the job
    ``<job_name>-<i // nnodes>``. ``c`` itself when pod_index is -1 (not used). An empty job_name
    stays empty (registration off); the rank still follows the ordinal."""
    if c.pod_index < 0:
        return c
    nnodes = c.parallel.nnodes
    job = f"{c.job_name}-{c.pod_index // nnodes}" if c.job_name else ""
    return dataclasses.replace(c, job_name=job, node_rank=c.pod_index % nnodes)


async def serve(cfg: Config, stop: asyncio.Event) -> int:
    # Resolved once: the link, the supervisor and every check below see the effective values.
    c = by_pod_index(cfg.nodemanager)
    if c.pod_index >= 0:
        log.event(
            "pod_index",
            pod_index=c.pod_index,
            nnodes=c.parallel.nnodes,
            job_name=c.job_name,
            node_rank=c.node_rank,
        )
    reaper = procgroup.Reaper()
    state = StateFile(c.state_dir)
    stale = await kill_recorded_engines(state, reaper)
    if stale:
        log.event("stale_engines_cleaned", count=stale)
    procgroup.become_subreaper()

    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    exit_rc: list[int] = []

    def request_exit(rc: int, reason: str, delay: float = 0.0) -> None:
        if exit_rc:
            return
        if signals.planned.is_set():
            rc = 0  # after SIGTERM every way out is the stop it asked for (the Stop it awaits)
        exit_rc.append(rc)
        log.event("exiting", rc=rc, reason=reason)
        loop.call_later(delay, done.set)

    sup = EngineSupervisor(c, cfg.engine, state, reaper)
    on_forced_exit(sup.kill_all_now)
    # From here on SIGTERM drains the instance first (stopping.py); SIGINT stops at once.
    signals = StopSignals(stop, sup.kill_all_now)
    signals.install()
    # A look at /dev and PATH: off the loop, once, before any engine starts.
    sup.device_env, why = await asyncio.to_thread(devices.resolve, c.device_env)
    log.event("device_env", variable=sup.device_env, configured=c.device_env, reason=why)
    if sup.device_env == devices.CPU:
        log_cpu_cores(c)
    link_task: asyncio.Task[None] | None = None
    stop_received = asyncio.Event()

    def leave() -> None:
        """Told to Stop: no more engines, and the link to the Controller ends."""
        sup.closed = True
        stop_received.set()
        if link_task is not None:
            link_task.cancel()

    servicer = NodeManagerService(sup, request_exit, leave)
    server = MotorServer(
        "nodemanager",
        c,
        [(nodemanager_pb2.DESCRIPTOR.services_by_name["NodeManager"], servicer)],
        port=c.port,
    )
    collector = metrics.NodeManagerCollector(sup)
    scrape = MetricsServer(c.host, c.metrics_port, metrics.registry(collector)) if c.metrics_port else None
    # Bound before the gRPC port: SERVING means /metrics answers too.
    if scrape is not None:
        await scrape.start()
    try:
        port = await server.start()
    except BaseException:
        if scrape is not None:
            await scrape.stop()
        raise
    sup.address = server.address
    server.announce(**({"metrics": scrape.address} if scrape else {}))

    running = [tasks.spawn("reaper", reaper.run)]
    link: ControllerLink | None = None
    if c.job_name:
        link = ControllerLink(c, port, sup)
        sup.sink = collector.link = link

        async def keep_link(link: ControllerLink) -> None:
            # The link runs for the node's life; when it fails, the node exits 1 and is restarted.
            try:
                await link.run()
            except RegistrationRefused as exc:
                request_exit(1, f"registration refused: {exc}")
            except Exception:
                log.exception("controller_link_failed")
                request_exit(1, "controller link failed")

        link_task = asyncio.create_task(keep_link(link), name="controller-link")
        running.append(link_task)
    else:
        log.event("registration_disabled", reason="empty job_name")
    arbiter = SuicideArbiter(
        sup,
        c.suicide_check_interval_s,
        c.suicide_threshold,
        lambda reason: request_exit(1, f"suicide: {reason}"),
    )
    running.append(tasks.spawn("suicide-arbiter", arbiter.run))

    await tasks.first_of(stop, done, signals.planned)
    rc = exit_rc[0] if exit_rc else 0
    if signals.planned.is_set() and not exit_rc:
        await drain_first(link, sup, stop, done, stop_received, c.drain_wait_s)
        rc = exit_rc[0] if exit_rc else 0

    for task in reversed(running[1:]):
        await tasks.cancel_quietly(task)
    grace = min(c.engine_stop_grace_s, SHUTDOWN_ENGINE_GRACE_S)
    await asyncio.gather(sup.close(grace), server.stop())
    if scrape is not None:
        await scrape.stop()
    await tasks.cancel_quietly(running[0])
    reaper.reap()
    if link is not None:
        await link.close()
    return rc


async def drain_first(
    link: ControllerLink | None,
    sup: EngineSupervisor,
    stop: asyncio.Event,
    done: asyncio.Event,
    stop_received: asyncio.Event,
    wait_s: float,
) -> None:
    """SIGTERM: have the Controller terminate this node's instance (it drains it on every
    Coordinator, deletes it, and sends this node Stop), and wait for that Stop to be carried
    out, at most ``wait_s`` (nodemanager.drain_wait_s) for it to arrive. Returns at once when
    there is nothing to drain or the Controller does not take the request; ``stop`` (stdin
    closed) cuts the wait short."""
    if stop_received.is_set():  # the Controller's Stop is being carried out already
        await tasks.first_of(done, stop)
        return
    if link is None or not link.registered.is_set() or not sup.instance_id or not sup.engines or not wait_s:
        why = (
            "not registered"
            if link is None or not link.registered.is_set()
            else "drain_wait_s is 0"
            if not wait_s
            else "no instance engines"
        )
        log.event("drain_skipped", reason=why)
        return
    instance_id = sup.instance_id
    link.leaving = True  # never registered again into a new instance
    sup.closed = True  # nor started engines
    log.event("drain_requested", instance_id=instance_id, wait_s=wait_s)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        await link.terminate_instance(f"NodeManager {sup.address} stopping (SIGTERM)", TERMINATE_TIMEOUT_S)
    except grpc.aio.AioRpcError as err:
        failure = errors.RpcFailure.of(err)
        log.warn(
            "drain_request_failed", instance_id=instance_id, code=failure.code.name, message=failure.message
        )
        return
    deadline = started + wait_s
    while not (done.is_set() or stop.is_set()):
        if stop_received.is_set():
            await tasks.first_of(done, stop)  # the Stop stops the engines, then asks for the exit
            continue
        left = deadline - loop.time()
        if left <= 0:
            break
        await tasks.first_of(done, stop, stop_received, within=left)
    outcome = (
        "stopped_by_controller" if stop_received.is_set() else "stdin_closed" if stop.is_set() else "timeout"
    )
    log.event(
        "drain_wait_over",
        instance_id=instance_id,
        outcome=outcome,
        waited_s=round(loop.time() - started, 3),
    )


def log_cpu_cores(c: NodeManagerConfig) -> None:
    """CPU platform: the cores this node's engines share, and each engine's (by DP rank; the
    launch binds them so, see launch.cpu_bind), ``;`` between engines: ``engines=0-1;2-3``."""
    cores = devices.node_cores(c.cpu_cores)
    engines = ";".join(devices.cpuset(s) for s in devices.split_cores(cores, c.parallel.dp))
    log.event("cpu_cores", cores=devices.cpuset(cores), configured=bool(c.cpu_cores), engines=engines)
