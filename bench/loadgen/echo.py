"""The echo baseline: ``python -m bench.loadgen.echo [--port 0] [--mode gen|rw]``.

A trivial grpc.aio server on the motor.v1.Controller proto: ``Register`` hands out node ids and
``Heartbeat`` acks every message, nothing else (no validation, no interceptors, no state).
Its CPU at a given beat rate is the floor a Python grpc.aio Controller can reach; the scale
benchmark reports the Controller's CPU as a ratio to it. ``--mode rw`` (default) serves the
stream with ``context.read()`` / ``context.write()``, as the Controller does; ``--mode gen`` as
an async generator (more CPU per message). Prints ``event=listening grpc=H:P``, and every 10 s the same
``event=heartbeat_stats`` line as the Controller (ack latency: message in hand → ack handed to
gRPC and the handler resumed).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import sys
import time
from collections.abc import AsyncIterator

import grpc

from bench.loadgen.harness import rpc_handlers
from motor_mesh.gen.motor.v1 import controller_pb2 as pb

STATS_WINDOW_S = 10.0


class EchoController:
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.acks: list[float] = []

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        return pb.RegisterResponse(node_id=next(self._ids), session_epoch=1, heartbeat_interval_ms=3000)

    async def Heartbeat(
        self, request_iterator: AsyncIterator[pb.HeartbeatRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.HeartbeatResponse]:
        perf, acks = time.perf_counter, self.acks
        async for req in request_iterator:
            t0 = perf()
            seq = req.beat.seq if req.HasField("beat") else req.engine_event.seq
            yield pb.HeartbeatResponse(ack=pb.Ack(seq=seq))
            acks.append(perf() - t0)


class ReadWriteEchoController(EchoController):
    async def Heartbeat(  # type: ignore[override]
        self, request_iterator: AsyncIterator[pb.HeartbeatRequest], context: grpc.aio.ServicerContext
    ) -> None:  # read()/write() instead of an async generator
        perf, acks = time.perf_counter, self.acks
        while True:
            req = await context.read()
            if req is grpc.aio.EOF:
                return
            t0 = perf()
            seq = req.beat.seq if req.HasField("beat") else req.engine_event.seq
            await context.write(pb.HeartbeatResponse(ack=pb.Ack(seq=seq)))
            acks.append(perf() - t0)


def handlers(servicer: EchoController) -> grpc.GenericRpcHandler:
    """Register and Heartbeat only: every other motor.v1.Controller method answers UNIMPLEMENTED."""
    return rpc_handlers(
        "motor.v1.Controller",
        {"Register": (servicer.Register, pb.RegisterRequest, pb.RegisterResponse)},
        {"Heartbeat": (servicer.Heartbeat, pb.HeartbeatRequest, pb.HeartbeatResponse)},
    )


async def report(servicer: EchoController) -> None:
    start = time.monotonic()
    while True:
        await asyncio.sleep(STATS_WINDOW_S)
        now = time.monotonic()
        acks = sorted(servicer.acks)
        servicer.acks.clear()
        if acks:
            p50 = acks[len(acks) // 2] * 1000
            p99 = acks[min(len(acks) - 1, int(len(acks) * 0.99))] * 1000
            print(
                f"event=heartbeat_stats messages={len(acks)} ack_p50_ms={p50:.3f} ack_p99_ms={p99:.3f} "
                f"window_s={now - start:.3f}",
                file=sys.stderr,
                flush=True,
            )
        start = now


async def amain(port: int, mode: str) -> int:
    server = grpc.aio.server()
    servicer = ReadWriteEchoController() if mode == "rw" else EchoController()
    server.add_generic_rpc_handlers((handlers(servicer),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"event=listening service=echo grpc=127.0.0.1:{bound}", file=sys.stderr, flush=True)
    reporter = asyncio.get_running_loop().create_task(report(servicer))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    reporter.cancel()
    await server.stop(grace=0.5)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.loadgen.echo")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--mode", choices=("gen", "rw"), default="rw")
    a = p.parse_args()
    sys.exit(asyncio.run(amain(a.port, a.mode)))
