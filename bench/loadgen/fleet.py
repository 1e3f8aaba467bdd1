"""A load-generator process: ``python -m bench.loadgen.fleet --target H:P --nodes N ...``.

Drives N fake NodeManagers against one Controller (or the echo baseline) over at most
``--channels`` grpc.aio channels, each its own TCP connection, and serves their NodeManager side
from one shared fake NodeManager server. Talks to its parent in JSON lines:

- prints ``{"event": "listening", "nm_port": P}`` once the fake NodeManager server is up;
- reads commands on stdin, one per line, and answers each with one JSON line:
  ``start <rate> [<inflight>]`` (begin registering at up to <rate> nodes/s, at most <inflight>
  not yet assembled), ``status``, ``mark`` (start recording
  ack round trips), ``report <path>`` (stop recording, write the samples to <path> as raw
  doubles, answer the counts), ``stop``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import grpc

from bench.loadgen.fakenm import FakeNodeManagers
from bench.loadgen.node import FakeNode, NodeSpec, Stats
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2_grpc

ROLES = (common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE)


def channel(target: str) -> grpc.aio.Channel:
    # A local subchannel pool: otherwise channels with equal arguments share one connection.
    return grpc.aio.insecure_channel(
        target,
        options=[
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.keepalive_time_ms", 20000),
            ("grpc.keepalive_timeout_ms", 10000),
            ("grpc.max_receive_message_length", 64 << 20),
        ],
    )


class Fleet:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stats = Stats()
        self.nm = FakeNodeManagers()
        self.channels = [channel(args.target) for _ in range(args.channels)]
        self.stubs = [controller_pb2_grpc.ControllerStub(c) for c in self.channels]
        self.nodes: list[FakeNode] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.ramp: asyncio.Task[None] | None = None
        self.failures = 0
        self.mark_t = 0.0
        self.mark_counts = (0, 0, 0)

    async def start_server(self) -> int:
        port = await self.nm.start()
        a = self.args
        for i in range(a.nodes):
            spec = NodeSpec(
                job_name=f"{a.prefix}-{i}",
                role=ROLES[i % 2],
                model_name="bench-model",
                host="127.0.0.1",
                nm_port=port,
                port=a.first_port + i,
            )
            node = FakeNode(spec, self.stubs[i % len(self.stubs)], self.stats, a.interval)
            self.nm.add(node)
            self.nodes.append(node)
        return port

    async def _ramp(self, rate: float, inflight: int) -> None:
        """Launch nodes at up to ``rate``/s with at most ``inflight`` of them not yet through
        (assembled: StartEngines received; for the echo baseline: registered). The closed loop
        lets the Controller set the pace instead of burying it under a queue of calls that gRPC
        ends up cancelling."""
        loop = asyncio.get_running_loop()
        s = self.stats
        t0 = loop.time()
        for i, node in enumerate(self.nodes):
            due = t0 + i / rate
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            while i - (s.registered if self.args.assume_started else s.started) >= inflight:
                s.progress.clear()
                await s.progress.wait()
            if self.args.assume_started:
                node.assume_started()
            task = loop.create_task(node.run())
            task.add_done_callback(self._done)
            self.tasks.append(task)

    def _done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.failures += 1
            err = task.exception()
            if isinstance(err, grpc.aio.AioRpcError):
                name = f"register {err.code().name}:{err.details()}"[:80]
                self.stats.codes[name] = self.stats.codes.get(name, 0) + 1
            print(json.dumps({"event": "node_failed", "error": repr(task.exception())}), flush=True)

    def command(self, line: str) -> dict[str, Any] | None:
        word, _, arg = line.strip().partition(" ")
        s = self.stats
        if word == "start":
            rate, _, inflight = arg.partition(" ")
            self.ramp = asyncio.get_running_loop().create_task(
                self._ramp(float(rate), int(inflight or 1 << 30))
            )
            return {"event": "started", "t": time.time()}
        if word == "status":
            return {
                "event": "status",
                "registered": s.registered,
                "streaming": s.streaming,
                "started": s.started,
                "errors": s.errors,
                "reregisters": s.reregisters,
                "register_retries": s.register_retries,
                "failed": self.failures,
                "ramp_done": self.ramp is not None and self.ramp.done(),
                "codes": s.codes,
            }
        if word == "mark":
            s.samples = type(s.samples)("d")
            s.recording = True
            self.mark_t = time.perf_counter()
            self.mark_counts = (s.beats, s.acks, s.errors)
            return {"event": "marked"}
        if word == "report":
            s.recording = False
            with open(arg, "wb") as f:
                s.samples.tofile(f)
            beats, acks, errors = self.mark_counts
            return {
                "event": "report",
                "window_s": time.perf_counter() - self.mark_t,
                "beats": s.beats - beats,
                "acks": s.acks - acks,
                "errors": s.errors - errors,
                "samples": len(s.samples),
                "streaming": s.streaming,
            }
        if word == "stop":
            return None
        return {"event": "error", "message": f"unknown command {word!r}"}

    async def close(self) -> None:
        for t in [*self.tasks, *([self.ramp] if self.ramp else [])]:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(c.close(grace=None) for c in self.channels), return_exceptions=True)
        await self.nm.stop()


async def amain(args: argparse.Namespace) -> int:
    fleet = Fleet(args)
    port = await fleet.start_server()
    print(json.dumps({"event": "listening", "nm_port": port}), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while True:
            line = (await reader.readline()).decode()
            if not line:
                break  # the parent went away
            answer = fleet.command(line)
            if answer is None:
                break
            print(json.dumps(answer), flush=True)
    finally:
        await fleet.close()
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.loadgen.fleet")
    p.add_argument("--target", required=True, help="Controller host:port")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--channels", type=int, default=50)
    p.add_argument("--prefix", required=True, help="job-name prefix, unique per generator")
    p.add_argument("--first-port", type=int, default=20000, help="engine port of the first node")
    p.add_argument("--interval", type=float, default=3.0)
    p.add_argument("--assume-started", action="store_true", help="beat NORMAL endpoints from the start")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(amain(parse(sys.argv[1:]))))
