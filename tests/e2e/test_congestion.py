"""The congestion alarm end to end: ``motor up`` with a Coordinator of two inference workers, small
admission limits and ``congestion_raise_s`` 1, slow simulated engines, and a real Alertmanager.
A sustained overload raises 0xFC001005 in the Controller's alarm store and fires it in
Alertmanager; once the load stops the Coordinator clears it and Alertmanager resolves it."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.cluster import COORDINATOR, Cluster
from tests.e2e.streaming import write_config
from tests.e2e.test_alarms import Alarms, firing, start_alertmanager
from tests.poll import wait_until

pytestmark = pytest.mark.timeout(240)

CONGESTION = "0xFC001005"
# Capacity 8, each worker's share 2 running + 2 queued: 85 % (7 of 8) takes both workers' requests.
COORDINATOR_CFG = {
    "workers": 2,
    "max_concurrent_requests": 4,
    "max_queued_requests": 4,
    "congestion_raise_s": 1,
}
ONE_WORKER = 4
TPOT_MS = 50  # 16 tokens: about 0.8 s per request
CLIENTS = 24


class Flood:
    """``CLIENTS`` threads sending completions back to back, each on a new connection (so the
    kernel spreads them over both workers); a refused one (429) is sent again after a pause."""

    def __init__(self, base_url: str) -> None:
        self.url = f"{base_url}/v1/completions"
        self.stop = threading.Event()
        self.statuses: dict[int, int] = {}
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(CLIENTS)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        body = json.dumps({"model": "motor-sim", "prompt": "congested", "max_tokens": 16}).encode()
        while not self.stop.is_set():
            req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    resp.read()
                    status = resp.status
            except urllib.error.HTTPError as err:
                status = err.code
            except OSError:
                status = 0
            with self._lock:
                self.statuses[status] = self.statuses.get(status, 0) + 1
            if status != 200:
                self.stop.wait(0.05)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(65)


def coordinator_metric(c: Cluster, name: str) -> float:
    with urllib.request.urlopen(f"{c.base_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


def test_sustained_overload_raises_the_congestion_alarm_and_its_end_resolves_it(tmp_path: Path) -> None:
    am = start_alertmanager(tmp_path)
    try:
        cfg = write_config(
            tmp_path,
            controller={"alarm_webhook_url": f"{am.base}/api/v2/alerts"},
            coordinator=COORDINATOR_CFG,
            engine={"args": {"tpot_ms": TPOT_MS}},
        )
        c = Cluster(tmp_path, "--config", str(cfg))
        try:
            c.wait_ready(90)
            alarms = Alarms(c)
            assert not alarms.active(CONGESTION)
            flood = Flood(c.base_url)
            try:
                raised = wait_until(lambda: alarms.active(CONGESTION), timeout=60, what="the alarm")[0]
                moi = f"service name=Coordinator, service ip={c.grpc(COORDINATOR)}"
                assert raised["moi"] == moi and raised["severity"] == "SEVERITY_MAJOR"
                info = raised["additional_info"]
                # Both workers' requests were counted: one alone holds at most its share.
                assert int(info["running"]) + int(info["queued"]) > ONE_WORKER, info
                assert info["capacity"] == "8"

                alert = wait_until(lambda: firing(am, CONGESTION), timeout=30, what="firing")[0]
                assert alert["labels"]["alertname"] == "MotorCoordinatorCongestion"
                assert alert["labels"]["moi"] == moi and alert["labels"]["severity"] == "major"
                assert coordinator_metric(c, "motor_coordinator_congestion_alarm") == 1
            finally:
                flood.close()
            assert flood.statuses.get(429), flood.statuses  # it was overloaded indeed

            wait_until(lambda: not alarms.active(CONGESTION), timeout=60, what="the clear")
            records = [a for a in alarms.history() if a["alarm_id"] == CONGESTION]
            assert [a["category"] for a in records] == ["ALARM_CATEGORY_ALARM", "ALARM_CATEGORY_CLEAR"]
            assert records[1]["moi"] == moi
            wait_until(lambda: not firing(am, CONGESTION), timeout=30, what="resolved in Alertmanager")
            assert coordinator_metric(c, "motor_coordinator_congestion_alarm") == 0
            assert coordinator_metric(c, "motor_coordinator_admission_use") < 0.75
        finally:
            c.cleanup()
    finally:
        am.stop()
