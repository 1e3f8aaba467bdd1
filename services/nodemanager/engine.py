"""One engine endpoint: its process group, its readiness and its death.

Status: INITIAL until the process runs, WAIT_TO_START until ``/health`` answers 200 and
``/v1/models`` lists the model (probed every 0.1 s until then), then NORMAL. Headless engines
have no HTTP server and are NORMAL while alive. Once an endpoint was NORMAL, it is ABNORMAL
while ``max_probe_failures`` consecutive health probes have failed, or, with
``engine_probe_inference`` on, ``probe_inference_failures`` consecutive inference probes (a
one-token completion, inference_probe.py: a wedged scheduler behind a ``/health`` that still
answers); it is NORMAL again once neither holds. ``engine_hang_timeout_s`` after it turned
ABNORMAL it is killed, on a timer rather than at the next probe, so the kill comes at a known
time, before the pod-restart fallback (arbiter.py) can act; the config loader refuses a hang
timeout that would not. Until an endpoint first is NORMAL, failures do not count (a model may
take minutes to load), but only within its start-up window (``engine_startup_timeout_s``): an
engine not healthy by its end is killed the same way, with one warning quoting its last output
lines. Either kill is then reported as a death, which the Controller answers with a relaunch
in place.

The engine's stdout and stderr always come through us (engine_output.py): on to our stdout, and
the last lines kept for GetStatus.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from motor_mesh.common import enums, log, procgroup, tasks
from motor_mesh.common.config import NodeManagerConfig
from motor_mesh.gen.motor.v1 import common_pb2
from motor_mesh.nodemanager import devices, inference_probe, launch
from motor_mesh.nodemanager.engine_output import LINE_LIMIT, STDOUT, Tail, pump
from motor_mesh.nodemanager.launch import EndpointSpec, LaunchParams, kv_events_ports

# How long a stopped engine's last lines may take to reach our stdout before we go on.
_DRAIN_S = 1.0
STARTUP_PROBE_S = 0.1
_EXIT_POLL_S = 0.05
# The start-up timeout's warning quotes the engine's last lines, this many characters at most.
_WARN_OUTPUT_CHARS = 2000


@dataclass(frozen=True)
class Timing:
    poll_s: float = 1.0
    probe_timeout_s: float = 2.0
    max_failures: int = 2
    startup_timeout_s: float = 1800.0
    hang_timeout_s: float = 9.0
    probe_inference: bool = False
    inference_interval_s: float = 5.0  # also each inference probe's deadline
    max_inference_failures: int = 6

    @classmethod
    def from_config(cls, c: NodeManagerConfig) -> Timing:
        return cls(
            poll_s=c.status_poll_interval_s,
            probe_timeout_s=c.status_probe_timeout_s,
            max_failures=c.max_probe_failures,
            startup_timeout_s=c.engine_startup_timeout_s,
            hang_timeout_s=c.engine_hang_timeout_s,
            probe_inference=c.engine_probe_inference,
            inference_interval_s=c.probe_inference_interval_s,
            max_inference_failures=c.probe_inference_failures,
        )


class EngineHooks(Protocol):
    def status_changed(self, engine: Engine) -> None: ...

    def engine_died(self, engine: Engine, pid: int, detail: str) -> None: ...

    def engine_unhealthy(self, engine: Engine, detail: str) -> None: ...

    def probed(self, seconds: float, ok: bool) -> None: ...

    def inference_probed(self, ok: bool) -> None: ...


class Engine:
    def __init__(
        self,
        spec: EndpointSpec,
        params: LaunchParams,
        bootstrap_port: int,
        timing: Timing,
        hooks: EngineHooks,
        reaper: procgroup.Reaper,
        http: aiohttp.ClientSession,
    ) -> None:
        self.spec = spec
        self.params = params
        self.bootstrap_port = bootstrap_port
        # Fixed by the launch, so reported even while the process is down or relaunching.
        self.kv_events_port, self.kv_events_replay_port = kv_events_ports(params, spec)
        self.timing = timing
        self.hooks = hooks
        self.reaper = reaper
        self.http = http
        self.status: enums.EndpointStatus = enums.EP_INITIAL
        self.pid = 0  # the leader (= pgid) of the current process group; 0 = none
        self.last_pid = 0
        self.alive = False
        self.ever_normal = False
        self.failures = 0  # consecutive failed health probes
        self.inference_failures = 0  # consecutive failed inference probes
        self._health_why = ""  # the reason of each probe's last failure
        self._inference_why = ""
        self.started_at = 0.0
        self.abnormal_since: float | None = None
        self._hang_clock: asyncio.TimerHandle | None = None
        self.stopping = False
        self._hung = ""
        self._proc: asyncio.subprocess.Process | None = None
        self._exited = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._pump: asyncio.Task[None] | None = None
        self.tail = Tail()  # its last output lines (GetStatus, the start-up timeout's warning)

    # --- reporting ---------------------------------------------------------------------------

    def in_startup_window(self) -> bool:
        return not self.ever_normal and time.monotonic() - self.started_at < self.timing.startup_timeout_s

    def startup_elapsed(self) -> float | None:
        """Seconds since its process started, while it runs and has not been healthy yet."""
        if not self.alive or self.status != enums.EP_WAIT:
            return None
        return time.monotonic() - self.started_at

    def status_proto(self, status: enums.EndpointStatus | None = None) -> common_pb2.Endpoint:
        """:meth:`to_proto` and what an operator needs while it starts (GetStatus only: the
        elapsed time changes with every call and the lines are long; heartbeats stay small)."""
        ep = self.to_proto(status)
        elapsed = self.startup_elapsed()
        if elapsed is not None and ep.status == enums.EP_WAIT:
            ep.startup_elapsed.FromNanoseconds(int(elapsed * 1e9))
        ep.last_output_lines.extend(self.tail.lines())
        return ep

    def to_proto(self, status: enums.EndpointStatus | None = None) -> common_pb2.Endpoint:
        return common_pb2.Endpoint(
            id=self.spec.id,
            host=self.spec.host,
            port=self.spec.port,
            bootstrap_port=self.bootstrap_port,
            status=self.status if status is None else status,
            headless=self.spec.headless,
            device_ids=list(self.spec.device_ids),
            pid=self.pid,
            kv_events_port=self.kv_events_port,
            kv_events_replay_port=self.kv_events_replay_port,
        )

    def _set(self, status: enums.EndpointStatus, *, force: bool = False) -> None:
        if status == self.status and not force:
            return
        old, self.status = self.status, status
        if status == enums.EP_NORMAL:
            self.ever_normal = True
        log.event(
            "endpoint_status",
            endpoint_id=self.spec.id,
            port=self.spec.port,
            pid=self.pid or self.last_pid,
            status=common_pb2.EndpointStatus.Name(status),
            previous=common_pb2.EndpointStatus.Name(old),
        )
        self.hooks.status_changed(self)

    # --- process -----------------------------------------------------------------------------

    async def spawn(self, argv: list[str], env: dict[str, str], log_prefix: bytes | None = None) -> int:
        """Start the engine in a new session (its own process group). Its stdout and stderr are
        piped through us to our stdout (whoever runs us sees the engine's logs), every line with
        ``log_prefix`` when given (``motor up`` shows ``[engine-<k>] ``), and the last lines kept
        in ``self.tail``."""
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            limit=LINE_LIMIT,
        )
        if proc.stdout is not None:
            # Not in self._tasks: it drains to EOF even after the leader exits.
            self._pump = tasks.start(
                f"engine-{self.spec.id}-log", pump(proc.stdout, log_prefix or b"", STDOUT, self.tail)
            )
        self.reaper.watch(proc.pid)
        self._pin(proc.pid)
        self._proc = proc
        self.pid = self.last_pid = proc.pid
        self.alive = True
        self.started_at = time.monotonic()
        log.event(
            "engine_started", endpoint_id=self.spec.id, port=self.spec.port, pid=proc.pid, argv0=argv[0]
        )
        self._tasks.append(tasks.start(f"engine-{self.spec.id}-exit", self._watch_exit(proc)))
        if self.spec.headless:
            self._set(enums.EP_NORMAL)
        else:
            self._set(enums.EP_WAIT)
            self._tasks.append(tasks.spawn(f"engine-{self.spec.id}-probe", self._probe_loop))
            if inference_probe.wanted(self.timing.probe_inference, self.spec):
                self._tasks.append(
                    tasks.spawn(f"engine-{self.spec.id}-inference-probe", self._inference_probe_loop)
                )
        return proc.pid

    def _pin(self, pid: int) -> None:
        """CPU platform: the whole engine, every thread and process it starts, on its own cores.
        The OpenMP binding variable places only the compute threads; the rest (vLLM's API server
        and EngineCore, NIXL's progress thread, which polls without sleeping) would otherwise
        run anywhere, and on a small machine they starved the engines they shared cores with:
        a six-token request took 25 s instead of 0.3 s with three engines on two cores."""
        cores = launch.pinned_cores(self.params, self.spec)
        if cores and not procgroup.pin(pid, cores):
            log.warn("engine_not_pinned", endpoint_id=self.spec.id, pid=pid, cores=devices.cpuset(cores))

    async def _watch_exit(self, proc: asyncio.subprocess.Process) -> None:
        rc = await _leader_exit(proc)
        self.reaper.unwatch(proc.pid)
        self.alive = False
        self.pid = 0
        self._stop_hang_clock()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        try:
            if self.stopping:
                log.event("engine_stopped", endpoint_id=self.spec.id, pid=proc.pid, rc=rc)
                return
            detail = self._hung or (f"killed by {_signame(-rc)}" if rc < 0 else f"exit code {rc}")
            log.error(
                "engine_died", endpoint_id=self.spec.id, port=self.spec.port, pid=proc.pid, detail=detail
            )
            # Report first: the Controller should know within a second.
            self.hooks.engine_died(self, proc.pid, detail)
            self._set(enums.EP_ABNORMAL, force=True)  # pid is 0 now: always worth a beat
            # The leader is gone; anything left in its group (workers) must not keep a port.
            await procgroup.stop_group(proc.pid, 0, self.reaper)
        finally:
            self._exited.set()

    async def stop(self, grace_s: float) -> None:
        """Stop the process group; returns once no member is left (ESRCH)."""
        self.stopping = True
        self._stop_hang_clock()
        proc = self._proc
        if proc is None:
            return
        for task in self._tasks:
            if task.get_name().endswith("-probe"):  # the health and the inference probe
                task.cancel()
        await procgroup.stop_group(proc.pid, grace_s, self.reaper)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._exited.wait(), 10)
        if self._pump is not None:
            # The group is gone, so the pipe is at EOF once its last bytes are read.
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._pump, 2)
            # Its last lines out before whatever we print next (the relaunch banner).
            await STDOUT.drained(_DRAIN_S)

    def kill_now(self, reason: str) -> None:
        """Kill a hung group; the exit watcher then reports it DEAD with ``reason``."""
        if self._proc is not None and self.alive:
            self._hung = reason
            procgroup.signal_group(self._proc.pid, signal.SIGKILL)

    # --- readiness ---------------------------------------------------------------------------

    async def _probe_loop(self) -> None:
        while self.alive:
            # Until it first answers, an engine is looked at often: the instance is out of
            # service until then, and a probe of a loading engine costs a refused connection.
            await asyncio.sleep(
                self.timing.poll_s if self.ever_normal else min(self.timing.poll_s, STARTUP_PROBE_S)
            )
            if not self.alive or self.stopping:
                return
            # Only probes that judge the engine count (for /metrics): polling a loading one
            # fails by design.
            judged = not self.in_startup_window()
            started = time.monotonic()
            ok, why = await self._probe()
            if self.alive and not self.stopping:
                if judged:
                    self.hooks.probed(time.monotonic() - started, ok)
                self.observe(ok, why)

    async def _inference_probe_loop(self) -> None:
        """One inference probe every ``inference_interval_s`` (start to start), once the engine
        has been NORMAL; each waits at most the interval, so none is ever stacked on another."""
        every = self.timing.inference_interval_s
        while self.alive and not self.stopping:
            started = time.monotonic()
            if self.ever_normal and not self._hung:
                ok, why = await inference_probe.ask(self.http, self.base_url, self.params, every)
                if not self.alive or self.stopping:
                    return
                self.hooks.inference_probed(ok)
                self.observe_inference(ok, why)
            await asyncio.sleep(max(0.0, every - (time.monotonic() - started)))

    def observe(self, ok: bool, why: str) -> None:
        """One health probe's outcome."""
        if ok:
            self.failures = 0
        elif self._hung:
            return  # being killed already: its exit watcher reports it
        elif not self.ever_normal:
            waited = time.monotonic() - self.started_at
            if waited >= self.timing.startup_timeout_s:
                self._startup_timed_out(waited, why)
            return  # still loading: failures do not count in the start-up window
        else:
            self.failures += 1
            self._health_why = why
        self._judge()

    def observe_inference(self, ok: bool, why: str) -> None:
        """One inference probe's outcome (sent only once the engine was NORMAL)."""
        if ok:
            self.inference_failures = 0
        else:
            self.inference_failures += 1
            self._inference_why = why
            log.warn(
                "inference_probe_failed",
                endpoint_id=self.spec.id,
                pid=self.pid,
                failures=self.inference_failures,
                threshold=self.timing.max_inference_failures,
                reason=why,
            )
        self._judge()

    def _broken(self) -> str:
        """Why the endpoint is ABNORMAL now, or "" when it is not."""
        if self.failures >= self.timing.max_failures:
            return self._health_why
        if self.inference_failures >= self.timing.max_inference_failures:
            return f"{self.inference_failures} inference probes failed in a row, last: {self._inference_why}"
        return ""

    def _judge(self) -> None:
        """NORMAL or ABNORMAL from both probes' counts; turning ABNORMAL starts the hang clock."""
        why = self._broken()
        if not why:
            self._stop_hang_clock()
            self.abnormal_since = None
            self._set(enums.EP_NORMAL)
            return
        if self.status == enums.EP_ABNORMAL or self._hung:
            return
        self.abnormal_since = time.monotonic()
        self._set(enums.EP_ABNORMAL)
        self.hooks.engine_unhealthy(self, why)
        loop = asyncio.get_running_loop()
        self._hang_clock = loop.call_later(self.timing.hang_timeout_s, self._hang_timed_out)

    def _stop_hang_clock(self) -> None:
        if self._hang_clock is not None:
            self._hang_clock.cancel()
            self._hang_clock = None

    def _hang_timed_out(self) -> None:
        self._hang_clock = None
        if not self.alive or self.stopping or self.status != enums.EP_ABNORMAL:
            return
        since = time.monotonic() - (self.abnormal_since or self.started_at)
        why = self._broken()
        log.error(
            "engine_hung", endpoint_id=self.spec.id, pid=self.pid, abnormal_s=round(since, 1), reason=why
        )
        self.kill_now(f"hung: ABNORMAL for {since:.0f}s ({why})")

    def _startup_timed_out(self, waited: float, why: str) -> None:
        """Never healthy within its start-up window: a real engine stuck loading (or waiting for
        a peer that never comes) does not recover by itself. Killed like a hung one, so its
        death report makes the Controller relaunch it; the one warning says what it last wrote."""
        last = "\n".join(self.tail.lines())[-_WARN_OUTPUT_CHARS:]
        log.warn(
            "engine_startup_timeout",
            endpoint_id=self.spec.id,
            port=self.spec.port,
            pid=self.pid,
            waited_s=round(waited, 1),
            timeout_s=self.timing.startup_timeout_s,
            probe=why,
            last_output=last,
        )
        self.kill_now(f"not healthy within {self.timing.startup_timeout_s:g}s of start-up ({why})")

    @property
    def base_url(self) -> str:
        """Where this node reaches the engine's HTTP server."""
        host = self.spec.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.spec.port}"

    async def _probe(self) -> tuple[bool, str]:
        base = self.base_url
        timeout = aiohttp.ClientTimeout(total=self.timing.probe_timeout_s)
        try:
            async with self.http.get(base + "/health", timeout=timeout) as resp:
                if resp.status != 200:
                    return False, f"/health answered {resp.status}"
            async with self.http.get(base + "/v1/models", timeout=timeout) as resp:
                if resp.status != 200:
                    return False, f"/v1/models answered {resp.status}"
                body = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as exc:
            return False, f"probe failed: {type(exc).__name__}"
        ids = (
            [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]
            if isinstance(body, dict)
            else []
        )
        # The engine may report the served name or the model path; any single model will do.
        if self.params.served_model_name in ids or self.params.model in ids or len(ids) == 1:
            return True, ""
        return False, f"/v1/models does not list {self.params.served_model_name!r}"


async def _leader_exit(proc: asyncio.subprocess.Process) -> int:
    """The leader's exit status, as soon as it is known.

    With piped output, Python 3.11's ``Process.wait()`` returns only once every holder of the
    pipe closed it, and an engine's workers may hold it after the leader died; the return code
    itself is set the moment the child watcher reaps the leader, so we watch for that too."""
    if proc.stdout is None:
        return await proc.wait()
    waiter = asyncio.ensure_future(proc.wait())
    try:
        while proc.returncode is None:
            await asyncio.wait([waiter], timeout=_EXIT_POLL_S)
        return proc.returncode
    finally:
        waiter.cancel()


def _signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"
