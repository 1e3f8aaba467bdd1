"""``motor up`` for the benchmarks that time a whole cluster (up, failover, table restarts).

``motor up`` binds fixed ports (its metrics ports too, all moved together by ``--port-offset``),
so it cannot be given port 0. A benchmark picks an offset at random, every port under the
kernel's ephemeral range (so no outgoing connection is handed one of them), launches, and if a
component reports its port taken (someone else's server got there first) it stops that launch
and tries another offset. A benchmark run is a one-off on a quiet machine: a clash is rare, and
a relaunch costs nothing but the measurement of that launch, which is discarded.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.loadgen.harness import PORT_TAKEN, REPO, PortTaken, clean_env

CONTROLLER, COORDINATOR, HTTP, NM = 7100, 7200, 8000, 7300
CONTROLLER_METRICS, NM_METRICS = 9100, 9300  # /metrics of the Controller, of NodeManager i (+ i)
CONTROLLER_1, CONTROLLER_1_METRICS = 7101, 9101  # under --ha: the second Controller, its /metrics
# Highest port used: an engine's KV events replay port, 12000 + 2 * engines + 1 + offset < 32768.
OFFSETS = range(10_000, 20_000, 10)


class Up:
    """``motor up ARGS`` running on a free offset: ``ready_s`` is spawn → READY of the launch
    that got there; every child's log is in ``log``. ``env`` is added to its environment;
    ``offsets`` are the ones tried (real engines use more ports, so fewer offsets fit)."""

    def __init__(
        self,
        args: list[str],
        workdir: Path,
        ready_within_s: float = 120.0,
        tries: int = 4,
        env: dict[str, str] | None = None,
        offsets: range = OFFSETS,
    ) -> None:
        self.args = args
        self.env = env or {}
        for attempt in range(tries):
            self.offset = random.choice(offsets)
            self.log = workdir / f"up-{attempt}.log"
            try:
                self.ready_s = self._launch(workdir / f"state-{attempt}", ready_within_s)
                return
            except PortTaken:
                print(f"  motor up: a port at offset {self.offset} is taken; another offset", file=sys.stderr)
                self.stop()
            except BaseException:
                self.stop()
                raise
        raise RuntimeError(f"motor up found a port taken at {tries} offsets in a row")

    def _launch(self, state: Path, ready_within_s: float) -> float:
        argv = [sys.executable, "-m", "motor_mesh.cli", "up", *self.args]
        argv += ["--port-offset", str(self.offset), "--state-dir", str(state)]
        t0 = time.perf_counter()
        with self.log.open("wb") as err:
            self.popen = subprocess.Popen(
                argv, cwd=REPO, env=clean_env(**self.env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=err, start_new_session=True,
            )  # fmt: skip
        first: queue.Queue[tuple[bytes, float]] = queue.Queue()
        assert self.popen.stdout is not None
        out = self.popen.stdout
        # The line, then the clock: stamped as soon as READY is read.
        threading.Thread(target=lambda: first.put((out.readline(), time.perf_counter())), daemon=True).start()
        while True:
            try:
                line, at = first.get(timeout=0.05)
            except queue.Empty:
                if PORT_TAKEN.search(self.log.read_text(errors="replace")):
                    raise PortTaken from None
                if time.perf_counter() - t0 > ready_within_s:
                    raise RuntimeError(
                        f"motor up not READY in {ready_within_s:g} s; see {self.log}"
                    ) from None
                continue
            if not line.startswith(b"READY "):
                if PORT_TAKEN.search(self.log.read_text(errors="replace")):
                    raise PortTaken  # it said so as it ended (its ports are tried before anything starts)
                raise RuntimeError(f"motor up ended before READY ({line!r}):\n{self.log.read_text()[-2000:]}")
            return at - t0

    @property
    def pid(self) -> int:
        return self.popen.pid

    def addr(self, port: int) -> str:
        """Where the service on default ``port`` (CONTROLLER, COORDINATOR, NM + i, and the
        metrics ports CONTROLLER_METRICS, NM_METRICS + i) listens."""
        return f"127.0.0.1:{port + self.offset}"

    @property
    def url(self) -> str:
        return f"http://{self.addr(HTTP)}"

    def children(self, *words: str) -> list[int]:
        """The pids of motor up's children with every one of ``words`` among their arguments."""
        found = []
        for entry in os.scandir("/proc"):
            try:
                ppid = int(Path(entry.path, "stat").read_text().rpartition(")")[2].split()[1])
                argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.pid and all(w.encode() in argv for w in words):
                found.append(int(entry.name))
        return found

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM (motor up stops its NodeManagers, their engines, then the services), then
        SIGKILL to whatever of the session is left."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.pid, sig)
                self.popen.wait(wait_s)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue


def gone(pid: int) -> bool:
    """No such process, or only its zombie left (its sockets are closed either way)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return True
    return state in "ZX"
