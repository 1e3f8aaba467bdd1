"""``motor up`` follows the Controller's desired instance counts while it runs: ``motor scale``
(SetDesiredInstances) up starts whole instances the way the first ones were started, on the next
NodeManager numbers and their ports, and they register, are assembled and serve; ``motor scale``
down drains the role's highest-numbered instances and stops them under a client streaming all the
while, with no request failing and nothing of theirs left running; the initial counts are the
recorded desired ones; a role ``motor up`` never started scales the same way; and its stop takes
the instances added later with it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from motor_mesh.nodemanager.statefile import StateFile
from tests.e2e.cluster import CONTROLLER, COORDINATOR, NM, CallFailed, Cluster
from tests.e2e.streaming import (
    Load,
    Probe,
    Streams,
    client_of,
    prompt_of,
    reference,
    whole_chat,
    write_config,
)
from tests.poll import wait_until
from tests.ports import port_free
from tests.procs import exited, group_alive, motor_argv, pids_with

pytestmark = pytest.mark.timeout(240)

TOKENS = 64
TPOT_MS = 30  # a 64-token answer streams for about 2 s: the scale-down finds streams on the way
STREAMS = 8
PROMPTS = 16
MODEL = "motor-sim"


def motor_scale(c: Cluster, role: str, replicas: int) -> str:
    """``motor scale --role ROLE --replicas N`` against the cluster's Controller: its output."""
    argv = motor_argv(
        "scale", "--controller", c.grpc(CONTROLLER), "--role", role, "--replicas", str(replicas)
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def desired(c: Cluster) -> dict[str, int]:
    got = c.call(c.grpc(CONTROLLER), "motor.v1.Controller/ListDesiredInstances").get("desired", [])
    return {d["role"].removeprefix("ROLE_").lower(): int(d.get("replicas", 0)) for d in got}


def active(c: Cluster, role: str) -> list[dict[str, Any]]:
    """The Controller's ACTIVE instances of ``role``, by id."""
    return [
        i
        for i in c.controller_instances()
        if i["role"] == f"ROLE_{role.upper()}" and i["status"] == "INSTANCE_STATUS_ACTIVE"
    ]


def wait_active(c: Cluster, role: str, jobs: set[str], timeout: float = 60) -> list[dict[str, Any]]:
    """Until the Controller's live instances of ``role`` are exactly ``jobs``, every one ACTIVE."""

    def there() -> list[dict[str, Any]] | None:
        live = [i for i in c.controller_instances() if i["role"] == f"ROLE_{role.upper()}"]
        ok = {i["job_name"] for i in live} == jobs and all(
            i["status"] == "INSTANCE_STATUS_ACTIVE" for i in live
        )
        return live if ok else None

    return wait_until(
        there, timeout, f"{role} instances {sorted(jobs)} ACTIVE", retry=(CallFailed,), every=0.1
    )


def routable(probe: Probe, role: str) -> set[str]:
    """The job names of the Coordinator's routable instances of ``role``."""
    return {i["job_name"] for i in probe.available() if i["role"] == f"ROLE_{role.upper()}"}


def decode_legs(c: Cluster, k: int) -> float:
    """The decode hand-offs engine ``k`` took part in (its simulated engine's counter)."""
    return c.pd_legs(k).get(("decode", "vllm"), 0)


def engine_pgids(c: Cluster, i: int) -> list[int]:
    """The process groups of NodeManager nm-<i>'s engines, as its state file records them."""
    return [r.pgid for r in StateFile(c.state / f"nm-{i}").read()]


def test_motor_scale_starts_decode_instances_that_serve_and_drains_them_away_under_load(
    tmp_path: Path,
) -> None:
    cfg = write_config(tmp_path, engine={"args": {"tpot_ms": TPOT_MS}})
    # Room for four NodeManagers: the prefill, the decode, and the two scaled in (nm-2, nm-3).
    c = Cluster(tmp_path, "--prefill", "1", "--decode", "1", "--config", str(cfg), nodes=4)
    try:
        c.wait_ready()
        probe = Probe(c)
        probe.wait_serving(prefill=1, decode=1)
        # The counts motor up started with are the desired ones.
        wait_until(
            lambda: desired(c) == {"prefill": 1, "decode": 1, "union": 0},
            30,
            "the initial counts recorded",
            retry=(CallFailed,),
        )

        # -- up: two more decode instances, on the next NodeManagers and their ports ------------
        assert motor_scale(c, "decode", 3).strip() == "decode: 3 instances desired"
        jobs = {f"{MODEL}-decode-0", f"{MODEL}-decode-1", f"{MODEL}-decode-2"}
        wait_active(c, "decode", jobs)
        c.proc.wait_line("motor up: scaled decode: 1 -> 3 instances (started nm-2, nm-3)", 10)
        wait_until(lambda: routable(probe, "decode") == jobs, 30, "three decode instances routable")
        new_nodes = {c.nodemanager_pid(i): i for i in (2, 3)}  # NodeManagers on 7302, 7303 (+ offset)
        by_job = {i["job_name"]: i for i in active(c, "decode")}
        assert {int(by_job[f"{MODEL}-decode-{n}"]["endpoints"][0]["port"]) for n in (1, 2)} == {
            c.engine_port(2),
            c.engine_port(3),
        }
        assert {f"127.0.0.1:{NM + i + c.off}" for i in (2, 3)} == {
            by_job[f"{MODEL}-decode-{n}"]["node_managers"][0] for n in (1, 2)
        }
        new_engines = [g for i in (2, 3) for g in engine_pgids(c, i)]
        assert len(new_engines) == 2

        # Requests through the OpenAI API reach the new instances: with the first decode
        # instance paused on the Coordinator, every answer is decoded by one of them.
        client = client_of(c)
        first = by_job[f"{MODEL}-decode-0"]["id"]
        c.call(c.grpc(COORDINATOR), "motor.v1.Coordinator/PauseInstances", {"ids": [first]})
        before = {k: decode_legs(c, k) for k in (1, 2, 3)}
        got = Streams(client, 8, 4).submit([prompt_of(i) for i in range(8)]).results()
        assert all(not isinstance(a, BaseException) for a in got.values()), got
        assert decode_legs(c, 1) == before[1]
        assert decode_legs(c, 2) + decode_legs(c, 3) == before[2] + before[3] + 8
        c.call(c.grpc(COORDINATOR), "motor.v1.Coordinator/ResumeInstances", {"ids": [first]})
        wait_until(
            lambda: not probe.table().get("paused"), 30, "decode-0 routable again", retry=(CallFailed,)
        )

        # The desired count is the Controller's stored state: a Controller killed and restarted
        # by motor up still holds it, and motor up, reading it again, removes nothing.
        killed = c.component_pid("controller")
        assert killed
        os.kill(killed, signal.SIGKILL)
        wait_until(lambda: c.component_pid("controller") not in (0, killed), 30, "the Controller restarted")
        wait_until(
            lambda: desired(c) == {"prefill": 1, "decode": 3, "union": 0},
            30,
            "the desired counts read from the restarted Controller",
            retry=(CallFailed,),
        )
        wait_active(c, "decode", jobs)
        assert routable(probe, "decode") == jobs

        # -- down to one while clients stream and send requests back to back ------------------
        want = reference(client, [prompt_of(i) for i in range(PROMPTS)], TOKENS)
        with (
            Load(client, want, TOKENS, stream=True, workers=STREAMS) as streams,
            Load(client, {p: whole_chat(client, p, 8) for p in list(want)[:4]}, 8, stream=False) as plain,
        ):
            # Streams run on the instances about to go, so the drain has something to drain.
            for k in (2, 3):
                wait_until(lambda k=k: probe.running(c.engine_port(k)) >= 1, 30, f"a stream on engine-{k}")
            started = time.monotonic()
            assert motor_scale(c, "decode", 1).strip() == "decode: 1 instance desired"
            c.proc.wait_line(
                "motor up: scaled decode: 3 -> 1 instances (draining and stopping nm-3, nm-2)", 10
            )
            for name in ("nm-3", "nm-2"):
                c.proc.wait_line(f"event=retired component={name} ", 90)
            wait_active(c, "decode", {f"{MODEL}-decode-0"})
            assert routable(probe, "decode") == {f"{MODEL}-decode-0"}
            # The load goes on on the one left.
            streams.wait_served(STREAMS)
            plain.wait_served(3)
        assert streams.failed == [] and plain.failed == []
        assert streams.ok >= STREAMS
        # Their NodeManagers and engines are gone, and so are their ports.
        wait_until(lambda: all(exited(p) for p in new_nodes), 30, "the removed NodeManagers gone")
        wait_until(lambda: not any(group_alive(g) for g in new_engines), 30, "their engines gone")
        for i in (2, 3):
            for port in (NM + i + c.off, c.engine_port(i)):
                assert port_free(port), port
        # Asked for: neither a restart nor a crash to motor up, which still runs.
        lines = c.proc.lines_since(started)
        assert not [s for s in lines if "event=restart " in s], lines
        assert c.proc.alive()
        assert [i["job_name"] for i in active(c, "prefill")] == [f"{MODEL}-prefill-0"]
        assert desired(c) == {"prefill": 1, "decode": 1, "union": 0}
        assert c.stop() == 0
    finally:
        c.cleanup()


def test_a_role_motor_up_never_started_scales_to_zero_and_back_and_the_stop_takes_it(tmp_path: Path) -> None:
    c = Cluster(tmp_path, "--prefill", "1", "--decode", "1", nodes=4)
    try:
        c.wait_ready()
        probe = Probe(c)
        probe.wait_serving(prefill=1, decode=1)
        wait_until(lambda: desired(c).get("union") == 0, 30, "union 0 recorded", retry=(CallFailed,))

        motor_scale(c, "union", 1)
        wait_active(c, "union", {f"{MODEL}-union-0"})
        c.proc.wait_line("motor up: scaled union: 0 -> 1 instances (started nm-2)", 10)
        first = c.nodemanager_pid(2)
        engines = engine_pgids(c, 2)

        # Zero stops them all; one starts one again, on the same NodeManager number and job.
        motor_scale(c, "union", 0)
        c.proc.wait_line("motor up: scaled union: 1 -> 0 instances (draining and stopping nm-2)", 10)
        c.proc.wait_line("event=retired component=nm-2 ", 90)
        wait_until(lambda: exited(first) and not any(group_alive(g) for g in engines), 30, "union gone")
        assert not [i for i in c.controller_instances() if i["role"] == "ROLE_UNION"]

        motor_scale(c, "union", 1)
        wait_active(c, "union", {f"{MODEL}-union-0"})
        wait_until(
            lambda: routable(probe, "union") == {f"{MODEL}-union-0"}, 30, "the union instance routable"
        )
        added = c.nodemanager_pid(2)
        assert added != first
        added_engines = engine_pgids(c, 2)
        assert added_engines

        # motor up's stop stops what it added too.
        assert c.stop() == 0
        assert exited(added)
        wait_until(lambda: not any(group_alive(g) for g in added_engines), 10, "the added engines gone")
        assert not pids_with("nodemanager", str(NM + 2 + c.off))
    finally:
        c.cleanup()
