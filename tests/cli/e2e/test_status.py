"""``motor status`` and ``motor instances --watch`` against a real ``motor up``: what they print
is what the services, grpcurl and /proc say; an unreachable part is shown and the rest still is;
the watch follows an engine's death and relaunch and outlives a Controller restart."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from motor_mesh.cli import status, status_table
from motor_mesh.gen.motor.v1 import common_pb2
from tests.e2e.cluster import CONTROLLER, COORDINATOR, Cluster
from tests.poll import wait_until
from tests.ports import reserved_port
from tests.procs import Proc, child_pids, motor_argv

pytestmark = pytest.mark.timeout(180)


def _instance(iid: int, role: int, model: str = "m", **kw: Any) -> common_pb2.Instance:
    ep = common_pb2.Endpoint(host="127.0.0.1", port=9000 + iid, headless=kw.pop("headless", False))
    return common_pb2.Instance(id=iid, role=role, model_name=model, endpoints=[ep], **kw)


def test_routable_pd_groups_pair_prefill_and_decode_of_one_model_and_protocol() -> None:
    p, d, u = common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE, common_pb2.ROLE_UNION
    sglang = {"engine_type": common_pb2.ENGINE_TYPE_SGLANG}
    available = [
        _instance(1, p),
        _instance(2, p),
        _instance(3, d),
        _instance(4, d, "other"),  # no prefill of its model
        _instance(5, p, **sglang),  # SGLang hand-off: no SGLang decode to pair with
        _instance(6, d, headless=True),  # no serving endpoint
        _instance(7, u),
    ]
    assert status.pd_groups(available) == [
        {"model": "m", "protocol": "vllm", "prefill": [1, 2], "decode": [3]}
    ]


def test_the_table_spans_an_unreachable_part_and_lists_every_engine_of_a_node() -> None:
    nm = {
        "address": "10.0.0.5:7300",
        "error": None,
        "instance_id": 4,
        "role": "decode",
        "ready": True,
        "engines": [
            {"endpoint": f"10.0.0.5:{port}", "pid": pid, "status": "NORMAL", "headless": False}
            for port, pid in ((10000, 41), (10002, 42))
        ],
        "uptime_s": 3725.0,
        "restarts": 2,
        "frozen": False,
        "frozen_until": None,
    }
    gone = {"address": "10.0.0.6:7300", "error": {"code": "UNAVAILABLE", "message": ""}, "instance_id": 5}
    coordinator = {"address": "10.0.0.7:7200", "health": "UNREACHABLE", "error": gone["error"]}
    controller = {"address": "10.0.0.1:7100", "health": "UNREACHABLE", "error": gone["error"]}
    gone["role"] = "prefill"
    doc = {"controller": controller, "coordinators": [coordinator], "nodemanagers": [nm, gone]}
    lines = status_table.render(doc, 0.0)
    assert lines[0] == "Controller 10.0.0.1:7100: UNREACHABLE (UNAVAILABLE)"
    assert "10.0.0.7:7200  UNREACHABLE (UNAVAILABLE)" in lines
    nodes = lines[lines.index(next(s for s in lines if s.startswith("NODEMANAGER"))) :]
    assert [s.split() for s in nodes[1:]] == [
        ["10.0.0.5:7300", "4", "decode", "yes", "1h02m", "2", "no", "10.0.0.5:10000", "pid=41", "NORMAL"],
        ["10.0.0.5:10002", "pid=42", "NORMAL"],
        ["10.0.0.6:7300", "5", "prefill", "UNREACHABLE", "(UNAVAILABLE)"],
    ]


# ---- against motor up ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("status")
    # An engine that takes a second to become ready: a relaunched instance stays out of ACTIVE
    # for longer than the watch's poll interval, whatever the machine's speed.
    # Two inference workers whatever the machine's CPU count.
    cfg = {"engine": {"args": {"startup_s": 1}}, "coordinator": {"workers": 2}}
    (tmp / "motor.json").write_text(json.dumps(cfg))
    c = Cluster(tmp, "--config", str(tmp / "motor.json"))
    try:
        c.wait_ready()
        wait_until(lambda: [i["status"] for i in c.controller_instances()] == ["INSTANCE_STATUS_ACTIVE"] * 2)
        yield c
    finally:
        c.stop()


def motor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(motor_argv(*args), capture_output=True, text=True, timeout=60)


def addresses(c: Cluster, coordinator: str = "") -> list[str]:
    return ["--controller", c.grpc(CONTROLLER), "--coordinator", coordinator or c.grpc(COORDINATOR)]


def engines(c: Cluster) -> dict[int, list[str]]:
    """Engine pid -> [its NodeManager, instance id, role, endpoint], from grpcurl (the
    Controller's instances), each pid checked in /proc to be a running simulated engine."""
    found = {}
    for inst in c.controller_instances():
        for ep in inst["endpoints"]:
            pid = int(ep["pid"])
            assert b"engine-sim" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            role = inst["role"].removeprefix("ROLE_").lower()
            found[pid] = [inst["node_managers"][0], inst["id"], role, f"{ep['host']}:{ep['port']}"]
    return found


def worker_pids(c: Cluster) -> list[int]:
    return child_pids(c.component_pid("coordinator"), "motor_mesh.coordinator.worker")


def test_status_shows_the_controller_the_coordinator_and_every_nodemanager(cluster: Cluster) -> None:
    c = cluster
    table = c.call(c.grpc(COORDINATOR), "motor.v1.Coordinator/ListInstances")
    pids = engines(c)
    assert sorted(pids) == sorted(c.engine_pgids())
    assert len(worker_pids(c)) == 2

    out = motor("status", *addresses(c))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) <= 24 and max(map(len, lines)) <= 100  # one screen
    assert lines[0] == f"Controller {c.grpc(CONTROLLER)}: SERVING"
    assert lines[1].split() == ["instances", "prefill", "1", "ACTIVE;", "decode", "1", "ACTIVE"]
    assert lines[2].split() == ["recovery", "no", "strategies", "running"]
    assert lines[3].split() == ["alarms", "none", "active"]
    rows = {s.split()[0]: s.split() for s in lines if re.match(r"\d+\.\d+\.\d+\.\d+:\d+ ", s)}
    coordinator = rows[c.grpc(COORDINATOR)]
    assert coordinator[1:4] == ["SERVING", "yes", table["revision"]]
    assert coordinator[4] == table["incarnation"][:8]
    assert coordinator[5:] == ["2", "0", "0", "1", "2/2"]
    assert "settings: their own file's (1/1 of every rate limit each) on every Coordinator" in lines
    for pid, (nm, iid, role, endpoint) in pids.items():
        uptime = rows[nm][4]
        assert re.fullmatch(r"\d+s|\d+m\d\ds", uptime)
        assert rows[nm][1:] == [iid, role, "yes", uptime, "0", "no", endpoint, f"pid={pid}", "NORMAL"]

    doc = json.loads(motor("status", "-o", "json", *addresses(c)).stdout)
    assert doc["ok"] is True
    assert doc["controller"]["instances"]["prefill"]["ACTIVE"] == 1
    assert doc["controller"]["instances"]["decode"]["ACTIVE"] == 1
    assert doc["controller"]["alarms"] == {"active": 0, "most_severe": []}
    (coord,) = doc["coordinators"]
    assert (coord["revision"], coord["incarnation"]) == (int(table["revision"]), table["incarnation"])
    assert coord["routable"] is True and coord["routable_pd_groups"] == 1
    assert coord["inference_workers"] == coord["inference_workers_serving"] == 2
    assert (coord["settings_revision"], coord["replicas"]) == (0, 1)  # no reload: its file's values
    assert {e["pid"]: nm["address"] for nm in doc["nodemanagers"] for e in nm["engines"]} == {
        pid: nm for pid, (nm, *_) in pids.items()
    }
    assert all(nm["restarts"] == 0 and nm["uptime_s"] >= 0 for nm in doc["nodemanagers"])


