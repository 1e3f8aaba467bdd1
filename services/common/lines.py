"""Reading a child's output as lines without ever stopping the reading.

A child writes into a pipe of 64 KiB; once nobody reads it, its next write blocks it for good.
So a line of any length is cut (with a marker saying where) instead of failing the read, and
the reading goes on to EOF. Used for ``motor up``'s children and a NodeManager's engines.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

MAX_LINE = 64 * 1024
CHUNK = 64 * 1024
CUT = b" [line cut at %d bytes]"


class LineSplitter:
    """Bytes in, lines out (each ending in a newline). A line longer than ``max_line`` comes out
    cut to ``max_line`` bytes plus a marker; the rest of it, up to its newline, is dropped."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self.max_line = max_line
        self._buf = bytearray()
        self._dropping = False  # inside the rest of a line already cut

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        lines: list[bytes] = []
        pos = 0  # consumed so far: the buffer is trimmed once, at the end
        while pos < len(buf):
            end = buf.find(b"\n", pos)
            if self._dropping:
                if end < 0:
                    pos = len(buf)
                    break
                pos, self._dropping = end + 1, False
            elif 0 <= end <= pos + self.max_line:
                lines.append(bytes(buf[pos : end + 1]))
                pos = end + 1
            elif end >= 0 or len(buf) - pos > self.max_line:
                lines.append(bytes(buf[pos : pos + self.max_line]) + CUT % self.max_line + b"\n")
                pos += self.max_line
                self._dropping = True
            else:
                break  # an unfinished line that may still fit: wait for more
        del buf[:pos]
        return lines

    def flush(self) -> list[bytes]:
        """At EOF: the unfinished last line (a child that died mid-line), newline added."""
        rest = b"" if self._dropping else bytes(self._buf)
        self._buf.clear()
        self._dropping = False
        return [rest + b"\n"] if rest else []


async def read_lines(stream: asyncio.StreamReader, on_line: Callable[[bytes], Any]) -> None:
    """Hand each line of ``stream`` (newline included) to ``on_line`` until EOF."""
    splitter = LineSplitter()
    while True:
        chunk = await stream.read(CHUNK)
        for line in splitter.feed(chunk) if chunk else splitter.flush():
            on_line(line)
        if not chunk:
            return
