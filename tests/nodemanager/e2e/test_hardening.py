"""Nothing a NodeManager does for its engines may stall its event loop: engine output (overlong
lines, a stdout nobody reads) and reaping (no scan of every process on the machine). TLS
material read once: tests/e2e/test_tls.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from motor_mesh.common import procgroup
from motor_mesh.nodemanager.engine_output import LINE_LIMIT, pump
from tests.nodemanager.conftest import nm_config
from tests.nodemanager.test_procgroup import STUBBORN, spawn_group
from tests.poll import until
from tests.ports import reserved_pair
from tests.procs import group_alive
from tests.standins import BECOME_SIM, prepend_path

LONG = 200 * 1024


class Lines:
    """Collects what the pump passes on, as :class:`motor_mesh.nodemanager.engine_output.Output` would."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def put(self, line: bytes) -> bool:
        self.lines.append(line)
        return True


def cut(body: bytes) -> bytes:
    return body[:LINE_LIMIT] + f" [line cut at {LINE_LIMIT} bytes]".encode()


async def test_an_overlong_line_is_cut_and_the_lines_after_it_come_through() -> None:
    stream = asyncio.StreamReader(limit=LINE_LIMIT)
    stream.feed_data(b"a" * LONG + b"\nafter\n" + b"b" * LONG + b"\nc" * 3)
    stream.feed_data(b"d" * LONG)  # an overlong last line, cut short by EOF
    stream.feed_eof()
    out = Lines()
    await pump(stream, b"[e] ", out)  # type: ignore[arg-type]
    assert out.lines == [
        b"[e] " + cut(b"a" * LONG) + b"\n",
        b"[e] after\n",
        b"[e] " + cut(b"b" * LONG) + b"\n",
        b"[e] c\n",
        b"[e] c\n",
        b"[e] " + cut(b"c" + b"d" * LONG) + b"\n",
    ]


def fake_vllm(tmp_path: Path, prologue: str) -> dict[str, str]:
    """A ``vllm`` that runs ``prologue`` and then becomes the simulated engine; the environment
    that puts it first on PATH, with the engine's output piped through the NodeManager."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "vllm"
    script.write_text(f"#!{sys.executable}\nimport os, sys\n{prologue}\n{BECOME_SIM}")
    script.chmod(0o755)
    return {"PATH": prepend_path(bin_dir, os.environ.get("PATH")), "MOTOR_UP_ENGINE_INDEX": "0"}


async def test_engine_printing_a_200k_line_stays_supervised(tmp_path: Path, start_nm) -> None:
    prologue = f"sys.stdout.write('x' * {LONG} + '\\n' + 'after-the-long-line\\n')\nsys.stdout.flush()\n"
    env = fake_vllm(tmp_path, prologue)
    nm = await start_nm(nm_config(tmp_path, [reserved_pair()], engine_type="vllm"), env=env)
    await nm.start_engines()
    await nm.wait_ready()  # probed NORMAL: the engine is still watched
    marker = f" [line cut at {LINE_LIMIT} bytes]"
    long = await nm.wait_line(marker)
    assert long == "[engine-0] " + "x" * LINE_LIMIT + marker
    after = nm.proc.lines.index(long) + 1
    await nm.wait_line("[engine-0] after-the-long-line", start=after)
    await nm.wait_line("[engine-0] ts=", start=after)  # the engine's own lines, later on


# Runs the NodeManager with a stdout that nobody reads: a pipe whose read end it holds itself.
STUCK_STDOUT = (
    "import os, sys\n"
    "r, w = os.pipe()\n"
    "os.set_inheritable(r, True)\n"
    "os.dup2(w, 1)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)


async def test_a_stdout_nobody_reads_drops_engine_lines_and_stalls_nothing(tmp_path: Path, start_nm) -> None:
    # Far more output than the pipe and the NodeManager's queue hold together.
    prologue = "for _ in range(20):\n    sys.stdout.write(('y' * 99 + '\\n') * 5000)\nsys.stdout.flush()\n"
    env = fake_vllm(tmp_path, prologue)
    cfg = nm_config(tmp_path, [reserved_pair()], engine_type="vllm")
    nm = await start_nm(cfg, env=env, wrapper=[sys.executable, "-c", STUCK_STDOUT])
    await nm.start_engines()
    await nm.wait_ready()  # GetStatus answered all along, and the engine was probed NORMAL
    line = await nm.wait_line("event=log_lines_dropped")
    assert "count=" in line and 'reason="stdout is not keeping up"' in line
    assert (await nm.status()).ready


async def test_reaper_wakes_on_sigchld_without_scanning_every_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scans: list[str] = []
    real = procgroup.all_procs

    def spy() -> list[procgroup.ProcInfo]:
        scans.append(threading.current_thread().name)
        return real()

    monkeypatch.setattr(procgroup, "all_procs", spy)
    reaper = procgroup.Reaper()
    running = asyncio.create_task(reaper.run())
    try:
        # Not an asyncio subprocess: asyncio's child watcher would collect that one itself.
        stray = subprocess.Popen([sys.executable, "-c", "pass"])  # noqa: ASYNC220
        await until(lambda: procgroup.proc_info(stray.pid) is None, 10, "the stray child reaped")
        stray.returncode = 0  # its status went to the reaper, as intended
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    assert scans == []
    assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL  # handed back


async def test_stopping_a_group_scans_processes_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    scans: list[bool] = []
    real = procgroup.all_procs

    def spy() -> list[procgroup.ProcInfo]:
        scans.append(threading.current_thread() is threading.main_thread())
        return real()

    proc = await spawn_group(STUBBORN)
    monkeypatch.setattr(procgroup, "all_procs", spy)
    reaper = procgroup.Reaper()
    reaper.watch(proc.pid)
    assert await procgroup.stop_group(proc.pid, 0.2, reaper)
    assert await asyncio.wait_for(proc.wait(), 5) == -9
    assert scans and not any(scans)


async def test_a_forced_exit_takes_the_engines_with_it(tmp_path: Path, start_nm) -> None:
    # The engine's group holds a process that ignores SIGTERM: a graceful stop waits its whole
    # engine_stop_grace_s for it. The second SIGTERM must not leave it behind.
    stubborn = (
        "import subprocess\n"
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'])\n"
    )
    env = fake_vllm(tmp_path, stubborn)
    cfg = nm_config(tmp_path, [reserved_pair()], engine_type="vllm", engine_stop_grace_s=120)
    nm = await start_nm(cfg, env=env)
    [ep] = (await nm.start_engines()).endpoints
    await nm.wait_ready()
    nm.proc.signal(signal.SIGTERM)
    await nm.proc.await_line("event=stopping", 10)
    nm.proc.signal(signal.SIGTERM)
    await nm.proc.await_line("event=forced_exit", 10)
    await until(lambda: not group_alive(ep.pid), 10, "the engine's process group to be gone")