def test_status_with_a_wrong_coordinator_address_shows_the_rest_and_exits_1(cluster: Cluster) -> None:
    c = cluster
    wrong = f"127.0.0.1:{reserved_port()}"  # nothing listens there
    out = motor("status", *addresses(c, f"{wrong},{c.grpc(COORDINATOR)}"))
    assert out.returncode == 1
    assert out.stderr.strip() == f"motor status: not every part answered: Coordinator {wrong} (UNAVAILABLE)"
    lines = out.stdout.splitlines()
    assert lines[0] == f"Controller {c.grpc(CONTROLLER)}: SERVING"
    assert f"{wrong}  UNREACHABLE (UNAVAILABLE)" in lines
    assert any(s.startswith(f"{c.grpc(COORDINATOR)}  SERVING  yes") for s in lines)
    assert len([s for s in lines if re.search(r" pid=\d+ NORMAL$", s)]) == 2  # both NodeManagers

    doc = json.loads(motor("status", "-o", "json", *addresses(c, wrong)).stdout)
    assert doc["ok"] is False
    assert doc["coordinators"][0]["health"] == "UNREACHABLE"
    assert doc["coordinators"][0]["error"]["code"] == "UNAVAILABLE"
    assert len(doc["nodemanagers"]) == 2 and doc["controller"]["error"] is None


