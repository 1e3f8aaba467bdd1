"""Starting, watching and restarting the inference worker processes.

Workers are fork+exec'd children (asyncio subprocesses, never a bare fork: the management
process may hold threads), started before any gRPC object exists. So this module imports
nothing that pulls in grpc (not even :mod:`motor_mesh.common.tasks`, whose Backoff lives next to
gRPC's retry rules): its one loop per worker guards itself the way ``tasks.supervise`` would,
logging any failure with its traceback and carrying on.

A worker that exits unexpectedly is forgotten by the hub at once (so no management write waits
for it) and started again after a backoff that grows while restarts keep failing quickly; the
new process takes a full snapshot on its hello like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from motor_mesh.common import log

if TYPE_CHECKING:
    from motor_mesh.coordinator.workers.hub import WorkerHub

RESTART_INITIAL_S = 0.1
RESTART_MAX_S = 2.0
HEALTHY_S = 10.0  # a worker that ran this long was healthy: its next restart is quick again


class WorkerSupervisor:
    def __init__(
        self,
        count: int,
        argv: Callable[[int], list[str]],
        hub: WorkerHub,
        env: dict[str, str] | None = None,
        *,
        on_exit: Callable[[int, int], None] | None = None,
        restart_initial_s: float = RESTART_INITIAL_S,
        restart_max_s: float = RESTART_MAX_S,
        healthy_s: float = HEALTHY_S,
    ) -> None:
        """``argv(i)`` is worker ``i``'s command line; ``env`` adds to (and overrides) this
        process's environment for every worker; ``on_exit(index, pid)`` is called after each
        worker process ended (unexpectedly or by :meth:`stop`), once the hub forgot it."""
        self.count = count
        self.argv = argv
        self.hub = hub
        self.env = {**os.environ, **env} if env is not None else None
        self.on_exit = on_exit
        self.restart_initial_s = restart_initial_s
        self.restart_max_s = restart_max_s
        self.healthy_s = healthy_s
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._started_at: dict[int, float] = {}
        self._watchers: list[asyncio.Task[None]] = []
        self._stopping = False

    async def start(self) -> None:
        """Start every worker (an OSError starting one is the caller's: nothing would serve)."""
        try:
            for i in range(self.count):
                await self._spawn(i)
        except BaseException:
            await self.stop(0.0)
            raise
        loop = asyncio.get_running_loop()
        self._watchers = [
            loop.create_task(self._watch(i), name=f"worker_supervisor_{i}") for i in range(self.count)
        ]

    def pids(self) -> dict[int, int]:
        """index -> pid of every worker process that is running."""
        return {i: p.pid for i, p in sorted(self._procs.items()) if p.returncode is None}

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every worker, wait up to ``grace_s`` in all, then SIGKILL what is left."""
        self._stopping = True
        for task in self._watchers:
            task.cancel()
        for task in self._watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._watchers = []
        procs = dict(self._procs)
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        waits = [asyncio.ensure_future(proc.wait()) for proc in procs.values()]
        if waits:
            await asyncio.wait(waits, timeout=grace_s)
        for i, proc in procs.items():
            if proc.returncode is None:
                log.warn("worker_killed", index=i, pid=proc.pid, grace_s=grace_s)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            rc = await proc.wait()
            self._ended(i, proc.pid)
            log.event("worker_stopped", index=i, pid=proc.pid, rc=rc)
        self._procs.clear()

    async def _spawn(self, index: int) -> None:
        # stdout and stderr are inherited: the workers' log lines join the management process's.
        proc = await asyncio.create_subprocess_exec(
            *self.argv(index), stdin=asyncio.subprocess.DEVNULL, env=self.env
        )
        self._procs[index] = proc
        self._started_at[index] = time.monotonic()
        log.event("worker_started", index=index, pid=proc.pid)

    def _ended(self, index: int, pid: int) -> None:
        self.hub.forget(index, pid)
        if self.on_exit is not None:
            try:
                self.on_exit(index, pid)
            except Exception:
                log.exception("worker_on_exit_failed", index=index, pid=pid)

    def _delay(self, attempt: int) -> float:
        return min(self.restart_initial_s * 2 ** min(attempt, 32), self.restart_max_s)

    async def _watch(self, index: int) -> None:
        """Restart worker ``index`` whenever it exits, until :meth:`stop`."""
        attempt = 0
        while not self._stopping:
            try:
                proc = self._procs.get(index)
                if proc is not None:
                    rc = await proc.wait()
                    if self._stopping:
                        return
                    del self._procs[index]
                    self._ended(index, proc.pid)
                    ran_s = time.monotonic() - self._started_at[index]
                    log.warn("worker_exited", index=index, pid=proc.pid, rc=rc, ran_s=round(ran_s, 3))
                    if ran_s >= self.healthy_s:
                        attempt = 0
                delay = self._delay(attempt)
                attempt += 1
                log.event("worker_restarting", index=index, in_s=round(delay, 3))
                await asyncio.sleep(delay)
                if not self._stopping:
                    await self._spawn(index)
            except asyncio.CancelledError:
                raise
            except Exception:
                # Starting the process failed (or this loop has a bug): try again after the
                # backoff rather than leave the index without a worker for good.
                log.exception("worker_supervisor_failed", index=index)
                await asyncio.sleep(self._delay(attempt))
