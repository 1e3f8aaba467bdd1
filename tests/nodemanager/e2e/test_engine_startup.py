"""An engine's start-up as a NodeManager shows it: GetStatus says how long a loading engine has
been starting and what it last wrote (the heartbeats carry neither), and an engine not healthy
within ``engine_startup_timeout_s`` is named in one warning with its last output, killed, and
reported dead to the Controller."""

from __future__ import annotations

import asyncio
import os
import urllib.request
from pathlib import Path

from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2
from tests.nodemanager.conftest import nm_config
from tests.poll import until
from tests.ports import reserved_pair
from tests.procs import group_gone

WAIT = common_pb2.ENDPOINT_STATUS_WAIT_TO_START
NORMAL = common_pb2.ENDPOINT_STATUS_NORMAL
ABNORMAL = common_pb2.ENDPOINT_STATUS_ABNORMAL
DEAD = controller_pb2.ENGINE_EVENT_TYPE_DEAD


def hung_vllm(tmp_path: Path) -> dict[str, str]:
    """A ``vllm`` on PATH that writes two lines at once and then never serves: a real engine
    stuck in its start-up (waiting for a peer, a device, a download)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    vllm = bin_dir / "vllm"
    vllm.write_text(
        "#!/bin/sh\necho 'INFO loading weights: shard 1 of 4'\necho 'INFO waiting for the other ranks'\n"
        "exec sleep 600\n"
    )
    vllm.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def lines_of(status, text: str) -> bool:
    return bool(status.endpoints) and any(text in line for line in status.endpoints[0].last_output_lines)


async def test_get_status_shows_how_long_an_engine_has_been_starting_and_its_last_output(
    tmp_path: Path, start_nm
) -> None:
    port = reserved_pair()
    # The simulated engine loading for ever (until /sim/ready): a model that takes minutes.
    nm = await start_nm(nm_config(tmp_path, [port], engine={"args": {"startup_s": "inf"}}))
    pid = (await nm.start_engines()).endpoints[0].pid

    status = await nm.wait_status(lambda s: lines_of(s, "event=loading"), "the engine's loading line")
    ep = status.endpoints[0]
    assert not status.ready
    assert (ep.status, ep.pid) == (WAIT, pid)
    assert ep.HasField("startup_elapsed") and ep.startup_elapsed.ToNanoseconds() > 0
    # Oldest first, the engine's own lines as it wrote them: the last one is what it does now.
    assert "service=engine-sim event=loading" in ep.last_output_lines[-1]
    assert "ready_in_s=never" in ep.last_output_lines[-1]
    assert any("event=listening" in line for line in ep.last_output_lines[:-1])
    first = ep.startup_elapsed.ToNanoseconds()
    await nm.wait_status(
        lambda s: s.endpoints[0].startup_elapsed.ToNanoseconds() > first, "the elapsed time growing"
    )
    # Its output still reaches the NodeManager's own output, unprefixed outside `motor up`.
    await nm.proc.await_line(
        lambda line: line.startswith("ts=") and "service=engine-sim event=loading" in line
    )

    ready_now = urllib.request.Request(f"http://127.0.0.1:{port}/sim/ready", b"")
    await asyncio.to_thread(urllib.request.urlopen, ready_now, timeout=5)
    ready = await nm.wait_ready()
    ep = ready.endpoints[0]
    assert (ep.status, ep.pid) == (NORMAL, pid)
    assert not ep.HasField("startup_elapsed")  # started: nothing to time any more
    assert "event=loaded" in ep.last_output_lines[-1]


async def test_an_engine_not_healthy_within_its_startup_window_is_named_killed_and_reported_dead(
    tmp_path: Path, start_nm, controller
) -> None:
    port = reserved_pair()
    cfg = nm_config(
        tmp_path,
        [port],
        job_name="job-a",
        controller=controller.address,
        engine_type="vllm",
        engine_startup_timeout_s=1.5,
        suicide_threshold=1000,  # the pod-restart fallback stays out of this
    )
    nm = await start_nm(cfg, env=hung_vllm(tmp_path))
    await nm.wait_line("event=registered")
    pid = (await nm.start_engines()).endpoints[0].pid

    # While it starts, GetStatus has its lines; the heartbeats stay small.
    await nm.wait_status(lambda s: lines_of(s, "waiting for the other ranks"), "the engine's output")

    warning = await nm.wait_line("event=engine_startup_timeout", 20)
    assert "level=warning" in warning
    assert f"endpoint_id=0 port={port} pid={pid} " in warning
    assert "waited_s=" in warning and "timeout_s=1.5" in warning
    assert "INFO loading weights: shard 1 of 4\\nINFO waiting for the other ranks" in warning

    # Killed like a hung engine, and reported dead: the Controller relaunches it from there.
    await until(lambda: group_gone(pid), 10, "the engine's process group killed")
    event = await until(
        lambda: next((e for e in controller.fake.events() if e.pid == pid), None), 10, "the death report"
    )
    assert event.type == DEAD and "not healthy within 1.5s of start-up" in event.detail
    status = await nm.wait_status(lambda s: s.endpoints[0].status == ABNORMAL, "ABNORMAL")
    assert status.endpoints[0].pid == 0
    assert "INFO waiting for the other ranks" in status.endpoints[0].last_output_lines[-1]

    assert nm.proc.output().count("event=engine_startup_timeout") == 1
    beats = [ep for b in controller.fake.beats() for ep in b.endpoints]
    assert beats and not any(ep.last_output_lines or ep.HasField("startup_elapsed") for ep in beats)
