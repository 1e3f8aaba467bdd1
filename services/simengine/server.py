"""Process runtime: workers, listeners, signals and shutdown of one simulated engine.

The process runs on uvloop and serves HTTP with motor_mesh.common.httpserver: with every latency
at zero the engine must answer far faster than any router put in front of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

from motor_mesh.common import log, telemetry
from motor_mesh.common.httpmessages import Handler
from motor_mesh.common.httpserver import HttpServer
from motor_mesh.common.signals import install_stop_signals
from motor_mesh.simengine import app
from motor_mesh.simengine.app import Engine
from motor_mesh.simengine.config import EngineConfig
from motor_mesh.simengine.tokens import load_tokenizer

# In-flight requests get this long to finish on SIGTERM; hung ones are then cancelled.
DRAIN_S = 1.0
BOOTSTRAP_MAX_BODY_BYTES = 1024 * 1024


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start_workers(count: int) -> list[asyncio.subprocess.Process]:
    """Children that live exactly as long as the leader: each holds the read end of a pipe whose
    only writer is the leader, so the leader's death (even SIGKILL) reaches them as EOF. They
    stay in the leader's process group so killpg takes them too."""
    procs = []
    for i in range(count):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "motor_mesh.simengine.worker",
            "--index",
            str(i),
            stdin=asyncio.subprocess.PIPE,
        )
        procs.append(proc)
        log.event("worker_started", index=i, pid=proc.pid)
    return procs


async def stop_workers(procs: list[asyncio.subprocess.Process]) -> None:
    for proc in procs:
        if proc.stdin is not None:
            proc.stdin.close()
    for proc in procs:
        try:
            await asyncio.wait_for(proc.wait(), 2.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def _listen(handler: Handler, host: str, port: int, max_body: int) -> tuple[HttpServer, int]:
    server = HttpServer(handler, max_body_bytes=max_body)
    return server, await server.listen(host, port)


async def serve(cfg: EngineConfig) -> int:
    stop = asyncio.Event()
    # The same stop signals as every Motor process: a second one exits at once (the workers
    # follow: their pipe from us closes).
    install_stop_signals(stop.set)
    engine = Engine(cfg, await asyncio.to_thread(load_tokenizer, cfg))
    tracer = None
    if cfg.otlp_traces_endpoint or telemetry.enabled():
        from motor_mesh.simengine.tracing import make_tracer

        tracer = engine.completions.tracer = make_tracer(cfg.otlp_traces_endpoint)
    servers: list[HttpServer] = []
    workers = await start_workers(cfg.workers)
    try:
        if cfg.fault != "none":
            engine.faults.arm(
                cfg.fault, cfg.fault_after_requests, cfg.fault_after_s, after_tokens=cfg.fault_after_tokens
            )
            log.event(
                "fault_armed",
                mode=cfg.fault,
                after_requests=cfg.fault_after_requests,
                after_s=cfg.fault_after_s,
                die_after=cfg.fault_after_tokens,  # (a field named *token* would be redacted)
            )
        fields: dict[str, object] = {
            "model": engine.model_id,
            "protocol": cfg.protocol,
            "role": cfg.role,
            "engine_id": cfg.engine_id,
        }
        prefix = engine.prefix
        fields["prefix_cache"] = f"{prefix.capacity}x{prefix.block_size}" if prefix is not None else "off"
        if engine.counts_tokens:
            fields["tokenizer_file"] = engine.tokenizer.name
        if engine.kv_events is not None:
            fields.update(engine.kv_events.endpoints)
        if cfg.headless:
            log.event("headless", **fields)
        else:
            server, engine.port = await _listen(engine.handler(), cfg.host, cfg.port, app.MAX_BODY_BYTES)
            servers.append(server)
            fields = {"http": _netloc(cfg.host, engine.port), **fields}
            if engine.rendezvous is not None:
                boot, boot_port = await _listen(
                    engine.rendezvous.handler(), cfg.host, cfg.bootstrap_port or 0, BOOTSTRAP_MAX_BODY_BYTES
                )
                servers.append(boot)
                fields["bootstrap"] = _netloc(cfg.host, boot_port)
            log.event("listening", **fields)
        await stop.wait()
        log.event("stopping")
    finally:
        # Both ports drain at once: stop accepting, let requests in flight finish, cut the rest.
        await asyncio.gather(*(s.close(DRAIN_S) for s in servers))
        await engine.close()
        if tracer is not None:
            await tracer.close()
        await stop_workers(workers)
    log.event("stopped")
    return 0


def run(cfg: EngineConfig) -> int:
    import uvloop

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(serve(cfg))
    except OSError as exc:
        log.error("bind_failed", error=str(exc), host=cfg.host, port=cfg.port)
        return 1
