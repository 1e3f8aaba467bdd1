"""A loopback TCP proxy with a cut and a stall control, run on its own event loop thread.

Placed between a NodeManager and the Controller: the NodeManager dials ``proxy.address``,
every connection is piped to ``upstream``. ``cut()`` aborts every open connection at once (both
sides see a reset, as when a link or a middlebox drops the flows); new connections are accepted
as before. ``stall()`` keeps every connection open but stops moving bytes either way (a
black-holed path: nothing is lost, nothing arrives) until ``resume()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class TcpProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.connections = 0  # accepted so far
        self.last_down_at = 0.0  # monotonic time bytes last went upstream -> client
        self._open: set[asyncio.StreamWriter] = set()
        self._flowing: asyncio.Event | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="chaos-proxy")
        self._server: asyncio.Server | None = None
        self.port = 0

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # -- controls --------------------------------------------------------------------------------
    def cut(self) -> int:
        """Abort every open connection; returns how many were cut."""
        return self._call(self._cut())

    def stall(self) -> None:
        self._call(self._set_flowing(False))

    def resume(self) -> None:
        self._call(self._set_flowing(True))

    # -- implementation --------------------------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(10)

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        # Connections still piping end with their sockets (a stalled one is let go first), so
        # none is left pending when the loop stops; any that lingers is cancelled.
        assert self._flowing is not None
        self._flowing.set()
        await self._cut()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if rest:
            _, pending = await asyncio.wait(rest, timeout=2)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _cut(self) -> int:
        writers = list(self._open)
        for w in writers:
            w.transport.abort()
        self._open.clear()
        return len(writers) // 2

    async def _set_flowing(self, on: bool) -> None:
        assert self._flowing is not None
        if on:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            u_reader, u_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            c_writer.transport.abort()
            return
        self._open.update((c_writer, u_writer))
        await asyncio.gather(
            self._pipe(c_reader, u_writer, c_writer, down=False),
            self._pipe(u_reader, c_writer, u_writer, down=True),
        )

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        other: asyncio.StreamWriter,
        down: bool,
    ) -> None:
        assert self._flowing is not None
        try:
            while True:
                await self._flowing.wait()
                data = await reader.read(65536)
                if not data:
                    break
                # Bytes read just before a stall began are held until it ends.
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
                if down:
                    self.last_down_at = time.monotonic()
        except (ConnectionError, OSError):
            pass
        finally:
            # One side gone: the other goes too (a reset, not a graceful close, after a cut).
            for w in (writer, other):
                self._open.discard(w)
                with contextlib.suppress(Exception):
                    w.transport.abort()
