"""Engines relaunched in place, end to end: `motor up --prefill 1 --decode 2` under steady load,
one decode engine's process group SIGKILLed. The NodeManager reports the death, the Controller
takes the instance out of routing and relaunches the engines without restarting the NodeManager,
and the instance serves again; then the other decode instance's NodeManager is SIGKILLed and its
instance rebuilt. Meanwhile not one request fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from typing import Any

import openai
import pytest

from tests.e2e.cluster import CONTROLLER, COORDINATOR, NM, Cluster
from tests.poll import wait_until
from tests.procs import motor_argv
from tests.standins import prepend_path, write_vllm

pytestmark = pytest.mark.timeout(180)

MESSAGES = [{"role": "user", "content": "Keep going while an engine dies."}]


class Load:
    """Non-streaming chat completions, one after another at most every 20 ms (so the engines'
    logs stay small and ``limit`` lasts minutes, however fast the router is), until stopped."""

    def __init__(self, base_url: str, limit: int = 6000) -> None:
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=30)
        self.limit = limit
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set() and self.ok + len(self.failed) < self.limit:
            try:
                resp = self.client.chat.completions.create(model="motor-sim", messages=MESSAGES, max_tokens=4)
                assert resp.choices[0].message.content
                self.ok += 1
            except Exception as exc:
                self.failed.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(0.02)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(40)


def decode_instances(c: Cluster) -> list[dict[str, Any]]:
    return [i for i in c.controller_instances() if i["role"] == "ROLE_DECODE"]


def test_a_killed_engine_is_relaunched_in_place_and_serves_again(tmp_path) -> None:
    c = Cluster(tmp_path, "--prefill", "1", "--decode", "2", nodes=3)
    try:
        c.wait_ready()
        wait_until(
            lambda: len([i for i in c.controller_instances() if i["status"] == "INSTANCE_STATUS_ACTIVE"]) == 3
        )
        victim = decode_instances(c)[0]
        (ep,) = victim["endpoints"]
        old_pgid, port = int(ep["pid"]), int(ep["port"])
        nm_index = c.node_of_port(port)
        nm_pid = c.nodemanager_pid(nm_index)
        with Load(c.base_url) as load:
            wait_until(lambda: load.ok >= 5)
            os.killpg(old_pgid, signal.SIGKILL)
            # It leaves routing: the Controller says so (a poll of its status can miss the
            # moment, when the relaunch is quick).
            left = f"event=instance_transition instance_id={victim['id']} "
            c.proc.wait_line(lambda s: left in s and "old=ACTIVE" in s, 30)
            c.proc.wait_line(lambda s: "[ENGINE RELAUNCH #1 " in s, 30)

            def relaunched() -> bool:
                inst = next(i for i in decode_instances(c) if i["id"] == victim["id"])
                pid = int(inst["endpoints"][0].get("pid", 0))
                return inst["status"] == "INSTANCE_STATUS_ACTIVE" and pid not in (0, old_pgid)

            wait_until(relaunched, timeout=60, every=0.2)
            served_before = load.ok
            wait_until(lambda: load.ok >= served_before + 10)
            assert c.nodemanager_pid(nm_index) == nm_pid  # the NodeManager was not restarted

            # Now the other decode instance's NodeManager is killed outright: its instance
            # leaves routing, is rebuilt by the restarted node, and serves again.
            other = next(i for i in decode_instances(c) if i["id"] != victim["id"])
            other_nm = c.node_of_port(int(other["endpoints"][0]["port"]))
            os.kill(c.nodemanager_pid(other_nm), signal.SIGKILL)

            def rebuilt() -> bool:
                return any(
                    i["status"] == "INSTANCE_STATUS_ACTIVE" and i["id"] not in (victim["id"], other["id"])
                    for i in decode_instances(c)
                )

            wait_until(rebuilt, timeout=30, every=0.2)
            served_before = load.ok
            wait_until(lambda: load.ok >= served_before + 10)
        assert load.failed == []

        # The strategy ends at its next readiness poll (every 5 s by default).
        def history() -> list[str]:
            req = {"instanceId": victim["id"]}
            (entry,) = c.call(c.grpc(CONTROLLER), "motor.v1.Controller/GetFaultToleranceStatus", req)[
                "instances"
            ]
            return entry.get("history", [])

        assert "EngineRelaunch succeeded" in wait_until(history, timeout=20)[0]

        # Operators see it, and can take the node out of routing and back with `motor faults`.
        status = motor(c, "status", "--coordinator", c.grpc(COORDINATOR), "-o", "json")
        assert status.returncode == 0, status.stderr
        [entry] = [
            e
            for e in json.loads(status.stdout)["controller"]["fault_tolerance"]
            if e["instance_id"] == int(victim["id"])
        ]
        assert (entry["fault_level"], entry["strategy"]) == (0, "")
        assert "EngineRelaunch succeeded" in entry["last_outcome"]
        node = c.grpc(NM + nm_index)
        out = motor(c, "faults", "report", "--node", node, "--level", "L4", "--code", "xid-79")
        assert (out.returncode, out.stdout) == (0, f"affected instances: {victim['id']}\n"), out.stderr
        wait_until(lambda: status_of(c, victim["id"]) == "INSTANCE_STATUS_INACTIVE")
        assert motor(c, "faults", "clear", "--node", node).returncode == 0
        wait_until(lambda: status_of(c, victim["id"]) == "INSTANCE_STATUS_ACTIVE")
        out = motor(c, "faults", "report", "--node", "127.0.0.1:1", "--level", "L3")
        assert out.returncode == 1 and out.stderr.startswith("motor faults: NOT_FOUND: ")
    finally:
        c.cleanup()


def motor(c: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    argv = motor_argv(args[0], "--controller", c.grpc(CONTROLLER), *args[1:])
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def status_of(c: Cluster, instance_id: int) -> str:
    return next(i["status"] for i in c.controller_instances() if i["id"] == instance_id)


def test_a_relaunch_that_cannot_start_falls_back_to_restarting_the_node(tmp_path) -> None:
    records = tmp_path / "records"
    records.mkdir()
    bin_dir = write_vllm(tmp_path / "bin")
    env = {"PATH": prepend_path(bin_dir, os.environ.get("PATH")), "STANDIN_RECORDS": str(records)}
    c = Cluster(tmp_path, "--engine-type", "vllm", env=env)
    try:
        c.wait_ready()
        decode = wait_until(
            lambda: [i for i in decode_instances(c) if i["status"] == "INSTANCE_STATUS_ACTIVE"]
        )[0]
        pgid = int(decode["endpoints"][0]["pid"])
        nm_pid = c.nodemanager_pid(1)
        # The engine cannot be launched again: `vllm` is no longer executable.
        (bin_dir / "vllm").chmod(0o644)
        os.killpg(pgid, signal.SIGKILL)
        c.proc.wait_line(lambda s: "event=strategy_failed" in s and f"instance_id={decode['id']}" in s, 30)
        (bin_dir / "vllm").chmod(0o755)  # the restarted node can launch it
        # Phase 2 told the decode node to give up holding its fallback; the escalation stopped
        # it; motor up restarted it; the instance is assembled again and serves.
        c.proc.wait_line(lambda s: s.startswith("[nm-1] ") and "event=unfrozen" in s, 10)
        c.proc.wait_line(lambda s: s.startswith("[nm-1] ") and "event=stop_requested" in s, 10)
        c.proc.wait_line("event=restart component=nm-1", 20)
        # nodemanager_pid() asserts there is one: none for a moment while motor up restarts it.
        wait_until(lambda: c.nodemanager_pid(1) != nm_pid, retry=(AssertionError,))
        rebuilt = wait_until(
            lambda: [
                i
                for i in decode_instances(c)
                if i["status"] == "INSTANCE_STATUS_ACTIVE" and i["id"] != decode["id"]
            ],
            timeout=40,
        )[0]
        assert int(rebuilt["endpoints"][0]["pid"]) not in (0, pgid)
        assert not any(line.startswith("[nm-0] ") and "event=unfrozen" in line for line in c.proc.lines)
        client = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="none", max_retries=0, timeout=30)
        assert client.chat.completions.create(model="motor-sim", messages=MESSAGES, max_tokens=4).choices
    finally:
        c.cleanup()
