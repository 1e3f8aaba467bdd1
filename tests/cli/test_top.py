"""``motor top``: the table and the JSON document from hand-built GetEngineMetrics answers, the
command against a fake Coordinator (tests/cli/top_data.py) and fake Controller, its one-line
errors, and the live mode: refreshed in place in a terminal, frame after frame into a pipe,
ended by Ctrl-C with exit status 0."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import io
import itertools
import json
import os
import pty
import signal
import struct
import termios
from collections.abc import AsyncIterator
from typing import Any

import pytest
from rich.console import Console

from motor_mesh.cli import main as motor
from motor_mesh.cli.top_model import ControllerView, TopModel
from motor_mesh.cli.top_view import render
from motor_mesh.common import enums, errors
from motor_mesh.gen.motor.v1 import alarm_pb2, common_pb2, coordinator_pb2
from tests.cli.top_data import T0, FakeCoordinator, FakeCoordinatorServer, realistic, timestamp
from tests.fake_controller import FakeController, controllers
from tests.poll import until
from tests.ports import reserved_port
from tests.procs import Proc, motor_argv

INSTANCE = coordinator_pb2.GetEngineMetricsRequest(
    view=coordinator_pb2.ENGINE_METRICS_VIEW_INSTANCE, include_coordinator=True
)
ROLE = coordinator_pb2.GetEngineMetricsRequest(view=coordinator_pb2.ENGINE_METRICS_VIEW_ROLE)
ALARMS = [
    alarm_pb2.Alarm(
        sequence=s,
        alarm_id="0xFC001002",
        severity=alarm_pb2.SEVERITY_MAJOR,
        instance_id=2,
        reason=f"instance 2 INACTIVE ({s})",
        occur_time=timestamp(T0 + s),
    )
    for s in range(1, 8)
]
INSTANCES = [
    common_pb2.Instance(id=1, role=enums.PREFILL, status=enums.ACTIVE),
    common_pb2.Instance(id=2, role=enums.DECODE, status=enums.INACTIVE),
]


class Controller(FakeController):
    """tests/fake_controller.py's, answering UNIMPLEMENTED for what it does not serve (RPCs
    newer than it)."""

    VALIDATORS: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        async def unimplemented(request: Any, context: Any) -> Any:
            raise errors.unimplemented(name)

        return unimplemented


@pytest.fixture
async def coordinator() -> AsyncIterator[FakeCoordinatorServer]:
    server = await FakeCoordinatorServer(FakeCoordinator(realistic())).start()
    yield server
    await server.stop()


def screen(doc: dict, **kw) -> list[str]:
    """The view as a 200-column file would get it: no colour, trailing blanks cut."""
    out = io.StringIO()
    Console(file=out, width=200, color_system=None, highlight=False).print(render(doc, now=T0 + 5, **kw))
    return [line.rstrip() for line in out.getvalue().splitlines()]


def row(lines: list[str], first: str) -> list[str]:
    """The cells of the line starting with ``first`` (cells hold no blanks but the stale mark)."""
    return next(line.split() for line in lines if line.split()[:1] == [first])


def at(coordinator: FakeCoordinatorServer | str, controller: str = "") -> list[str]:
    """The flags naming the Coordinator and the Controller ('' none)."""
    address = coordinator if isinstance(coordinator, str) else coordinator.address
    return ["--coordinator", address, "--controller", controller]


def motor_top(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, list[str]]:
    rc = motor.main(["top", *argv])
    out, err = capsys.readouterr()
    return rc, out, err.splitlines()


# ---- the table ------------------------------------------------------------------------------------


def test_the_table_shows_roles_instances_stale_engines_migrations_and_alarms() -> None:
    cluster = realistic()
    view = ControllerView(address="127.0.0.1:7100", statuses={1: "ACTIVE", 2: "INACTIVE"}, alarms=ALARMS)
    doc = TopModel("127.0.0.1:7200").update(cluster.response(INSTANCE), cluster.response(ROLE), view)
    lines = screen(doc, interval=2)
    assert lines[0] == (
        "motor top  Coordinator 127.0.0.1:7200  collected 08:00:00Z (5s ago)  latency since the engines started"
        "  refresh 2s"
    )
    assert row(lines, "ROLE") == (
        "ROLE INST ENGINES RUN WAIT KV MEAN KV MAX IN TOK/S OUT TOK/S TTFT P50 TTFT P99 TPOT P50 TPOT P99".split()
    )
    assert row(lines, "prefill") == "prefill 1 1 2 1 25.0% 25.0% 1,500 0.0 52ms 375ms - -".split()
    assert row(lines, "decode") == "decode 2 3 (2 stale) 7 0 62.5% 75.0% 0.0 800 70ms 80ms 18ms 72ms".split()
    assert row(lines, "ID") == (
        "ID ROLE STATUS RUN WAIT KV IN TOK/S OUT TOK/S TTFT P50 TTFT P99 TPOT P50 TPOT P99 ENGINES".split()
    )
    assert row(lines, "1") == "1 prefill ACTIVE 2 1 25.0% 1,500 0.0 52ms 375ms - - 127.0.0.1:10000".split()
    assert (
        row(lines, "2")
        == (
            "2 decode INACTIVE 7 0 62.5% 0.0 800 70ms 80ms 18ms 72ms 127.0.0.1:10010/dp0 127.0.0.1:10011/dp1 STALE"
        ).split()
    )
    # Scraped, no data yet: listed, every figure "-", and no status from the Controller.
    assert row(lines, "3") == "3 decode - - - - - - - - - - 127.0.0.1:10020 STALE".split()
    assert "  stale: instance 2 127.0.0.1:10011 (dp 1): connection refused; last success 08:00:00Z" in lines
    assert "  stale: instance 3 127.0.0.1:10020 (dp 0): connection refused; last success never" in lines
    assert "migrations 3: completed 1, continued 2   workers active: prefill 1, decode 1" in lines
    at = lines.index("alarms: 7 active, newest first:")
    assert lines[at + 1] == "  08:00:07Z  MAJOR     0xFC001002  instance 2  instance 2 INACTIVE (7)"
    assert lines[at + 5] == "  08:00:03Z  MAJOR     0xFC001002  instance 2  instance 2 INACTIVE (3)"
    assert lines[at + 6] == "  ... and 2 more (motor alarms)"


def test_the_table_says_what_is_missing_and_why() -> None:
    cluster = realistic()
    model = TopModel("127.0.0.1:7200")
    alone = model.update(cluster.response(INSTANCE), cluster.response(ROLE), ControllerView())
    lines = screen(alone)
    assert lines[-1] == "no Controller (--controller ''): standalone view, no alarms or instance status"
    cluster.collect_time = T0 + 3
    cluster.migrations[("disconnect", "continued")] += 1
    gone = ControllerView(
        address="127.0.0.1:7100", error={"code": "UNAVAILABLE", "message": "connect failed"}
    )
    later = model.update(cluster.response(INSTANCE), cluster.response(ROLE), gone)
    lines = screen(later, problem="cannot reach the Coordinator at 127.0.0.1:7200 (UNAVAILABLE)")
    assert "rates and latency over the last 3.0s" in lines[0]
    assert lines[1] == "cannot reach the Coordinator at 127.0.0.1:7200 (UNAVAILABLE); showing the last data"
    assert lines[-2].startswith("migrations 4 (+1): completed 1, continued 3")
    assert lines[-1] == "Controller 127.0.0.1:7100 did not answer (UNAVAILABLE): no alarms or instance status"


# ---- the command, against fakes -------------------------------------------------------------------


async def test_once_json_is_one_document_with_every_scraped_instance(coordinator, capsys) -> None:
    rc, out, err = await asyncio.to_thread(motor_top, capsys, "--once", "-o", "json", *at(coordinator))
    assert (rc, err) == (0, [])
    doc = json.loads(out)
    assert set(doc) == {
        "coordinator", "collect_time", "window_s", "roles", "active_workers", "instances", "migrations",
        "controller", "alarms",
    }  # fmt: skip
    assert doc["collect_time"] == "2027-01-15T08:00:00+00:00" and doc["window_s"] is None
    assert list(doc["roles"]) == ["prefill", "decode"]
    assert [(i["instance_id"], i["role"]) for i in doc["instances"]] == [
        (1, "prefill"),
        (2, "decode"),
        (3, "decode"),
    ]
    i1 = doc["instances"][0]
    assert i1 == {
        "instance_id": 1,
        "role": "prefill",
        "status": None,
        "running": 2.0,
        "waiting": 1.0,
        "kv_cache_usage": 0.25,
        "kv_cache_usage_max": 0.25,
        "prompt_tokens_per_second": 1500.0,
        "generation_tokens_per_second": 0.0,
        "ttft_p50_s": pytest.approx(0.0525),
        "ttft_p99_s": pytest.approx(0.375),
        "tpot_p50_s": None,
        "tpot_p99_s": None,
        "engines": [
            {
                "host": "127.0.0.1",
                "port": 10000,
                "dp_rank": 0,
                "fresh": True,
                "error": None,
                "last_success_time": "2027-01-15T08:00:00+00:00",
            }
        ],
    }
    assert doc["instances"][2]["running"] is None
    assert doc["migrations"]["by_outcome"] == {"completed": 1, "continued": 2, "refused": 0}
    assert (doc["controller"], doc["alarms"]) == (None, None)
    # One INSTANCE view with the Coordinator's own series, one ROLE view.
    views = sorted((r.view, r.include_coordinator) for r in coordinator.fake.requests)
    assert views == [
        (coordinator_pb2.ENGINE_METRICS_VIEW_INSTANCE, True),
        (coordinator_pb2.ENGINE_METRICS_VIEW_ROLE, False),
    ]


async def test_with_a_controller_it_shows_instance_status_and_alarms(coordinator, capsys) -> None:
    async with controllers(Controller()) as (ctl,):
        ctl.fake.instances, ctl.fake.alarms = list(INSTANCES), list(ALARMS[:2])
        rc, out, err = await asyncio.to_thread(
            motor_top, capsys, "--once", "-o", "json", *at(coordinator, ctl.address)
        )
        assert (rc, err) == (0, [])
        doc = json.loads(out)
        assert [i["status"] for i in doc["instances"]] == ["ACTIVE", "INACTIVE", None]
        assert [a["sequence"] for a in doc["alarms"]] == [2, 1]
        assert doc["controller"] == {"address": ctl.address, "error": None}
        rc, out, err = await asyncio.to_thread(motor_top, capsys, "--once", *at(coordinator, ctl.address))
        assert (rc, err) == (0, [])
        assert "alarms: 2 active, newest first:" in out.splitlines()
        assert any(line.split()[:3] == ["2", "decode", "INACTIVE"] for line in out.splitlines()), out


async def test_a_controller_that_is_not_there_only_loses_its_part(coordinator, capsys) -> None:
    nowhere = f"127.0.0.1:{reserved_port()}"
    rc, out, err = await asyncio.to_thread(
        motor_top, capsys, "--once", "-o", "json", *at(coordinator, nowhere)
    )
    assert (rc, err) == (0, [])
    doc = json.loads(out)
    assert doc["controller"]["address"] == nowhere and doc["controller"]["error"]["code"] == "UNAVAILABLE"
    assert doc["alarms"] is None and len(doc["instances"]) == 3


@pytest.mark.parametrize(
    ("failure", "line"),
    [
        (
            errors.precondition("ENGINE_METRICS_OFF", "coordinator", "engine metrics collection is off"),
            "motor top: engine metrics collection is off (coordinator.engine_metrics_interval_s = 0)",
        ),
        (
            errors.unimplemented("GetEngineMetrics"),
            "motor top: the Coordinator at {address} does not serve GetEngineMetrics (UNIMPLEMENTED): "
            "it is older than this motor",
        ),
        (errors.bad_request([("view", "unknown")], "bad view"), "motor top: INVALID_ARGUMENT: bad view"),
    ],
)
async def test_a_coordinator_refusal_is_one_line_and_exit_1(coordinator, capsys, failure, line) -> None:
    coordinator.fake.fail = failure
    rc, out, err = await asyncio.to_thread(motor_top, capsys, "--once", *at(coordinator))
    assert (rc, out, err) == (1, "", [line.format(address=coordinator.address)])


async def test_an_unreachable_coordinator_is_one_line_and_exit_1(capsys) -> None:
    nowhere = f"127.0.0.1:{reserved_port()}"
    rc, out, err = await asyncio.to_thread(motor_top, capsys, *at(nowhere))
    assert (rc, out, err) == (1, "", [f"motor top: cannot reach the Coordinator at {nowhere} (UNAVAILABLE)"])


def test_bad_flags_exit_2(capsys) -> None:
    for argv in (["--interval", "0"], ["--interval", "soon"], ["-o", "yaml"], ["--bogus"]):
        with pytest.raises(SystemExit) as exited:
            motor.main(["top", *argv])
        assert exited.value.code == 2
    assert "--interval: must be more than 0" in capsys.readouterr().err


def test_a_bad_key_file_is_one_line_and_exit_1(tmp_path, capsys) -> None:
    rc, out, err = motor_top(capsys, "--once", "--key-file", str(tmp_path / "missing"), "--controller", "")
    assert rc == 1 and out == "" and len(err) == 1 and err[0].startswith("motor top: ")


# ---- a real process ---------------------------------------------------------------------------------


async def test_motor_top_once_json_as_a_process(coordinator) -> None:
    """What a script runs: ``motor top --once -o json``, one JSON document on stdout."""
    proc = await asyncio.create_subprocess_exec(
        *motor_argv("top", "--once", "-o", "json", *at(coordinator)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert (proc.returncode, err) == (0, b"")
    doc = json.loads(out)
    assert [i["instance_id"] for i in doc["instances"]] == [1, 2, 3]
    assert doc["roles"]["decode"]["stale_engines"] == 2
    assert doc["migrations"]["total"] == 3


async def test_live_into_a_pipe_prints_frame_after_frame_and_ctrl_c_exits_0(coordinator) -> None:
    proc = Proc(motor_argv("top", "--interval", "0.2", *at(coordinator)))
    stale = f"cannot reach the Coordinator at {coordinator.address} (UNAVAILABLE); showing the last data"
    try:
        # The second frame, after a refresh: a collection 3 s after the first.
        await proc.await_line("ROLE ", within=30)
        coordinator.fake.cluster.collect_time = T0 + 3
        await proc.await_line("over the last 3.0s", within=20)
        # A Coordinator that stops answering after the start: the last data, and why it is old.
        coordinator.fake.fail = errors.unavailable("restarting")
        await proc.await_line(stale, within=20)
        seen = len(proc.stdout_lines)
        coordinator.fake.fail = None

        def answered_again() -> bool:
            """A frame begun after the failure whose next line is not the failure's."""
            lines = proc.stdout_lines[seen:]
            return any(a.startswith("motor top  ") and b != stale for a, b in itertools.pairwise(lines))

        await until(answered_again, 20, "a frame with fresh data")
        proc.signal(signal.SIGINT)
        assert await proc.await_exit() == 0
    finally:
        proc.kill()
    frames = "\n".join(proc.stdout_lines).split("motor top  ")[1:]
    assert stale not in frames[-1] and "127.0.0.1:10020 STALE" in frames[-1]
    assert all("ROLE " in f for f in frames)
    assert "Traceback" not in proc.output()


