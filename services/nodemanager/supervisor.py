"""The engines of this node: start command, launch, stop, relaunch, and what they report.

``EngineSupervisor`` owns every :class:`Engine`; the servicer and the Controller link only talk
to it. Status changes and deaths go to an :class:`EventSink` (the heartbeat stream).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Coroutine, Iterable
from datetime import UTC, datetime
from typing import Any, Protocol

import aiohttp
import grpc

from motor_mesh.common import enums, errors, log, procgroup, tasks
from motor_mesh.common.config import EngineConfig, NodeManagerConfig
from motor_mesh.common.latency import LatencyHistogram
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2
from motor_mesh.gen.motor.v1 import nodemanager_pb2 as pb
from motor_mesh.nodemanager import launch
from motor_mesh.nodemanager.arbiter import Freeze
from motor_mesh.nodemanager.engine import Engine, Timing
from motor_mesh.nodemanager.launch import LaunchError, LaunchParams
from motor_mesh.nodemanager.statefile import EngineRecord, StateFile

ENGINE_INDEX_ENV = "MOTOR_UP_ENGINE_INDEX"
# A death report not acked within this long freezes nothing: the Controller is unreachable.
ACK_WAIT_S = 10.0
# Upper bounds (seconds) of the health probe latency histogram.
PROBE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EventSink(Protocol):
    relaunch_enabled: bool

    def beat_now(self) -> None: ...

    def engine_event(
        self, type_: controller_pb2.EngineEventType.ValueType, endpoint_id: int, pid: int, detail: str
    ) -> asyncio.Future[bool]: ...


class NullSink:
    """Registration disabled: nobody to tell."""

    relaunch_enabled = False

    def beat_now(self) -> None:
        pass

    def engine_event(
        self, type_: controller_pb2.EngineEventType.ValueType, endpoint_id: int, pid: int, detail: str
    ) -> asyncio.Future[bool]:
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        fut.set_result(False)
        return fut


def _command_key(req: pb.StartEnginesRequest) -> tuple[Any, ...]:
    """What makes two start commands the same (status and pid are not identity)."""
    eps = sorted((e.id, e.host.lower(), e.port, e.headless, tuple(e.device_ids)) for e in req.endpoints)
    heads = tuple((h.host.lower(), h.port) for h in req.heads)
    return (req.job_name, req.instance_id, req.role, req.master_host, req.node_rank, tuple(eps), heads)


class EngineSupervisor:
    def __init__(
        self, nm_cfg: NodeManagerConfig, engine_cfg: EngineConfig, state: StateFile, reaper: procgroup.Reaper
    ) -> None:
        self.nm_cfg = nm_cfg
        self.engine_cfg = engine_cfg
        self.state = state
        self.reaper = reaper
        self.timing = Timing.from_config(nm_cfg)
        self.device_env = nm_cfg.device_env  # "auto" is resolved by main before any launch
        # This process: a restarted NodeManager on the same address has a larger one.
        self.incarnation = time.time_ns()
        self.sink: EventSink = NullSink()
        self.address = f"{nm_cfg.host}:{nm_cfg.port}"  # set to the bound address by main
        self.engines: dict[int, Engine] = {}
        self.command: pb.StartEnginesRequest | None = None
        self.instance_id = 0
        # The role the engines serve (StartEngines must carry it, registration reports it): the
        # configured one until a SwitchRole. Kept for this process's life only: a restarted
        # NodeManager serves its configured role again.
        self.role: enums.Role = enums.ROLES_BY_NAME[nm_cfg.role]
        self.paused = False
        self.relaunching = False
        self.relaunch_count = 0
        self.generation = 0
        self.freeze = Freeze()
        self.lock = asyncio.Lock()
        self.closed = False
        self._http: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task[None]] = set()
        # Since the start, for /metrics: health probes of started engines, the failed ones,
        # failed inference probes, and engine process groups that died unasked.
        self.probe_latency = LatencyHistogram(PROBE_BUCKETS)
        self.probe_failures = 0
        self.inference_probe_failures = 0
        self.engine_exits = 0

    # --- what we report ----------------------------------------------------------------------

    def current_engines(self) -> Iterable[Engine]:
        return [self.engines[k] for k in sorted(self.engines)]

    def _reported(self, e: Engine) -> enums.EndpointStatus:
        if self.relaunching:
            return enums.EP_INITIAL  # engines are down on purpose: nothing status-driven to report
        if self.paused and e.status != enums.EP_ABNORMAL:
            return enums.EP_PAUSED
        return e.status

    def endpoints(self) -> list[common_pb2.Endpoint]:
        """As the heartbeats and StartEngines answers carry them."""
        return [e.to_proto(self._reported(e)) for e in self.current_engines()]

    def status_endpoints(self) -> list[common_pb2.Endpoint]:
        """As GetStatus answers them: with how long each has been starting and its last output
        lines, which the heartbeats leave out (see Engine.status_proto)."""
        return [e.status_proto(self._reported(e)) for e in self.current_engines()]

    def ready(self, relaxed: bool) -> bool:
        engines = list(self.current_engines())
        if not engines or self.relaunching:
            return False
        # Judged on what we report: a paused endpoint is not NORMAL, so a paused node is not ready.
        for e in engines:
            status = self._reported(e)
            if not e.alive:
                return False
            if status == enums.EP_NORMAL or (relaxed and e.spec.headless and status == enums.EP_WAIT):
                continue
            return False
        return True

    # --- engine hooks ------------------------------------------------------------------------

    def status_changed(self, engine: Engine) -> None:
        if engine in self.engines.values():
            self.sink.beat_now()

    def engine_died(self, engine: Engine, pid: int, detail: str) -> None:
        self.engine_exits += 1
        acked = self.sink.engine_event(enums.EVENT_DEAD, engine.spec.id, pid, detail)
        self._spawn_task(f"freeze-when-acked-{pid}", self._freeze_when_acked(acked, pid))

    def engine_unhealthy(self, engine: Engine, detail: str) -> None:
        log.warn("engine_unhealthy", endpoint_id=engine.spec.id, pid=engine.pid, detail=detail)
        self.sink.engine_event(enums.EVENT_UNHEALTHY, engine.spec.id, engine.pid, detail)

    def probed(self, seconds: float, ok: bool) -> None:
        self.probe_latency.observe(seconds)
        if not ok:
            self.probe_failures += 1

    def inference_probed(self, ok: bool) -> None:
        if not ok:
            self.inference_probe_failures += 1

    async def _freeze_when_acked(self, acked: asyncio.Future[bool], pid: int) -> None:
        # Freeze only when the Controller has the report and will relaunch; otherwise the
        # suicide fallback must go ahead.
        try:
            ok = await asyncio.wait_for(asyncio.shield(acked), ACK_WAIT_S)
        except TimeoutError:
            log.warn("death_report_unacked", pid=pid)
            return
        if ok and self.sink.relaunch_enabled:
            self.freeze.freeze(self.nm_cfg.engine_restart_wait_timeout_s, reason=f"engine {pid} died")

    def _spawn_task(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = tasks.start(name, coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- start -------------------------------------------------------------------------------

    def check_command(self, req: pb.StartEnginesRequest) -> None:
        """FAILED_PRECONDITION ``NODE_MISMATCH`` unless the command is for this node."""
        problems = []
        cfg = self.nm_cfg
        job = cfg.job_name
        if job and req.job_name != job:
            problems.append(f"job_name {req.job_name!r} is not this node's job {job!r}")
        if req.role != self.role:
            problems.append(
                f"role {enums.enum_name(common_pb2.Role, req.role)} is not this node's role "
                f"{enums.ROLE_NAMES[self.role]}"
            )
        ports = list(cfg.ports)
        got = [e.port for e in req.endpoints]
        if len(got) != len(ports) or set(got) != set(ports):
            problems.append(f"endpoint ports {sorted(got)} are not this node's ports {sorted(ports)}")
        host = cfg.host.lower()
        dp, first = cfg.parallel.dp, req.node_rank * cfg.parallel.dp
        for i, e in enumerate(req.endpoints):
            if e.host.lower() != host:
                problems.append(f"endpoints[{i}].host {e.host!r} is not this node ({host})")
            if not first <= e.id < first + dp:
                problems.append(
                    f"endpoints[{i}].id {e.id} is not a DP rank of node_rank {req.node_rank} "
                    f"(ids {first}..{first + dp - 1} with parallel.dp {dp})"
                )
        if problems:
            raise errors.precondition("NODE_MISMATCH", f"node/{self.address}", "; ".join(problems))

    def launch_params(self, req: pb.StartEnginesRequest) -> LaunchParams:
        return launch.params_for(req, self.nm_cfg, self.engine_cfg, self.device_env)

    async def start(self, req: pb.StartEnginesRequest) -> list[common_pb2.Endpoint]:
        self.check_command(req)
        async with self.lock:
            running = self.engines and all(e.alive for e in self.engines.values())
            if self.command is not None and running and _command_key(req) == _command_key(self.command):
                log.event("start_engines_repeated", instance_id=req.instance_id)
                return self.endpoints()
            if self.engines:
                log.event(
                    "start_engines_replacing", old_instance_id=self.instance_id, instance_id=req.instance_id
                )
                await self._stop_engines(self.nm_cfg.engine_stop_grace_s)
            self.command = pb.StartEnginesRequest()
            self.command.CopyFrom(req)
            self.instance_id = req.instance_id
            try:
                await self._launch(req)
            except LaunchError as exc:
                raise errors.error_info(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "ENGINE_LAUNCH_FAILED",
                    f"cannot launch engine: {exc}",
                ) from None
            return self.endpoints()

    async def _launch(self, req: pb.StartEnginesRequest) -> None:
        """Spawn one process group per endpoint; on any failure stop what was spawned."""
        if self.closed:
            raise LaunchError("the NodeManager is shutting down")
        if self._http is None:
            self._http = aiohttp.ClientSession()
        params = self.launch_params(req)
        specs = launch.endpoint_specs(req)
        self.generation += 1
        engines: dict[int, Engine] = {}
        try:
            for spec in specs:
                argv = launch.build_argv(params, spec)
                env = launch.build_env(params, spec)
                argv = launch.resolve(argv, env)
                engine = Engine(
                    spec,
                    params,
                    launch.bootstrap_port(params, spec),
                    self.timing,
                    self,
                    self.reaper,
                    self._http,
                )
                engines[spec.id] = engine
                self.engines = dict(engines)
                try:
                    await engine.spawn(argv, env, self._log_prefix(len(engines) - 1))
                except OSError as exc:
                    raise LaunchError(f"{argv[0]}: {exc.strerror or exc}") from exc
        except LaunchError as exc:
            log.error("engine_launch_failed", instance_id=req.instance_id, reason=str(exc))
            self.engines = engines
            await self._stop_engines(0)
            raise
        finally:
            await self._record()
        log.event(
            "engines_launched",
            instance_id=req.instance_id,
            engine_type=params.engine_type,
            pids=[e.pid for e in self.current_engines()],
        )
        self.sink.beat_now()

    def _log_prefix(self, position: int) -> bytes | None:
        """``[engine-<k>] `` under ``motor up``, which numbers the engines and passes this node's
        first k in MOTOR_UP_ENGINE_INDEX; None elsewhere (engine output is passed on as is)."""
        base = os.environ.get(ENGINE_INDEX_ENV, "")
        if not base.isdigit():
            return None
        return f"[engine-{int(base) + position}] ".encode()

    async def _record(self) -> None:
        records = []
        for e in self.current_engines():
            if not e.alive:
                continue
            info = procgroup.proc_info(e.pid)
            markers = ["engine-sim", "vllm", "VLLM", "sglang", f"--port {e.spec.port}"]
            records.append(
                EngineRecord(e.spec.id, e.spec.port, e.pid, e.pid, info.start_ticks if info else 0, markers)
            )
        try:
            await self.state.save(records)
        except OSError as exc:
            log.error("engine_state_write_failed", path=str(self.state.path), reason=str(exc))

    # --- stop --------------------------------------------------------------------------------

    async def _stop_engines(self, grace_s: float) -> None:
        engines = list(self.engines.values())
        if not engines:
            return
        await asyncio.gather(*(e.stop(grace_s) for e in engines))
        self.engines = {}
        await self._record()
        log.event("engines_stopped", count=len(engines))

    async def stop_all(self, grace_s: float) -> None:
        async with self.lock:
            await self._stop_engines(grace_s)
        self.sink.beat_now()

    def kill_all_now(self) -> None:
        """A forced exit: SIGKILL every engine group at once. The next start would find them in
        engines.json and kill them too, but until then they would hold their ports."""
        for e in self.engines.values():
            if e.pid:
                procgroup.signal_group(e.pid, signal.SIGKILL)

    async def close(self, grace_s: float) -> None:
        """Shutdown: stop every engine (without waiting for a relaunch in progress)."""
        self.closed = True
        for e in list(self.engines.values()):
            e.stopping = True
        await asyncio.gather(*(e.stop(grace_s) for e in list(self.engines.values())))
        self.engines = {}
        await self._record()
        for task in list(self._background):
            task.cancel()
        if self._http is not None:
            await self._http.close()

    # --- pause / relaunch --------------------------------------------------------------------

    def set_paused(self, paused: bool) -> None:
        if paused != self.paused:
            self.paused = paused
            log.event("paused" if paused else "resumed")
            self.sink.beat_now()

    async def restart(self, req: pb.RestartEnginesRequest) -> int:
        if req.instance_id and self.instance_id and req.instance_id != self.instance_id:
            raise errors.precondition(
                "INSTANCE_MISMATCH",
                f"instance/{req.instance_id}",
                f"this node serves instance {self.instance_id}, not {req.instance_id}",
            )
        if req.action == enums.ABORT:
            self.freeze.unfreeze(reason="relaunch aborted")
            return self.relaunch_count
        self._refuse_while_relaunching()
        self._require_command()
        return await self._relaunch("relaunch")

    async def switch_role(self, req: pb.SwitchRoleRequest) -> tuple[enums.Role, bool, int]:
        """SwitchRole: relaunch the engines from the recorded command with ``req.role`` in it.
        Returns the role served now, whether this call relaunched, and the relaunch count."""
        if self.instance_id and req.instance_id != self.instance_id:
            raise errors.precondition(
                "INSTANCE_MISMATCH",
                f"instance/{req.instance_id}",
                f"this node serves instance {self.instance_id}, not {req.instance_id}",
            )
        command = self._require_command()
        if self.role == enums.UNION:
            raise errors.precondition(
                "ROLE_NOT_SWITCHABLE",
                f"node/{self.address}",
                "this node serves UNION (prefill and decode in one engine): no role to switch to",
            )
        if req.role == self.role and command.role == req.role and self.engines:
            # Served already: a Controller that lost the first answer asks again. (After a
            # launch that failed there are no engines: asking again launches them.)
            return self.role, False, self.relaunch_count
        self._refuse_while_relaunching()
        count = await self._relaunch("role switch", req.role)
        return self.role, True, count

    def _refuse_while_relaunching(self) -> None:
        if self.relaunching:
            raise errors.error_info(
                grpc.StatusCode.ABORTED, "RELAUNCH_IN_PROGRESS", "a relaunch is already running"
            )

    def _require_command(self) -> pb.StartEnginesRequest:
        if self.command is None:
            raise errors.precondition(
                "NO_START_RECORDED", f"node/{self.address}", "no start command recorded"
            )
        return self.command

    async def _relaunch(self, reason: str, role: enums.Role | None = None) -> int:
        """Stop the engines and launch them again from the recorded start command, with ``role``
        in it from now on when given (a role switch), holding the suicide fallback meanwhile and
        reporting the endpoints INITIAL. Returns the relaunch count; INTERNAL RELAUNCH_FAILED
        (the hold lifted, no engines running) when the launch fails."""
        self.relaunching = True
        self.freeze.freeze(self.nm_cfg.engine_restart_freeze_s, reason=reason)
        self.sink.beat_now()
        try:
            async with self.lock:
                await self._stop_engines(self.nm_cfg.engine_stop_grace_s)
                command = self._require_command()
                previous = self.role
                if role is not None:
                    # The recorded command changes with the role, so that a later RestartEngines
                    # (or a repeated StartEngines, which must carry the new role) matches it.
                    switched = pb.StartEnginesRequest()
                    switched.CopyFrom(command)
                    switched.role = role
                    self.command = command = switched
                    self.role = role
                self.relaunch_count += 1
                stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
                print(f"[ENGINE RELAUNCH #{self.relaunch_count} {stamp}]", flush=True)
                if role is None:
                    log.event(
                        "engine_relaunch", relaunch_count=self.relaunch_count, instance_id=self.instance_id
                    )
                else:
                    log.event(
                        "role_switched",
                        instance_id=self.instance_id,
                        from_role=enums.ROLE_NAMES[previous],
                        to_role=enums.ROLE_NAMES[role],
                        relaunch_count=self.relaunch_count,
                    )
                try:
                    await self._launch(command)
                except LaunchError as exc:
                    self.freeze.unfreeze(reason=f"{reason} failed")
                    raise errors.error_info(
                        grpc.StatusCode.INTERNAL, "RELAUNCH_FAILED", f"relaunch failed: {exc}"
                    ) from None
            return self.relaunch_count
        finally:
            self.relaunching = False
            self.sink.beat_now()
