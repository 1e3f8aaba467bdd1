"""``motor up``: a whole local cluster under one supervisor, as Kubernetes would run it.

Controller and Coordinator first; once both report SERVING, one NodeManager per instance (in the
order prefill, decode, union), each launching its engines. Children that exit unasked are
restarted with backoff (0.1 s doubling to 10 s), like pods. ``READY http://host:port`` goes to
stdout exactly once, when the Coordinator is routable (``https://`` when its section has a
TLS certificate); every child's log goes to stderr with a
``[name] `` prefix (engines: ``[engine-<k>] ``).

Until READY, a child that exits with an error is a start-up failure, not a crash to restart
(a corrupt state file, a port in use, a refused registration: restarting changes nothing):
everything stops and the last line is ``motor up: <child> failed to start (exit code N): <the
child's last error line>``, exit code 1.

Stopping: SIGTERM/SIGINT stop the NodeManagers (and so their engines), then the Coordinator and
Controller; a second signal kills every process we started, and their process groups, at once
(exit 128 + signal). A child's stdin is a pipe from us that we never write to: closing it is how
we ask the child to stop (no signal: after a terminal's Ctrl-C, which reaches our whole process
group, another one would count as the child's second), and it closes by itself when we are
gone, even by SIGKILL, so no child outlives us. The temporary state directory (no
``--state-dir``) is removed on every way out but SIGKILL; a given one is kept.

Every instance has ``--dp`` DP ranks (default: ``nodemanager.parallel.dp`` of the configuration),
one engine each. Engines are numbered k = 0, 1, ... across the NodeManagers: NodeManager i owns
engines i * dp ... i * dp + dp - 1, and engine k's business port is ``nodemanager.ports[0]`` +
2k (+ ``--port-offset``), leaving port + 1 for its SGLang bootstrap / vLLM DP RPC.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import ssl
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli.up_args import parse
from services.cli.up_output import error_line, pump
from services.cli.up_procs import kill_descendants, remove_state_dir
from services.common import log, retry, tasks
from services.common.channel import open_channel
from services.common.config import Config, ConfigError, ServerConfig, load
from services.common.procgroup import Reaper, become_subreaper
from services.common.signals import STDIN_GUARD_ENV, install_stop_signals
from services.nodemanager.statefile import StateFile, kill_recorded_engines

# A child that ran this long was healthy: its next restart waits the shortest delay again.
HEALTHY_RUN_S = 30.0
STOP_BUDGET_S = 12.0  # under the 15 s promise, leaving time to sweep leftover engines
# How long the rest of a dead child's output may take: a grandchild that inherited the pipe
# (the Coordinator's workers do) can hold it open after the child is gone.
OUTPUT_DRAIN_S = 2.0
# /metrics of the Controller and of NodeManager i (+ i), where the configuration leaves it off.
CONTROLLER_METRICS_PORT, NODEMANAGER_METRICS_PORT = 9100, 9300


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    state_dir: Path | None = None  # NodeManagers: where engines.json records their engines
    proc: asyncio.subprocess.Process | None = None
    pump: asyncio.Task[None] | None = None
    restarts: int = 0
    # A child that was running fine is back at once (its work waits on it); one that keeps
    # crashing slows down to one try every 10 s.
    backoff: retry.Backoff = field(default_factory=lambda: retry.Backoff(initial=0.1, maximum=10.0))
    started: float = 0.0
    last_error: str | None = None  # the last line of its output that can say why it failed


class Cluster:
    def __init__(self, args: argparse.Namespace, cfg: Config, state: Path, *, own_state: bool) -> None:
        self.args, self.cfg, self.state = args, cfg, state
        self.own_state = own_state  # a temporary directory of ours, removed on the way out
        off = args.port_offset
        self.host = cfg.coordinator.host
        self.controller_addr = f"{cfg.controller.host}:{cfg.controller.port + off}"
        self.coordinator_addr = f"{self.host}:{cfg.coordinator.port + off}"
        self.http_port = cfg.coordinator.http_port + off
        self.children: list[Child] = []
        self.stopping = asyncio.Event()
        self.ready = False  # READY printed: from then on a child's exit is a crash to restart
        self.failure: str | None = None  # why start-up failed: our last line
        self.pumps: set[asyncio.Task[None]] = set()  # every output pump still reading
        # Engines of a NodeManager that died re-parent to us (subreaper): reap them, but leave
        # our own children to asyncio, which waits on them by pid.
        self.reaper = Reaper()

    # -- what to run -------------------------------------------------------------------------
    def plan(self) -> None:
        a, off, base = self.args, self.args.port_offset, [sys.executable, "-m", "services.cli"]
        config = ["--config", a.config] if a.config else []
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        ctl = self.cfg.controller
        self.children.append(
            Child(
                "controller",
                [
                    *base,
                    "controller",
                    *config,
                    "--port",
                    str(ctl.port + off),
                    "--metrics-port",
                    str((ctl.metrics_port or CONTROLLER_METRICS_PORT) + off),
                ],
                dict(
                    env,
                    MOTOR_CONTROLLER_COORDINATORS=json.dumps([self.coordinator_addr]),
                    MOTOR_CONTROLLER_STATE_DIR=str(self.state / "controller"),
                ),
            )
        )
        self.children.append(
            Child(
                "coordinator",
                [
                    *base,
                    "coordinator",
                    *config,
                    "--port",
                    str(self.cfg.coordinator.port + off),
                    "--http-port",
                    str(self.http_port),
                ],
                dict(env, **self._coordinator_env()),
            )
        )
        nm_cfg = self.cfg.nodemanager
        dp = a.dp or nm_cfg.parallel.dp
        nm_env = dict(env)
        if a.dp:  # replaces the configured DP size; tp, pp, ... stay as configured
            nm_env["MOTOR_NODEMANAGER_PARALLEL"] = json.dumps(asdict(replace(nm_cfg.parallel, dp=dp)))
        engine_base = nm_cfg.ports[0] + off
        roles = ["prefill"] * a.prefill + ["decode"] * a.decode + ["union"] * a.union
        seen: dict[str, int] = {}
        for i, role in enumerate(roles):
            n = seen[role] = seen.get(role, -1) + 1
            first = i * dp  # this NodeManager's engines are first .. first + dp - 1
            state_dir = self.state / f"nm-{i}"
            self.children.append(
                Child(
                    f"nm-{i}",
                    [
                        *base,
                        "nodemanager",
                        *config,
                        "--port",
                        str(nm_cfg.port + i + off),
                        "--metrics-port",
                        str((nm_cfg.metrics_port or NODEMANAGER_METRICS_PORT) + i + off),
                    ],
                    dict(
                        nm_env,
                        MOTOR_NODEMANAGER_CONTROLLER=self.controller_addr,
                        MOTOR_NODEMANAGER_JOB_NAME=f"{a.model}-{role}-{n}",
                        MOTOR_NODEMANAGER_ROLE=role,
                        MOTOR_NODEMANAGER_MODEL=a.model,
                        MOTOR_NODEMANAGER_ENGINE_TYPE=a.engine_type,
                        MOTOR_NODEMANAGER_SIM_PROTOCOL=a.sim_protocol,
                        MOTOR_NODEMANAGER_PORTS=json.dumps(
                            [engine_base + 2 * k for k in range(first, first + dp)]
                        ),
                        MOTOR_NODEMANAGER_STATE_DIR=str(state_dir),
                        # Engine output is prefixed [engine-<k>] by the NodeManager itself.
                        MOTOR_UP_ENGINE_INDEX=str(first),
                    ),
                    state_dir=state_dir,
                )
            )

    def _coordinator_env(self) -> dict[str, str]:
        """Where the Coordinator reports precision alarms: this cluster's Controller (its port
        moves with --port-offset), with the key that Controller requires unless the
        configuration names another."""
        env = {"MOTOR_COORDINATOR_CONTROLLER": self.controller_addr}
        co, ctl = self.cfg.coordinator, self.cfg.controller
        if not co.controller_key_file and ctl.management_key_file:
            env["MOTOR_COORDINATOR_CONTROLLER_KEY_FILE"] = ctl.management_key_file
        return env

    # -- running children ----------------------------------------------------------------------
    async def spawn(self, child: Child) -> None:
        child.proc = await asyncio.create_subprocess_exec(
            *child.argv,
            env=dict(child.env, **{STDIN_GUARD_ENV: "1"}),
            # Never written to: closing it is how we ask the child to stop, and it closes by
            # itself when we exit, however we exit (even by SIGKILL).
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        self.reaper.watch(child.proc.pid)
        child.last_error = None
        prefix = f"[{child.name}] ".encode()
        assert child.proc.stdout is not None

        def on_line(line: bytes) -> None:
            # Engines already carry their own [engine-<k>] prefix.
            if not line.startswith(b"[engine-"):
                child.last_error = error_line(line) or child.last_error
                line = prefix + line
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()

        child.pump = tasks.start(f"{child.name}-output", pump(child.name, child.proc.stdout, on_line))
        self.pumps.add(child.pump)
        child.pump.add_done_callback(self.pumps.discard)
        child.started = asyncio.get_running_loop().time()

    async def _drained(self, child: Child) -> None:
        """Wait (a while) until ``child``'s output is read to its end."""
        if child.pump is None:
            return
        done, _ = await asyncio.wait({child.pump}, timeout=OUTPUT_DRAIN_S)
        if not done:  # it goes on reading in the background, so nothing blocks on the pipe
            log.warn("output_still_open", component=child.name, waited_s=OUTPUT_DRAIN_S)

    async def supervise(self, child: Child) -> None:
        """Restart ``child`` whenever it exits without being asked, with backoff; before READY,
        an exit with an error ends the cluster instead."""
        loop = asyncio.get_running_loop()
        while not self.stopping.is_set():
            assert child.proc is not None
            rc = await child.proc.wait()
            self.reaper.unwatch(child.proc.pid)
            await self._drained(child)  # its last lines, the error among them, are read
            if self.stopping.is_set():
                return
            if rc > 0 and not self.ready:
                self._start_failed(child, rc)
                return
            if loop.time() - child.started > HEALTHY_RUN_S:
                child.backoff.reset()
            delay = child.backoff.next()
            log.warn("restart", component=child.name, rc=rc, in_s=round(delay, 2))
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), delay)
                if self.stopping.is_set():
                    return
                try:
                    await self.spawn(child)
                    break
                except OSError:
                    log.exception("spawn_failed", component=child.name)
                    delay = child.backoff.next()
            child.restarts += 1

    def _start_failed(self, child: Child, rc: int) -> None:
        why = child.last_error
        log.error("start_failed", component=child.name, rc=rc, reason=why or "")
        self.failure = f"{child.name} failed to start (exit code {rc})" + (f": {why}" if why else "")
        self.stopping.set()

    async def wait_serving(self, addr: str, service: str, section: ServerConfig) -> None:
        # The section's TLS settings: a cluster configured for TLS answers nothing in plaintext.
        async with open_channel(addr, tls=section) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while not self.stopping.is_set():
                with contextlib.suppress(grpc.aio.AioRpcError):  # not up yet: the loop retries
                    r = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                await asyncio.sleep(0.05)

    async def announce_ready(self) -> None:
        co = self.cfg.coordinator
        https = bool(co.tls_cert_file and co.tls_key_file)
        url = f"{'https' if https else 'http'}://{self.host}:{self.http_port}"
        ssl_ctx: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=co.tls_ca_file or None) if https else True
        )
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while not self.stopping.is_set():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):  # not routable yet
                    async with http.get(f"{url}/readiness", ssl=ssl_ctx) as resp:
                        if resp.status == 200:
                            self.ready = True
                            print(f"READY {url}", flush=True)
                            return
                await asyncio.sleep(0.05)

    async def run(self) -> int:
        """0 after a stop that was asked for, 1 when start-up failed (``self.failure``)."""
        self.plan()
        running = [tasks.spawn("reaper", self.reaper.run)]
        core, nodes = self.children[:2], self.children[2:]
        try:
            for child in core:
                await self.spawn(child)
                running.append(tasks.start(f"{child.name}-supervisor", self.supervise(child)))
            await asyncio.gather(
                self.wait_serving(self.controller_addr, "motor.v1.Controller", self.cfg.controller),
                self.wait_serving(self.coordinator_addr, "motor.v1.Coordinator", self.cfg.coordinator),
            )
            for child in nodes:
                if self.stopping.is_set():
                    break
                await self.spawn(child)
                running.append(tasks.start(f"{child.name}-supervisor", self.supervise(child)))
            running.append(tasks.start("announce-ready", self.announce_ready()))
            await self.stopping.wait()
        except OSError as exc:  # a child could not even be started (spawn() raised)
            log.exception("spawn_failed")
            self.failure = f"cannot start the cluster: {exc}"
        finally:
            await self.shutdown()
            for task in [*running, *self.pumps]:
                await tasks.cancel_quietly(task)
        return 1 if self.failure else 0

    async def shutdown(self) -> None:
        """NodeManagers first (they stop their engines), then the Coordinator and Controller."""
        log.event("stopping", component="up")
        nodes = [c for c in self.children[2:] if c.proc]
        core = [c for c in reversed(self.children[:2]) if c.proc]
        await self._terminate(nodes, STOP_BUDGET_S * 2 / 3)
        await self._terminate(core, STOP_BUDGET_S / 3)
        # A NodeManager that died hard leaves engines behind: its record says which.
        for c in nodes:
            if c.state_dir is not None:
                await kill_recorded_engines(StateFile(c.state_dir), self.reaper)
        log.event("stopped", component="up")

    async def _terminate(self, children: list[Child], budget: float) -> None:
        for c in children:
            if c.proc and c.proc.returncode is None and c.proc.stdin is not None:
                c.proc.stdin.close()  # the stop request (see the module's docstring)
        waits = [c.proc.wait() for c in children if c.proc and c.proc.returncode is None]
        if waits:
            _, pending = await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=budget)
            if pending:
                for c in children:
                    if c.proc and c.proc.returncode is None:
                        c.proc.kill()
                await asyncio.gather(*pending, return_exceptions=True)
        for c in children:
            await self._drained(c)

    def kill_all(self) -> None:
        """The forced exit (a second signal), which must not wait for anything: SIGKILL every
        process we started and every process group of theirs (engines), and remove our
        temporary state directory."""
        kill_descendants(os.getpid())
        remove_state_dir(self.state, self.own_state)


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        cfg = load(args.config)
    except ConfigError as err:
        for line in err.errors:
            print(line, file=sys.stderr)
        return 1
    if cfg.nodemanager.parallel.nnodes > 1:
        # Every NodeManager here would be node_rank 0: the instance could never assemble.
        print(
            "motor up runs each instance on one node: nodemanager.parallel.nnodes must be 1", file=sys.stderr
        )
        return 1
    log.setup("up", cfg.controller.log_format)
    own_state = not args.state_dir
    state = Path(args.state_dir) if args.state_dir else Path(tempfile.mkdtemp(prefix="motor-up-"))
    cluster: Cluster | None = None
    try:
        state.mkdir(parents=True, exist_ok=True)
        # Orphaned engines (their NodeManager killed) re-parent to us, so we can reap and stop them.
        become_subreaper()

        async def amain() -> int:
            nonlocal cluster
            cluster = Cluster(args, cfg, state, own_state=own_state)
            install_stop_signals(cluster.stopping.set, before_forced_exit=cluster.kill_all)
            log.event(
                "starting", component="up", state_dir=str(state), http=f"{cluster.host}:{cluster.http_port}"
            )
            return await cluster.run()

        rc = asyncio.run(amain())
    finally:
        remove_state_dir(state, own_state)
    if cluster is not None and cluster.failure:
        # Last, after every child's own last words: the one line that says what went wrong.
        print(f"motor up: {cluster.failure}", file=sys.stderr, flush=True)
    return rc
