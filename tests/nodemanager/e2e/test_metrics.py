"""A NodeManager's ``/metrics`` on a real ``motor nodemanager`` with ``metrics_port`` set: its
engines' statuses, probes, deaths, relaunches and freeze, and its link to the Controller, show
in the numbers; without ``metrics_port`` it serves none."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from motor_mesh.common import server
from motor_mesh.gen.motor.v1 import nodemanager_pb2 as pb
from tests.metrics import Scrape, ascrape, scrape_until
from tests.nodemanager.conftest import ControllerServer, nm_config
from tests.ports import reserved_pair, reserved_port
from tests.procs import listening_ports

RESTART = pb.RestartEnginesRequest(action=pb.RESTART_ACTION_RESTART)
ABORT = pb.RestartEnginesRequest(action=pb.RESTART_ACTION_ABORT)


async def test_metrics_follow_engines_probes_relaunches_and_the_controller_link(
    tmp_path: Path,
    start_nm: Callable[..., Any],
    controller: ControllerServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server, "SHUTDOWN_DRAIN_S", 0.0)  # the fake Controller stops at once
    port = reserved_port()
    cfg = nm_config(
        tmp_path,
        [reserved_pair()],
        job_name="job-a",
        controller=controller.address,
        metrics_port=port,
        status_probe_timeout_s=0.2,
        engine_hang_timeout_s=600,  # a stopped engine stays ABNORMAL until the test kills it
        suicide_check_interval_s=600,
        engine_probe_inference=True,
        probe_inference_interval_s=0.2,
    )
    nm = await start_nm(cfg)
    line = await nm.wait_line("event=listening")
    assert re.search(rf" metrics=127\.0\.0\.1:{port}\b", line)
    url = f"http://127.0.0.1:{port}/metrics"

    def scraped(check: Callable[[Scrape], Any]) -> Awaitable[Scrape]:
        return scrape_until(url, check)

    m = await scraped(lambda m: m.value("motor_nodemanager_controller_connected") == 1)
    assert m.value("motor_nodemanager_engines", status="NORMAL") == 0
    assert m.value("motor_nodemanager_probe_duration_seconds_count") == 0

    # Engines up: NORMAL, and probed from then on.
    started = await nm.start_engines(job_name="job-a")
    pid = started.endpoints[0].pid
    await nm.wait_ready()
    m = await scraped(lambda m: m.value("motor_nodemanager_probe_duration_seconds_count") >= 2)
    assert m.value("motor_nodemanager_engines", status="NORMAL") == 1
    assert m.value("motor_nodemanager_probe_failures_total") == 0
    assert m.value("motor_nodemanager_inference_probe_failures_total") == 0
    assert m.value("motor_nodemanager_engine_exits_total") == 0

    # The engine stops answering: its probes fail and it turns ABNORMAL; then it dies.
    os.killpg(pid, signal.SIGSTOP)
    m = await scraped(lambda m: m.value("motor_nodemanager_engines", status="ABNORMAL") == 1)
    assert m.value("motor_nodemanager_probe_failures_total") >= 2
    await scraped(lambda m: m.value("motor_nodemanager_inference_probe_failures_total") >= 1)
    os.killpg(pid, signal.SIGKILL)
    m = await scraped(lambda m: m.value("motor_nodemanager_engine_exits_total") == 1)
    assert m.value("motor_nodemanager_engine_restarts_total") == 0
    assert m.value("motor_nodemanager_frozen") == 0

    # A relaunch: counted, the fallback held off, the new engine NORMAL; ABORT lifts the hold.
    assert (await nm.stub.RestartEngines(RESTART, timeout=20)).relaunch_count == 1
    nm.track(*(e.pid for e in (await nm.status()).endpoints))
    m = await scraped(lambda m: m.value("motor_nodemanager_engines", status="NORMAL") == 1)
    assert m.value("motor_nodemanager_engine_restarts_total") == 1
    assert m.value("motor_nodemanager_frozen") == 1
    await nm.stub.RestartEngines(ABORT, timeout=5)
    m = await ascrape(url)
    assert m.value("motor_nodemanager_frozen") == 0
    assert m.value("motor_nodemanager_engine_exits_total") == 1  # still only the one that died
    assert m.value("motor_nodemanager_engine_output_dropped_lines_total") == 0

    # The Controller goes away: the stream is closed.
    await controller.stop()
    await scraped(lambda m: m.value("motor_nodemanager_controller_connected") == 0)


async def test_no_metrics_port_by_default(tmp_path: Path, start_nm: Callable[..., Any]) -> None:
    nm = await start_nm(nm_config(tmp_path, [reserved_pair()]))
    line = await nm.wait_line("event=listening")
    assert " metrics=" not in line
    assert listening_ports(nm.proc.pid) == {nm.port}
