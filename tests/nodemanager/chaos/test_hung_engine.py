"""A hung engine is relaunched in place, end to end: `motor up --prefill 1 --decode 2` (simulated
engines) under a light load of non-streaming completions, the NodeManagers' probes made faster.
One decode engine hangs, first as a whole process (its group SIGSTOPped: /health stops
answering; the hang timeout and the pod-restart fallback at their defaults), then as a wedged
scheduler (the simulated engine's `hang` fault: /health keeps answering 200, only the inference
probe notices; every timing scaled down). Either way the NodeManager kills it
`engine_hang_timeout_s` after it turned ABNORMAL, the Controller relaunches it in place (same
NodeManager process, new engine pid), it serves again, the pod-restart fallback never acts, and
not one request fails: the requests stuck on the hung engine are retried on the other decode
instance when its connections drop at the kill."""

from __future__ import annotations

import contextlib
import os
import signal
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.chaos.harness import ACTIVE, Cluster, Load, Scenario, by_job, pid_of, scenario
from tests.poll import wait_until

pytestmark = pytest.mark.timeout(150)

# Health probes every 0.2 s with a 0.5 s deadline: a stopped engine is ABNORMAL within about
# 1.4 s. The hang timeout and the pod-restart fallback keep their defaults in the first test (the
# kill 9 s after the ABNORMAL turn must come before the fallback, which may act 3 * (5 - 1) =
# 12 s after it); the second test scales them down to 2 s and 1 * (5 - 1) = 4 s.
DETECTION = {"status_poll_interval_s": 0.2, "status_probe_timeout_s": 0.5, "max_probe_failures": 2}
FAST_HANG = {"engine_hang_timeout_s": 2, "suicide_check_interval_s": 1, "suicide_threshold": 5}
# Relaunch readiness is polled every second (the default 5 s only slows the test down).
CONTROLLER = {"engine_relaunch_poll_interval_s": 1}
# motor up numbers its NodeManagers prefill first: nm-0 prefill, nm-1 and nm-2 decode.
VICTIM, VICTIM_NM = "motor-sim-decode-0", 1
VICTIMS_LINE = f"[nm-{VICTIM_NM}] "
NON_STREAMING = 1 << 62  # Load streams every n-th request: never
# A one-token completion every 0.5 s (its deadline too); three failed in a row: ABNORMAL.
INFERENCE_PROBE = {
    "engine_probe_inference": True,
    "probe_inference_interval_s": 0.5,
    "probe_inference_failures": 3,
}


@contextlib.contextmanager
def running(tmp_path: Path, **nodemanager: Any) -> Iterator[tuple[Cluster, Load]]:
    """The cluster (with ``nodemanager`` settings added) and its load, serving."""
    config = {"controller": CONTROLLER, "nodemanager": {**DETECTION, **nodemanager}}
    c = Cluster(tmp_path, prefill=1, decode=2, config=config)
    load: Load | None = None
    try:
        c.wait_ready()
        c.steady(3)
        load = Load(c.base_url, stream_every=NON_STREAMING).start()
        load.wait_served(10, since=0.0)
        yield c, load
    finally:
        if load is not None:
            load.stop()
        c.close()


def victims(event: str) -> Callable[[str], bool]:
    """Matches the victim's NodeManager's ``event`` lines in motor up's output."""
    return lambda line: line.startswith(VICTIMS_LINE) and f" event={event} " in line


def relaunched_in_place(c: Cluster, load: Load, sc: Scenario, before: dict[str, Any], nm_pid: int) -> None:
    """The victim's instance ACTIVE again under its id with a new engine on the same
    NodeManager, serving; nothing restarted and no request failed."""
    victim = before[VICTIM]
    old_pid = pid_of(victim)
    c.up.wait_line(lambda s: s.startswith(VICTIMS_LINE + "[ENGINE RELAUNCH #1 "), 30)

    def relaunched() -> bool:
        inst = by_job(c.instances()).get(VICTIM)
        return inst is not None and inst.status == ACTIVE and pid_of(inst) not in (0, old_pid)

    wait_until(relaunched, 60, "the instance ACTIVE again with a new engine", every=0.05)
    sc.recovered()
    load.wait_served(10, since=sc.recovered_at or 0.0)
    after = by_job(c.steady(3))
    assert {j: i.id for j, i in after.items()} == {j: i.id for j, i in before.items()}
    assert c.nodemanager_pid(VICTIM_NM) == nm_pid  # relaunched in place, not a pod restart
    # The fallback counted the ABNORMAL engine (suicide_check) but never reached its threshold.
    assert not [s for s in c.up.lines if "event=restart " in s or "suicide:" in s]
    assert all(pid_of(after[j]) == pid_of(i) for j, i in before.items() if j != VICTIM)
    # The new engine itself answers.
    port = after[VICTIM].endpoints[0].port
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=10)
    assert client.completions.create(model="motor-sim", prompt="again", max_tokens=2).choices
    failed, total, _, _ = sc.counts()
    assert total > 0 and failed == 0, sc.errors()


def test_a_stopped_engine_is_killed_and_relaunched_in_place(tmp_path: Path) -> None:
    what = "SIGSTOP a decode engine's process group"
    with running(tmp_path) as (cluster, load), scenario("engine_sigstop", load, what, cluster=cluster) as sc:
        before = by_job(cluster.steady(3))
        nm_pid = cluster.nodemanager_pid(VICTIM_NM)
        old_pid = pid_of(before[VICTIM])
        sc.fault()
        os.killpg(old_pid, signal.SIGSTOP)
        line = cluster.up.wait_line(victims("engine_hung"), 30, start=cluster.up.index_at(sc.fault_at or 0))
        assert f"pid={old_pid}" in line
        relaunched_in_place(cluster, load, sc, before, nm_pid)


def test_a_wedged_scheduler_is_found_by_the_inference_probe_and_relaunched(tmp_path: Path) -> None:
    what = "the simulated engine's hang fault on a decode engine (inference probe on)"
    with (
        running(tmp_path, **FAST_HANG, **INFERENCE_PROBE) as (cluster, load),
        scenario("engine_sim_hang", load, what, cluster=cluster) as sc,
    ):
        before = by_job(cluster.steady(3))
        nm_pid = cluster.nodemanager_pid(VICTIM_NM)
        old_pid = pid_of(before[VICTIM])
        base = f"http://127.0.0.1:{before[VICTIM].endpoints[0].port}"
        sc.fault()
        arm = urllib.request.Request(
            base + "/sim/fault", data=b'{"mode": "hang"}', headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(arm, timeout=5) as resp:
            assert resp.status == 200
        since = cluster.up.index_at(sc.fault_at or 0)
        line = cluster.up.wait_line(victims("engine_unhealthy"), 30, start=since)
        assert "inference probes failed in a row" in line
        # Judged hung, and not killed yet: its /health answers 200 all the same.
        with urllib.request.urlopen(base + "/health", timeout=5) as resp:
            assert resp.status == 200
        line = cluster.up.wait_line(victims("engine_hung"), 30, start=since)
        assert f"pid={old_pid}" in line and "inference" in line
        relaunched_in_place(cluster, load, sc, before, nm_pid)
