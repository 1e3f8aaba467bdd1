"""Helpers for NodeManager tests: a fake Controller served in-process, and real NodeManager
processes (``motor nodemanager``) whose engines are killed at teardown whatever happened."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from motor_mesh.common import errors
from motor_mesh.common.channel import open_channel
from motor_mesh.common.config import load
from motor_mesh.common.server import MotorServer
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2, nodemanager_pb2, nodemanager_pb2_grpc
from tests.poll import Retry, until
from tests.procs import Exited, Proc, motor_argv

CONTROLLER = controller_pb2.DESCRIPTOR.services_by_name["Controller"]


# --- a fake Controller --------------------------------------------------------------------------


class FakeController:
    """Register and Heartbeat only; records what it receives and acks every message by seq."""

    def __init__(self) -> None:
        self.registers: list[controller_pb2.RegisterRequest] = []
        self.received: list[controller_pb2.HeartbeatRequest] = []
        self.register_errors: list[errors.MotorError] = []  # raised in order, before any success
        self.interval_ms = 200
        self.relaunch_enabled = False
        self.epoch = 0
        self.streams_opened = 0
        self._streams: list[asyncio.Queue[Any]] = []
        # TerminateInstance: recorded, and answered (terminated false: the drain is under way,
        # as the Controller answers before its Stop) only when accept_terminate is set; else
        # UNIMPLEMENTED, like every method this fake does not serve.
        self.terminates: list[controller_pb2.TerminateInstanceRequest] = []
        self.accept_terminate = False

    # what the tests look at
    def beats(self) -> list[controller_pb2.Beat]:
        return [r.beat for r in self.received if r.HasField("beat")]

    def events(self) -> list[controller_pb2.EngineEvent]:
        return [r.engine_event for r in self.received if r.HasField("engine_event")]

    def last_endpoints(self) -> list[common_pb2.Endpoint]:
        beats = self.beats()
        return list(beats[-1].endpoints) if beats else []

    def reregister(self) -> None:
        """What the Controller does on a stale session: the directive, then end the stream."""
        for q in self._streams:
            q.put_nowait(controller_pb2.HeartbeatResponse(directive=controller_pb2.DIRECTIVE_REREGISTER))
            q.put_nowait(errors.precondition("STALE_SESSION", "node/7", "stale session"))

    def break_streams(self) -> None:
        """End every open stream with UNAVAILABLE (a Controller hiccup, the session stays valid)."""
        for q in self._streams:
            q.put_nowait(errors.unavailable("going away"))

    # motor.v1.Controller
    async def Register(self, request: Any, context: Any) -> controller_pb2.RegisterResponse:
        self.registers.append(request)
        if self.register_errors:
            raise self.register_errors.pop(0)
        self.epoch += 1
        return controller_pb2.RegisterResponse(
            node_id=7,
            session_epoch=self.epoch,
            heartbeat_interval_ms=self.interval_ms,
            engine_relaunch_enabled=self.relaunch_enabled,
        )

    async def Heartbeat(self, stream: Any, context: Any) -> None:
        out: asyncio.Queue[Any] = asyncio.Queue()
        self._streams.append(out)
        self.streams_opened += 1

        async def read() -> None:
            with contextlib.suppress(Exception):
                while (r := await stream.read()) is not None:
                    self.received.append(r)
                    seq = r.beat.seq if r.HasField("beat") else r.engine_event.seq
                    out.put_nowait(controller_pb2.HeartbeatResponse(ack=controller_pb2.Ack(seq=seq)))
            out.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while True:
                item = await out.get()
                if item is None:
                    return
                if isinstance(item, errors.MotorError):
                    raise item
                await stream.write(item)
        finally:
            reader.cancel()
            self._streams.remove(out)

    async def TerminateInstance(
        self, request: controller_pb2.TerminateInstanceRequest, context: Any
    ) -> controller_pb2.TerminateInstanceResponse:
        self.terminates.append(request)
        if not self.accept_terminate:
            raise errors.unimplemented("TerminateInstance")
        return controller_pb2.TerminateInstanceResponse(terminated=False)

    def __getattr__(self, name: str) -> Any:
        if not name[:1].isupper() or name == "VALIDATORS":
            raise AttributeError(name)

        async def unimplemented(request: Any, context: Any) -> Any:
            raise errors.unimplemented(name)

        return unimplemented


class ControllerServer:
    def __init__(self, port: int = 0) -> None:
        self.fake = FakeController()
        cfg = load(None, env={}, overrides={"controller": {"port": port}}).controller
        self.server = MotorServer("controller", cfg, [(CONTROLLER, self.fake)], port=port)

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> ControllerServer:
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.stop()


@pytest.fixture
async def controller() -> AsyncIterator[ControllerServer]:
    srv = await ControllerServer().start()
    yield srv
    await srv.stop()


# --- NodeManager processes ----------------------------------------------------------------------


def nm_config(tmp_path: Path, ports: list[int], **overrides: Any) -> dict[str, Any]:
    """A sectioned config for a test NodeManager (fast probes, short graces)."""
    engine = overrides.pop("engine", {})
    nm_cfg = {
        "port": 0,
        "controller": "127.0.0.1:1",
        "job_name": "",
        "role": "prefill",
        "model": "m1",
        "served_model_name": "served-1",
        "engine_type": "sim",
        "ports": ports,
        "parallel": {"dp": len(ports)},  # one DP rank per engine port
        "state_dir": str(tmp_path / "state"),
        "status_poll_interval_s": 0.1,
        "status_probe_timeout_s": 1,
        "max_probe_failures": 2,
        "engine_stop_grace_s": 3,
        "engine_hang_timeout_s": 1,
        # The fallback may act 0.5 * (4 - 1) = 1.5 s after an engine turns ABNORMAL: after the
        # hang timeout, as the config loader insists.
        "suicide_check_interval_s": 0.5,
        "suicide_threshold": 4,
        **overrides,
    }
    return {"nodemanager": nm_cfg, "engine": engine}


class NodeManagerProc:
    def __init__(self, proc: Proc, address: str, cfg: dict[str, Any], tracker: set[int]) -> None:
        self.proc = proc
        self.address = address
        self.port = int(address.rsplit(":", 1)[1])
        self.cfg = cfg
        self._tracker = tracker
        self.channel = open_channel(address)
        self.stub = nodemanager_pb2_grpc.NodeManagerStub(self.channel)

    def track(self, *pids: int) -> None:
        self._tracker.update(p for p in pids if p > 0)

    def start_request(self, instance_id: int = 5, **overrides: Any) -> nodemanager_pb2.StartEnginesRequest:
        nm_cfg = self.cfg["nodemanager"]
        role = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE}.get(
            nm_cfg["role"], common_pb2.ROLE_UNION
        )
        fields: dict[str, Any] = {
            "job_name": nm_cfg["job_name"] or "job-a",
            "instance_id": instance_id,
            "role": role,
            "endpoints": [
                common_pb2.Endpoint(id=i, host="127.0.0.1", port=p) for i, p in enumerate(nm_cfg["ports"])
            ],
            "master_host": "127.0.0.1",
        }
        fields.update(overrides)
        return nodemanager_pb2.StartEnginesRequest(**fields)

    async def start_engines(self, **overrides: Any) -> nodemanager_pb2.StartEnginesResponse:
        resp = await self.stub.StartEngines(self.start_request(**overrides), timeout=20)
        self.track(*(e.pid for e in resp.endpoints))
        return resp

    async def status(self, relaxed: bool = False) -> nodemanager_pb2.GetStatusResponse:
        resp = await self.stub.GetStatus(nodemanager_pb2.GetStatusRequest(relaxed=relaxed), timeout=5)
        self.track(*(e.pid for e in resp.endpoints))
        return resp

    async def wait_status(
        self,
        pred: Callable[[nodemanager_pb2.GetStatusResponse], bool],
        what: str,
        wait_s: float = 20.0,
        *,
        retry: Retry = (),
    ) -> nodemanager_pb2.GetStatusResponse:
        """The first GetStatus answer for which ``pred`` holds; ``retry``: the errors of ``pred``
        that mean "not yet" (the NodeManager listens: its answers are not among them)."""

        async def matching() -> nodemanager_pb2.GetStatusResponse | None:
            resp = await self.status()
            return resp if pred(resp) else None

        try:
            return await until(matching, wait_s, f"NodeManager {what}", retry=retry)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.tail()}") from None

    async def wait_ready(self, wait_s: float = 20.0) -> nodemanager_pb2.GetStatusResponse:
        return await self.wait_status(lambda s: s.ready, "ready", wait_s)

    async def wait_line(self, text: str, wait_s: float = 15.0, start: int = 0) -> str:
        return await self.proc.await_line(text, wait_s, start)

    async def wait_exit(self, wait_s: float = 15.0) -> int:
        return await self.proc.await_exit(wait_s)

    def tail(self, n: int = 40) -> str:
        return self.proc.tail(n)

    def recorded_pgids(self) -> list[int]:
        path = Path(self.cfg["nodemanager"]["state_dir"]) / "engines.json"
        try:
            return [int(r["pgid"]) for r in json.loads(path.read_text())["engines"]]
        except (OSError, ValueError, KeyError):
            return []


@pytest.fixture
async def start_nm(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """``await start_nm(cfg, env=...)`` runs ``motor nodemanager`` and waits for its port."""
    started: list[NodeManagerProc] = []
    engine_pgids: set[int] = set()

    async def start(
        cfg: dict[str, Any], env: dict[str, str] | None = None, wrapper: list[str] | None = None
    ) -> NodeManagerProc:
        path = tmp_path / f"nm-{len(started)}.json"
        path.write_text(json.dumps(cfg))
        argv = [*(wrapper or []), *motor_argv("nodemanager", "--config", str(path))]
        proc = Proc(argv, cwd=tmp_path, env=env)
        try:
            address, _ = await proc.await_listening(20)
        except (AssertionError, Exited):
            proc.kill()
            raise
        nm = NodeManagerProc(proc, address, cfg, engine_pgids)
        started.append(nm)
        return nm

    yield start
    for nm in started:
        engine_pgids.update(nm.recorded_pgids())
        nm.proc.kill()
        await nm.channel.close()
    for pgid in engine_pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
