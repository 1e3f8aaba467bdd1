"""A planned stop end to end, under ``motor up`` (a real Controller, Coordinator and NodeManagers):
SIGTERM to the decode instance's NodeManager has the Controller terminate its instance, which the
Coordinator drains (no new request, the one in flight finishes there, whole) before the
Controller deletes it and the NodeManager stops its engine; removed on purpose, it raises no
instance alarm."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

from motor_mesh.nodemanager.statefile import StateFile
from tests.e2e.cluster import CONTROLLER, COORDINATOR, CallFailed, Cluster
from tests.poll import wait_until
from tests.procs import group_alive

TOKENS = 100
INSTANCE_FAULT = "0xFC001002"


def stream(cluster: Cluster) -> Any:
    """A streamed chat completion of TOKENS tokens, its answer open (read it line by line)."""
    body = {
        "model": "motor-sim",
        "messages": [{"role": "user", "content": "tell me everything"}],
        "max_tokens": TOKENS,
        "stream": True,
    }
    req = urllib.request.Request(
        f"{cluster.base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=60)


def events(resp: Any) -> list[dict[str, Any]]:
    """The stream's data events, to the end."""
    out = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


def test_sigterm_on_a_nodemanager_drains_its_instance_before_its_engine_stops(tmp_path: Path) -> None:
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"engine": {"args": {"tpot_ms": 100}}}))  # a 10 s answer
    c = Cluster(tmp_path, "--config", str(slow))
    try:
        c.wait_ready()
        (decode,) = [i for i in c.controller_instances() if i["role"] == "ROLE_DECODE"]
        decode_id = decode["id"]
        resp = stream(c)
        # The answer is under way on the decode engine (a few tokens in: the Coordinator's
        # inference workers report their requests to it every 0.1 s).
        begun = 0
        while begun < 5:
            begun += resp.readline().startswith(b"data: ")

        (engine,) = StateFile(c.state / "nm-1").read()  # the decode engine's process group
        os.kill(c.nodemanager_pid(1), signal.SIGTERM)
        # The Coordinator drains it: still in its table, routed to by no new request.
        wait_until(
            lambda: (
                decode_id
                in c.call(c.grpc(COORDINATOR), "motor.v1.Coordinator/ListInstances").get("draining_ids", [])
            ),
            20,
            "the decode instance draining",
        )
        assert group_alive(engine.pgid)  # drained while its engine still runs
        # The request in flight finishes where it is, whole.
        rest = events(resp)
        assert sum(len(e["choices"]) for e in rest if e.get("choices")) >= TOKENS - begun
        assert not [e for e in rest if "error" in e]
        assert rest[-1]["choices"][0]["finish_reason"] == "length"

        # Then the Controller deletes it and its NodeManager stops the engine.
        def deleted() -> bool:
            gone = c.call(
                c.grpc(CONTROLLER), "motor.v1.Controller/ListInstances", {"status": "INSTANCE_STATUS_DELETED"}
            )
            return decode_id in [i["id"] for i in gone.get("instances", [])]

        wait_until(deleted, 60, "the decode instance deleted", retry=(CallFailed,))
        wait_until(lambda: not group_alive(engine.pgid), 30, "the decode engine stopped")
        c.proc.wait_line(lambda s: "[nm-1]" in s and "event=drain_wait_over" in s, 30)
        over = next(s for s in c.proc.lines if "[nm-1]" in s and "event=drain_wait_over" in s)
        assert "outcome=stopped_by_controller" in over
        # Removed on purpose: no instance alarm for it.
        history = c.call(c.grpc(CONTROLLER), "motor.v1.Controller/ListAlarms", {"page_size": 1000})
        assert not [
            a
            for a in history.get("alarms", [])
            if a.get("alarm_id") == INSTANCE_FAULT and a.get("instance_id") == decode_id
        ]
    finally:
        c.stop()
