"""What every failover round of bench/bench_failover.py shares: the client load it measures
failed requests with, and the age of the process it is about to kill (``motor up`` restarts a
child that crashed soon after its last start only after a growing delay, so a round waits until
its victim has run longer than that).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import openai
from openai.types.chat import ChatCompletionMessageParam

from bench.loadgen.up import CONTROLLER, Up
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2, controller_pb2_grpc

ACTIVE = common_pb2.INSTANCE_STATUS_ACTIVE


@dataclass
class Load:
    """One client, one request at a time, counting failures (``errors``: what each said)."""

    url: str
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=30)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "failover"}]
        while not self.stop.is_set():
            try:
                client.chat.completions.create(model="motor-sim", messages=messages, max_tokens=4)
                self.ok += 1
            except Exception as exc:
                self.failed += 1
                self.errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
                time.sleep(0.01)


def process_age_s(pid: int) -> float:
    """How long process ``pid`` has been running."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


class UpCluster:
    """``motor up ARGS`` with ``config`` (written to a file of its own), expected to hold
    ``size`` instances, read through the Controller."""

    def __init__(self, args: list[str], config: dict[str, object], size: int) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        cfg = Path(self.tmp.name) / "cfg.json"
        cfg.write_text(json.dumps(config))
        self.size = size
        self.up = Up([*args, "--config", str(cfg)], Path(self.tmp.name))
        self.channel = grpc.insecure_channel(self.up.addr(CONTROLLER))
        self.stub = controller_pb2_grpc.ControllerStub(self.channel)
        self.url = self.up.url

    def instances(self) -> list[common_pb2.Instance]:
        return list(self.stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5).instances)

    def all_active(self, timeout: float = 120) -> list[common_pb2.Instance]:
        """Every instance ACTIVE with a running engine."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = self.instances()
            if len(live) == self.size and all(i.status == ACTIVE and i.endpoints[0].pid for i in live):
                return live
            time.sleep(0.05)
        raise RuntimeError(f"the cluster did not come back to {self.size} ACTIVE instances")

    def close(self) -> None:
        self.channel.close()
        self.up.stop()
        self.tmp.cleanup()
