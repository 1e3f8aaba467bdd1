"""``motor up``: a whole local cluster under one supervisor, as Kubernetes would run it.

Controller and Coordinator first; once both report SERVING, one NodeManager per instance (in the
order prefill, decode, union), each launching its engines. With ``--ha``, an etcd before them
(once its /health says true) and two Controllers on it: the NodeManagers start once one of them
leads (services/cli/up_plan.py says what runs). Children that exit unasked are
restarted with backoff (0.1 s doubling to 10 s), like pods. ``READY http://host:port`` goes to
stdout exactly once, when the Coordinator is routable (``https://`` when its section has a
TLS certificate); every child's log goes to stderr with a
``[name] `` prefix (engines: ``[engine-<k>] ``).

Until READY, a child that exits with an error is a start-up failure, not a crash to restart
(a corrupt state file, a port in use, a refused registration: restarting changes nothing):
everything stops and the last line is ``motor up: <child> failed to start (exit code N): <the
child's last error line>``, exit code 1. The ports whose answers READY waits on (the
Controllers', the Coordinator's gRPC and HTTP) are tried first: were one held by another
cluster, its servers would answer for ours and READY would name a cluster we did not start, so
a port in use is the one line ``motor up: <what> <host:port>: address already in use ...``,
exit code 1, before anything starts.

Stopping: SIGTERM/SIGINT stop the NodeManagers (and so their engines), then the Coordinator and
Controllers, then etcd; a second signal kills every process we started, and their process
groups, at once (exit 128 + signal). A child's stdin is a pipe from us that we never write to:
closing it is how we ask the child to stop (no signal: after a terminal's Ctrl-C, which reaches
our whole process group, another one would count as the child's second), and it closes by itself
when we are gone, even by SIGKILL, so no child outlives us. etcd, which does not watch its stdin,
runs in a session of its own (a Ctrl-C does not reach it), is stopped by SIGTERM, and is sent
SIGTERM by the kernel when we are gone. The temporary state directory (no ``--state-dir``) is
removed on every way out but SIGKILL; a given one is kept.

While READY is awaited, every ``PROGRESS_S`` seconds (``MOTOR_UP_PROGRESS_S`` overrides it) a
line on stderr for each engine it still waits for (``motor up: waiting for engine-<k> (nm-<i>,
port P, pid N): starting for 2m13s; last output: ...``), from each NodeManager's GetStatus: a real
model takes minutes to load, and without this nothing would say what it is doing.

While it runs it follows the Controller's desired instance counts (``motor scale``): once a
Controller answers it records its own counts there, and from READY on it starts instances or
drains and stops the highest-numbered ones to match (services/cli/up_scale.py). A NodeManager it
removes exits unrestarted; its stop stops the ones it added too.

Every instance has ``--dp`` DP ranks (default: ``nodemanager.parallel.dp`` of the configuration),
one engine each. Engines are numbered k = 0, 1, ... across the NodeManagers: NodeManager i owns
engines i * dp ... i * dp + dp - 1, and engine k's business port is ``nodemanager.ports[0]`` +
2k (+ ``--port-offset``), leaving port + 1 for its SGLang bootstrap / vLLM DP RPC.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import socket
import ssl
import sys
import tempfile
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from motor_mesh.cli.status_table import clip, duration
from motor_mesh.cli.up_args import parse
from motor_mesh.cli.up_output import error_line, pump
from motor_mesh.cli.up_plan import NO_ETCD, Child, etcd_binary, plan
from motor_mesh.cli.up_procs import die_with_parent, kill_descendants, remove_state_dir
from motor_mesh.cli.up_scale import Scaler
from motor_mesh.common import enums, log, tasks
from motor_mesh.common.channel import open_channel
from motor_mesh.common.config import Config, ConfigError, ServerConfig, load, read_key_file
from motor_mesh.common.config.loader import WILDCARDS
from motor_mesh.common.procgroup import Reaper, become_subreaper
from motor_mesh.common.signals import STDIN_GUARD_ENV, install_stop_signals
from motor_mesh.gen.motor.v1 import common_pb2, nodemanager_pb2, nodemanager_pb2_grpc
from motor_mesh.nodemanager.statefile import StateFile, kill_recorded_engines

# A child that ran this long was healthy: its next restart waits the shortest delay again.
HEALTHY_RUN_S = 30.0
STOP_BUDGET_S = 12.0  # under the 15 s promise, leaving time to sweep leftover engines
# How long the rest of a dead child's output may take: a grandchild that inherited the pipe
# (the Coordinator's workers do) can hold it open after the child is gone.
OUTPUT_DRAIN_S = 2.0
ETCD_STOP_S = 1.5  # etcd stops last, after the Controllers; taken from the NodeManagers' share
# Until READY, how often each engine still waited for is reported on stderr; the variable
# overrides it (tests, or an impatient operator).
PROGRESS_S = 15.0
PROGRESS_ENV = "MOTOR_UP_PROGRESS_S"
PROGRESS_RPC_S = 2.0  # the deadline of each NodeManager's GetStatus for a report
PROGRESS_LINE_CHARS = 200  # an engine's last output line, cut to this in a report


class Cluster:
    def __init__(
        self, args: argparse.Namespace, cfg: Config, state: Path, *, own_state: bool, etcd: str = "etcd"
    ) -> None:
        self.args, self.cfg, self.state = args, cfg, state
        self.own_state = own_state  # a temporary directory of ours, removed on the way out
        self.plan = plan(args, cfg, state, etcd)
        self.children = self.plan.children
        self.host = cfg.coordinator.host
        self.http_port = cfg.coordinator.http_port + args.port_offset
        self.stopping = asyncio.Event()
        self.ready = False  # READY printed: from then on a child's exit is a crash to restart
        self.announced = asyncio.Event()  # set with ``ready``
        self.failure: str | None = None  # why start-up failed: our last line
        self.pumps: set[asyncio.Task[None]] = set()  # every output pump still reading
        self.running: list[asyncio.Task[None]] = []  # the reaper and every child's supervisor
        # Engines of a NodeManager that died re-parent to us (subreaper): reap them, but leave
        # our own children to asyncio, which waits on them by pid.
        self.reaper = Reaper()

    # -- running children ----------------------------------------------------------------------
    async def start(self, child: Child) -> None:
        """Run ``child`` and restart it whenever it exits unasked, until we stop (or it is
        removed: ``child.retiring``)."""
        await self.spawn(child)
        child.supervisor = tasks.start(f"{child.name}-supervisor", self.supervise(child))
        self.running[:] = [t for t in self.running if not t.done()]  # a removed child's is
        self.running.append(child.supervisor)

    async def spawn(self, child: Child) -> None:
        child.proc = await asyncio.create_subprocess_exec(
            *child.argv,
            env=dict(child.env, **{STDIN_GUARD_ENV: "1"}),
            # Never written to: closing it is how we ask the child to stop, and it closes by
            # itself when we exit, however we exit (even by SIGKILL). etcd ignores it: the
            # kernel stops it when we are gone instead.
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=child.foreign,
            preexec_fn=die_with_parent() if child.foreign else None,
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
            if self.stopping.is_set() or child.retiring.is_set():  # the exit we asked for
                return
            if rc > 0 and not self.ready and rc not in child.restart_codes:
                self._start_failed(child, rc)
                return
            if loop.time() - child.started > HEALTHY_RUN_S:
                child.backoff.reset()
            delay = child.backoff.next()
            log.warn("restart", component=child.name, rc=rc, in_s=round(delay, 2))
            while True:
                await tasks.first_of(self.stopping, child.retiring, within=delay)
                if self.stopping.is_set() or child.retiring.is_set():
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

    async def wait_leader(self) -> None:
        """Until one Controller serves motor.v1.Controller: the leader (standbys answer
        NOT_SERVING)."""
        waits = [
            tasks.start(f"wait-{c.name}", self.wait_serving(addr, "motor.v1.Controller", self.cfg.controller))
            for c, addr in zip(self.plan.controllers, self.plan.controller_addrs, strict=True)
        ]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                await tasks.cancel_quietly(w)

    async def wait_etcd(self, endpoint: str) -> None:
        """Until etcd's /health says true: it has a leader and serves requests."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while not self.stopping.is_set():
                # Not up yet (refused, or a body that is not the answer yet): the loop retries.
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    async with http.get(f"http://{endpoint}/health") as resp:
                        if (await resp.json(content_type=None)).get("health") == "true":
                            log.event("etcd_ready", endpoint=endpoint)
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
                            self.announced.set()
                            print(f"READY {url}", flush=True)
                            return
                await asyncio.sleep(0.05)

    # -- progress until READY --------------------------------------------------------------------
    async def report_progress(self, interval: float) -> None:
        """Every ``interval`` s until READY, one line on stderr per engine READY still waits for
        (and per NodeManager that cannot say yet), so a slow or stuck start-up is seen."""
        key = await asyncio.to_thread(nodemanager_key, self.cfg.nodemanager)
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), interval)
            if self.stopping.is_set():
                return
            if self.ready:
                break
            nodes = [c for c in self.plan.nodes if c.proc is not None]
            answers = await asyncio.gather(*(self._node_status(c, key) for c in nodes))
            lines = [line for c, got in zip(nodes, answers, strict=True) for line in self._progress(c, got)]
            if self.ready:  # READY came while we asked: nothing is waited for any more
                break
            for line in lines or ["motor up: every engine is ready; waiting for the Coordinator to route"]:
                print(line, file=sys.stderr, flush=True)
        # Said once, so whoever watches the reports knows none will follow.
        log.event("progress_done", reason="ready")

    async def _node_status(
        self, child: Child, key: str | None
    ) -> nodemanager_pb2.GetStatusResponse | grpc.aio.AioRpcError:
        async with open_channel(
            self.nodemanager_address(child), key=key, tls=self.cfg.nodemanager, retries=False
        ) as ch:
            try:
                return await nodemanager_pb2_grpc.NodeManagerStub(ch).GetStatus(
                    nodemanager_pb2.GetStatusRequest(), timeout=PROGRESS_RPC_S, wait_for_ready=False
                )
            except grpc.aio.AioRpcError as err:
                return err

    def nodemanager_address(self, child: Child) -> str:
        """Where NodeManager ``child`` serves gRPC: its ``--port`` on the configured host."""
        host = self.cfg.nodemanager.host
        host = "127.0.0.1" if host in WILDCARDS else host
        port = child.argv[child.argv.index("--port") + 1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _progress(
        self, child: Child, got: nodemanager_pb2.GetStatusResponse | grpc.aio.AioRpcError
    ) -> list[str]:
        where = f"{child.name} ({self.nodemanager_address(child)})"
        if isinstance(got, grpc.aio.AioRpcError):
            code = got.code().name
            if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                return [f"motor up: waiting for {where}: not answering yet ({code})"]
            return [f"motor up: waiting for {where}: GetStatus failed: {code}: {got.details() or ''}"]
        if not got.endpoints:
            return [f"motor up: waiting for {where}: no engines yet (its instance is not assembled yet)"]
        first = int(child.env.get("MOTOR_UP_ENGINE_INDEX", "0") or 0)
        # Engine k is the NodeManager's first + its position (GetStatus lists them by id, the
        # order they were spawned and prefixed [engine-<k>] in).
        return [
            engine_progress(f"engine-{first + n}", child.name, ep)
            for n, ep in enumerate(got.endpoints)
            if ep.status != enums.EP_NORMAL
        ]

    def probed(self) -> list[tuple[str, str, int]]:
        """(what, host, port) of every server READY waits on, where it binds."""
        ctl, co, off = self.cfg.controller, self.cfg.coordinator, self.args.port_offset
        controllers = [
            (
                "the Controller's gRPC" + (f" {i}" if len(self.plan.controllers) > 1 else ""),
                ctl.host,
                ctl.port + i + off,
            )
            for i in range(len(self.plan.controllers))
        ]
        return [
            *controllers,
            ("the Coordinator's gRPC", co.host, co.port + off),
            ("the Coordinator's HTTP", co.host, co.http_port + off),
        ]

    async def run(self) -> int:
        """0 after a stop that was asked for, 1 when start-up failed (``self.failure``)."""
        taken = await asyncio.to_thread(first_in_use, self.probed())
        if taken is not None:
            self.failure = taken
            return 1
        running = self.running
        running.append(tasks.spawn("reaper", self.reaper.run))
        p = self.plan
        scaler = Scaler(self, self.start)
        follow: asyncio.Task[None] | None = None
        try:
            if p.etcd is not None:
                await self.start(p.etcd)
                await self.wait_etcd(p.etcd_endpoint)
            for child in [*p.controllers, p.coordinator]:
                if not self.stopping.is_set():
                    await self.start(child)
            # The Controller records our counts as the desired ones once it answers; from READY
            # on, the cluster follows them (up_scale.py).
            follow = tasks.start("scale", scaler.run(self.announced))
            await asyncio.gather(
                self.wait_leader(),
                self.wait_serving(p.coordinator_addr, "motor.v1.Coordinator", self.cfg.coordinator),
            )
            for child in p.nodes:
                if self.stopping.is_set():
                    break
                await self.start(child)
            running.append(tasks.start("announce-ready", self.announce_ready()))
            running.append(tasks.start("progress", self.report_progress(progress_interval())))
            await self.stopping.wait()
        except OSError as exc:  # a child could not even be started (spawn() raised)
            log.exception("spawn_failed")
            self.failure = f"cannot start the cluster: {exc}"
        finally:
            # Nothing is started or removed any more: whatever runs is stopped by the shutdown.
            await tasks.cancel_quietly(follow)
            await scaler.close()
            await self.shutdown()
            for task in [*running, *self.pumps]:
                await tasks.cancel_quietly(task)
        return 1 if self.failure else 0

    async def shutdown(self) -> None:
        """NodeManagers first (they stop their engines), then the Coordinator and Controllers,
        then etcd: a leader gives its lease back on the way out."""
        log.event("stopping", component="up")
        p = self.plan
        nodes = [c for c in p.nodes if c.proc]
        core = [c for c in [p.coordinator, *reversed(p.controllers)] if c.proc]
        etcd = [p.etcd] if p.etcd is not None and p.etcd.proc else []
        await self._terminate(nodes, STOP_BUDGET_S * 2 / 3 - (ETCD_STOP_S if p.etcd else 0))
        await self._terminate(core, STOP_BUDGET_S / 3)
        await self._terminate(etcd, ETCD_STOP_S)
        # A NodeManager that died hard leaves engines behind: its record says which.
        for c in nodes:
            if c.state_dir is not None:
                await kill_recorded_engines(StateFile(c.state_dir), self.reaper)
        log.event("stopped", component="up")

    async def _terminate(self, children: list[Child], budget: float) -> None:
        for c in children:
            if c.proc and c.proc.returncode is None and c.foreign:
                c.proc.terminate()
            elif c.proc and c.proc.returncode is None and c.proc.stdin is not None:
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


def engine_progress(engine: str, node: str, ep: common_pb2.Endpoint) -> str:
    """``motor up: waiting for engine-0 (nm-0, port 10000, pid 1234): starting for 2m13s; last
    output: ...``"""
    pid = f"pid {ep.pid}" if ep.pid else "no pid"
    if ep.HasField("startup_elapsed"):
        state = f"starting for {duration(ep.startup_elapsed.ToNanoseconds() / 1e9)}"
    else:
        state = enums.endpoint_status_name(ep.status)
    last = (
        f"last output: {clip(ep.last_output_lines[-1], PROGRESS_LINE_CHARS)}"
        if ep.last_output_lines
        else "no output yet"
    )
    return f"motor up: waiting for {engine} ({node}, port {ep.port}, {pid}): {state}; {last}"


def progress_interval() -> float:
    """``PROGRESS_S``, or the positive number of seconds ``MOTOR_UP_PROGRESS_S`` says."""
    try:
        value = float(os.environ.get(PROGRESS_ENV, ""))
    except ValueError:
        return PROGRESS_S
    return value if 0 < value < 86400 else PROGRESS_S


def nodemanager_key(section: ServerConfig) -> str | None:
    """The management key the NodeManagers require, when they do (their section's key file);
    None when none is set or it cannot be read (the NodeManager then says so itself)."""
    if not section.management_key_file:
        return None
    try:
        return read_key_file(section.management_key_file)
    except (ConfigError, OSError):
        return None


def first_in_use(addresses: list[tuple[str, str, int]]) -> str | None:
    """What to say of the first of ``addresses`` a server already listens on, if any. A bind
    with SO_REUSEADDR, as our servers bind: only a listener refuses it, not a closed connection
    lingering in TIME_WAIT."""
    for what, host, port in addresses:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return (
                        f"{what} {host}:{port}: address already in use (another cluster there? "
                        "--port-offset moves every port)"
                    )
                # Any other refusal (a host not of this machine) is the server's to report.
    return None


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
    etcd = ""
    if args.ha:
        etcd = etcd_binary() or ""
        if not etcd:
            print(NO_ETCD, file=sys.stderr)
            return 1
    own_state = not args.state_dir
    state = Path(args.state_dir) if args.state_dir else Path(tempfile.mkdtemp(prefix="motor-up-"))
    cluster: Cluster | None = None
    try:
        state.mkdir(parents=True, exist_ok=True)
        # Orphaned engines (their NodeManager killed) re-parent to us, so we can reap and stop them.
        become_subreaper()

        async def amain() -> int:
            nonlocal cluster
            cluster = Cluster(args, cfg, state, own_state=own_state, etcd=etcd)
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
