"""``motor up`` from start to exit, as an operator meets it: a start-up that fails says why in
one line, Ctrl-C stops everything in order, a second signal does not wait, the temporary state
directory goes with the cluster, and no child's output can wedge it."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from motor_mesh.nodemanager.statefile import StateFile
from tests.e2e.cluster import CONTROLLER, COORDINATOR, HTTP, Cluster, up_ports
from tests.poll import wait_until
from tests.ports import Ports, reserve
from tests.procs import Proc, child_pids, exited, group_alive, grpcurl_bin, motor_argv, pids_with

pytestmark = pytest.mark.timeout(180)

Start = Callable[..., tuple[Proc, Ports]]


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Start]:
    """``start(*args)``: ``motor up --port-offset <reserved> *args`` (no --state-dir unless in
    ``args``), killed with everything it started at teardown."""
    started: list[tuple[Proc, Ports]] = []

    def start(
        *args: str, ports: Ports | None = None, env: dict[str, str] | None = None
    ) -> tuple[Proc, Ports]:
        ports = ports or reserve(up_ports(2))
        proc = Proc(motor_argv("up", "--port-offset", str(ports.shift), *args), cwd=tmp_path, env=env)
        started.append((proc, ports))
        return proc, ports

    yield start
    for proc, ports in started:
        proc.kill()
        ports.close()


def temporary_state_dir(proc: Proc) -> Path:
    line = proc.wait_line("event=starting component=up")
    m = re.search(r" state_dir=(\S+)", line)
    assert m is not None
    return Path(m.group(1))


def everything_started(proc: Proc, state: Path) -> tuple[list[int], list[int]]:
    """The pids of ``motor up``'s children and the process groups of the engines (READY)."""
    proc.wait_line(lambda s: s.startswith("READY "), 90)
    kids = child_pids(proc.pid, "motor_mesh.cli")
    assert len(kids) == 4  # Controller, Coordinator, two NodeManagers
    engines = [r.pgid for i in range(2) for r in StateFile(state / f"nm-{i}").read()]
    assert len(engines) == 2
    return kids, engines


def all_gone(kids: list[int], engines: list[int]) -> bool:
    return all(exited(k) for k in kids) and not any(group_alive(g) for g in engines)


def test_ctrl_c_stops_everything_in_order_and_removes_the_temporary_state_dir(up: Start) -> None:
    proc, _ = up()
    state = temporary_state_dir(proc)
    kids, engines = everything_started(proc, state)
    assert state.is_dir()

    proc.signal(signal.SIGINT)
    assert proc.popen.wait(timeout=30) == 0
    assert not state.exists()
    wait_until(lambda: all_gone(kids, engines), 10, "every child and engine gone")
    lines = proc.lines
    last_node = max(i for i, s in enumerate(lines) if re.match(r"\[nm-\d\] .*event=stopped", s))
    first_core = min(
        i for i, s in enumerate(lines) if re.match(r"\[(controller|coordinator)\] .*event=stopped", s)
    )
    assert last_node < first_core  # NodeManagers (and their engines) first
    assert "event=forced_exit" not in proc.output()


def test_a_second_sigterm_kills_everything_at_once(up: Start) -> None:
    proc, ports = up()
    state = temporary_state_dir(proc)
    kids, engines = everything_started(proc, state)
    # An open health Watch on the Controller: its graceful stop waits out its whole grace period.
    addr = f"127.0.0.1:{CONTROLLER + ports.shift}"
    watch = Proc([grpcurl_bin(), "-plaintext", "-d", '{"service": ""}', addr, "grpc.health.v1.Health/Watch"])
    try:
        watch.wait_line('"status"')
        proc.signal(signal.SIGTERM)
        proc.wait_line("event=stopping component=up")
        proc.signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        watch.kill()
    assert "event=forced_exit signal=SIGTERM rc=143" in proc.output()
    assert "service=up event=stopped" not in proc.output()  # the graceful stop was cut short
    assert not state.exists()
    wait_until(lambda: all_gone(kids, engines), 10, "every child and engine killed")


