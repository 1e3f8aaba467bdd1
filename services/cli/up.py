"""``motor up``: a whole local cluster under one supervisor, as Kubernetes would run it.

Controller and Coordinator first; once both report SERVING, one NodeManager per instance (in the
order prefill, decode, union), each launching its engines. Children that exit unasked are
restarted with backoff (0.1 s doubling to 10 s), like pods. ``READY http://host:port`` goes to
stdout exactly once, when the Coordinator is routable (``https://`` when its section has a
TLS certificate); every child's log goes to stderr with a
``[name] `` prefix (engines: ``[engine-<k>] ``).

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
import signal
import ssl
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import log, retry
from services.common.channel import open_channel
from services.common.config import Config, ConfigError, ServerConfig, load
from services.common.procgroup import Reaper, become_subreaper
from services.nodemanager.statefile import StateFile, kill_recorded_engines

# A child that ran this long was healthy: its next restart waits the shortest delay again.
HEALTHY_RUN_S = 30.0
STOP_BUDGET_S = 12.0  # under the 15 s promise, leaving time to sweep leftover engines


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


EPILOG = """\
ports (defaults, each + --port-offset): Controller 7100, Coordinator gRPC 7200 and HTTP 8000,
NodeManager i 7300 + i. Engines are numbered k = 0, 1, ... across the NodeManagers (prefill,
decode, union): NodeManager i runs engines i*dp .. i*dp+dp-1, one per DP rank, and engine k
serves on nodemanager.ports[0] + 2k (10000 + 2k) and uses that port + 1 too (SGLang bootstrap,
vLLM DP RPC). Real engines also use port + 4000 (vLLM NIXL side channel)."""


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="motor up",
        description="Run a whole local Motor cluster.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prefill", type=int, help="prefill instances (default 1 when no count is given)")
    p.add_argument("--decode", type=int, help="decode instances (default 1 when no count is given)")
    p.add_argument("--union", type=int, help="union instances (default 0)")
    p.add_argument(
        "--dp",
        type=int,
        metavar="N",
        help="DP ranks per instance, one engine each (default: nodemanager.parallel.dp, else 1)",
    )
    p.add_argument(
        "--engine-type",
        "--engine",
        dest="engine_type",
        choices=["sim", "vllm", "sglang"],
        default="sim",
        help="engine software (default sim); vllm must be on PATH, sglang importable",
    )
    p.add_argument(
        "--sim-protocol",
        choices=["vllm", "sglang"],
        default="vllm",
        help="KV hand-off the simulated engine speaks (default vllm)",
    )
    p.add_argument("--model", default="motor-sim", help="model every engine serves (default motor-sim)")
    p.add_argument("--config", metavar="FILE", help="sectioned JSON config applied to every component")
    p.add_argument("--port-offset", type=int, default=0, help="added to every default port")
    p.add_argument("--state-dir", help="state directory (default: a fresh temporary directory)")
    args = p.parse_args(argv)
    if args.prefill is None and args.decode is None and args.union is None:
        args.prefill, args.decode, args.union = 1, 1, 0
    args.prefill, args.decode, args.union = args.prefill or 0, args.decode or 0, args.union or 0
    if min(args.prefill, args.decode, args.union) < 0 or args.prefill + args.decode + args.union == 0:
        p.error("instance counts must be >= 0 and at least one instance is needed")
    if args.dp is not None and args.dp < 1:
        p.error("--dp must be >= 1")
    return args


class Cluster:
    def __init__(self, args: argparse.Namespace, cfg: Config, state: Path) -> None:
        self.args, self.cfg, self.state = args, cfg, state
        off = args.port_offset
        self.host = cfg.coordinator.host
        self.controller_addr = f"{cfg.controller.host}:{cfg.controller.port + off}"
        self.coordinator_addr = f"{self.host}:{cfg.coordinator.port + off}"
        self.http_port = cfg.coordinator.http_port + off
        self.children: list[Child] = []
        self.stopping = asyncio.Event()
        # Engines of a NodeManager that died re-parent to us (subreaper): reap them, but leave
        # our own children to asyncio, which waits on them by pid.
        self.reaper = Reaper()

    # -- what to run -------------------------------------------------------------------------
    def plan(self) -> None:
        a, off, base = self.args, self.args.port_offset, [sys.executable, "-m", "services.cli"]
        config = ["--config", a.config] if a.config else []
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.children.append(
            Child(
                "controller",
                [*base, "controller", *config, "--port", str(self.cfg.controller.port + off)],
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
                    [*base, "nodemanager", *config, "--port", str(nm_cfg.port + i + off)],
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
            env=child.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        self.reaper.watch(child.proc.pid)
        child.pump = asyncio.create_task(self._pump(child, child.proc))
        child.started = asyncio.get_running_loop().time()

    async def _pump(self, child: Child, proc: asyncio.subprocess.Process) -> None:
        prefix = f"[{child.name}] ".encode()
        assert proc.stdout is not None
        async for line in proc.stdout:
            # Engines already carry their own [engine-<k>] prefix.
            sys.stderr.buffer.write(line if line.startswith(b"[engine-") else prefix + line)
            sys.stderr.buffer.flush()

    async def supervise(self, child: Child) -> None:
        """Restart ``child`` whenever it exits without being asked, with backoff."""
        loop = asyncio.get_running_loop()
        while not self.stopping.is_set():
            assert child.proc is not None
            rc = await child.proc.wait()
            self.reaper.unwatch(child.proc.pid)
            if child.pump:
                await child.pump
            if self.stopping.is_set():
                return
            if loop.time() - child.started > HEALTHY_RUN_S:
                child.backoff.reset()
            delay = child.backoff.next()
            log.warn("restart", component=child.name, rc=rc, in_s=round(delay, 2))
            try:
                await asyncio.wait_for(self.stopping.wait(), delay)
                return
            except TimeoutError:
                pass
            child.restarts += 1
            await self.spawn(child)

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
                            print(f"READY {url}", flush=True)
                            return
                await asyncio.sleep(0.05)

    async def run(self) -> int:
        self.plan()
        reaping = asyncio.create_task(self.reaper.run())
        supervisors = []
        core, nodes = self.children[:2], self.children[2:]
        for child in core:
            await self.spawn(child)
            supervisors.append(asyncio.create_task(self.supervise(child)))
        await asyncio.gather(
            self.wait_serving(self.controller_addr, "motor.v1.Controller", self.cfg.controller),
            self.wait_serving(self.coordinator_addr, "motor.v1.Coordinator", self.cfg.coordinator),
        )
        for child in nodes:
            if self.stopping.is_set():
                break
            await self.spawn(child)
            supervisors.append(asyncio.create_task(self.supervise(child)))
        ready = asyncio.create_task(self.announce_ready())
        await self.stopping.wait()
        ready.cancel()
        await self.shutdown()
        for s in supervisors:
            s.cancel()
        reaping.cancel()
        return 0

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
            if c.proc and c.proc.returncode is None:
                c.proc.send_signal(signal.SIGTERM)
        waits = [c.proc.wait() for c in children if c.proc and c.proc.returncode is None]
        if waits:
            _, pending = await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=budget)
            if pending:
                for c in children:
                    if c.proc and c.proc.returncode is None:
                        c.proc.kill()
                await asyncio.gather(*pending, return_exceptions=True)
        for c in children:
            if c.pump:
                await asyncio.gather(c.pump, return_exceptions=True)


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
    state = Path(args.state_dir) if args.state_dir else Path(tempfile.mkdtemp(prefix="motor-up-"))
    state.mkdir(parents=True, exist_ok=True)
    # Orphaned engines (their NodeManager killed) re-parent to us, so we can reap and stop them.
    become_subreaper()

    async def amain() -> int:
        cluster = Cluster(args, cfg, state)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, cluster.stopping.set)
        log.event(
            "starting", component="up", state_dir=str(state), http=f"{cluster.host}:{cluster.http_port}"
        )
        return await cluster.run()

    return asyncio.run(amain())