def test_watch_follows_a_relaunch_and_outlives_a_controller_restart(cluster: Cluster) -> None:
    c = cluster
    watch = Proc(
        motor_argv("instances", "--watch", "-o", "json", "--interval", "0.2", "--timeout", "1", *addresses(c))
    )
    try:
        events = lambda: [json.loads(s) for s in watch.stdout_lines]  # noqa: E731
        wait_until(lambda: len(events()) == 2)
        assert {e["type"] for e in events()} == {"ADDED"}
        victim = next(e["instance"] for e in events() if e["instance"]["role"] == "ROLE_DECODE")
        old_pid = int(victim["endpoints"][0]["pid"])
        os.killpg(old_pid, signal.SIGKILL)

        def seen(test: Any) -> list[dict[str, Any]]:
            return [
                e["instance"]
                for e in events()[2:]
                if e["type"] == "MODIFIED" and e["instance"]["id"] == victim["id"] and test(e["instance"])
            ]

        left = wait_until(lambda: seen(lambda i: i["status"] != "INSTANCE_STATUS_ACTIVE"), 20)
        back = wait_until(
            lambda: seen(
                lambda i: (
                    i["status"] == "INSTANCE_STATUS_ACTIVE"
                    and int(i["endpoints"][0].get("pid", 0)) not in (0, old_pid)
                )
            ),
            60,
        )
        assert events().index({"type": "MODIFIED", "instance": left[0]}) < events().index(
            {"type": "MODIFIED", "instance": back[0]}
        )

        # motor status counts the relaunch on the victim's NodeManager and shows its new engine.
        doc = json.loads(motor("status", "-o", "json", *addresses(c)).stdout)
        (node,) = [n for n in doc["nodemanagers"] if n["instance_id"] == int(victim["id"])]
        assert node["restarts"] == 1
        assert [e["pid"] for e in node["engines"]] == [int(back[0]["endpoints"][0]["pid"])]

        # A Controller that stops answering (SIGSTOP), then is killed and restarted by motor up.
        controller = c.component_pid("controller")
        os.kill(controller, signal.SIGSTOP)
        watch.wait_line(f"motor instances: lost the Controller at {c.grpc(CONTROLLER)} (DEADLINE_EXCEEDED)")
        os.kill(controller, signal.SIGKILL)
        watch.wait_line(f"motor instances: the Controller at {c.grpc(CONTROLLER)} answers again", 30)
        assert watch.alive()
        watch.signal(signal.SIGINT)
        assert watch.popen.wait(10) == 130
        assert [s for s in watch.lines if s not in watch.stdout_lines and "Controller" not in s] == []
    finally:
        watch.kill()
