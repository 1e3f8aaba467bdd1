"""Alarms end to end under ``motor up``: a decode engine whose output turns to garbage raises the
precision alarm in the Controller, on a watch stream, and in a real Alertmanager; it survives a
Controller SIGKILL; it is cleared by normal samples, by an operator's TerminateInstance, and by
automatic recovery; a killed engine raises and clears the instance alarm."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.controller.e2e.test_alertmanager import RealAlertmanager, alertmanager_binary
from tests.e2e.cluster import CONTROLLER, CallFailed, Cluster
from tests.poll import wait_until
from tests.procs import Proc, grpcurl, motor_argv

pytestmark = pytest.mark.timeout(240)

PRECISION, INSTANCE_FAULT = "0xFC001009", "0xFC001002"
DETECTION = {
    "precision_check_enabled": True,
    "precision_interval_s": 0.1,
    "precision_issue_threshold": 2,
    "precision_clear_threshold": 2,
    "probe_max_attempts": 1,
    "probe_timeout_s": 10,
}


def start_alertmanager(tmp: Path) -> RealAlertmanager:
    binary = alertmanager_binary()
    if binary is None:
        pytest.skip(
            "no Alertmanager installed (`make system-deps` installs it as root): e2e alarm test skipped"
        )
    am = RealAlertmanager(binary, tmp / "alertmanager").started()
    wait_until(
        lambda: urllib.request.urlopen(f"{am.base}/-/ready", timeout=2).status == 200,
        timeout=30,
        retry=(OSError,),  # refused, or 503 (an HTTPError), until it is ready
    )
    return am


def firing(am: RealAlertmanager, alarm_id: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{am.base}/api/v2/alerts?active=true", timeout=5) as resp:
        alerts = json.loads(resp.read())
    return [a for a in alerts if a["labels"].get("alarm_id") == alarm_id and a["status"]["state"] == "active"]


class Load:
    """Chat completions in a loop on a thread: precision samples follow client traffic."""

    def __init__(self, base_url: str) -> None:
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)
        self.stop = threading.Event()
        self.ok = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.client.chat.completions.create(
                    model="motor-sim", messages=[{"role": "user", "content": "hello"}], max_tokens=8
                )
                self.ok += 1
            except openai.OpenAIError:
                self.stop.wait(0.05)  # nothing routable for a moment (a restart): try again

    def close(self) -> None:
        self.stop.set()
        self.thread.join(35)


class Alarms:
    def __init__(self, cluster: Cluster) -> None:
        self.addr = cluster.grpc(CONTROLLER)

    def call(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        out = grpcurl("-d", json.dumps(body), self.addr, f"motor.v1.Controller/{method}")
        if out.returncode != 0:
            raise CallFailed(out.stderr)
        return dict(json.loads(out.stdout or "{}"))

    def active(self, alarm_id: str) -> list[dict[str, Any]]:
        found = self.call("ListAlarms", {"active_only": True, "page_size": 1000}).get("alarms", [])
        return [a for a in found if a["alarm_id"] == alarm_id]

    def history(self) -> list[dict[str, Any]]:
        found = self.call("ListAlarms", {"page_size": 1000}).get("alarms", [])
        return sorted(found, key=lambda a: int(a["sequence"]))


def set_fault(cluster: Cluster, engine: int, mode: str) -> None:
    req = urllib.request.Request(
        f"{cluster.engine_url(engine)}/sim/fault",
        data=json.dumps({"mode": mode}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200


def pd_ids(alarms: Alarms) -> tuple[str, str]:
    insts = alarms.call("ListInstances", {"status": "INSTANCE_STATUS_ACTIVE"}).get("instances", [])
    by_role = {i["role"]: i["id"] for i in insts}
    return by_role["ROLE_PREFILL"], by_role["ROLE_DECODE"]


@pytest.fixture
def cluster_with(tmp_path: Path) -> Iterator[Any]:
    started: list[Cluster] = []

    def start(controller: dict[str, Any]) -> Cluster:
        cfg = tmp_path / "motor.json"
        cfg.write_text(json.dumps({"controller": controller, "coordinator": DETECTION}))
        c = Cluster(tmp_path, "--config", str(cfg))
        started.append(c)
        c.wait_ready(90)
        return c

    yield start
    for c in started:
        c.cleanup()


def test_precision_alarm_lifecycle(tmp_path: Path, cluster_with: Any) -> None:
    am = start_alertmanager(tmp_path)
    try:
        c = cluster_with({"alarm_webhook_url": f"{am.base}/api/v2/alerts"})
        alarms = Alarms(c)
        p, d = pd_ids(alarms)
        watch = Proc(motor_argv("alarms", "--watch", "-o", "json", "--controller", alarms.addr))

        def watching() -> bool:
            """An EVENT printed by the watch: it is following the store (it starts with new
            records only, so it must subscribe before the fault is injected)."""
            if any('"test-start"' in ln for ln in watch.stdout_lines):
                return True
            event = {"alarm_id": "test-start", "category": "ALARM_CATEGORY_EVENT", "moi": "test"}
            alarms.call("ReportAlarms", {"alarms": [event]})
            return False

        wait_until(watching, timeout=20, every=0.5)
        load = Load(c.base_url)
        try:
            # 1. The decode engine's output turns to garbage: ALARM in the store, on the watch,
            #    and firing in Alertmanager.
            set_fault(c, 1, "precision")
            raised = wait_until(lambda: alarms.active(PRECISION), timeout=60)[0]
            moi = raised["moi"]
            assert moi.endswith(f"pId={p}, instanceId={d}") and raised["instance_id"] == d
            wait_until(lambda: any(f'"{PRECISION}"' in ln for ln in watch.stdout_lines), timeout=20)
            alert = wait_until(lambda: firing(am, PRECISION), timeout=30)[0]
            assert alert["labels"]["moi"] == moi and alert["labels"]["instance_id"] == d

            # 2. The Controller is SIGKILLed: the alarm is still active after its restart, and
            #    the watch (which resumes from its last sequence) misses nothing.
            pid = wait_until(lambda: c.component_pid("controller"), timeout=15)
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: c.component_pid("controller") not in (0, pid), timeout=30)
            # The restarted Controller refuses calls until it listens again.
            again = wait_until(lambda: alarms.active(PRECISION), timeout=30, retry=(CallFailed,))[0]
            assert (again["moi"], again["sequence"]) == (moi, raised["sequence"])

            # 3. The fault goes away: the Coordinator's normal samples send the CLEAR (same moi),
            #    and Alertmanager's alert resolves.
            set_fault(c, 1, "none")
            wait_until(lambda: not alarms.active(PRECISION), timeout=60)
            clear = [a for a in alarms.history() if a["alarm_id"] == PRECISION][-1]
            assert clear["category"] == "ALARM_CATEGORY_CLEAR" and clear["moi"] == moi
            wait_until(lambda: not firing(am, PRECISION), timeout=30)

            # 4. Garbage again, then an operator terminates the group with precision_alarm_clear.
            set_fault(c, 1, "precision")
            second = wait_until(lambda: alarms.active(PRECISION), timeout=60)[0]
            resp = alarms.call(
                "TerminateInstance",
                {"instance_id": d, "p_instance_id": p, "precision_alarm_clear": True, "reason": "test"},
            )
            assert (
                resp.get("terminated")
                and resp.get("precision_alarm_cleared")
                and resp["moi"] == second["moi"]
            )
            assert not alarms.active(PRECISION)
            # The NodeManagers stopped and motor up restarted them: new instances serve again
            # (no ACTIVE prefill or decode for a while: pd_ids' KeyError).
            wait_until(lambda: pd_ids(alarms) != (p, d), timeout=60, retry=(KeyError,))
            served = load.ok
            wait_until(lambda: load.ok > served + 3, timeout=30)

            # 5. A killed engine: the instance alarm is raised, and cleared once it is back.
            p2, d2 = pd_ids(alarms)
            pgids = c.engine_pgids()
            os.killpg(pgids[-1], signal.SIGKILL)
            wait_until(lambda: [a for a in alarms.history() if a["alarm_id"] == INSTANCE_FAULT], timeout=30)
            wait_until(lambda: not alarms.active(INSTANCE_FAULT), timeout=60)
            raised_ids = {a["instance_id"] for a in alarms.history() if a["alarm_id"] == INSTANCE_FAULT}
            assert raised_ids & {p2, d2}
        finally:
            load.close()
            watch.signal(signal.SIGINT)
            try:
                watch.popen.wait(10)
            finally:
                watch.kill()  # whatever happened, no watch outlives the test

        # The watch printed every record the store holds, once each, across the restart.
        printed = [json.loads(ln) for ln in watch.stdout_lines if ln.startswith("{")]
        seqs = [int(a["sequence"]) for a in printed]
        assert seqs == sorted(set(seqs))
        stored = [int(a["sequence"]) for a in alarms.history()]
        assert seqs == [s for s in stored if s >= seqs[0]]
    finally:
        am.stop()


def test_auto_recovery_terminates_the_group_and_clears(cluster_with: Any) -> None:
    c = cluster_with({"precision_auto_recovery_enabled": True})
    alarms = Alarms(c)
    p, d = pd_ids(alarms)
    restarts_before = c.proc.output().count("event=restart component=nm-")
    load = Load(c.base_url)
    try:
        set_fault(c, 1, "precision")
        wait_until(lambda: [a for a in alarms.history() if a["alarm_id"] == PRECISION], timeout=60)
        # Recovered at once: the ALARM and its CLEAR, both NodeManagers stopped and restarted.
        records = wait_until(
            lambda: [a for a in alarms.history() if a["alarm_id"] == PRECISION][1:], timeout=30
        )
        assert records[0]["category"] == "ALARM_CATEGORY_CLEAR"
        assert records[0]["moi"].endswith(f"pId={p}, instanceId={d}")
        assert not alarms.active(PRECISION)
        wait_until(
            lambda: c.proc.output().count("event=restart component=nm-") >= restarts_before + 2, timeout=60
        )
        # The instances come back (new ids) and serve (none ACTIVE for a while: pd_ids' KeyError).
        wait_until(lambda: pd_ids(alarms) != (p, d), timeout=60, retry=(KeyError,))
        served = load.ok
        wait_until(lambda: load.ok > served + 3, timeout=30)
    finally:
        load.close()
