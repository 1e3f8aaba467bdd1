"""Stop signals of the services ``motor up`` runs (each also runs alone, as in a container): the
first SIGTERM/SIGINT starts the graceful stop, a second one ends the process at once."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from tests.poll import wait_until
from tests.procs import Proc, exited, grpcurl_bin

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize(
    ("command", "sig", "workers"),
    [
        ("controller", signal.SIGTERM, 1),
        ("coordinator", signal.SIGINT, 1),
        ("coordinator", signal.SIGTERM, 2),
        ("nodemanager", signal.SIGTERM, 1),
    ],
)
def test_a_second_signal_cuts_a_slow_graceful_stop_short(
    motor_proc, command: str, sig: int, workers: int
) -> None:
    extra = ["--http-port", "0"] if command == "coordinator" else []
    proc = motor_proc(command, "--port", "0", *extra, env={"MOTOR_COORDINATOR_WORKERS": str(workers)})
    addr, _ = proc.listening()
    # With inference workers: their private directory, and the workers themselves.
    hub = [Path(m) for m in re.findall(r"event=worker_hub_started sock_dir=(\S+)", proc.output())]
    worker_pids = [int(p) for p in re.findall(r"event=worker_started index=\d+ pid=(\d+)", proc.output())]
    assert len(worker_pids) == (workers if workers > 1 else 0)
    # An open health Watch: the graceful stop drains, then waits out its whole grace period for
    # this stream, seconds in all.
    watch = Proc([grpcurl_bin(), "-plaintext", "-d", '{"service": ""}', addr, "grpc.health.v1.Health/Watch"])
    try:
        watch.wait_line('"status"')
        proc.signal(sig)
        proc.wait_line("event=stopping")
        proc.signal(sig)
        assert proc.popen.wait(timeout=30) == 128 + sig
    finally:
        watch.kill()
    # Its last lines may still be in the pipe when the exit is seen: wait for the line itself.
    line = proc.wait_line("event=forced_exit", 10)
    assert f"event=forced_exit signal={signal.Signals(sig).name} rc={128 + sig}" in line
    out = proc.output()
    assert out.count("event=forced_exit") == 1
    assert "event=stopped" not in out  # the graceful stop never finished: it was skipped
    # Nothing it started outlives it.
    wait_until(lambda: all(exited(p) for p in worker_pids), 10, "the workers to be gone")
    assert not any(d.exists() for d in hub)


def test_one_signal_still_stops_gracefully(motor_proc) -> None:
    proc = motor_proc("controller", "--port", "0")
    proc.listening()
    proc.signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=30) == 0
    out = proc.output()
    assert "event=stopped" in out and "event=forced_exit" not in out