def test_no_child_outlives_motor_up_killed_with_sigkill(up: Start) -> None:
    proc, _ = up()
    state = temporary_state_dir(proc)
    kids, engines = everything_started(proc, state)
    os.kill(proc.pid, signal.SIGKILL)  # motor up alone: its children get no signal at all
    assert proc.popen.wait(timeout=10) == -signal.SIGKILL
    # Their stdin (a pipe from motor up) closed: each stops, the NodeManagers their engines too.
    wait_until(lambda: all_gone(kids, engines), 30, "every child and engine stopped")
    shutil.rmtree(state)  # the one way out that leaves it: nobody was left to remove it


@pytest.mark.parametrize(
    ("port", "what"), [(CONTROLLER, "the Controller's gRPC"), (HTTP, "the Coordinator's HTTP")]
)
def test_a_port_another_server_holds_ends_motor_up_before_anything_starts(
    up: Start, port: int, what: str
) -> None:
    # Another cluster's servers there would answer for ours: READY would name a cluster we did
    # not start.
    ports = reserve(up_ports(2))
    port += ports.shift
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        proc, _ = up(ports=ports)
        state = temporary_state_dir(proc)
        assert proc.popen.wait(timeout=60) == 1
    wait_until(lambda: len(proc.lines) and proc.lines[-1].startswith("motor up: "), 5, "the last line")
    assert proc.lines[-1] == (
        f"motor up: {what} 127.0.0.1:{port}: address already in use (another cluster there? "
        "--port-offset moves every port)"
    )
    assert proc.stdout_lines == []  # never READY
    assert "Traceback" not in proc.output()
    assert "event=restart" not in proc.output()  # not a crash to retry
    assert not state.exists()
    coordinator = str(COORDINATOR + ports.shift)
    wait_until(lambda: not pids_with("coordinator", coordinator), 10, "the Coordinator stopped too")


def test_a_corrupt_controller_state_file_is_one_line_and_exit_1(up: Start, tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "controller").mkdir(parents=True)
    (state / "controller" / "controller.db").write_bytes(b"this is not a database" * 100)
    proc, _ = up("--state-dir", str(state))
    assert proc.popen.wait(timeout=60) == 1
    wait_until(lambda: len(proc.lines) and proc.lines[-1].startswith("motor up: "), 5, "the last line")
    last = proc.lines[-1]
    prefix = "motor up: controller failed to start (exit code 1): motor controller: state file "
    assert last.startswith(prefix) and " is corrupt (" in last, last
    (moved,) = (state / "controller").glob("controller.db.corrupt-*")
    assert f"moved it to {moved}" in last
    assert "Traceback" not in proc.output()
    assert state.is_dir()  # given by the user: kept


SITECUSTOMIZE = """\
import fcntl, os, sys
if os.environ.get("MOTOR_TEST_LONG_LINE"):
    # Every Python process of the cluster says this first: one line far over a pipe's 64 KiB.
    # The Coordinator's inference workers share its pipe, and writes that large from several
    # processes interleave; the lock keeps each process's line whole, as a test of the cutter.
    with open(os.environ["MOTOR_TEST_LONG_LINE"], "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sys.stderr.write("x" * 100000 + "\\n")
        sys.stderr.write("after the long line\\n")
        sys.stderr.flush()
"""


def test_a_line_longer_than_a_pipe_holds_is_cut_and_the_cluster_still_starts(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    c = Cluster(tmp_path, env={"PYTHONPATH": path, "MOTOR_TEST_LONG_LINE": str(tmp_path / "line.lock")})
    try:
        c.wait_ready(90)
        lines = c.proc.lines
        for name in ("controller", "coordinator", "nm-0", "nm-1"):
            # The Coordinator's inference workers share its output: one such line each.
            cut = [s for s in lines if s.startswith(f"[{name}] xxxx")]
            assert cut and set(cut) == {f"[{name}] " + "x" * 65536 + " [line cut at 65536 bytes]"}
            assert f"[{name}] after the long line" in lines
        assert c.stop(timeout=30) == 0
    finally:
        c.cleanup()
