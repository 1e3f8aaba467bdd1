"""Process plumbing for the control-plane benchmarks: start a process pinned to given CPUs (a
``python -c`` trampoline sets the affinity and execs, so every thread the process ever starts
inherits it), find its ``event=listening`` line, read its CPU time from /proc, stop its group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc

T = TypeVar("T")
CLK_TCK = os.sysconf("SC_CLK_TCK")
_PIN = (
    "import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)
REPO = Path(__file__).resolve().parents[2]
# What a server that found its port taken says: Motor's components, the simulated engine, Rust.
PORT_TAKEN = re.compile(r"address (already )?in use|event=bind_failed", re.IGNORECASE)


class PortTaken(RuntimeError):
    """A server of the benchmark could not bind its port: launch it again on another."""


def port_free(port: int) -> bool:
    """Whether a server could bind ``port`` on loopback right now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid`` so far."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_ns(pid: int) -> int:
    """Nanoseconds ``pid``'s threads have run so far (the scheduler's own count, exact where
    ``cpu_seconds`` counts clock ticks); 0 once it is gone."""
    total = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    return total


def session_pids(session: int, cmdline_has: str) -> list[int]:
    """The processes of ``session`` whose command line contains ``cmdline_has``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            raw = Path(f"/proc/{entry}/stat").read_text()
            if int(raw[raw.rindex(")") + 2 :].split()[3]) != session:
                continue
            if cmdline_has in Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                out.append(int(entry))
    return out


def system_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine so far, every core summed."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = f[:8]
    return (user + nice + system + irq + softirq) / CLK_TCK, steal / CLK_TCK


async def wait_quiet(pids: list[int], limit_pct: float = 15.0, max_wait_s: float = 30.0) -> float:
    """Wait (at most ``max_wait_s``) for a second in which the machine's CPU outside ``pids`` and
    this process stays under ``limit_pct`` of one core: other users' jobs distort every figure.
    Returns the last second's background CPU %."""
    deadline = time.monotonic() + max_wait_s
    while True:
        m0, mine0, me0 = system_cpu()[0], sum(cpu_seconds(p) for p in pids), time.process_time()
        await asyncio.sleep(1.0)
        m1, mine1, me1 = system_cpu()[0], sum(cpu_seconds(p) for p in pids), time.process_time()
        background = 100 * max(0.0, (m1 - m0) - (mine1 - mine0) - (me1 - me0))
        if background < limit_pct or time.monotonic() > deadline:
            return background


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOTOR_", "OTEL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


class Proc:
    """A child process in its own session; stderr goes to ``log`` (read back by the caller)."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.proc = proc
        self.log = log
        self._t = (time.perf_counter(), 0.0)

    @classmethod
    async def start(
        cls,
        name: str,
        args: list[str],
        log: Path,
        *,
        cpus: str | None = None,
        env: dict[str, str] | None = None,
        pipes: bool = False,
    ) -> Proc:
        argv = [sys.executable, "-c", _PIN, cpus, *args] if cpus else [sys.executable, *args]
        pipe = asyncio.subprocess.PIPE if pipes else asyncio.subprocess.DEVNULL
        with log.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=pipe,
                stdout=pipe,
                stderr=err,
                env=env or clean_env(),
                cwd=REPO,
                start_new_session=True,
                limit=1 << 24,
            )
        return cls(name, proc, log)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    async def log_match(self, pattern: str, timeout_s: float = 20.0) -> re.Match[str]:
        """The first match of ``pattern`` in the stderr log, once it is there."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log.read_text(errors="replace"))
            if m:
                return m
            if self.proc.returncode is not None:
                break
            await asyncio.sleep(0.05)
        tail = self.log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{self.name}: no /{pattern}/ in its log:\n{tail}")

    async def listening(self, timeout_s: float = 20.0) -> dict[str, str]:
        """The fields of the ``event=listening`` line on stderr."""
        line = (await self.log_match(r"(?m)^.*event=listening.*$", timeout_s)).group(0)
        return dict(re.findall(r"(\w+)=(\S+)", line))

    async def send(self, command: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """One command to a fleet process, its one JSON answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command.encode() + b"\n")
        await self.proc.stdin.drain()
        return await self.read_json(timeout_s)

    async def read_json(self, timeout_s: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
            if not line:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.name} exited:\n{tail}")
            msg = json.loads(line)
            if msg.get("event") == "node_failed":
                print(f"  {self.name}: node failed: {msg['error']}", file=sys.stderr)
                continue
            return dict(msg)

    async def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.returncode is not None:
            return
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            # A fleet process: ask first (it closes its streams), then signal.
            try:
                self.proc.stdin.write(b"stop\n")
                self.proc.stdin.close()
                await asyncio.wait_for(self.proc.wait(), 5.0)
                return
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                pass
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            await asyncio.wait_for(self.proc.wait(), grace_s)
        except TimeoutError:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await self.proc.wait()


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def machine() -> str:
    import platform

    return (
        f"{time.strftime('%Y-%m-%d %H:%M')}, nproc {os.cpu_count()}, Python {platform.python_version()}, "
        f"{platform.machine()}, kernel {platform.release()}"
    )


def publish(path: Path, text: str) -> int:
    """Write a benchmark's result file and show it; 0, for ``main`` to return."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    return 0


def entry(
    amain: Callable[[T], Coroutine[Any, Any, int]], parse: Callable[[list[str]], T]
) -> Callable[[list[str] | None], int]:
    """The ``main(argv)`` of an asyncio benchmark (``python -m bench NAME`` passes no arguments)."""

    def main(argv: list[str] | None = None) -> int:
        return asyncio.run(amain(parse([] if argv is None else argv)))

    return main


Method = tuple[Callable[..., Any], Any, Any]  # handler, request class, response class


def rpc_handlers(service: str, unary: dict[str, Method], streams: dict[str, Method] | None = None) -> Any:
    """A grpc generic handler serving only these methods of ``service`` (request/response
    streams for those in ``streams``); every other method answers UNIMPLEMENTED."""

    def method(make: Callable[..., Any], fn: Callable[..., Any], req: Any, resp: Any) -> Any:
        return make(fn, request_deserializer=req.FromString, response_serializer=resp.SerializeToString)

    table = {name: method(grpc.unary_unary_rpc_method_handler, *m) for name, m in unary.items()}
    table |= {name: method(grpc.stream_stream_rpc_method_handler, *m) for name, m in (streams or {}).items()}
    return grpc.method_handlers_generic_handler(service, table)
