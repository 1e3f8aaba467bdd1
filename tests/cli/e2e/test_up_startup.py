"""Engine start-up you can see, against a real ``motor up``: while READY is awaited it reports
every engine it waits for on stderr (name, NodeManager, port, pid, how long, its last line),
``motor status`` shows a starting engine with its elapsed time and last line, and an engine not
healthy within ``engine_startup_timeout_s`` is named in one warning, killed and relaunched in
place by the Controller."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from motor_mesh.cli import status, status_table, up
from motor_mesh.cli.up_args import parse
from motor_mesh.common.config import load
from motor_mesh.gen.motor.v1 import common_pb2, nodemanager_pb2
from tests.e2e.cluster import CONTROLLER, COORDINATOR, Cluster
from tests.nodemanager.e2e.test_engine_startup import hung_vllm
from tests.procs import motor_argv

pytestmark = pytest.mark.timeout(180)

PROGRESS_S = 0.3  # MOTOR_UP_PROGRESS_S: motor up's report interval, shortened


def config(tmp: Path, cfg: dict) -> str:
    path = tmp / "motor.json"
    path.write_text(json.dumps({"coordinator": {"workers": 1}, **cfg}))
    return str(path)


def motor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(motor_argv(*args), capture_output=True, text=True, timeout=60)


def test_the_table_shows_a_long_start_up_with_its_last_line_cut_to_fit() -> None:
    loading = "INFO 01-05 10:11:12 [weight_utils.py:250] " + "x" * 200 + " shards: 50% 2/4"
    engines = [
        {"endpoint": "10.0.0.5:10000", "pid": 41, "status": "NORMAL", "headless": False},
        {"endpoint": "10.0.0.5:10002", "pid": 1234, "status": "WAIT_TO_START", "headless": False,
         "startup_elapsed_s": 133.4, "last_output_lines": ["older", loading]},
        {"endpoint": "10.0.0.5:10004", "pid": 1235, "status": "WAIT_TO_START", "headless": False,
         "startup_elapsed_s": 3.0, "last_output_lines": ["just started"]},
    ]  # fmt: skip
    nm = {"address": "10.0.0.5:7300", "error": None, "instance_id": 4, "role": "decode", "ready": False,
          "engines": engines, "uptime_s": 140.0, "restarts": 0, "frozen": False, "frozen_until": None}  # fmt: skip
    ok = {
        "address": "10.0.0.1:7100",
        "health": "UNREACHABLE",
        "error": {"code": "UNAVAILABLE", "message": ""},
    }
    lines = status_table.render({"controller": ok, "coordinators": [], "nodemanagers": [nm]}, 0.0)
    rows = lines[lines.index(next(s for s in lines if s.startswith("NODEMANAGER"))) + 1 :]
    assert rows[0].endswith("10.0.0.5:10000 pid=41 NORMAL")
    assert rows[1].endswith("10.0.0.5:10002 pid=1234 WAIT_TO_START starting 2m13s")
    # Its last line, under it, from the second column, cut in the middle to fit 100 columns.
    assert rows[2].startswith(" " * len("10.0.0.5:7300  ") + "last output: INFO 01-05")
    assert rows[2].endswith("xx shards: 50% 2/4") and "…" in rows[2] and len(rows[2]) == status_table.WIDTH
    # Starting for 3 s: nothing to explain yet.
    assert rows[3].endswith("10.0.0.5:10004 pid=1235 WAIT_TO_START starting 3s") and len(rows) == 4


def test_a_progress_report_says_what_each_node_and_engine_is_waiting_for(tmp_path: Path) -> None:
    cluster = up.Cluster(
        parse(["--prefill", "1", "--dp", "2"]), load(None, env={}), tmp_path, own_state=False
    )
    nm = cluster.plan.nodes[0]
    down = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
    assert cluster._progress(nm, down) == [
        "motor up: waiting for nm-0 (127.0.0.1:7300): not answering yet (UNAVAILABLE)"
    ]
    empty = nodemanager_pb2.GetStatusResponse()
    assert cluster._progress(nm, empty) == [
        "motor up: waiting for nm-0 (127.0.0.1:7300): no engines yet (its instance is not assembled yet)"
    ]
    loading = common_pb2.Endpoint(
        id=1,
        port=10002,
        pid=42,
        status=common_pb2.ENDPOINT_STATUS_WAIT_TO_START,
        last_output_lines=["a", "b"],
    )
    loading.startup_elapsed.FromSeconds(133)
    got = nodemanager_pb2.GetStatusResponse(
        endpoints=[
            common_pb2.Endpoint(id=0, port=10000, pid=41, status=common_pb2.ENDPOINT_STATUS_NORMAL),
            loading,
        ]
    )
    # The ready engine is not waited for; engine-1 is NodeManager 0's second.
    assert cluster._progress(nm, got) == [
        "motor up: waiting for engine-1 (nm-0, port 10002, pid 42): starting for 2m13s; last output: b"
    ]
    dead = common_pb2.Endpoint(id=0, port=10000, status=common_pb2.ENDPOINT_STATUS_ABNORMAL)
    assert cluster._progress(nm, nodemanager_pb2.GetStatusResponse(endpoints=[dead])) == [
        "motor up: waiting for engine-0 (nm-0, port 10000, no pid): ABNORMAL; no output yet"
    ]


def test_motor_up_and_motor_status_show_an_engine_loading_until_it_is_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # One union instance whose simulated engine loads until the test says it is done.
    cfg = config(tmp_path, {"engine": {"args": {"startup_s": "inf"}}})
    c = Cluster(
        tmp_path, "--union", "1", "--config", cfg, nodes=1, env={"MOTOR_UP_PROGRESS_S": str(PROGRESS_S)}
    )
    try:
        port = c.engine_port(0)
        progress = re.compile(
            rf"^motor up: waiting for engine-0 \(nm-0, port {port}, pid (\d+)\): starting for \d+s; "
            r"last output: ts=\S+ level=info service=engine-sim event=loading .*ready_in_s=never"
        )
        line = c.proc.wait_line(progress, 60)
        assert line not in c.proc.stdout_lines  # stderr: stdout carries READY alone
        pid = int(progress.search(line).group(1))  # type: ignore[union-attr]
        assert b"engine-sim" in Path(f"/proc/{pid}/cmdline").read_bytes()

        where = ["--controller", c.grpc(CONTROLLER), "--coordinator", c.grpc(COORDINATOR)]
        table = motor("status", *where)
        assert table.returncode == 0, table.stderr
        assert re.search(rf"127\.0\.0\.1:{port} pid={pid} WAIT_TO_START starting \d+s", table.stdout)
        doc = json.loads(motor("status", *where, "-o", "json").stdout)
        engine = doc["nodemanagers"][0]["engines"][0]
        assert (engine["pid"], engine["status"]) == (pid, "WAIT_TO_START")
        assert engine["startup_elapsed_s"] > 0
        assert "event=loading" in engine["last_output_lines"][-1]
        # Past SHOW_OUTPUT_AFTER_S (15 s, made 0 here) the table also shows its last line.
        monkeypatch.setattr(status_table, "SHOW_OUTPUT_AFTER_S", 0.0)
        assert status.main(where) == 0
        shown = capsys.readouterr().out.splitlines()
        row = next(k for k, s in enumerate(shown) if f"pid={pid} WAIT_TO_START starting" in s)
        note = shown[row + 1].strip()
        assert note.startswith("last output: ts=") and "event=loading" in note

        urllib.request.urlopen(urllib.request.Request(f"{c.engine_url(0)}/sim/ready", b""), timeout=5)
        c.wait_ready()
        ready_at = time.monotonic()
        # The reports stop with READY: the next time one would have been due, motor up says so.
        c.proc.wait_line("event=progress_done reason=ready", 30)
        assert not c.proc.lines_since(ready_at, "motor up: waiting for")
    finally:
        c.stop()


def test_an_engine_not_healthy_within_its_startup_window_is_killed_and_relaunched_in_place(
    tmp_path: Path,
) -> None:
    # A `vllm` that writes two lines and never serves; 1.5 s of start-up allowed.
    cfg = config(tmp_path, {"nodemanager": {"engine_startup_timeout_s": 1.5}})
    c = Cluster(
        tmp_path, "--union", "1", "--engine-type", "vllm", "--config", cfg, nodes=1, env=hung_vllm(tmp_path)
    )
    try:
        started = c.proc.wait_line(re.compile(r"^\[nm-0\] .*event=engine_started "), 60)
        pid = int(re.search(r" pid=(\d+)", started).group(1))  # type: ignore[union-attr]
        warning = c.proc.wait_line("event=engine_startup_timeout", 30)
        assert warning.startswith("[nm-0] ") and "level=warning" in warning
        assert f"port={c.engine_port(0)} pid={pid} " in warning
        assert 'last_output="INFO loading weights: shard 1 of 4\\nINFO waiting for the other' in warning

        # Reported dead, and relaunched in place by the Controller: the same instance, a new pid.
        c.proc.wait_line(re.compile(rf"event=engine_died .*pid={pid} .*not healthy within 1.5s"), 20)
        c.proc.wait_line(
            re.compile(r"^\[controller\] .*event=strategy_started .*strategy=EngineRelaunch"), 20
        )
        c.proc.wait_line(re.compile(r"^\[nm-0\] .*event=engine_relaunch relaunch_count=1"), 20)
        again = c.proc.wait_line(re.compile(rf"^\[nm-0\] .*event=engine_started .* pid=(?!{pid} )\d+"), 20)
        assert again != started
        named = f"event=engine_startup_timeout endpoint_id=0 port={c.engine_port(0)} pid={pid} "
        assert c.proc.output().count(named) == 1  # one line, however long it was probed
    finally:
        c.stop()
