"""Process helpers for tests that run real Motor processes, plus the simulated-engine fixture.

Processes run in their own session (as the NodeManager runs engines), log to a file we poll,
and are SIGKILLed by process group at teardown so nothing outlives a test.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.02


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (an orphan may wait a while to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def wait_until(predicate: Callable[[], object], timeout: float, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(POLL_S)


async def await_until(predicate: Callable[[], object], within: float, what: str = "condition") -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(POLL_S)


async def poll(check: Callable[[], Awaitable[object]], within: float, what: str = "condition") -> None:
    """Like await_until for a predicate that must itself await (an HTTP probe)."""
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(POLL_S)


def metric(text: str, name: str, **labels: str) -> float:
    """One sample from Prometheus text, matched by name and the given labels."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name} {labels}")


class Proc:
    """A child process whose stderr goes to a file that tests can search."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.log = tempfile.NamedTemporaryFile(prefix="motor-test-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            start_new_session=True,
        )
        self.pid = self.proc.pid

    def text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def lines(self) -> list[str]:
        return self.text().splitlines()

    def find(self, pattern: str) -> re.Match[str] | None:
        return re.search(pattern, self.text())

    def _line_ready(self, pattern: str) -> re.Match[str] | None:
        m = self.find(pattern)
        if m is None and self.proc.poll() is not None:
            raise AssertionError(
                f"process exited rc={self.proc.returncode} before /{pattern}/:\n{self.text()}"
            )
        return m

    def wait_line(self, pattern: str, timeout: float = 15.0) -> re.Match[str]:
        wait_until(lambda: self._line_ready(pattern), timeout, f"/{pattern}/ in the log of {self.argv}")
        m = self.find(pattern)
        assert m is not None
        return m

    async def await_line(self, pattern: str, within: float = 15.0) -> re.Match[str]:
        await await_until(lambda: self.find(pattern), within, f"/{pattern}/ in the log")
        m = self.find(pattern)
        assert m is not None
        return m

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def await_exit(self, within: float = 10.0) -> int:
        await await_until(lambda: self.proc.poll() is not None, within, f"exit of pid {self.pid}")
        return int(self.proc.returncode)

    def terminate(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill_group(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def cleanup(self) -> None:
        self.kill_group()
        self.log.close()
        os.unlink(self.log.name)


class SimEngine(Proc):
    """`motor engine-sim` in a subprocess; `start()` waits for its `event=listening` line."""

    def __init__(self, args: list[str]) -> None:
        super().__init__([sys.executable, "-m", "services.cli", "engine-sim", *args])
        self.port = 0
        self.bootstrap_port = 0
        self.host = "127.0.0.1"

    def start(self, timeout: float = 15.0) -> SimEngine:
        m = self.wait_line(r"event=listening .*", timeout)
        line = m.group(0)
        http = re.search(r"http=(\S+):(\d+)", line)
        assert http, line
        self.host, self.port = http.group(1), int(http.group(2))
        boot = re.search(r"bootstrap=\S+:(\d+)", line)
        self.bootstrap_port = int(boot.group(1)) if boot else 0
        return self

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def v1(self) -> str:
        return self.base + "/v1"

    def worker_pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"event=worker_started index=\d+ pid=(\d+)", self.text())]


@pytest.fixture
def spawn_engine() -> Iterator[Callable[..., SimEngine]]:
    """`spawn_engine(*flags, wait=True)` starts an engine on an ephemeral port."""
    started: list[SimEngine] = []

    def spawn(*flags: str, wait: bool = True, port: bool = True) -> SimEngine:
        args = list(flags) + (["--port", "0"] if port and "--port" not in flags else [])
        eng = SimEngine(args)
        started.append(eng)
        return eng.start() if wait else eng

    yield spawn
    for eng in started:
        eng.cleanup()


@pytest.fixture(scope="module")
def shared_engine() -> Iterator[SimEngine]:
    """One default engine for a whole module, for tests that leave no state behind."""
    eng = SimEngine(["--port", "0"]).start()
    yield eng
    eng.cleanup()