async def test_live_json_is_one_document_per_line(coordinator) -> None:
    proc = Proc(motor_argv("top", "-o", "json", "--interval", "0.2", *at(coordinator)))
    try:
        await until(lambda: len(proc.stdout_lines) >= 2, 30, "two refreshes")
        proc.signal(signal.SIGINT)
        assert await proc.await_exit() == 0
    finally:
        proc.kill()
    docs = [json.loads(line) for line in proc.stdout_lines]
    assert all(len(d["instances"]) == 3 for d in docs)


async def test_live_in_a_terminal_redraws_in_place_and_ctrl_c_exits_0(coordinator) -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    proc = await asyncio.create_subprocess_exec(
        *motor_argv("top", "--interval", "0.2", *at(coordinator)),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    screen_bytes = bytearray()
    closed = asyncio.Event()  # the child closed the terminal: every byte it wrote was read
    loop = asyncio.get_running_loop()

    def readable() -> None:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            chunk = b""
        if chunk:
            screen_bytes.extend(chunk)
        else:
            loop.remove_reader(master)
            closed.set()

    loop.add_reader(master, readable)
    try:
        await until(lambda: b"127.0.0.1:10020" in screen_bytes, 30, "the first frame")
        asked = len(coordinator.fake.requests)
        await until(lambda: len(coordinator.fake.requests) >= asked + 4, 20, "two more refreshes")
        proc.send_signal(signal.SIGINT)
        rc = await asyncio.wait_for(proc.wait(), 20)
        await asyncio.wait_for(closed.wait(), 10)
    finally:
        loop.remove_reader(master)
        os.close(master)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    text = screen_bytes.decode(errors="replace")
    assert rc == 0, text
    assert "ROLE" in text and "decode" in text and "Traceback" not in text
    # Redrawn in place: the cursor goes back up over the previous frame (ESC [ n A).
    assert "\x1b[1A" in text or "\x1b[A" in text, text
